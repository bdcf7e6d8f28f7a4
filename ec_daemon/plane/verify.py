"""Entries a loader reported as not matching their checksum, checked by the
daemon against their pages.

Every engine worker maps the region read-write, so any of them can change an
entry's bytes (or stamps) after it was saved. Its writer reported the
checksum of the bytes that landed (`ec_protocol.checksums`); loaders check
their copy against it and report a mismatch on their view's stream
(`ClientMessage.mismatches`). The daemon does not take a client's word for
it: it reads the pages itself (pread, off the event loop: `Region.read`) and
checks their stamps and checksum. A mismatch withdraws the entry (its pages
stamped LOST, so no load of it passes the stamp check any more, and hidden:
its views drop it, and once they acknowledged, the next save of the key can
land), counted (`checksum_mismatches`) and logged; a match changes nothing,
so a client that lies evicts nothing.

What one client can make the daemon read is bounded: an entry is checked once
at a time, at most MAX_MISMATCH_CHECKS at once, and an entry found whole is not
checked again for WHOLE_SECONDS (reports meanwhile are only counted).

Not thread-safe: the event loop calls it; the reading runs in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable

from ec_daemon.core.cache import Cache
from ec_daemon.core.events import Extent
from ec_daemon.core.limits import MAX_MISMATCH_CHECKS, WHOLE_REMEMBERED, WHOLE_SECONDS
from ec_daemon.core.records import Entry, Session, State
from ec_daemon.durable.region import Region
from ec_protocol.checksums import NONE, checksum

log = logging.getLogger(__name__)



class Verifier:
    def __init__(self, cache: Cache, region_file: Region | None) -> None:
        """`region_file`: the region the pages are read from
        (None: reports are counted, nothing is read: a cache without a region)."""
        self.cache = cache
        self.region_file = region_file
        self._checking: dict[int, asyncio.Future[None]] = {}  # entry id -> its check
        self._whole: OrderedDict[int, float] = OrderedDict()  # entry id -> checked at

    def report(self, session: Session, refs: Iterable[tuple[str, int]]) -> None:
        """`session`'s engine found these entries' bytes not to match their
        checksum: each still ready is checked (stale refs are ignored)."""
        namespace = session.namespace
        for mm_hash, entry_id in refs:
            entry = self.cache.get(namespace, mm_hash)
            if entry is None or entry.entry_id != entry_id or entry.state is not State.READY:
                continue  # gone or going already
            self.cache.counters["mismatch_reports"] += 1
            log.info("session %d (engine %r) reports entry %d (%s) does not match its "
                     "checksum: checking its pages", session.index, session.engine_id,
                     entry_id, mm_hash)
            if self._skip(entry_id):
                continue
            check = asyncio.ensure_future(self._check(entry))
            self._checking[entry_id] = check

    def cancel(self) -> None:
        for check in list(self._checking.values()):
            check.cancel()

    def _skip(self, entry_id: int) -> bool:
        if self.region_file is None or entry_id in self._checking \
                or len(self._checking) >= MAX_MISMATCH_CHECKS:
            return True
        now = time.monotonic()
        while self._whole and next(iter(self._whole.values())) <= now - WHOLE_SECONDS:
            self._whole.popitem(last=False)
        return entry_id in self._whole

    async def _check(self, entry: Entry) -> None:
        region = self.region_file
        assert region is not None  # (`_skip` checks nothing without one)
        try:
            extents, stamp, expected = self.cache.extents(entry), entry.entry_id, entry.checksum
            whole = await asyncio.get_running_loop().run_in_executor(
                None, self._pages_hold, region, extents, stamp, expected)
            if whole:
                self._whole[stamp] = time.monotonic()
                while len(self._whole) > WHOLE_REMEMBERED:
                    self._whole.popitem(last=False)
                log.info("entry %d (%s) is whole: its pages match its stamp and checksum; "
                         "nothing changed", stamp, entry.mm_hash)
            elif entry.state is State.READY:  # (still the entry it read)
                self.cache.counters["checksum_mismatches"] += 1
                log.warning("entry %d (%s in %r) no longer holds the bytes its writer saved "
                            "(another process wrote its pages): hidden, so the next save of "
                            "its key can land", stamp, entry.mm_hash, entry.key[0])
                self.cache.withdraw(entry)
        except Exception:  # a check that cannot run changes nothing
            log.exception("checking entry %d failed", entry.entry_id)
        finally:
            self._checking.pop(entry.entry_id, None)

    def _pages_hold(self, region: Region, extents: tuple[Extent, ...], stamp: int,
                    expected: int) -> bool:
        """(In a thread.) Do the pages carry `stamp`, and their bytes `expected`?"""
        parts = region.read(extents)
        if not self.cache.stamps.holds(extents, stamp):
            return False
        return expected == NONE or checksum(parts) == expected
