"""The region file's layout: the stamp table, the payload, and the trailer's
canary. Both sides import this module: the daemon writes, the workers check.

```
 [ stamp table ][ payload pages ... ][ trailer: TRAILER_BYTES, the canary last ]
 0              data_offset          region size                        file size
```

The region file starts with the stamp table (`data_offset` bytes, whole
pages), then the payload pages. Slot p holds the entry_id of the allocation
that owns payload page p, or 0 while the page is free. The daemon writes an
allocation's stamp into all of its pages before the writer is given the
extents, and clears them when the pages come back; a reader compares the
stamps of its extents with the entry_id it was told after its copy. Pages
reused under a copy carry another stamp by then (it was written before any
new byte), so a load that read anything but the saved bytes is caught.

Workers read the table with pread through their descriptor (`StampReader`),
never through a mapping: every worker opens the file read-write, so any of
them can truncate it, and a mapped page past the file's end is a SIGBUS on
the next access, which would end the process that read it.

The trailer follows the payload (the region's size, as `AttachReply.region`
tells it, does not count it). Its last 8 bytes are the **canary**: a random
number none of whose bytes is 0, which the daemon writes when it creates the
file and writes anew whenever it repairs it (`ec_daemon.durable.region`).
A truncation below the file's size cuts at least the canary's last byte,
and what a cut removed reads as zeros once the file is regrown, so after
any cut the canary has a zero byte (`whole` is false; it reads 0 when a
page was cut, or short) until the daemon's repair gives it a new value. A
worker compares the canary with the one it saw when it mapped the file
after each batch of copies: equal, no page it copied through was cut since
it mapped the file (a pinned page a cut took away stays the GPU's while the
file gets new ones: `ec_client.copy.mapping` says why that matters). Only
a process that writes the canary back on purpose hides a cut from it: what
such a writer can do is said in docs/security.md, and the entries'
checksums catch it.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable

SLOT_BYTES = 8
FREE = 0
# The trailer after the payload: one page, the canary in its last bytes.
TRAILER_BYTES = 4096
CANARY_BYTES = 8
# A load's stamps are read in one pread per group of runs at most this many
# slots apart (the entry's pages are usually near each other): one system
# call instead of one per extent, reading at most 4 KiB it does not need.
MERGE_GAP_SLOTS = 512


def table_bytes(payload_pages: int, page_bytes: int) -> int:
    """Bytes at the front of the region (whole pages) holding the stamps of
    `payload_pages` pages: the payload starts at this offset."""
    return -(-payload_pages * SLOT_BYTES // page_bytes) * page_bytes


def file_bytes(region_size: int) -> int:
    """The size of a region file of `region_size` bytes (the trailer included)."""
    return region_size + TRAILER_BYTES


def canary_offset(region_size: int) -> int:
    """Where the canary of a region of `region_size` bytes lies in its file."""
    return file_bytes(region_size) - CANARY_BYTES


def whole(canary: int) -> bool:
    """Whether `canary` is one the daemon writes (none of its bytes is 0):
    any cut of the file zeroes at least one."""
    return 0 < canary < 1 << 64 and all(canary.to_bytes(CANARY_BYTES, "little"))


def read_canary(fd: int, region_size: int) -> int:
    """The canary in the file open as `fd` (pread): 0 when the file is cut
    short of it (the daemon never writes 0)."""
    data = os.pread(fd, CANARY_BYTES, canary_offset(region_size))
    return int.from_bytes(data, "little") if len(data) == CANARY_BYTES else 0


def write_canary(fd: int, region_size: int, canary: int) -> None:
    """Write `canary` (the daemon does, with pwrite)."""
    data = canary.to_bytes(CANARY_BYTES, "little")
    offset = canary_offset(region_size)
    while data:
        wrote = os.pwrite(fd, data, offset)
        data, offset = data[wrote:], offset + wrote


def page_span(extents: Iterable[tuple[int, int]], page_bytes: int,
              data_offset: int) -> list[tuple[int, int]] | None:
    """The payload pages (first, last) each extent touches, or None when an
    extent is empty or outside the payload."""
    out = []
    for offset, length in extents:
        first = (offset - data_offset) // page_bytes
        last = (offset + length - 1 - data_offset) // page_bytes
        if first < 0 or length <= 0:
            return None
        out.append((first, last))
    return out


class StampTable:
    """A view of the table. `table` is the table's bytes (a writable
    memoryview: a copy in memory, or a mapping the caller owns); not
    thread-safe for writers."""

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


class StampReader:
    """The table read through a descriptor with pread, never mapped (the
    module docstring says why); the daemon's `StampFile` writes it the same
    way. A page cut off the file reads as free, which no check of an entry
    passes. Thread-safe (it keeps no state but the descriptor, which the
    caller keeps open)."""

    def __init__(self, fd: int, page_bytes: int, data_offset: int, pages: int) -> None:
        self._fd = fd
        self.page_bytes = page_bytes
        self.data_offset = data_offset
        self.pages = pages

    def holds(self, extents: Iterable[tuple[int, int]], stamp: int) -> bool:
        """Do all pages under these byte extents carry `stamp`? One pread per
        group of nearby runs (`MERGE_GAP_SLOTS`), not one per extent."""
        spans = page_span(extents, self.page_bytes, self.data_offset)
        if not spans or any(last >= self.pages for _, last in spans):
            return False
        want = array("Q", [stamp]).tobytes()
        groups: list[tuple[int, int, list[tuple[int, int]]]] = []
        for first, last in sorted(spans):
            if groups and first - groups[-1][1] <= MERGE_GAP_SLOTS:
                group_first, group_last, members = groups[-1]
                members.append((first, last))
                groups[-1] = (group_first, max(group_last, last), members)
            else:
                groups.append((first, last, [(first, last)]))
        for group_first, group_last, members in groups:
            data = self._read(group_first, group_last + 1 - group_first)
            for first, last in members:
                at = (first - group_first) * SLOT_BYTES
                if data[at:at + (last + 1 - first) * SLOT_BYTES] != want * (last + 1 - first):
                    return False
        return True

    def stamps(self, first: int, pages: int) -> list[int]:
        """The stamps of `pages` payload pages from `first`."""
        return array("Q", self._read(first, pages)).tolist()

    def _read(self, first: int, pages: int) -> bytes:
        """The slots of `pages` pages from `first`; those cut off read as free."""
        want = pages * SLOT_BYTES
        data = os.pread(self._fd, want, first * SLOT_BYTES)
        while 0 < len(data) < want:  # (a short read of a regular file: go on)
            more = os.pread(self._fd, want - len(data), first * SLOT_BYTES + len(data))
            if not more:
                break
            data += more
        return data + bytes(want - len(data))

    def release(self) -> None:
        """(Nothing is mapped; the descriptor is the caller's.)"""
        return None

