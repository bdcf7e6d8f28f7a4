"""Who may talk to the daemon: file modes, groups, and tokens.

A Unix socket and the region are owner-only by default; `--socket-mode` and
`--group` open both to a group (a vLLM container's user). TCP is refused
unless a token file is given: every call must then carry
`authorization: Bearer <token>` or gets UNAUTHENTICATED (on a Unix socket
too, when a token file is given there). A second, read-only token
(`--read-token-file`, for routers) may only call READ_ONLY_METHODS; anything
else it asks gets PERMISSION_DENIED. TLS (cert and key flags) is optional on
top, for TCP.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import hmac
import os
import stat
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from ec_protocol.protocol import pb

METADATA_KEY = "authorization"
# What the read-only token may call: the daemon's methods that change
# nothing a writer relies on, and the whole standard health service.
READ_ONLY_CALLS = ("Watch", "Stats", "Lookup")


def _method_paths(service: Any, names: Iterable[str] | None = None) -> frozenset[str]:
    """gRPC method paths (`/package.Service/Method`) of a generated service
    descriptor: `names` (a KeyError if the protocol lost one), or all."""
    methods = service.methods if names is None else [service.methods_by_name[n] for n in names]
    return frozenset(f"/{service.full_name}/{method.name}" for method in methods)


READ_ONLY_METHODS = (_method_paths(pb.DESCRIPTOR.services_by_name["ECDaemon"], READ_ONLY_CALLS)
                     | _method_paths(health_pb2.DESCRIPTOR.services_by_name["Health"]))
READ_ONLY_SUMMARY = ", ".join(READ_ONLY_CALLS) + ", health"


class AuthError(Exception):
    """A permission setting cannot be applied; the message is for the operator."""


def parse_mode(text: str) -> int:
    """'0660' -> 0o660; only permission bits, read and write (no execute)."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise ValueError(f"invalid mode {text!r}: use octal like 0600 or 0660") from None
    if mode & ~0o666:
        raise ValueError(f"invalid mode {text!r}: only read/write bits (e.g. 0600, 0660)")
    if not mode & 0o600 == 0o600:
        raise ValueError(f"invalid mode {text!r}: the owner needs read and write")
    return mode


def resolve_group(name: str) -> int | None:
    """A group name or number -> gid; None for ''. Raises AuthError."""
    if not name:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise AuthError(f"unknown group {name!r}") from None


def apply_access(path: str | Path, mode: int, gid: int | None) -> None:
    """Give the socket `path` the group `gid` (if set), then `mode`.

    Never follows a symlink: the daemon may run as root, and a symlink put in
    place of its socket must not make it open someone else's file. The group
    comes first so the wider mode never applies to the daemon's own group.
    Raises AuthError.
    """
    try:
        with _entry_path(path) as entry:
            if gid is not None:
                os.chown(entry, -1, gid)
            os.chmod(entry, mode)
    except OSError as exc:
        hint = ""
        if exc.errno == errno.EPERM and gid is not None and os.getuid() != 0 \
                and gid not in os.getgroups() and gid != os.getgid():
            hint = (f" (this user, uid {os.getuid()}, is not in group {gid}: run the daemon "
                    f"with that group, e.g. docker run --group-add {gid})")
        raise AuthError(f"cannot set access on {path}: {exc.strerror or exc}{hint}") from None


def make_socket_folder(folder: Path, gid: int | None) -> None:
    """Create the socket folder owner-only if it is missing, then check it
    with check_socket_folder. Raises AuthError."""
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass  # whatever is there is checked below, without following it
    except OSError as exc:
        raise AuthError(f"cannot create the socket folder {folder}: {exc.strerror}") from None
    check_socket_folder(folder, gid)


def check_socket_folder(folder: Path, gid: int | None) -> None:
    """Refuse a socket folder that someone else could have prepared or can
    change: a symlink, a folder owned by another user than ours or root, or
    one writable by others (or by a group other than `gid`, --group).

    Like OpenSSH's StrictModes: whoever controls the folder can replace the
    socket and intercept every client. Raises AuthError; the message names
    the folder and what to do.
    """
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise AuthError(f"cannot inspect the socket folder {folder}: {exc.strerror}") from None
    problem = _folder_problem(info, gid)
    if problem:
        raise AuthError(f"refusing socket folder {folder}: it {problem}; remove it (someone "
                        "may have created it to intercept clients) or choose --socket in a "
                        "folder this user owns (mode 0700)")


