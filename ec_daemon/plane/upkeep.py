"""The data plane's upkeep: what runs every quarter lease (a second at
most), whatever clients do: sessions that read too slowly, views that did
not acknowledge an eviction in time, leases and ghosts that ran out, a
region file a client cut (its size short, or its canary changed),
quarantines that are over, the journal's compaction, and convergence's
bounds. None of it waits for a client; an
upkeep that fails is tried again (the cache would fill for good otherwise).

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ec_daemon.core.cache import Cache
from ec_daemon.core.records import Session
from ec_daemon.durable.region import Region
from ec_daemon.plane.convergence import Convergence

log = logging.getLogger(__name__)


class Upkeep:
    def __init__(self, cache: Cache, convergence: Convergence, *, lease_seconds: float,
                 region_file: Region | None, region_path: str,
                 end_session: Callable[[Session], None], ended: Callable[[Session], None],
                 drop_slow_reader: Callable[[Session], None],
                 verify: Callable[[], None]) -> None:
        """The data plane's parts it keeps, and what it asks of the plane:
        `end_session(session)` ends a live session (a ghost: its engine may
        still be loading), `ended(session)` is told of one whose lease ran
        out (ended already), `drop_slow_reader(session)` ends one whose
        outbox overflowed, `verify()` checks the bookkeeping."""
        self.cache = cache
        self.convergence = convergence
        self.lease_seconds = lease_seconds
        self.region_file = region_file
        self.region_path = region_path
        self.end_session = end_session
        self.ended = ended
        self.drop_slow_reader = drop_slow_reader
        self.verify = verify

    async def run(self) -> None:
        """Expire silent sessions, slow readers, ghosts and quarantines; runs
        until cancelled."""
        interval = min(1.0, self.lease_seconds / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self.once()
            except Exception:  # never stop expiring: the cache would fill for good
                log.exception("upkeep failed; trying again in %.1fs", interval)

    def once(self) -> None:
        for session in self.cache.sessions:
            if session.overflowed:
                self.drop_slow_reader(session)
        for view in self.cache.acks.overdue_views():
            self.cache.counters["ack_timeouts"] += 1
            view.ended_why = (f"it did not acknowledge an eviction within "
                              f"{self.cache.acks.ack_wait_seconds:.0f}s (--ack-wait-seconds)")
            log.warning("session %d (engine %r %s) ended: %s; awaited as a ghost for one lease "
                        "more", view.index, view.engine_id, view.component, view.ended_why)
            self.end_session(view)  # a ghost: its engine may still be loading
        for session in self.cache.expire_sessions():
            self.ended(session)
            log.warning("session %d expired (engine %r %s): no message for %.1fs",
                        session.index, session.engine_id, session.component,
                        self.lease_seconds)
        for ghost in self.cache.release_ghosts():
            log.info("session %d (engine %r) no longer awaited: its lease ran out",
                     ghost.index, ghost.engine_id)
        self._check_region()
        self.cache.release_quarantine()
        self.cache.compact_index()
        self.convergence.expire()
        self.verify()

    def _check_region(self) -> None:
        """A region file a client cut (every engine worker opens it
        read-write): give it its size back, drop what was cut, so nothing
        is served from a short or zeroed file (`Cache.cut_off`), then write
        a new canary, which tells every worker that mapped the file before
        that what it copied since may not be the file's. A short file was cut
        where its size says; one whose canary changed at full size was cut
        and regrown before this look (or its trailer written), where is
        unknown: every entry is dropped."""
        region = self.region_file
        if region is None:
            return
        cache = self.cache
        size = region.shortfall()
        if size is None:
            if region.canary_intact():
                return
            first, how = 0, "truncated and regrown (its canary changed)"
        else:
            first = max(0, (size - cache.data_offset) // cache.page_bytes)
            how = f"truncated to {size} bytes"
        cache.counters["region_truncations"] += 1
        try:
            region.restore()
        except OSError as exc:
            log.error("the region %s was %s by a client, and cannot be given its size back "
                      "(%s): trying again", self.region_path, how, exc)
            return
        lost = cache.cut_off(first)
        region.renew_canary()  # last: what was cut is dropped by now
        log.error("the region %s was %s by a client of the socket: its size is restored, the "
                  "%d entries it cut are dropped (never served), and its canary renewed",
                  self.region_path, how, len(lost))
