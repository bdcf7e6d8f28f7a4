"""A save's copy into the pages the daemon allocated, and the checks that
vouch for it: both save paths of the saver (`ec_client.worker_side.saver`,
on the session stream or by calls) copy through `RegionCopier.copy`.

A save copies only while the session is fresh and its pages carry its
allocation's stamp (a writer frozen past its lease never overwrites).

Once a copy landed the copier reads the bytes back from the region file
(pread: never the mapping's pages, which a worker that truncates the file
would make a SIGBUS) and returns their checksum, which the saver reports
with `saved` (xxh3-64, `ec_protocol.checksums`): the daemon records it and
sends it with the entry, so a loader can tell the saved bytes from ones
another process wrote since. It costs the saver thread a pass over the
bytes, never the engine (docs/performance.md). Then it reads the file's
canary (`Regions.intact`): changed, the file was cut since it was mapped,
and the copy may have landed in pinned pages the file no longer has while
the read-back vouched for what the file holds instead, so the save is given
up (`saves_region_cut`) and never reported saved.

Called on the saver's thread only (its log's pacing is that thread's).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from ec_client.common.limits import CUT_LOG_SECONDS
from ec_client.common.session import Attachment, SessionLink
from ec_client.copy import CopyBackend
from ec_client.copy.mapping import RegionDamaged
from ec_client.worker_side.regions import Regions
from ec_protocol.checksums import checksum

# The saver's log: what became of a save is said under one logger name.
log = logging.getLogger("ec_client.worker_side.saver")


class RegionCopier:
    def __init__(self, *, link: SessionLink, regions: Regions, backend: CopyBackend,
                 stats: Counter[str]) -> None:
        """`stats` is the worker's counters."""
        self.link = link
        self.regions = regions
        self.backend = backend
        self.stats = stats
        self._cut_logged = -CUT_LOG_SECONDS

    def copy(self, attachment: Attachment, output: Any, ready: Any, entry_id: int,
             extents: list[tuple[int, int]]) -> int | None:
        """Copy `output` into its allocated extents; the checksum of the bytes
        that landed (read back from the region file), or None (give it up)
        unless the allocation's session is the link's and fresh, the pages
        carry its stamp (else nothing is copied), and the file was not cut
        under the copy (its canary)."""
        try:
            with self.regions.use(attachment.region) as (mapping, stamps):
                # A writer frozen past its lease and its quarantine must not
                # copy into pages reused since: copy only while the session is
                # known alive and the pages still carry this allocation's stamp.
                if self.link.attachment is not attachment or not self.link.fresh() \
                        or not stamps.holds(extents, entry_id):
                    self.stats["saves_stale"] += 1
                    return None
                self.backend.save(output, mapping, extents, ready)
                # What every loader will read: the file's pages, read with pread.
                sums = checksum(mapping.chunks(extents))
                if not self.regions.intact(mapping):  # after the read-back
                    self.stats["saves_region_cut"] += 1
                    return None
                return sums
        except RegionDamaged as exc:  # cut under the copy, or not repaired yet
            self.stats["saves_region_cut"] += 1
            now = time.monotonic()
            if now >= self._cut_logged + CUT_LOG_SECONDS:  # (once a while: saves go on)
                self._cut_logged = now
                log.warning("ec-daemon save given up (%d so far): %s",
                            self.stats["saves_region_cut"], exc)
            return None
