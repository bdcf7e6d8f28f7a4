"""Checks the daemon makes before it serves, each failing with one line.

The socket's place on disk is checked here, before anything is bound or
pre-faulted: a valid URI, a path short enough for a Unix socket, a folder
the daemon can trust (see auth.check_socket_folder), and no socket of a live
daemon in the way. A stale socket of a dead daemon is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
from pathlib import Path

from ec_daemon.serving.auth import AuthError, make_socket_folder
from ec_protocol.protocol import grpc_target, unix_path

log = logging.getLogger("ec_daemon")

UNIX_PATH_MAX = 107


class StartupError(Exception):
    """The daemon cannot start; the message says why and what to do."""


class SocketLock:
    """`<socket>.lock` beside the socket, flock'ed for the daemon's life: two
    daemons started at once on one socket cannot both serve (a socket only
    answers once the region is ready, so a probe alone cannot tell)."""

    def __init__(self, path: Path | None, fd: int = -1) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        """At exit, after the socket is gone: remove the file, then unlock."""
        if self._fd < 0 or self.path is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = -1


def prepare_socket(uri: str, gid: int | None = None) -> tuple[str, SocketLock]:
    """Check the socket URI, create its folder (owner-only) or refuse one
    that is not safe (`gid`: the --group that may share it), lock the socket
    for this daemon, and remove a stale socket left by a dead daemon.
    Returns the gRPC bind target and the lock. Raises StartupError."""
    try:
        target = grpc_target(uri)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    path_text = unix_path(uri)
    if path_text is None:
        return target, SocketLock(None)
    path = Path(path_text)
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise StartupError(f"socket path {path} is too long for a Unix socket "
                           f"(max {UNIX_PATH_MAX} bytes)")
    try:
        make_socket_folder(path.parent, gid)
    except AuthError as exc:
        raise StartupError(str(exc)) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise StartupError(f"socket folder {path.parent} is not writable by this user")
    lock = _lock(path)
    try:
        _remove_stale(path)
    except BaseException:
        lock.release()
        raise
    return target, lock


def _lock(path: Path) -> SocketLock:
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise StartupError(f"cannot lock {lock_path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StartupError(f"another daemon is serving or starting on {path}; stop it or "
                           "use --socket") from None
    return SocketLock(lock_path, fd)


def _remove_stale(path: Path) -> None:
    if not (path.exists() or path.is_symlink()):
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
    if _socket_is_live(path):
        raise StartupError(f"another daemon is serving on {path}; stop it or use --socket")
    path.unlink()
    log.info("removed stale socket %s", path)


def _socket_is_live(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise
    return True
