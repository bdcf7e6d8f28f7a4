"""The second tier's index follower (indexed stores: Redis): the thread that
reads other hosts' announcements into the local index, sweeps what expired,
and keeps the index dated by the store's clock.

It is its own module because following is the one part an indexed store
needs and a probed store (Mooncake) never runs: a blocking read loop with
its own pacing (FOLLOW_PAUSE_S, UPKEEP_S) and failure handling. It holds
the core (`core`), whose lock guards the index it fills, not the tier.
"""

from __future__ import annotations

import logging
import time

from ec_daemon.remote.backend import Announcement, IndexedStore, RemoteError
from ec_daemon.remote.core import TierCore

log = logging.getLogger("ec_daemon.remote")

UPKEEP_S = 5.0  # the index: expired entries swept, the store's clock read, this often
FOLLOW_PAUSE_S = 0.02  # after a read that found announcements, the index is read again this late


class Follower:
    """The index-following thread (`run`) of one indexed store, until the
    core stops. A read that fails is counted and retried after block_s."""

    def __init__(self, core: TierCore, store: IndexedStore, *, block_s: float,
                 batch: int) -> None:
        """`block_s`: how long one read waits for announcements; `batch`:
        the most announcements one read returns."""
        self.core = core
        self.store = store
        self.block_s = block_s
        self.batch = batch

    def run(self) -> None:
        core, store = self.core, self.store
        cursor: str | None = None
        next_upkeep = time.monotonic()
        while not core.stopping.is_set():
            if core.take_rescan():
                cursor = None
            try:
                found, cursor = store.read_index(cursor, self.block_s, self.batch,
                                                 breakers=core.breakers)
            except RemoteError as exc:
                if core.stopping.is_set():
                    break
                core.count(errors=1)
                log.debug("index read failed: %s", exc)
                core.stopping.wait(self.block_s)
                continue
            except Exception:
                if core.stopping.is_set():
                    break
                core.count(errors=1)
                log.exception("index read failed")
                core.stopping.wait(self.block_s)
                continue
            if time.monotonic() >= next_upkeep:  # (before the absorb: the first read's too)
                self._learn_time()
                next_upkeep = time.monotonic() + UPKEEP_S
                self._sweep()
            if found:
                self._absorb(found)
                # Let announcements gather (each read costs 0.3 ms of CPU; a
                # publishing host would read back each of its own alone).
                core.stopping.wait(FOLLOW_PAUSE_S)

    def _absorb(self, found: list[Announcement]) -> None:
        core = self.core
        with core.index_lock:
            evicted = core.index.absorb(found)
        core.count(index_announcements=len(found), index_evictions=evicted)

    def _sweep(self) -> None:
        with self.core.index_lock:
            self.core.index.sweep()

    def _learn_time(self) -> None:
        """Read the store's clock: a daemon that starts, or an index nobody
        announced on for a while, must still see which entries expired.
        (Store failures go to the breakers; the index keeps its time.)"""
        core = self.core
        try:
            now_ms = self.store.clock_ms(core.breakers)
        except Exception:
            core.count(errors=1)
            log.exception("reading the store's clock failed")
            return
        if now_ms is not None:
            with core.index_lock:
                core.index.clock.observe(now_ms)
