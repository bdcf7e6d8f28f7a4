"""The region's stamp table as the daemon keeps it: read and written through
its own descriptor with pread/pwrite, never mapped.

Why not a mapping: every engine worker opens the region read-write, so any of
them can ftruncate it. A page of a mapping
beyond the file's end is a SIGBUS on the next access: one client truncating
the region ended the daemon at its next save (with --group, a group member
could so end a daemon it cannot signal). pwrite past the end extends the
file instead, and pread past it returns short, so the daemon survives and
notices (`Region.shortfall`), restores the size, and drops what was cut
(`Cache.cut_off`). The workers read the table the same way
(`ec_protocol.stamps.StampReader`, whose checks this class shares); a write
is one pwrite a run, a check one pread per group of nearby runs (an
allocation's stamps cost a system call, microseconds).

Not thread-safe for writers: the event loop writes; the second tier's
publisher thread only reads (`holds`).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable

from ec_protocol.stamps import FREE, SLOT_BYTES, StampReader

# A page whose stamp was lost (the table was cut) carries this: no entry id
# (ids stay below 2^62), so no reader's check passes on it, and a writer of
# a pending save whose stamp it replaced copies nothing.
LOST = (1 << 64) - 1


class StampFile(StampReader):
    """The table of `pages` payload pages at the front of the file open as
    `fd` (the caller keeps it open): read as every worker reads it
    (`StampReader.holds`, `stamps`), written with pwrite."""

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
