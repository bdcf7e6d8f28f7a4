"""The shared region: one file in a tmpfs, and its index beside it.

`region` owns only the files (clients map the region themselves; `index`
writes the journal). The daemon never maps the region (`stamp_file` says
why: a client can truncate it, and a mapped page past the end is a SIGBUS):
it reads payload bytes with pread (`read`: publishing a saved entry to the
second tier, checking an entry a loader reported as not matching its
checksum; a copy of each MiB costs 0.1-0.25 ms of CPU, and the daemon's RSS
does not grow with the region), writes promoted ones with pwrite (`write`),
and its stamp table through its own descriptor. A file found shorter than
the region (`shortfall`) is given its size back (`restore`).

The file ends with a trailer page after the payload whose last 8 bytes are
the canary (`ec_protocol.stamps`): a random non-zero value written at
creation and written anew (`renew_canary`) whenever the daemon repairs a
file a client cut. Any cut zeroes at least one of its bytes (none is 0), so
a file cut and regrown before the daemon looked at its size still shows
(`canary_intact`), and a worker that reads the value it mapped the file
with after its copies knows no page they used was cut. A region of an older
daemon has no trailer: adopting it adds one (`add_canary`).

The file is created owner-only under a name that carries the generation,
its pages are allocated up front with posix_fallocate (pre-faulting without
touching memory, and failing with a clear error instead of a SIGBUS later
when the tmpfs is short). The final names are taken with link(2) and
O_EXCL, never by replacing a file: a name another user took first costs a
new generation, never the start-up.

Liveness of a region is a flock on its index (`index`; format 2): the daemon
holds it exclusively for its whole life, so a region whose index's lock can
be taken belongs to a dead daemon. Not the region's own lock: every client
opens the region to map it, and one holding a shared lock on a dead daemon's
region made the next start begin empty and `ec-daemon clean` leave it (a
region whose index is of format 1, an older daemon's, is still judged by its
own lock, as that daemon holds it).
At exit the daemon leaves the region and its index for the next daemon on the
same socket to adopt (`adoption`, which finds them: `dead`), or removes them
(`--on-exit remove`).
Files are opened without following symlinks and without blocking (a FIFO
planted under a region's name is skipped), and only this user's are touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ec_daemon.core.limits import (
    DEFAULT_SOCKET_MODE,
    PREFAULT_CHUNK_BYTES,
    PROGRESS_MIN_BYTES,
    PUBLISH_ATTEMPTS,
)
from ec_daemon.durable.index import Index, index_path
from ec_daemon.durable.journal import Header
from ec_daemon.durable.stamp_file import StampFile
from ec_protocol.sizes import format_size
from ec_protocol.stamps import file_bytes, read_canary, write_canary

log = logging.getLogger(__name__)

PREFIX = "ec-daemon-"
SUFFIX = ".region"
# A region being created has this name until it is locked and pre-faulted,
# so a daemon starting at the same moment never takes it for a dead one's.
CREATING_SUFFIX = ".creating"


class RegionError(Exception):
    """The region cannot be created; the message is for the operator."""


class RegionTooLarge(RegionError):
    """The tmpfs could hold the region but has not enough space free now (it
    may come back: clients of a previous daemon unmap its region within
    seconds). A region larger than the whole tmpfs raises RegionError."""


def new_generation() -> int:
    """A random non-zero 63-bit number, different on every start."""
    return secrets.randbits(63) | 1


def new_canary(old: int = 0) -> int:
    """A random 64-bit number none of whose bytes is 0 (a cut zeroes one:
    `ec_protocol.stamps.whole`), other than `old`."""
    while (canary := int.from_bytes(bytes(secrets.randbelow(255) + 1 for _ in range(8)),
                                    "little")) == old:
        pass
    return canary


class Region:
    def __init__(self, path: Path, size: int, generation: int, fd: int,
                 index: Index | None = None, canary: int = 0) -> None:
        """`size`: the region's (stamp table and payload), not counting the
        trailer; `canary`: the one the file holds (0: it has none yet)."""
        self.path = path
        self.size = size
        self.generation = generation
        self._fd = fd
        self.index = index  # None only for a region without one (tools, tests)
        self.canary = canary

    @classmethod
    def create(cls, shm_dir: str | Path, size: int, *, mode: int = DEFAULT_SOCKET_MODE,
               gid: int | None = None,
               progress: Callable[[str], None] | None = None,
               index_header: Callable[[int], Header] | None = None) -> Region:
        """Create, lock and pre-fault a region of `size` bytes in `shm_dir`,
        with an empty index (`index_header(generation)` is its header).

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
        creating = folder / f".{PREFIX}{secrets.token_hex(8)}{CREATING_SUFFIX}"
        # Owner-only until the group is set: created with `mode`, the file
        # would be open to the daemon's own primary group until the fchown.
        fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        index = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)  # the umask must not widen or narrow it
            _prefault(fd, file_bytes(size), folder, progress)
            canary = new_canary()
            write_canary(fd, size, canary)
            path, generation, index = _publish(folder, creating, index_header)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                creating.unlink()
            raise
        return cls(path, size, generation, fd, index, canary)

    def fileno(self) -> int:
        """The region file's descriptor (a store that maps it: the second tier)."""
        return self._fd

    def stamps(self, page_bytes: int, data_offset: int) -> StampFile:
        """The stamp table at the front of the file, read and written through
        this region's descriptor (`stamp_file`: never mapped)."""
        return StampFile(self._fd, page_bytes, data_offset,
                         (self.size - data_offset) // page_bytes)

    def read(self, extents: Iterable[tuple[int, int]]) -> list[bytes]:
        """The bytes under `extents` ((offset, length) pairs), with pread: a
        client may rewrite them meanwhile (the caller checks the pages'
        stamps after reading) or truncate the file (then an extent reads
        short, padded with zeros, which no checksum or stamp check passes on:
        a mapping would have been a SIGBUS). Thread-safe."""
        parts = []
        for offset, length in extents:
            if offset < 0 or length < 0 or offset + length > self.size:
                raise ValueError(f"extent ({offset}, {length}) is outside the region")
            data = os.pread(self._fd, length, offset)
            while len(data) < length:
                more = os.pread(self._fd, length - len(data), offset + len(data))
                if not more:
                    data += bytes(length - len(data))  # cut off the file
                    break
                data += more
            parts.append(data)
        return parts

    def shortfall(self) -> int | None:
        """The file's size when a client truncated it below the region's
        and its trailer (None: whole)."""
        size = os.fstat(self._fd).st_size
        return size if size < file_bytes(self.size) else None

    def canary_intact(self) -> bool:
        """Whether the file holds its canary (pread). False: a client cut
        it, perhaps regrowing it at once (or wrote the trailer)."""
        return read_canary(self._fd, self.size) == self.canary

    def restore(self) -> None:
        """Give a truncated file its size back (zeros where it was cut),
        allocated again as at creation. Raises OSError (the tmpfs is full).
        The canary stays cut: `renew_canary` once what was cut is dropped."""
        os.ftruncate(self._fd, file_bytes(self.size))
        with contextlib.suppress(OSError):  # (a tmpfs without fallocate: faulted on use)
            os.posix_fallocate(self._fd, 0, file_bytes(self.size))

    def renew_canary(self) -> int:
        """Write a new canary (the file is repaired): a worker that mapped it
        before the cut finds it changed, whatever it saw meanwhile."""
        self.canary = new_canary(self.canary)
        write_canary(self._fd, self.size, self.canary)
        return self.canary

    def add_canary(self) -> None:
        """Adopting an older daemon's region (no trailer): add the trailer
        and a canary. Raises OSError (the tmpfs is full)."""
        os.ftruncate(self._fd, file_bytes(self.size))
        with contextlib.suppress(OSError):
            os.posix_fallocate(self._fd, self.size, file_bytes(self.size) - self.size)
        self.renew_canary()

    def write(self, extents: Iterable[tuple[int, int]],
              parts: Iterable[bytes | bytearray | memoryview]) -> None:
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

    def close(self, *, remove: bool = True) -> None:
        """Drop the lock; with `remove`, remove the files too. Clients still
        mapping the region keep their mappings until they unmap. Kept, the
        region and its index are adopted by the next daemon on this socket."""
        if self._fd < 0:
            return
        if self.index is not None:
            self.index.close(remove=remove)
        if remove:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def region_path(folder: Path, generation: int) -> Path:
    """Where the region of `generation` lives (its index beside it: `index_path`)."""
    return folder / f"{PREFIX}{generation:016x}{SUFFIX}"


def _publish(folder: Path, creating: Path,
             index_header: Callable[[int], Header] | None) -> tuple[Path, int, Index | None]:
    """Give the pre-faulted region its final name and its index under a new
    generation. link(2) and O_EXCL never replace a file, so a name another
    user took first costs only another generation. Returns (path,
    generation, index)."""
    for _ in range(PUBLISH_ATTEMPTS):
        generation = new_generation()
        path = region_path(folder, generation)
        index = None
        try:
            if index_header is not None:
                index = Index.create(index_path(path), index_header(generation))
            os.link(creating, path)  # visible to clients and cleaners only now
        except FileExistsError:
            if index is not None:
                index.close(remove=True)
            continue
        except BaseException:
            if index is not None:
                index.close(remove=True)
            raise
        creating.unlink()
        return path, generation, index
    raise RegionError(f"could not name a region in {folder}: every name tried was taken")


def _space(folder: Path) -> tuple[int, int]:
    """(bytes available to us, bytes in all) of the filesystem of `folder`."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _prefault(fd: int, size: int, folder: Path, progress: Callable[[str], None] | None) -> None:
    """Allocate every page of the file now, reporting progress on big ones."""
    say = progress if progress is not None and size >= PROGRESS_MIN_BYTES else None
    started = time.monotonic()
    last_report = started
    if say is not None:
        say(f"pre-faulting a region of {format_size(size)} in {folder}...")
    done = 0
    while done < size:
        length = min(PREFAULT_CHUNK_BYTES, size - done)
        try:
            os.posix_fallocate(fd, done, length)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise RegionError(
                    f"the tmpfs holding {folder} ran out of space after "
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
