"""Copies of region chunks CUDA has not registered, through page-locked
memory of this process's own.

A chunk of the region that is not registered (yet: registration runs in the
background, `pinning`; or ever: it was refused) cannot be handed to
cudaMemcpyAsync as pageable memory: CUDA would read or write it with the
CPU, and a page another worker cut off the file is a SIGBUS there
(`ec_client.copy.mapping`). So such a copy goes through a bounce buffer
(`BOUNCE_BYTES` per copy stream, allocated page-locked on first need): a
load reads each piece from the file with pread into it and copies it to the
device from there; a save copies each piece from the device into it and
writes it into the file with pwrite once it landed. A buffer is reused once
its copies landed (the host waits for its stream once per `BOUNCE_BYTES`),
by one copy at a time. A load whose read the cut file made short fails
(`RegionCut`); a save's write extends a cut file, and the canary check after
the copy gives the save up.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from ec_client.common.limits import BOUNCE_BYTES
from ec_client.copy.mapping import RegionDamaged, RegionMapping

# One copy: (dst, dst_offset, src, src_offset, length); one side is host memory.
Copy = tuple[Any, int, Any, int, int]


class Copier(Protocol):
    """What a bounce buffer needs of a CUDA runtime (`ec_client.copy.cuda.CudaRuntime`)."""

    def pinned_host(self, nbytes: int) -> tuple[Any, memoryview]: ...

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, length: int,
             stream: Any) -> None: ...

    def synchronize_stream(self, stream: Any) -> None: ...


class Bounce:
    """One copy stream's bounce buffer. Thread-safe (one copy at a time)."""

    def __init__(self, runtime: Copier, nbytes: int = BOUNCE_BYTES) -> None:
        self.runtime = runtime
        self.host, self.view = runtime.pinned_host(nbytes)
        self.nbytes = nbytes
        self._lock = threading.Lock()

    def load(self, copies: Sequence[tuple[Copy, tuple[int, RegionMapping]]],
             stream: Any) -> dict[int, Exception]:
        """Queue `copies` (region to device; each tagged with its load's
        index and mapping) on `stream`, each piece read from the file into
        the buffer first, and return once they landed. Returns the loads (by
        index) whose read the cut file made short: their outputs are garbage."""
        rt = self.runtime
        failed: dict[int, Exception] = {}
        with self._lock:
            used = 0
            for (dst, dst_offset, _, offset, length), (index, mapping) in copies:
                if index in failed:
                    continue
                try:
                    while length:
                        if used == self.nbytes:
                            rt.synchronize_stream(stream)  # its copies read the buffer
                            used = 0
                        n = min(length, self.nbytes - used)
                        mapping.read_into(offset, self.view[used:used + n])
                        rt.copy(dst, dst_offset, self.host, used, n, stream)
                        used, offset, dst_offset, length = (used + n, offset + n,
                                                            dst_offset + n, length - n)
                except RegionDamaged as exc:
                    failed[index] = exc
            # Before another load refills it (the caller waits for this stream
            # right after anyway: the bytes are checked once they landed).
            rt.synchronize_stream(stream)
        return failed

    def save(self, copies: Sequence[tuple[Copy, RegionMapping]], stream: Any) -> None:
        """Queue `copies` (device to region; each tagged with its mapping) on
        `stream` into the buffer, and write each piece into the file once it
        landed there; return when every piece is written."""
        rt = self.runtime
        landed: list[tuple[int, int, RegionMapping, int]] = []  # at, bytes, mapping, offset

        def drain() -> None:
            rt.synchronize_stream(stream)
            for at, n, mapping, offset in landed:
                mapping.write_from(offset, self.view[at:at + n])
            landed.clear()

        with self._lock:
            used = 0
            for (_, offset, src, src_offset, length), mapping in copies:
                while length:
                    if used == self.nbytes:
                        drain()
                        used = 0
                    n = min(length, self.nbytes - used)
                    rt.copy(self.host, used, src, src_offset, n, stream)
                    landed.append((used, n, mapping, offset))
                    used, offset, src_offset, length = (used + n, offset + n, src_offset + n,
                                                        length - n)
            drain()
