"""The daemon's data plane: what the gRPC handlers ask for, on plain values.

It owns the cache and everything that listens to it: convergence (who makes
a wanted item), the watchers (`watch`), the second tier (`remote`: publishing
saves, and `promotions` from it), the workers' saves (`saves`: allocations,
waiting for pages, reports, on the unary calls and on the session stream),
and the upkeep that expires sessions (`upkeep`). The servicer (`service`) only converts
protobuf and calls in here, as MLServer's servicers hand their work to its
data plane, so the waiting, retrying and announcing are read (and tested)
without gRPC.

"An entry became ready" is said in one place, `entry_changed`: the cache
tells the views itself (their events carry its bookkeeping), then tells the
plane, its listener from its making (`CacheListener`), once per entry that
became READY, and every other listener hears it there:
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

from ec_daemon.core import invariants, stats
from ec_daemon.core.cache import Cache, CacheListener
from ec_daemon.core.events import ClientMessage, HeartbeatEcho, Resolution
from ec_daemon.core.limits import (
    DEFAULT_MAX_WATCHERS,
    DEFAULT_MAX_WATCHERS_PER_PEER,
    validate_mm_hash,
)
from ec_daemon.core.records import Entry, Key, Session, State
from ec_daemon.core.sessions import engine_key
from ec_daemon.durable.region import Region
from ec_daemon.errors import (
    CacheError,
    FailedPrecondition,
    InvalidArgument,
    InvariantViolated,
)
from ec_daemon.plane import watch
from ec_daemon.plane.convergence import Convergence
from ec_daemon.plane.promotions import Promotions
from ec_daemon.plane.room import Room
from ec_daemon.plane.saves import Saves
from ec_daemon.plane.second_tier import SecondTier
from ec_daemon.plane.upkeep import Upkeep
from ec_daemon.plane.verify import Verifier
from ec_protocol.protocol import Role

log = logging.getLogger(__name__)


class DataPlane:
    def __init__(self, make_cache: Callable[[CacheListener], Cache], *, lease_seconds: float,
                 alloc_wait_seconds: float, check_invariants: bool = False,
                 generation: int = 0, region_path: str = "", region_file: Region | None = None,
                 tier: SecondTier | None = None, max_watchers: int = DEFAULT_MAX_WATCHERS,
                 max_watchers_per_peer: int = DEFAULT_MAX_WATCHERS_PER_PEER,
                 adoption: dict[str, int] | None = None) -> None:
        """`make_cache(listener)` makes the cache the plane runs, with the
        plane as its listener (`entry_changed`, `pages_reclaimed`).
        `generation` and `region_path` name the region in stats, `adoption`
        says what this start found of the previous daemon's (`adoption.Found`);
        `region_file` is the region (its size watched, pages read to check
        reported mismatches, promotions written into), `tier` the second tier
        (None: none; it needs the region file)."""
        if tier is not None and region_file is None:
            raise ValueError("a second tier promotes into the region file: give it")
        self.cache = make_cache(self)
        self.lease_seconds = lease_seconds
        self.alloc_wait_seconds = alloc_wait_seconds
        self.check_invariants = check_invariants
        self.generation = generation
        self.region_path = region_path
        self.adoption = dict(adoption or {})
        self.started = time.monotonic()
        self.closing = False
        cache = self.cache
        self.room = Room(cache, alloc_wait_seconds)
        self.watchers = watch.Watchers(max_watchers=max_watchers,
                                       max_per_peer=max_watchers_per_peer)
        self.region_file = region_file
        self.tier = tier
        self.promotions: Promotions | None = None
        if tier is not None and region_file is not None:
            self.promotions = Promotions(cache, tier, region_file, self.room, verify=self.verify)
        self.convergence = Convergence(
            cache, remote_available=tier.available if tier is not None else None,
            promoter=self.promotions, resolve=self._resolve if tier is not None else None,
            call_later=_call_later)
        self.saves = Saves(cache, self.convergence, self.room)
        self.verifier = Verifier(cache, region_file)
        self.upkeep = Upkeep(cache, self.convergence, lease_seconds=lease_seconds,
                             region_file=region_file, region_path=region_path,
                             end_session=self.end_session, ended=self._ended,
                             drop_slow_reader=self.drop_slow_reader, verify=self.verify)

    def _resolve(self, key: Key, claim: bool) -> bool:
        """Ask the second tier about a wanted key (`Convergence.resolve`);
        its answer comes back on the loop."""
        assert self.tier is not None
        loop = asyncio.get_running_loop()

        def done(outcome: Resolution) -> None:
            loop.call_soon_threadsafe(self._resolved, key, outcome)

        return self.tier.resolve(key[0], key[1], done, claim)

    def _resolved(self, key: Key, outcome: Resolution) -> None:
        assert self.tier is not None
        nbytes = self.tier.available(*key) if outcome is Resolution.FOUND else None
        self.convergence.resolved(key, outcome, nbytes)
        self.verify()

    # ----------------------------------------------------------- sessions

    def session(self, session_id: str) -> Session:
        """The live session; raises NotFound (the client must re-attach)."""
        return self.cache.sessions.get(session_id)

    def attach(self, *, engine_id: str, role: Role, rank: int | None, world_size: int,
               namespace: str, client_name: str, engine_token: str = "",
               store_namespace: str = "") -> Session:
        """A new session (`Cache.attach`); it takes part once its stream
        opens. `store_namespace`: the second tier's name of `namespace`
        (`SecondTier.follow`)."""
        victim = self.cache.sessions.victim_for(engine_id, engine_token)
        if victim is not None:  # an attach that never became anything makes room
            log.warning("session %d (engine %r %s) ended: its stream never opened in %.0fs, and "
                        "an engine presenting its token needs the place", victim.index,
                        victim.engine_id, victim.component,
                        self.cache.sessions.clock() - victim.created)
            self.cache.counters["preempted_sessions"] += 1
            self.end_session(victim, detached=True)
        session = self.cache.attach(engine_id=engine_id, role=role, rank=rank,
                                    world_size=world_size, namespace=namespace,
                                    client_name=client_name, engine_token=engine_token,
                                    in_place_of=victim)
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
        self.cache.views.open(session)
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
            self.cache.views.acknowledge(session, m.acks)
        if m.holds:
            self.cache.views.hold(session, m.holds)
        if m.touches:
            self.cache.views.touch(session, m.touches)
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
                self.cache.views.record_lookups(session, beat.lookups, beat.hits)
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

    def entry_changed(self, entry: Entry) -> None:
        """The cache's one announcement that `entry` became READY (its views
        were told just before) or HIDDEN (`CacheListener`): watchers hear
        both; a ready entry's waiters hit now, and a save of this host is
        published (write-behind; a promoted entry came from the second tier)."""
        self.watchers.publish(entry)
        if entry.state is not State.READY:
            return
        self.convergence.ready(entry.key)
        if self.promotions is not None and not self.promotions.writing(entry.key):
            self._publish(entry)

    def pages_reclaimed(self) -> None:
        """Pages came back (`CacheListener`): saves waiting for room ask again."""
        self.room.pages_came_back()

    def _publish(self, entry: Entry) -> None:
        """Queue a ready entry for the second tier, sent from its pages off the loop."""
        assert self.tier is not None and self.region_file is not None
        extents, stamp, stamps = self.cache.extents(entry), entry.entry_id, self.cache.stamps

        def current() -> bool:
            """Whether the pages still hold the entry (reused, their stamp
            changed: ids never repeat)."""
            return stamps.holds(extents, stamp)

        namespace, mm_hash = entry.key
        self.tier.publish(namespace, mm_hash, entry.shape, entry.dtype, self.region_file,
                          extents, current)

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


def _call_later(seconds: float, fn: Callable[[], None]) -> object:
    """`fn()` on the running loop after `seconds` (`Convergence.call_later`)."""
    return asyncio.get_running_loop().call_later(seconds, fn)
