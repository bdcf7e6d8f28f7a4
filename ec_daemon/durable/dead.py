"""What dead daemons left in the tmpfs: their regions, found and locked
(`dead_regions`), then adopted (`DeadRegion.take`: `serving.adoption`),
removed (`clean_stale`, `ec-daemon clean`) or left.

A region belongs to a dead daemon when its index's lock can be taken
(format 2: a live daemon holds it for its whole life; `region`); a region
whose index is of format 1, an older daemon's, is judged by its own lock, as
that daemon holds it. Half-created regions and indexes without a region, left
by a daemon that died starting, are removed on the way. Files are opened
without following symlinks and without blocking (a FIFO planted under a
region's name is skipped), and only this user's are touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ec_daemon.core.limits import CREATING_STALE_SECONDS
from ec_daemon.durable.index import (
    COMPACTING_SUFFIX,
    INDEX_SUFFIX,
    Index,
    index_path,
    open_own_file,
    read_header,
)
from ec_daemon.durable.journal import Header, IndexUnreadable
from ec_daemon.durable.region import CREATING_SUFFIX, PREFIX, SUFFIX, Region
from ec_protocol.stamps import read_canary


@dataclass
class DeadRegion:
    """A region file of this user whose daemon is gone (its lock is ours now)."""

    path: Path
    fd: int  # open (locked too where its liveness is the region's lock)
    size: int  # the file's (a region's trailer included)
    header: Header | None  # None when its index is missing or unreadable
    problem: str = ""  # why there is no header
    index_fd: int = -1  # its index, open and locked, where liveness is the index's lock

    def canary(self, region_size: int) -> int:
        """The canary its file holds as a region of `region_size` bytes (0:
        none, or cut)."""
        return read_canary(self.fd, region_size)

    def take(self, index: Index, region_size: int, canary: int) -> Region:
        """Adopt it as a region of `region_size` bytes whose file holds
        `canary` (0: none yet, `Region.add_canary`): its lock stays held for
        this daemon's life (the index's passes to `index`: `take_index_fd`)."""
        fd, self.fd = self.fd, -1
        return Region(self.path, region_size, _generation_of(self.path), fd, index, canary)

    def take_index_fd(self) -> int | None:
        """The index, open and locked, for `Index.reopen` to keep (None: not held)."""
        fd, self.index_fd = self.index_fd, -1
        return fd if fd >= 0 else None

    def remove(self) -> None:
        """Remove the region and its index (only regular files of this user:
        another user's file or folder under the index's name stays)."""
        _unlink_own(index_path(self.path))
        _unlink_own(self.path)
        self.release()

    def release(self) -> None:
        """Leave the files; let go of the lock."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.index_fd >= 0:
            os.close(self.index_fd)
            self.index_fd = -1


def dead_regions(shm_dir: str | Path, socket: str | None = None) -> list[DeadRegion]:
    """This user's region files in `shm_dir` whose daemon is dead, locked now
    (the caller adopts, removes or releases each), newest index first; with
    `socket`, only those whose index names it or that have no readable index
    (the others are never locked: their own daemon may be starting now).
    Half-created regions and indexes without a region, left by a daemon that
    died starting, are removed on the way. Anything that is not a regular
    file of this user (a symlink, a FIFO, a folder, another user's) is left
    alone, and no such file can make the scan fail."""
    folder = Path(shm_dir)
    if not folder.is_dir():
        return []
    old = time.time() - CREATING_STALE_SECONDS
    for path in [*folder.glob(f".{PREFIX}*{CREATING_SUFFIX}"),
                 *folder.glob(f".{PREFIX}*{COMPACTING_SUFFIX}"),
                 *folder.glob(f"{PREFIX}*{INDEX_SUFFIX}")]:
        if _mtime(path) >= old or (path.suffix == INDEX_SUFFIX
                                   and os.path.lexists(path.with_suffix(SUFFIX))):
            continue  # (checked before locking: never race a creator)
        fd = _lock_own(path)
        if fd is not None:
            _unlink_own(path)
            os.close(fd)
    found = []
    for path in folder.glob(f"{PREFIX}*{SUFFIX}"):
        header, problem = _header(path)
        if socket is not None and header is not None and header.socket != socket:
            continue
        if header is not None and header.version >= 2:  # its daemon locks the index
            dead = _dead_by_index(path, header)
            if dead is not None:
                found.append(dead)
            continue
        fd = _lock_own(path)
        if fd is not None:
            found.append(DeadRegion(path, fd, os.fstat(fd).st_size, header, problem))
    found.sort(key=lambda d: -_mtime(index_path(d.path)))
    return found


def _dead_by_index(path: Path, header: Header) -> DeadRegion | None:
    """The region at `path` if its index's lock is free (its daemon is dead),
    open, with its index open and locked; else None. The region's own lock is
    taken where it can be (a client may hold it: it does not count)."""
    index_fd = _lock_own(index_path(path))
    if index_fd is None:
        return None  # a live daemon holds it (or it is not this user's)
    try:
        fd = open_own_file(path, os.O_RDWR)
    except OSError:
        os.close(index_fd)
        return None
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return DeadRegion(path, fd, os.fstat(fd).st_size, header, index_fd=index_fd)


def _header(path: Path) -> tuple[Header | None, str]:
    """The header of a region's index, or why there is none."""
    try:
        return read_header(index_path(path)), ""
    except FileNotFoundError:
        return None, "it has no index"
    except (OSError, IndexUnreadable) as exc:
        return None, f"its index is unreadable: {exc}"


def clean_stale(shm_dir: str | Path, socket: str | None = None) -> list[Path]:
    """Remove dead daemons' regions (those of `socket` only, when given);
    returns them. Regions of live daemons and other users' files stay."""
    removed = []
    for dead in dead_regions(shm_dir, socket):
        dead.remove()
        removed.append(dead.path)
    return removed


def _unlink_own(path: Path) -> None:
    """Remove `path` if it is still a regular file of this user; never fails."""
    with contextlib.suppress(OSError):
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
            path.unlink()


def _lock_own(path: Path) -> int | None:
    """An open, exclusively locked descriptor of `path` when it is a regular
    file of this user that no live daemon holds; else None."""
    try:
        fd = open_own_file(path, os.O_RDWR)  # read-write: an adopted region is served
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None  # a live daemon holds it
    return fd


def _generation_of(path: Path) -> int:
    return int(path.name[len(PREFIX):-len(SUFFIX)], 16)


def _mtime(path: Path) -> float:
    """When `path` itself (not what it links to) changed; never for a file
    that cannot be looked at."""
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return float("inf")
