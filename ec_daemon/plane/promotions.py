"""Promotions: an item another host published, fetched from the second tier
into this host's region, because an engine here wants it (`convergence`).

`Promotions` owns the daemon's own writer in each namespace (a session no
client can name), the running fetch-and-write tasks and their thread pool.
Why the daemon writes and not the engine that wants the item: one fetch per
key per host however many engines want it, the store's bytes are verified
before any page is touched, and a failure costs the waiting engines only an
encode (the item is handed to one of them). A promotion otherwise goes the
way of a save: pages allocated (waiting for room as a save does), written,
committed, and announced ready like any entry.

Not thread-safe: the daemon's event loop is the only caller; fetches and
writes run on the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ec_daemon.core.cache import Cache
from ec_daemon.core.events import AllocOutcome, AllocResult, Fetched
from ec_daemon.core.limits import PROMOTION_THREADS
from ec_daemon.core.records import Key, Session
from ec_daemon.durable.region import Region
from ec_daemon.errors import CacheError
from ec_daemon.plane.convergence import Promoted, PromotionDone
from ec_daemon.plane.room import Room
from ec_daemon.plane.second_tier import SecondTier
from ec_protocol.protocol import BOTH

log = logging.getLogger(__name__)



class Promotions:
    def __init__(self, cache: Cache, tier: SecondTier, region_file: Region, room: Room, *,
                 verify: Callable[[], None]) -> None:
        """`tier` is fetched from, `region_file` written to, in pages `room`
        allocates (waiting for room as a save does); `verify` checks the
        bookkeeping after each promotion (--check-invariants)."""
        self.cache = cache
        self.tier = tier
        self.region_file = region_file
        self.room = room
        self.verify = verify
        self._promoters: dict[str, Session] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        # Keys being written into pages of their own (allocated, not yet
        # committed or aborted): their entries come from the second tier.
        self._writing: set[Key] = set()
        self._pool = ThreadPoolExecutor(PROMOTION_THREADS, thread_name_prefix="ec-promote")

    def start(self, key: Key, nbytes: int, done: PromotionDone) -> None:
        """Promote `key` (`convergence.Promoter`); `done` hears how it ended."""
        task = asyncio.ensure_future(self._promote(key, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def writing(self, key: Key) -> bool:
        """Whether a promotion is writing `key` now: the entry that becomes
        ready under it came from the second tier (not to be published back)."""
        return key in self._writing

    def namespace_unused(self, namespace: str) -> None:
        """No session uses `namespace` any more: forget its writer unless a
        promotion still holds a pending entry there."""
        promoter = self._promoters.get(namespace)
        if promoter is not None and not promoter.pending:
            del self._promoters[namespace]

    def cancel(self) -> None:
        """Shutdown: cancel every promotion (a write under way may still run)."""
        for task in list(self._tasks):
            task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _promoter(self, namespace: str) -> Session:
        """The daemon's own writer in `namespace`: promotions' pending entries
        are its (never in the session table: no client can name it)."""
        promoter = self._promoters.get(namespace)
        if promoter is None:
            now = time.monotonic()
            promoter = self._promoters[namespace] = Session(
                session_id="", index=0, engine_id="ec-daemon", role=BOTH, rank=0,
                world_size=1, namespace=namespace, client_name="second tier", created=now,
                lease_deadline=float("inf"))
        return promoter

    async def _promote(self, key: Key, done: PromotionDone) -> None:
        """Fetch `key` from the second tier (verified), allocate, write, commit.
        Any failure hands the item to a waiting engine to encode, and so does
        a spent promotion budget: the value's bytes are reserved before the
        fetch and released after the write, whatever happens (`remote.budget`)."""
        namespace, mm_hash = key
        loop = asyncio.get_running_loop()
        ended, nbytes = Promoted.FAILED, 0
        started = time.perf_counter()
        reservation = self.tier.reserve(namespace, mm_hash)
        try:
            if reservation is None:
                return  # the budget is spent, or the key's announcement is gone
            found = await loop.run_in_executor(self._pool, self.tier.fetch, namespace, mm_hash,
                                               reservation.nbytes)
            fetched = time.perf_counter()
            if found is None:
                return  # (the tier counted and logged why)
            promoter = self._promoter(namespace)
            result = await self.room.allocate(lambda: promoter, mm_hash, found.nbytes,
                                              tuple(found.shape), found.dtype)
            if result.outcome is AllocOutcome.ALREADY_PENDING:  # a worker is saving it
                ended = Promoted.SAVING
                return
            if result.outcome is AllocOutcome.ALREADY_READY:
                ended = Promoted.READY
                return
            if result.outcome is not AllocOutcome.ALLOCATED:
                return
            if not await self._write(key, promoter, result, found):
                return  # (the tier counted and logged why, and forgot the key)
            ended, nbytes = Promoted.WRITTEN, found.nbytes
            log.debug("promoted %s (%d bytes) in %.1f ms (fetch %.1f ms)", mm_hash,
                      found.nbytes, (time.perf_counter() - started) * 1e3,
                      (fetched - started) * 1e3)
        except CacheError as exc:
            # A value that verified but cannot be cached here (too large, a
            # shape or dtype the daemon refuses): never fetched again.
            self.tier.forget(namespace, mm_hash)
            log.warning("promotion of %s failed: %s; not trying it again", mm_hash, exc)
        except Exception:
            self.tier.forget(namespace, mm_hash)
            log.exception("promotion of %s failed", mm_hash)
        finally:
            if reservation is not None:
                # (Cancelled, at shutdown only, a write may still run: its
                # bytes go with the daemon.)
                reservation.release()
            done(key, ended, nbytes)
            self.verify()

    async def _write(self, key: Key, promoter: Session, result: AllocResult,
                     found: Fetched) -> bool:
        """Write the value the tier found into its pages (`fetch_into`:
        verified on the way) and commit (the entry is announced ready);
        aborted if it fails to read, verify or write (False)."""
        loop = asyncio.get_running_loop()
        self._writing.add(key)
        try:
            try:
                written = await loop.run_in_executor(
                    self._pool, self.tier.fetch_into, key[0], key[1], found, self.region_file,
                    result.extents)
            except Exception:  # (cancelled only at shutdown: the write may still run)
                self.cache.abort(promoter, [key[1]])
                raise
            if not written:
                self.cache.abort(promoter, [key[1]])
                return False
            self.cache.commit(promoter, [key[1]])
            return True
        finally:
            self._writing.discard(key)
