"""A client's view of the daemon's region file: its descriptor, and a
MAP_SHARED mapping made only where a copy needs one.

The daemon only owns the file; each client process opens it itself. A
mapping belongs to one region generation: after a daemon restart the old
file is gone and extents of the old generation must never be read through a
new mapping.

Why the CPU never touches the mapping. Every engine worker opens the file
read-write, so any of them (a bug, or a process that means it) can
`ftruncate` it, and a mapped page past the file's end is a SIGBUS at the
next access: the process that touched it ends. So on every worker path the
CPU reads and writes the file with pread/pwrite through `fd` (`read_into`,
`write_from`, `chunks`): a read the cut made short raises `RegionCut` (that
copy fails; a pwrite past the end only extends the file, and the canary
says so). The mapping (`view`) is made on first use, by the CUDA backends,
which register it with CUDA: registered pages are pinned and DMA'd by the
GPU, which never faults on them.

Why the canary (`ec_protocol.stamps`). cudaHostRegister pins the pages the
mapping had. A cut takes them out of the file while the GPU keeps copying
to and from them (orphaned pages), and a file regrown at once looks whole:
a save would land in pages no other process sees, and a load read bytes no
longer the file's. The file's canary changes with any cut that removes a
page (a cut zeroes at least one of its bytes, none of which the daemon
writes as 0, until the daemon repairs the file and writes a new one),
so `intact` after a batch of copies says whether every page they used was
still the file's: the canary this mapping saw when it was made is still
there. A mapping that finds it changed is `damaged` for good: its user
drops it, and the file is opened, mapped and registered anew once the
daemon repaired it (`watch_canary` refuses a file whose canary was cut).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from ec_client.common.limits import READ_CHUNK_BYTES
from ec_client.common.trust import open_region
from ec_protocol.stamps import read_canary, whole


class RegionDamaged(OSError):
    """The region file was cut (truncated) or its canary changed: what was
    copied through this mapping since it was made may not be the file's.
    The copy fails (a load) or is given up (a save); the daemon repairs the
    file within a second or so, and a new mapping is made then."""


class RegionCut(RegionDamaged):
    """A read reached the file's end before the region's: another process
    cut the file (the copy fails; nothing faulted)."""


class RegionMapping:
    def __init__(self, path: str, size: int, generation: int, *,
                 expected_uid: int | None = None) -> None:
        """Open the region. `expected_uid`: the daemon's user
        (trust.socket_owner), the file's required owner besides root; None
        checks no owner.

        Raises OSError: FileNotFoundError when the daemon that announced it
        is gone (attach again); trust.UntrustedError for a symlink, a file
        that is not regular, or one of another owner (do not use the daemon).
        """
        fd = open_region(path, expected_uid)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise RegionCut(f"region {path} is {actual} bytes, expected {size}")
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.path = path
        self.size = size
        self.generation = generation
        # The canary seen when the file was opened (`watch_canary`); None: not
        # checked (a region of a daemon that writes none).
        self.canary: int | None = None
        self.damaged = False  # sticky: a changed canary was seen
        self._lock = threading.Lock()
        self._mmap: mmap.mmap | None = None
        self._view: memoryview | None = None

    @property
    def view(self) -> memoryview:
        """The file mapped read-write (made on first use). Only CUDA's
        registration and DMA may touch its pages: a CPU access of a page a
        cut removed is a SIGBUS (the module docstring)."""
        with self._lock:
            if self._view is None:
                if self.fd < 0:
                    raise ValueError("the region mapping is closed")
                self._mmap = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED,
                                       mmap.PROT_READ | mmap.PROT_WRITE)
                self._view = memoryview(self._mmap)
            return self._view

    def check(self, offset: int, length: int) -> None:
        """Raise ValueError unless [offset, offset+length) lies in the region."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"extent {offset}+{length} is outside the region ({self.size} bytes)")

    # ------------------------------------------------------ pread / pwrite

    def read_into(self, offset: int, buffer: Any) -> None:
        """Fill `buffer` (writable, contiguous) with the file's bytes from
        `offset`. Raises RegionCut when the file ends first."""
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise RegionCut(f"region {self.path} ends before byte {offset + done}: another "
                                "process truncated it")
            done += got

    def write_from(self, offset: int, data: Any) -> None:
        """Write `data` (bytes-like, contiguous) into the file at `offset`.
        (A write past a cut end extends the file, with a hole before it: the
        canary, which nobody but the daemon writes, stays cut.)"""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)

    def chunks(self, extents: Iterable[tuple[int, int]],
               chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[memoryview]:
        """The bytes under `extents`, in order, as views of one reused buffer
        (each valid until the next is taken): what a checksum reads. Raises
        RegionCut when the file ends first."""
        buffer = memoryview(bytearray(chunk_bytes))
        for offset, length in extents:
            end = offset + length
            while offset < end:
                piece = buffer[:min(chunk_bytes, end - offset)]
                self.read_into(offset, piece)
                yield piece
                offset += len(piece)

    # -------------------------------------------------------------- canary

    def watch_canary(self) -> int:
        """Take the file's canary as this mapping's (call it before the
        mapping is registered or copied through). Raises RegionDamaged when
        it reads 0: the file was cut and the daemon has not repaired it yet."""
        canary = read_canary(self.fd, self.size)
        if not whole(canary):
            raise RegionDamaged(f"region {self.path} was cut by another process and is not "
                                f"repaired yet (its canary reads {canary:016x}): the daemon "
                                "repairs it within a second or so")
        self.canary = canary
        return canary

    def intact(self) -> bool:
        """Whether the file's canary is still the one this mapping saw
        (always, for a mapping that watches none). Read with pread; False
        once is False for good (`damaged`)."""
        if self.canary is None:
            return True
        if not self.damaged and read_canary(self.fd, self.size) != self.canary:
            self.damaged = True
        return not self.damaged

    def close(self) -> None:
        with self._lock:
            view, self._view = self._view, None
            region, self._mmap = self._mmap, None
            fd, self.fd = self.fd, -1
        if view is not None:
            view.release()
        if region is not None:
            # A copy may still hold a view: the mapping then goes with the last one.
            with contextlib.suppress(BufferError):
                region.close()
        if fd >= 0:
            os.close(fd)
