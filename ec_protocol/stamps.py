"""The stamp table: which allocation owns each payload page of the region.

The region file starts with this table (`data_offset` bytes, whole pages),
then the payload pages. Slot p holds the entry_id of the allocation that owns
payload page p, or 0 while the page is free. The daemon writes an
allocation's stamp into all of its pages before the writer is given the
extents, and clears them when the pages come back; a reader compares the
stamps of its extents with the entry_id it was told after its copy. Pages
reused under a copy carry another stamp by then (it was written before any
new byte), so a load that read anything but the saved bytes is caught.

Both sides import this module: the daemon writes, the workers check.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

SLOT_BYTES = 8
FREE = 0


def table_bytes(payload_pages: int, page_bytes: int) -> int:
    """Bytes at the front of the region (whole pages) holding the stamps of
    `payload_pages` pages: the payload starts at this offset."""
    return -(-payload_pages * SLOT_BYTES // page_bytes) * page_bytes


class StampTable:
    """A view of the table. `table` is the table's bytes (a writable
    memoryview of a shared mapping); not thread-safe for writers."""

    def __init__(self, table: memoryview, page_bytes: int, data_offset: int) -> None:
        self._slots = table.cast("B").cast("Q")
        self.page_bytes = page_bytes
        self.data_offset = data_offset

    def write(self, runs: Iterable[tuple[int, int]], stamp: int) -> None:
        """Stamp the payload pages of `runs` ((first page, pages) pairs)."""
        for first, pages in runs:
            self._slots[first:first + pages] = array("Q", [stamp]) * pages

    def clear(self, runs: Iterable[tuple[int, int]]) -> None:
        self.write(runs, FREE)

    def holds(self, extents: Iterable[tuple[int, int]], stamp: int) -> bool:
        """Do all pages under these byte extents carry `stamp`? (A reader
        checks an entry's stamp, never FREE: entry ids start at 1.)"""
        for offset, length in extents:
            first = (offset - self.data_offset) // self.page_bytes
            last = (offset + length - 1 - self.data_offset) // self.page_bytes
            if first < 0 or last >= len(self._slots) or length <= 0:
                return False
            if self._slots[first:last + 1].tobytes() != array("Q", [stamp]).tobytes() * (
                    last + 1 - first):
                return False
        return True

    def stamps(self, first: int, pages: int) -> list[int]:
        """The stamps of `pages` payload pages from `first` (checks, tools)."""
        return self._slots[first:first + pages].tolist()

    def release(self) -> None:
        self._slots.release()
