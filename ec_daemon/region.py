"""The shared region: one file in a tmpfs, owned by the daemon process.

`region` owns only the file (clients map it themselves). The daemon touches
payload bytes only for the second tier, with pread/pwrite on its descriptor
(`read`, `write`): publishing a saved entry, promoting a fetched one.

The file is created owner-only under a name that carries the generation,
its pages are allocated up front with posix_fallocate (pre-faulting without
touching memory, and failing with a clear error instead of a SIGBUS later
when the tmpfs is short), and it is removed when the daemon exits.

Liveness of a region is its flock: the daemon holds an exclusive lock for its
whole life, so a region file whose lock can be taken belongs to a dead daemon
and is removed at the next start (no pid files, no pid reuse races).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ec_daemon.config import format_size

log = logging.getLogger(__name__)

PREFIX = "ec-daemon-"
SUFFIX = ".region"
# A region being created has this name until it is locked and pre-faulted,
# so a daemon starting at the same moment never takes it for a dead one's.
CREATING_SUFFIX = ".creating"
# A half-created region untouched this long (pre-faulting keeps touching it)
# belongs to a daemon that died starting.
CREATING_STALE_SECONDS = 30
# Progress lines are printed while pre-faulting regions at least this large.
PROGRESS_MIN_BYTES = 1 << 30
_CHUNK_BYTES = 256 << 20


class RegionError(Exception):
    """The region cannot be created; the message is for the operator."""


class RegionTooLarge(RegionError):
    """The tmpfs could hold the region but has not enough space free now (it
    may come back: clients of a previous daemon unmap its region within
    seconds). A region larger than the whole tmpfs raises RegionError."""


def new_generation() -> int:
    """A random non-zero 63-bit number, different on every start."""
    return secrets.randbits(63) | 1


class Region:
    def __init__(self, path: Path, size: int, generation: int, fd: int) -> None:
        self.path = path
        self.size = size
        self.generation = generation
        self._fd = fd

    @classmethod
    def create(cls, shm_dir: str | Path, size: int, *, mode: int = 0o600,
               gid: int | None = None,
               progress: Callable[[str], None] | None = None) -> Region:
        """Create, lock and pre-fault a region of `size` bytes in `shm_dir`.

        Raises RegionError (nothing left behind) when the directory is
        unusable or the tmpfs cannot hold `size` bytes.
        """
        folder = Path(shm_dir)
        if not folder.is_dir():
            raise RegionError(f"shm directory {folder} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise RegionError(f"shm directory {folder} is not writable by this user")
        available, total = _space(folder)
        if size > available:
            raise (RegionTooLarge if size <= total else RegionError)(
                f"a region of {format_size(size)} does not fit in {folder} "
                f"({format_size(available)} available): lower --cpu-bytes or enlarge the "
                "tmpfs (docker: --shm-size; host: mount -o remount,size=... /dev/shm)")
        generation = new_generation()
        path = folder / f"{PREFIX}{generation:016x}{SUFFIX}"
        creating = folder / f".{PREFIX}{generation:016x}{CREATING_SUFFIX}"
        # Owner-only until the group is set: created with `mode`, the file
        # would be open to the daemon's own primary group until the fchown.
        fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)  # the umask must not widen or narrow it
            _prefault(fd, size, path, progress)
            os.rename(creating, path)  # visible to clients and cleaners only now
        except BaseException:
            os.close(fd)
            for leftover in (creating, path):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
            raise
        return cls(path, size, generation, fd)

    def map_front(self, length: int) -> mmap.mmap:
        """A shared, writable mapping of the file's first `length` bytes (the
        stamp table: the daemon never maps the payload)."""
        return mmap.mmap(self._fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def read(self, extents: Iterable[tuple[int, int]], nbytes: int) -> bytearray:
        """The bytes under `extents` ((offset, length) pairs), concatenated."""
        out = bytearray(nbytes)
        view = memoryview(out)
        at = 0
        for offset, length in extents:
            while length:
                got = os.preadv(self._fd, [view[at:at + length]], offset)
                if got <= 0:
                    raise OSError(errno.EIO, f"short read of region {self.path}")
                at, offset, length = at + got, offset + got, length - got
        if at != nbytes:
            raise ValueError(f"extents hold {at} bytes, not {nbytes}")
        return out

    def write(self, extents: Iterable[tuple[int, int]], parts: Iterable[Any]) -> None:
        """Write the concatenation of `parts` (bytes-like) across `extents`,
        in order, with pwritev: no joining copy."""
        pieces: Iterator[memoryview | None] = iter([memoryview(p).cast("B") for p in parts])
        part: memoryview | None = memoryview(b"")
        for offset, length in extents:
            batch = []
            while length:
                if not part:
                    part = next(pieces, None)
                    if part is None:
                        raise ValueError("the payload is shorter than its extents")
                    continue
                take = min(len(part), length)
                batch.append(part[:take])
                part, length = part[take:], length - take
            while batch:
                wrote = os.pwritev(self._fd, batch, offset)
                offset += wrote
                while batch and wrote >= len(batch[0]):
                    wrote -= len(batch.pop(0))
                if batch and wrote:
                    batch[0] = batch[0][wrote:]
        if part or next(pieces, None) is not None:
            raise ValueError("the payload is longer than its extents")

    def close(self) -> None:
        """Remove the file and drop the lock. Clients still mapping it keep
        their mappings until they unmap; nothing new can open it."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def clean_stale(shm_dir: str | Path) -> list[Path]:
    """Remove region files of dead daemons (their lock is free); returns them.
    Regions of live daemons, and files of other users, are left alone."""
    removed: list[Path] = []
    folder = Path(shm_dir)
    if not folder.is_dir():
        return removed
    old = time.time() - CREATING_STALE_SECONDS
    half_created = [p for p in folder.glob(f".{PREFIX}*{CREATING_SUFFIX}")
                    if _mtime(p) < old]  # checked before locking: never race a creator
    for path in [*folder.glob(f"{PREFIX}*{SUFFIX}"), *half_created]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live daemon holds it
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _space(folder: Path) -> tuple[int, int]:
    """(bytes available to us, bytes in all) of the filesystem of `folder`."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _prefault(fd: int, size: int, path: Path, progress: Callable[[str], None] | None) -> None:
    """Allocate every page of the file now, reporting progress on big ones."""
    say = progress if progress is not None and size >= PROGRESS_MIN_BYTES else None
    started = time.monotonic()
    last_report = started
    if say is not None:
        say(f"pre-faulting region {path} of {format_size(size)}...")
    done = 0
    while done < size:
        length = min(_CHUNK_BYTES, size - done)
        try:
            os.posix_fallocate(fd, done, length)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise RegionError(
                    f"the tmpfs holding {path.parent} ran out of space after "
                    f"{format_size(done)} of {format_size(size)}: lower --cpu-bytes or "
                    "enlarge the tmpfs") from None
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                os.ftruncate(fd, size)  # no fallocate here: size it, fault on use
                return
            raise
        done += length
        now = time.monotonic()
        if say is not None and (now - last_report >= 1.0 or done == size):
            last_report = now
            say(f"pre-faulting region: {format_size(done)} of {format_size(size)} "
                f"({100 * done // size}%, {now - started:.1f}s)")
