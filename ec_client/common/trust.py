"""Which daemon socket and region file a client may use.

A client hands its embeddings to whoever answers on the socket and maps
whatever file that daemon names, so both are checked before use: the socket
must not be a stranger's (`socket_owner`), and the region must be a regular
file of the daemon's user, opened without following a symlink
(`open_region`). Both raise UntrustedError, a PermissionError, so callers
that treat an OSError as "the daemon is not there" keep doing so.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class UntrustedError(PermissionError):
    """A socket or region this client must not use; the message says why."""


def socket_owner(uri: str) -> int | None:
    """The uid of the daemon serving on `uri` (None for TCP): the owner its
    region must have (pass it to RegionMapping as `expected_uid`).

    A socket owned by this user or root is trusted. Another user's socket is
    trusted only when no folder on its path, as given or resolved, is
    writable by every user: there anyone (a squatter on /tmp/ec-daemon-$UID)
    could have put it, whereas a folder such as /run/ec-daemon was set up by
    root or us for the daemon's user (the --group and container setups).

    Raises UntrustedError (a symlink, not a socket, or a stranger's socket),
    FileNotFoundError when no daemon has created it.
    """
    # Imported here: mapping a region (open_region) needs no gRPC or stubs.
    from ec_protocol.protocol import unix_path

    path = unix_path(uri)
    if path is None:
        return None
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedError(f"socket {path} is a symlink; give the daemon's socket itself")
    if not stat.S_ISSOCK(info.st_mode):
        raise UntrustedError(f"{path} is not a socket; is the daemon's --socket elsewhere?")
    if info.st_uid in (os.geteuid(), 0):
        return info.st_uid
    open_folder = _folder_anyone_can_write(Path(path))
    if open_folder is not None:
        raise UntrustedError(
            f"socket {path} belongs to uid {info.st_uid}, not to this user or root, and "
            f"{open_folder} is writable by every user, so anyone could have put it there: "
            "run the daemon as this user, or give its socket a folder only it can write")
    return info.st_uid


def attached_socket_owner(uri: str) -> int | None:
    """`socket_owner` for a client that just attached through `uri`: None
    also when the socket is gone again (a restart under way). Raises
    UntrustedError for a socket this client must not use."""
    try:
        return socket_owner(uri)
    except FileNotFoundError:
        return None


def open_region(path: str, expected_uid: int | None = None, *, writable: bool = True) -> int:
    """Open the region file read-write (read-only unless `writable`) and
    return the descriptor (the caller closes it). Refuses a symlink,
    anything but a regular file, and, when `expected_uid` is given, a file
    owned by anyone but that user or root. Raises UntrustedError, or another
    OSError (FileNotFoundError when the daemon that named it is gone)."""
    # O_NONBLOCK: a FIFO or device put in its place must not block the open.
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW \
        | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedError(f"region {path} is a symlink; refusing to map it") from None
        raise
    try:
        _check_region(path, os.fstat(fd), expected_uid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_region(path: str, info: os.stat_result, expected_uid: int | None) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise UntrustedError(f"region {path} is not a regular file; refusing to map it")
    if expected_uid is not None and info.st_uid not in (expected_uid, 0):
        raise UntrustedError(f"region {path} belongs to uid {info.st_uid}, not to the "
                             f"daemon's user (uid {expected_uid}) or root; refusing to map it")


def _folder_anyone_can_write(path: Path) -> Path | None:
    """The first folder above `path`, as given or with symlinks resolved,
    that every user may write to (sticky or not), or None."""
    given = Path(os.path.abspath(path)).parents
    resolved = Path(os.path.realpath(path)).parents
    for folder in (*given, *resolved):
        if os.stat(folder).st_mode & stat.S_IWOTH:
            return folder
    return None