def _folder_problem(info: os.stat_result, gid: int | None) -> str:
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid not in (os.geteuid(), 0):
        return f"belongs to uid {info.st_uid}, not to this user or root"
    if mode & stat.S_IWOTH:
        return f"is writable by every user (mode {mode:04o})"
    if mode & stat.S_IWGRP and (gid is None or info.st_gid != gid):
        return f"is writable by group {info.st_gid} (mode {mode:04o}), which is not --group"
    return ""


def open_folder_to_group(folder: Path, gid: int | None) -> None:
    """A socket folder we created (ours, 0700): let the group traverse it
    (0710). Works on the folder opened without following a symlink.
    Raises AuthError."""
    if gid is None:
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        not_dir = exc.errno in (errno.ELOOP, errno.ENOTDIR)
        reason = "it is a symlink or not a folder" if not_dir else exc.strerror
        raise AuthError(f"cannot open the socket folder {folder}: {reason}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700:
            os.fchown(fd, -1, gid)
            os.fchmod(fd, 0o710)
    except OSError as exc:
        raise AuthError(f"cannot open {folder} to group {gid}: {exc.strerror}") from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def _entry_path(path: str | Path) -> Iterator[str]:
    """A path that names the entry `path` itself, never a symlink's target.

    Python 3.11 cannot chmod without following a symlink on Linux, and a
    socket cannot be opened for fchmod; an O_PATH descriptor pins the entry
    and its /proc/self/fd link reaches exactly that inode.
    """
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise OSError(errno.ELOOP, "it is a symlink")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def read_token(path: str) -> str:
    """The token in `path` (surrounding whitespace ignored). Raises AuthError."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise AuthError(f"cannot read token file {path}: {exc.strerror}") from None
    if len(token) < 16:
        raise AuthError(f"token in {path} is shorter than 16 characters")
    return token


def token_interceptor(token_file: str, read_token_file: str) -> TokenInterceptor | None:
    """The interceptor for --token-file and --read-token-file; None when
    neither is given (every call is allowed). Raises AuthError: a file that
    cannot be read or holds a short token, a read-only token without the
    full one (it would restrict nothing), or the same token in both."""
    if not token_file:
        if read_token_file:
            raise AuthError("--read-token-file needs --token-file: without a full token every "
                            "call is allowed, so a read-only token would restrict nothing")
        return None
    token = read_token(token_file)
    read_only = read_token(read_token_file) if read_token_file else None
    if read_only == token:
        raise AuthError(f"the read-only token in {read_token_file} is the full token of "
                        f"{token_file}: give routers a different token")
    return TokenInterceptor(token, read_only)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token`."""
    return ((METADATA_KEY, f"Bearer {token}"),)


Refusal = tuple[grpc.StatusCode, str]


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through by the bearer token it carries: the full token
    allows every method, the read-only token only READ_ONLY_METHODS
    (PERMISSION_DENIED otherwise); no token or another one gets
    UNAUTHENTICATED. Tokens are compared in constant time."""

    def __init__(self, token: str, read_token: str | None = None) -> None:
        self._full = f"Bearer {token}".encode()
        self._read = f"Bearer {read_token}".encode() if read_token else None

    def refusal(self, method: str, metadata: Iterable[tuple[str, Any]] | None) -> Refusal | None:
        """Why a call of `method` (its path, `/package.Service/Method`) with
        `metadata` is refused: a status code and its details; None if allowed."""
        presented = [str(value).encode() for key, value in metadata or ()
                     if key == METADATA_KEY]
        if any(hmac.compare_digest(value, self._full) for value in presented):
            return None
        if self._read is not None and any(hmac.compare_digest(value, self._read)
                                          for value in presented):
            if method in READ_ONLY_METHODS:
                return None
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method.lstrip('/')} needs the full token: the read-only token only "
                    f"reads ({READ_ONLY_SUMMARY})")
        return (grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong token (authorization: Bearer <token>)")

    async def intercept_service(
            self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        refusal = self.refusal(details.method, details.invocation_metadata)
        if refusal is None or handler is None:  # an unknown method stays UNIMPLEMENTED
            return handler
        return _denying(handler, *refusal)


def _denying(handler: Any, code: grpc.StatusCode, details: str) -> Any:
    """A handler of the same shape as `handler` that aborts with `code`."""
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
