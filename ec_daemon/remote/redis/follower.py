"""The follower of a Redis store's index: the thread that
reads other hosts' announcements into what this host follows
(`announcements`), sweeps what expired, and keeps them dated by the store's
clock.

It is its own module because following is the one part a store with an
index needs and Mooncake never runs: a blocking read loop with its own pacing
(FOLLOW_PAUSE_S, INDEX_UPKEEP_S) and failure handling. It holds the tier's common
state (`common`: the stop, the breakers, the counters), the index shards it reads
and the announcements it fills, under its backend's lock.
"""

from __future__ import annotations

import logging
import threading
import time

from ec_daemon.core.limits import FOLLOW_PAUSE_S, INDEX_UPKEEP_S
from ec_daemon.remote.common import Common, RemoteError
from ec_daemon.remote.redis.announcements import Announcement, Announcements
from ec_daemon.remote.redis.shards import IndexShards

log = logging.getLogger("ec_daemon.remote")



class Follower:
    """The following thread (`run`) of one Redis store, until the tier
    stops. A read that fails is counted and retried after block_s."""

    def __init__(self, common: Common, shards: IndexShards,
                 announcements: Announcements, lock: threading.Lock, *, block_s: float,
                 batch: int) -> None:
        """`lock` guards `announcements`; `block_s`: how long one read waits
        for announcements; `batch`: the most announcements one read returns."""
        self.common = common
        self.shards = shards
        self.announcements = announcements
        self.lock = lock
        self.block_s = block_s
        self.batch = batch

    def run(self) -> None:
        common, shards = self.common, self.shards
        cursor: str | None = None
        next_upkeep = time.monotonic()
        while not common.stopping.is_set():
            with self.lock:
                if self.announcements.take_rescan():
                    cursor = None
            try:
                found, cursor = shards.read(cursor, self.block_s, self.batch,
                                             breakers=common.breakers)
            except RemoteError as exc:
                if common.stopping.is_set():
                    break
                common.count(errors=1)
                log.debug("index read failed: %s", exc)
                common.stopping.wait(self.block_s)
                continue
            except Exception:
                if common.stopping.is_set():
                    break
                common.count(errors=1)
                log.exception("index read failed")
                common.stopping.wait(self.block_s)
                continue
            if time.monotonic() >= next_upkeep:  # (before the absorb: the first read's too)
                self._learn_time()
                next_upkeep = time.monotonic() + INDEX_UPKEEP_S
                with self.lock:
                    self.announcements.sweep()
            if found:
                self._absorb(found)
                # Let announcements gather (each read costs 0.3 ms of CPU; a
                # publishing host would read back each of its own alone).
                common.stopping.wait(FOLLOW_PAUSE_S)

    def _absorb(self, found: list[Announcement]) -> None:
        with self.lock:
            evicted = self.announcements.absorb(found)
        self.common.count(index_announcements=len(found), index_evictions=evicted)

    def _learn_time(self) -> None:
        """Read the store's clock: a daemon that starts, or an index nobody
        announced on for a while, must still see which entries expired.
        (Store failures go to the breakers; the announcements keep their time.)"""
        try:
            now_ms = self.shards.clock_ms(self.common.breakers)
        except Exception:
            self.common.count(errors=1)
            log.exception("reading the store's clock failed")
            return
        if now_ms is not None:
            with self.lock:
                self.announcements.clock.observe(now_ms)
