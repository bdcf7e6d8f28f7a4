"""The engine instance token: what makes a worker rank count as its own
engine's, and nobody else's.

The daemon counts toward a scheduler's view only the worker ranks that
present the token its scheduler presented (`ec_daemon.core.sessions`), so two
engines configured with one `engine_id`, or any other client of the socket,
never complete each other's rank count. The token must be known to the
engine's own processes only, and to its workers before the first step
(vLLM builds them before the scheduler, and a first step that only misses
would cost an engine started on a warm cache its first hits). So it is
derived: an HMAC, under a secret of this user on this host
(`user_secret`: a private file), of the engine id and vLLM's instance id,
which every process of one engine shares and no two engines do. A worker
that cannot derive it (another container, another user's home, no private
folder) learns it from its scheduler's first step metadata instead, as do
workers of an engine whose scheduler could not derive one (it then mints a
random token: `new_engine_token`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path

from ec_protocol.protocol import ENGINE_TOKEN_BYTES

log = logging.getLogger(__name__)

SECRET_NAME = "ec-daemon-engine-secret"
SECRET_BYTES = 32


def new_engine_token() -> str:
    """A random engine token (an engine whose processes share no secret)."""
    return secrets.token_hex(ENGINE_TOKEN_BYTES)


def derived_engine_token(engine_id: str, instance_id: str,
                         folder: Path | None = None) -> str:
    """The token of engine `engine_id` of vLLM instance `instance_id`, as every
    process of this user on this host derives it; "" when this process has
    no private secret (the worker then learns it from its step metadata)."""
    secret = user_secret(folder)
    if secret is None:
        return ""
    message = f"{engine_id}\0{instance_id}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:2 * ENGINE_TOKEN_BYTES]


def secret_folder() -> Path | None:
    """Where the user's secret lives: $XDG_RUNTIME_DIR (a private tmpfs),
    else ~/.cache/ec-daemon; None when neither can be had."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime)
    with contextlib.suppress(RuntimeError, KeyError):
        return Path.home() / ".cache" / "ec-daemon"
    return None


def user_secret(folder: Path | None = None) -> bytes | None:
    """This user's secret (made on first use), or None when there is no
    private folder for it: one another user could write, or a secret file
    another user could read or replace, is never used."""
    folder = folder or secret_folder()
    if folder is None:
        return None
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(folder.lstat(), folder_mode=True):
            raise PermissionError(f"{folder} is not this user's private folder")
        path = folder / SECRET_NAME
        if not path.exists():
            _create(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if not _private(os.fstat(fd), folder_mode=False):
                raise PermissionError(f"{path} is not this user's private file")
            secret = os.read(fd, SECRET_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        log.info("ec-daemon: no engine secret (%s); workers learn their engine's token from "
                 "its first step", exc)
        return None
    if len(secret) != SECRET_BYTES:
        log.warning("ec-daemon: %s is not an engine secret (%d bytes); not used",
                    folder / SECRET_NAME, len(secret))
        return None
    return secret


def _private(info: os.stat_result, *, folder_mode: bool) -> bool:
    """Owned by this user; a folder writable by it alone, a file readable by it alone."""
    kind = stat.S_ISDIR if folder_mode else stat.S_ISREG
    loose = 0o022 if folder_mode else 0o077
    return kind(info.st_mode) and info.st_uid == os.geteuid() \
        and not stat.S_IMODE(info.st_mode) & loose


def _create(path: Path) -> None:
    """Write a fresh secret whole, then link it into place: a process that
    finds the file reads all of it, and of racing creators one wins."""
    temporary = path.with_name(f".{SECRET_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_bytes(SECRET_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temporary, path)
    except FileExistsError:
        pass  # another process of this user made it first: theirs is the secret
    finally:
        temporary.unlink()
