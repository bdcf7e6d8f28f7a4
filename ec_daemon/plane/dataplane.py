"""The daemon's data plane: what the gRPC handlers ask for, on plain values.

It owns the cache and everything that listens to it: convergence (who makes
a wanted item), the watchers (`watch`), the second tier (`remote`: publishing
saves, and `promotions` from it), the workers' saves (`saves`: allocations,
waiting for pages, reports, on the unary calls and on the session stream),
and the upkeep that expires sessions. The servicer (`service`) only converts
protobuf and calls in here, as MLServer's servicers hand their work to its
data plane, so the waiting, retrying and announcing are read (and tested)
without gRPC.

"An entry became ready" is said in one place, `_entry_changed`: the cache
tells the views itself (their events carry its bookkeeping), then calls it
once per entry that became READY, and every other listener hears it there:
the watchers, convergence (the entry's waiters hit now) and the second tier
(a save of this host is published). A new way of making an entry ready
cannot forget one of them. Eviction (HIDDEN) reaches the watchers the same way.

Not thread-safe: the daemon's event loop is the only caller (the second
tier's store calls run on its own threads).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from ec_daemon.core import invariants, stats
from ec_daemon.core.cache import Cache
from ec_daemon.core.events import ClientMessage, HeartbeatEcho
from ec_daemon.core.limits import MAX_WATCHERS, MAX_WATCHERS_PER_PEER, validate_mm_hash
from ec_daemon.core.records import Entry, Key, Session, State
from ec_daemon.core.sessions import engine_key
from ec_daemon.errors import (
    CacheError,
    FailedPrecondition,
    InvalidArgument,
    InvariantViolated,
)
from ec_daemon.plane import watch
from ec_daemon.plane.convergence import Convergence
from ec_daemon.plane.promotions import Promotions
from ec_daemon.plane.saves import SPACE, Saves
from ec_daemon.plane.verify import Verifier
from ec_daemon.plane.wakeups import Wakeups

log = logging.getLogger(__name__)


class DataPlane:
    def __init__(self, cache: Cache, *, lease_seconds: float, alloc_wait_seconds: float,
                 check_invariants: bool = False, generation: int = 0, region_path: str = "",
                 region_file: Any = None, tier: Any = None,
                 max_watchers: int = MAX_WATCHERS,
                 max_watchers_per_peer: int = MAX_WATCHERS_PER_PEER,
                 adoption: dict[str, int] | None = None) -> None:
        """`generation` and `region_path` name the region in stats, `adoption`
        says what this start found of the previous daemon's (`adoption.Found`);
        `region_file` is the `region.Region` (its size watched, pages read to
        check reported mismatches), `tier` a `remote.tier.RemoteTier` (only
        with a second tier)."""
        self.cache = cache
        self.lease_seconds = lease_seconds
        self.alloc_wait_seconds = alloc_wait_seconds
        self.check_invariants = check_invariants
        self.generation = generation
        self.region_path = region_path
        self.adoption = dict(adoption or {})
        self.started = time.monotonic()
        self.closing = False
        self.wakeups = Wakeups()
        cache.on_reclaim = lambda: self.wakeups.wake(SPACE)
        self.watchers = watch.Watchers(max_watchers=max_watchers,
                                       max_per_peer=max_watchers_per_peer)
        cache.on_entry_change = self._entry_changed
        self.region_file = region_file
        self.tier = tier
        self.convergence = Convergence(
            cache, remote_available=tier.available if tier is not None else None)
        self.saves = Saves(cache, self.convergence, self.wakeups, alloc_wait_seconds)
        self.verifier = Verifier(cache, region_file)
        self.promotions: Promotions | None = None
        if tier is not None:
            self.promotions = Promotions(cache, self.convergence, tier, region_file,
                                         allocate=self.saves.allocate_waiting,
                                         verify=self.verify)
            self.convergence.start_promotion = self.promotions.start
            self.convergence.resolve = self._resolve
            self.convergence.call_later = \
                lambda seconds, fn: asyncio.get_running_loop().call_later(seconds, fn)

    def _resolve(self, key: Key, claim: bool) -> bool:
        """Ask the second tier about a wanted key (`Convergence.resolve`);
        its answer comes back on the loop."""
        loop = asyncio.get_running_loop()

        def done(outcome: Any) -> None:
            loop.call_soon_threadsafe(self._resolved, key, outcome)

        return bool(self.tier.resolve(key[0], key[1], done, claim))

    def _resolved(self, key: Key, outcome: Any) -> None:
        nbytes = self.tier.available(*key) if outcome.value == "found" else None
        self.convergence.resolved(key, outcome.value, nbytes)
        self.verify()

    # ----------------------------------------------------------- sessions

    def session(self, session_id: str) -> Session:
        """The live session; raises NotFound (the client must re-attach)."""
        return self.cache.sessions.get(session_id)

    def attach(self, **fields: Any) -> Session:
        """A new session (`Cache.attach`); it takes part once its stream opens."""
        store_namespace = fields.pop("store_namespace", "")
        victim = self.cache.sessions.victim_for(fields["engine_id"],
                                                fields.get("engine_token", ""))
        if victim is not None:  # an attach that never became anything makes room
            log.warning("session %d (engine %r %s) ended: its stream never opened in %.0fs, and "
                        "an engine presenting its token needs the place", victim.index,
                        victim.engine_id, victim.component,
                        self.cache.sessions.clock() - victim.created)
            self.cache.counters["preempted_sessions"] += 1
            self.end_session(victim, detached=True)
        session = self.cache.attach(**fields, in_place_of=victim)
        if self.tier is not None:
            self.tier.follow(session.namespace, store_namespace)
        log.info("attached session %d: engine %r %s (%s) in %r", session.index,
                 session.engine_id, session.component, session.role, session.namespace)
        return session

    def detach(self, session_id: str) -> None:
        """The client ends its session: it will load nothing more (no ghost)."""
        session = self.cache.sessions.get(session_id)
        self.end_session(session, detached=True)
        log.info("detached session %d (engine %r)", session.index, session.engine_id)

    def end_session(self, session: Session, *, detached: bool = False) -> None:
        alive = session.alive
        self.cache.end_session(session, detached=detached)
        if alive:
            self._ended(session)
        self.verify()

    def _ended(self, session: Session) -> None:
        """After a session ended (any way): its claims pass on, its
        namespace's views learn the engine count, a namespace nobody uses any
        more is no longer followed in the second tier's index."""
        self.convergence.session_ended(session)
        namespace = session.namespace
        if session.is_scheduler:
            self._tell_namespace(namespace)
        if not self.cache.sessions.in_use(namespace):
            if self.tier is not None:
                self.tier.unfollow(namespace)
            if self.promotions is not None:
                self.promotions.namespace_unused(namespace)

    def _tell_namespace(self, namespace: str) -> None:
        """Every view of `namespace`: whether wanting items helps now."""
        info = self.convergence.info(namespace)
        for view in self.cache.sessions.subscribers(namespace):
            view.send(info)

    def verify(self) -> None:
        """With --check-invariants: raise InvariantViolated (INTERNAL) if the
        bookkeeping does not add up. Tests and fuzzing run with it."""
        if not self.check_invariants:
            return
        try:
            invariants.check(self.cache)
        except AssertionError as exc:
            log.critical("cache invariant violated: %s", exc)
            raise InvariantViolated(f"cache invariant violated: {exc}") from exc

    def snapshot(self) -> stats.Snapshot:
        tier = {k: float(v) for k, v in self.tier.snapshot().items()} \
            if self.tier is not None else None
        snapshot = stats.take(self.cache, generation=self.generation,
                              region_path=self.region_path, started=self.started,
                              convergence=self.convergence.counters, remote_tier=tier)
        return dataclasses.replace(snapshot, watchers=self.watchers.count,
                                   dropped_watchers=self.watchers.dropped,
                                   adoption=self.adoption)

    def lookup(self, namespace: str, mm_hashes: list[str]) -> list[Entry | None]:
        if not namespace:
            raise InvalidArgument("namespace is empty (use the one Attach returned)")
        return self.cache.lookup(namespace, mm_hashes)

    # ------------------------------------------------------------- stream

    def open_stream(self, session_id: str, first: Callable[[], ClientMessage]) -> Session:
        """`session_id`'s stream opened; `first()` is its first message,
        converted only now. Raises NotFound, FailedPrecondition (it has a
        stream already) or the first message's CacheError: a session whose
        first message is refused has ended, told nothing."""
        session = self.cache.sessions.get(session_id)
        if session.streaming:
            raise FailedPrecondition("this session already has a stream")
        self.cache.open(session)
        try:
            self.apply(session, first())  # checks everything before it applies anything
        except CacheError:
            # A session without its stream is dead; it was told nothing yet.
            self.end_session(session, detached=True)
            raise
        if session.is_scheduler:  # its loads in flight were declared just now
            self.cache.reattached(session)
            self._tell_namespace(session.namespace)
        return session

    def apply(self, session: Session, message: ClientMessage) -> None:
        """A worker's reports then allocations (answered on the stream, a
        refusal too), acknowledgements, touches, then the heartbeat (whose
        echo follows the lease renewal). Everything is checked before
        anything is applied."""
        m, beat = message, message.heartbeat
        if (m.acks or m.holds or m.touches or m.mismatches
                or (beat is not None and beat.lookups)) and not session.is_scheduler:
            raise FailedPrecondition("only scheduler sessions acknowledge, hold, touch, count "
                                     "lookups or report mismatches")
        if (m.wants or m.releases or m.encoding) and not session.is_scheduler:
            raise FailedPrecondition("only scheduler sessions want, release or encode items")
        if m.yields and not (session.is_scheduler and session.can_load):
            # (a producer never waits: it cannot take another's claim in its place)
            raise FailedPrecondition("only scheduler sessions of consumer or both engines "
                                     "yield items")
        if (m.allocations or m.reports) and session.rank is None:
            raise FailedPrecondition("only worker sessions save")
        if m.engine_token and session.rank is None:
            raise FailedPrecondition("only worker sessions present an engine token on the "
                                     "stream (a scheduler names its own at Attach)")
        for mm_hash in (*m.wants, *m.releases, *m.yields, *m.encoding,
                        *(r.mm_hash for r in m.reports)):
            validate_mm_hash(mm_hash)
        self.cache.sessions.renew(session)
        if m.engine_token:  # before its saves: they are the instance's
            self.cache.join(session, engine_key(session.engine_id, m.engine_token))
        if m.reports or m.allocations:
            self.saves.on_stream(session, m.reports, m.allocations)
        if m.acks:
            self.cache.acknowledge(session, m.acks)
        if m.holds:
            self.cache.hold(session, m.holds)
        if m.touches:
            self.cache.touch(session, m.touches)
        if m.mismatches:
            self.verifier.report(session, m.mismatches)
        if m.releases:
            self.convergence.release(session, m.releases)
        if m.yields:
            self.convergence.step_aside(session, m.yields)
        if m.encoding:
            self.convergence.started(session, m.encoding)
        if m.wants:
            self.convergence.want(session, m.wants)
        if beat is not None:
            if session.is_scheduler:
                self.cache.record_lookups(session, beat.lookups, beat.hits)
            if beat.seq:
                session.send(HeartbeatEcho(beat.seq))
        self.verify()

    def stream_ended(self, session: Session) -> None:
        """`session`'s stream ended. Only Detach ends a session as detached:
        a stream that ends, even as a clean half-close (a killed client's may
        look like one), leaves a ghost, since its engine may still be loading."""
        if session.alive:
            log.info("session %d ended (engine %r %s): stream ended without Detach",
                     session.index, session.engine_id, session.component)
        self.end_session(session)

    def stalled(self, what: Session | watch.Watcher) -> str:
        """A session or watcher whose client has not taken a message for
        the stall bound (`serving.streams`): ended as a reader too slow (a
        session becomes a ghost: its engine may still be loading), counted.
        Returns what its client is told."""
        self.cache.counters["stalled_streams"] += 1
        if isinstance(what, watch.Watcher):
            self.watchers.drop(what, stalled=True)
            return str(what.error)
        log.warning("session %d (engine %r %s) detached: its client has not read a message "
                    "for %.0fs", what.index, what.engine_id, what.component,
                    self.lease_seconds)
        what.ended_why = f"its client read nothing for {self.lease_seconds:.0f}s"
        if what.alive:
            self.end_session(what)
        return f"session detached: {what.ended_why}"

    def drop_slow_reader(self, session: Session) -> None:
        """End a session whose outbox overflowed (it becomes a ghost). Its
        stream may still be blocked writing to a client that stopped reading:
        that must not keep evictions waiting for it."""
        if not session.alive:
            return
        log.warning("session %d (engine %r %s) detached: it read events too slowly "
                    "(%d queued); it re-attaches with a fresh snapshot", session.index,
                    session.engine_id, session.component, len(session.outbox))
        session.ended_why = "events were read too slowly"
        self.end_session(session)

    # -------------------------------------------------------------- watch

    def open_watcher(self, namespace: str, peer: str, engine_id: str = "",
                     token: str = "") -> watch.Watcher:
        """A router's watcher of `namespace` (`watch.Watchers.open`); close
        it (`close_watcher`) when its call ends, however it ends. One that
        presents a running engine instance's id and token counts in that
        instance's bucket; any other, in its peer's."""
        key = engine_key(engine_id, token) if engine_id and token else ""
        running = bool(key) and self.cache.sessions.running(key)
        return self.watchers.open(namespace, self.cache.entries(), peer,
                                  engine=key if running else "")

    def close_watcher(self, watcher: watch.Watcher) -> None:
        self.watchers.close(watcher)

    # ----------------------------------------------------- announcements

    def _entry_changed(self, entry: Entry) -> None:
        """The cache's one announcement that `entry` became READY (its views
        were told just before) or HIDDEN: watchers hear both; a ready entry's
        waiters hit now, and a save of this host is published (write-behind;
        a promoted entry came from the second tier)."""
        self.watchers.publish(entry)
        if entry.state is not State.READY:
            return
        self.convergence.ready(entry.key)
        if self.promotions is not None and not self.promotions.writing(entry.key):
            self._publish(entry)

    def _publish(self, entry: Entry) -> None:
        """Queue a ready entry for the second tier, sent from its pages off the loop."""
        extents, stamp = self.cache.extents(entry), entry.entry_id
        stamps, region_file, nbytes = self.cache.stamps, self.region_file, entry.nbytes

        def current() -> bool:
            """Whether the pages still hold the entry (reused, their stamp
            changed: ids never repeat)."""
            return stamps.holds(extents, stamp)

        namespace, mm_hash = entry.key
        self.tier.publish(namespace, mm_hash, entry.shape, entry.dtype, nbytes,
                          lambda: region_file.read(extents), current=current,
                          extents=list(extents))

    # ------------------------------------------------------------ upkeep

    async def upkeep(self) -> None:
        """Expire silent sessions, slow readers, ghosts and quarantines; runs
        until cancelled."""
        interval = min(1.0, self.lease_seconds / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self._upkeep_once()
            except Exception:  # never stop expiring: the cache would fill for good
                log.exception("upkeep failed; trying again in %.1fs", interval)

    def _upkeep_once(self) -> None:
        for session in self.cache.sessions:
            if session.overflowed:
                self.drop_slow_reader(session)
        for view in self.cache.overdue_views():
            self.cache.counters["ack_timeouts"] += 1
            view.ended_why = (f"it did not acknowledge an eviction within "
                              f"{self.cache.ack_wait_seconds:.0f}s (--ack-wait-seconds)")
            log.warning("session %d (engine %r %s) ended: %s; awaited as a ghost for one lease "
                        "more", view.index, view.engine_id, view.component, view.ended_why)
            self.end_session(view)  # a ghost: its engine may still be loading
        for session in self.cache.expire_sessions():
            self._ended(session)
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
        size = region.shortfall()
        if size is None:
            if region.canary_intact():
                return
            first, how = 0, "truncated and regrown (its canary changed)"
        else:
            first = max(0, (size - self.cache.data_offset) // self.cache.page_bytes)
            how = f"truncated to {size} bytes"
        cache = self.cache
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

    def close_streams(self) -> None:
        """Shutdown: end every session stream (clients see the stream end)."""
        self.closing = True
        self.watchers.close_all()
        for session in self.cache.sessions:
            session.wake()
        if self.promotions is not None:
            self.promotions.cancel()
        self.saves.cancel()
        self.verifier.cancel()
