"""The region's stamp table as the daemon keeps it: read and written through
its own descriptor with pread/pwrite, never mapped.

Why not a mapping (as the workers have): every engine worker opens the region
read-write to map it, so any of them can ftruncate it. A page of a mapping
beyond the file's end is a SIGBUS on the next access: one client truncating
the region ended the daemon at its next save (with --group, a group member
could so end a daemon it cannot signal). pwrite past the end extends the
file instead, and pread past it returns short, so the daemon survives and
notices (`Region.shortfall`), restores the size, and drops what was cut
(`Cache.lost_pages`). The layout is `ec_protocol.stamps`'s; a write is one
pwrite a run, a check one pread an extent (an allocation's stamps cost a
system call, microseconds).

Not thread-safe for writers: the event loop writes; the second tier's
publisher thread only reads (`holds`).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable

from ec_protocol.stamps import FREE, SLOT_BYTES

# A page whose stamp was lost (the table was cut) carries this: no entry id
# (ids stay below 2^62), so no reader's check passes on it, and a writer of
# a pending save whose stamp it replaced copies nothing.
LOST = (1 << 64) - 1


class StampFile:
    def __init__(self, fd: int, page_bytes: int, data_offset: int, pages: int) -> None:
        """The table of `pages` payload pages at the front of the file open as
        `fd` (the caller keeps it open)."""
        self._fd = fd
        self.page_bytes = page_bytes
        self.data_offset = data_offset
        self.pages = pages

    def write(self, runs: Iterable[tuple[int, int]], stamp: int) -> None:
        """Stamp the payload pages of `runs` ((first page, pages) pairs)."""
        for first, pages in runs:
            data = (array("Q", [stamp]) * pages).tobytes()
            offset = first * SLOT_BYTES
            while data:
                wrote = os.pwrite(self._fd, data, offset)
                data, offset = data[wrote:], offset + wrote

    def clear(self, runs: Iterable[tuple[int, int]]) -> None:
        self.write(runs, FREE)

    def holds(self, extents: Iterable[tuple[int, int]], stamp: int) -> bool:
        """Do all pages under these byte extents carry `stamp`?"""
        for offset, length in extents:
            first = (offset - self.data_offset) // self.page_bytes
            last = (offset + length - 1 - self.data_offset) // self.page_bytes
            if first < 0 or last >= self.pages or length <= 0:
                return False
            if self.stamps(first, last + 1 - first) != [stamp] * (last + 1 - first):
                return False
        return True

    def stamps(self, first: int, pages: int) -> list[int]:
        """The stamps of `pages` payload pages from `first` (a page cut off
        the file reads as free)."""
        data = os.pread(self._fd, pages * SLOT_BYTES, first * SLOT_BYTES)
        data += bytes(pages * SLOT_BYTES - len(data))
        return array("Q", data).tolist()

    def release(self) -> None:
        """(Nothing is mapped.)"""
        return None
