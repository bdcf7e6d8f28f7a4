"""The gRPC servicer: a thin asyncio adapter around the cache core.

Each handler converts the request (`wire`), calls the core, converts the
reply; `_abort` maps the core's domain errors to status codes in one place,
and anything unexpected is logged with its stack and answered INTERNAL.
Everything runs on one event loop, so the core needs no locks and each
session stream costs a coroutine, not a thread.

One call may wait without blocking the loop: an allocation whose victims
await acknowledgements (until pages come back or `alloc_wait_seconds`).
Loads make no call at all (see `cache`). Wanted items are answered on the
stream (`convergence`); with a second tier (`remote`), its store calls run
on threads: promotions (fetch, then write into pages allocated here) and
write-behind publishing of saved entries, never on the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc

from ec_daemon import invariants, stats, watch, wire
from ec_daemon.cache import Cache
from ec_daemon.convergence import Convergence
from ec_daemon.errors import (
    CacheError,
    FailedPrecondition,
    InvalidArgument,
    InvariantViolated,
    ResourceExhausted,
)
from ec_daemon.events import AllocOutcome, AllocResult, HeartbeatEcho, ReportStatus
from ec_daemon.limits import validate_mm_hash
from ec_daemon.metrics import rpc_histogram
from ec_daemon.records import Key
from ec_daemon.records import Session as ClientSession
from ec_protocol.protocol import BOTH, PROTOCOL_VERSION, pb, rpc

log = logging.getLogger(__name__)

OPEN_TIMEOUT_SECONDS = 10.0
# A save waits this part of --alloc-wait-seconds for hidden pages to come
# back before it evicts more ready entries instead.
HIDDEN_PATIENCE_FRACTION = 0.1
MAX_EVENTS_PER_MESSAGE = 4096
# Well under gRPC's default 4 MiB receive limit, whatever the events hold.
MAX_MESSAGE_BYTES = 1 << 20
# Promotions running at once (each a store read and a copy into the region).
PROMOTION_THREADS = 4

T = TypeVar("T")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]]


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status of `exc`: a CacheError's own code, and
    INTERNAL (logged with its stack) for anything else."""
    if isinstance(exc, CacheError):
        await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
    log.error("internal error: %s", exc, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
    raise AssertionError("unreachable")


def grpc_errors(handler: Handler[T]) -> Handler[T]:
    """Map errors to gRPC statuses (a CacheError changed nothing)."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        started = time.perf_counter()
        try:
            reply = await handler(self, request, context)
            self.verify()
            return reply
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            if isinstance(exc, CacheError):
                self.verify()
            await _abort(context, exc)
        finally:
            self.rpc_seconds.labels(handler.__name__).observe(time.perf_counter() - started)

    return wrapper


SPACE = "space"  # the Wakeups key of pages coming back


class Wakeups:
    """One-shot wakeups by key, each wait bounded by a deadline."""

    def __init__(self) -> None:
        self._waiters: dict[Hashable, set[asyncio.Future[bool]]] = {}

    async def wait(self, keys: Iterable[Hashable], deadline: float) -> bool:
        """Until `wake` of any of `keys` or `wake_all()`: True; False at the deadline."""
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            return False
        keys = tuple(keys)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        expiry = loop.call_later(timeout, _settle, future, False)
        sets = [self._waiters.setdefault(key, set()) for key in keys]
        for waiters in sets:
            waiters.add(future)
        try:
            return await future
        finally:
            expiry.cancel()
            for key, waiters in zip(keys, sets, strict=True):
                waiters.discard(future)
                if not waiters and self._waiters.get(key) is waiters:
                    del self._waiters[key]

    def wake(self, key: Hashable) -> None:
        for future in self._waiters.pop(key, ()):
            _settle(future, True)

    def wake_all(self) -> None:
        for key in list(self._waiters):
            self.wake(key)


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class ECDaemonService(rpc.ECDaemonServicer):
    def __init__(self, cache: Cache, region: Any, *, lease_seconds: float,
                 alloc_wait_seconds: float, check_invariants: bool = False,
                 region_file: Any = None, tier: Any = None,
                 max_watchers: int = watch.MAX_WATCHERS,
                 max_watchers_per_peer: int = watch.MAX_WATCHERS_PER_PEER) -> None:
        """`region` is the pb.Region clients are told; `region_file` (a
        `region.Region`) and `tier` (a `remote.tier.RemoteTier`) only with a
        second tier."""
        self.cache = cache
        self.region = region  # pb.Region
        self.lease_seconds = lease_seconds
        self.alloc_wait_seconds = alloc_wait_seconds
        self.check_invariants = check_invariants
        self.started = time.monotonic()
        self.closing = False
        self.rpc_seconds = rpc_histogram()
        self.wakeups = Wakeups()
        cache.on_reclaim = lambda: self.wakeups.wake(SPACE)
        self.watchers = watch.Watchers(max_watchers=max_watchers,
                                       max_per_peer=max_watchers_per_peer)
        cache.on_entry_change = self.watchers.publish
        self.region_file = region_file
        self.tier = tier
        self.convergence = Convergence(
            cache, remote_available=tier.available if tier is not None else None)
        self.convergence.start_promotion = self._start_promotion
        self._promoters: dict[str, ClientSession] = {}
        self._promotions: set[asyncio.Future[None]] = set()
        self._pool = ThreadPoolExecutor(PROMOTION_THREADS, thread_name_prefix="ec-promote") \
            if tier is not None else None

    def end_session(self, session: ClientSession, *, detached: bool = False) -> None:
        alive = session.alive
        self.cache.end_session(session, detached=detached)
        if alive:
            self._ended(session)
        self.verify()

    def _ended(self, session: ClientSession) -> None:
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
            promoter = self._promoters.get(namespace)
            if promoter is not None and not promoter.pending:
                del self._promoters[namespace]

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
        snapshot = stats.take(self.cache, generation=self.region.generation,
                          region_path=self.region.path, started=self.started,
                          convergence=self.convergence.counters, remote_tier=tier)
        return dataclasses.replace(snapshot, watchers=self.watchers.count,
                                   dropped_watchers=self.watchers.dropped)

    # -------------------------------------------------------------- unary

    @grpc_errors
    async def Attach(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"protocol version {request.protocol_version} is not supported: this daemon "
                f"speaks version {PROTOCOL_VERSION}; upgrade the client or the daemon")
        if self.closing:
            raise FailedPrecondition("the daemon is shutting down")
        session = self.cache.attach(**wire.attach_fields(request))
        if self.tier is not None:
            self.tier.follow(session.namespace)
        log.info("attached session %d: engine %r %s (%s) in %r", session.index,
                 session.engine_id, session.component, session.role, session.namespace)
        # Ten heartbeats a lease: a view stays fresh (able to answer hits) for
        # half a lease after each echoed one, so several may be slow or lost.
        heartbeat_ms = max(50, int(self.lease_seconds * 1000 / 10))
        return pb.AttachReply(
            session_id=session.session_id, session_index=session.index, region=self.region,
            namespace=session.namespace, lease_ms=int(self.lease_seconds * 1000),
            heartbeat_ms=heartbeat_ms)

    @grpc_errors
    async def Detach(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        session = self.cache.sessions.get(request.session_id)
        self.end_session(session, detached=True)
        log.info("detached session %d (engine %r)", session.index, session.engine_id)
        return pb.DetachReply()

    @grpc_errors
    async def Allocate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            result = await self._allocate(lambda: self.cache.sessions.get(request.session_id),
                                          request.mm_hash, request.nbytes,
                                          tuple(request.shape), request.dtype)
        except ResourceExhausted:
            # No room: an engine waiting for this save encodes it instead.
            session = self.cache.sessions.find(request.session_id)
            if session is not None:
                self.convergence.save_given_up((session.namespace, request.mm_hash),
                                               session.engine_id)
            raise
        return wire.alloc_reply(result)

    async def _allocate(self, session_of: Callable[[], ClientSession], mm_hash: str,
                        nbytes: int, shape: tuple[int, ...], dtype: str) -> AllocResult:
        """Allocate for the session `session_of()` returns (it may end while
        this waits), waiting for hidden pages within --alloc-wait-seconds."""
        started = time.monotonic()
        deadline = started + self.alloc_wait_seconds
        # Past this, hidden pages held back (a load in flight, a ghost) no
        # longer count as coming back: more ready entries are evicted instead.
        patience = started + self.alloc_wait_seconds * HIDDEN_PATIENCE_FRACTION
        impatient = False  # once only: the victims it hides are then counted as coming
        while True:
            session = session_of()
            count_hidden = impatient or time.monotonic() < patience
            impatient = impatient or not count_hidden
            result = self.cache.allocate(session, mm_hash, nbytes, shape, dtype,
                                         count_hidden=count_hidden)
            if result.outcome is not AllocOutcome.WAIT:
                return result
            wake_by = deadline if impatient else patience
            if not await self.wakeups.wait((SPACE,), wake_by) and time.monotonic() >= deadline:
                raise self.cache.refuse_waited_save(nbytes)

    @grpc_errors
    async def Report(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        session = self.cache.sessions.get(request.session_id)
        saved = wire.batch(request.saved, "saved")
        aborted = wire.batch(request.aborted, "aborted")
        if session.rank is None:
            raise FailedPrecondition("only worker sessions report saves")
        for mm_hash in aborted:  # before any save is applied: an error changes nothing
            validate_mm_hash(mm_hash)
        statuses = self.cache.commit(session, saved)  # validates all before changing any
        for mm_hash, status in zip(saved, statuses, strict=True):
            if status is ReportStatus.ACCEPTED:
                self._saved((session.namespace, mm_hash))
        aborts = self.cache.abort(session, aborted)
        for mm_hash in aborted:  # allocated or not (a skipped save is reported too)
            self.convergence.save_given_up((session.namespace, mm_hash), session.engine_id)
        return pb.ReportReply(saved=[wire.REPORT_STATUS[s] for s in statuses],
                              aborted=[wire.REPORT_STATUS[s] for s in aborts])

    @grpc_errors
    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        hashes = wire.batch(request.mm_hashes, "mm_hashes")
        if not request.namespace:
            raise InvalidArgument("namespace is empty (use the one Attach returned)")
        return pb.LookupReply(results=[wire.lookup_result(self.cache, entry) for entry
                                       in self.cache.lookup(request.namespace, hashes)])

    @grpc_errors
    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.stats_reply(self.snapshot(), self.region)

    # ------------------------------------------------------------- stream

    async def Session(self, request_iterator: AsyncIterator[Any],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        session = await self._open(request_iterator, context)
        wake = asyncio.Event()
        session.wake = wake.set
        reader = asyncio.ensure_future(self._read(session, request_iterator, wake))
        try:
            while session.alive and not self.closing and not session.overflowed:
                if not session.outbox and not reader.done():
                    await wake.wait()
                    wake.clear()
                if reader.done() or session.overflowed:
                    break
                message = self._next_message(session)
                if message is not None:
                    yield message
            if session.overflowed:
                self.drop_slow_reader(session)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    "session detached: events were read too slowly")
            if reader.done() and not reader.cancelled():
                exc = reader.exception()
                if exc is not None:  # a CacheError's own code; anything else INTERNAL, logged
                    await _abort(context, exc)
        finally:
            # Only Detach ends a session as detached: a stream that ends, even
            # as a clean half-close (a killed client's may look like one),
            # leaves a ghost, since its engine may still be loading.
            reader.cancel()
            if session.alive:
                log.info("session %d ended (engine %r %s): stream ended without Detach",
                         session.index, session.engine_id, session.component)
            self.end_session(session)

    def drop_slow_reader(self, session: ClientSession) -> None:
        """End a session whose outbox overflowed (it becomes a ghost). Its
        stream may still be blocked writing to a client that stopped reading:
        that must not keep evictions waiting for it."""
        if not session.alive:
            return
        log.warning("session %d (engine %r %s) detached: it read events too slowly "
                    "(%d queued); it re-attaches with a fresh snapshot", session.index,
                    session.engine_id, session.component, len(session.outbox))
        self.end_session(session)

    def _next_message(self, session: ClientSession) -> Any:
        events: list[Any] = []
        size = 0
        outbox = session.outbox
        while outbox and len(events) < MAX_EVENTS_PER_MESSAGE and size < MAX_MESSAGE_BYTES:
            events.append(outbox.popleft())
            size += wire.event_size(events[-1])
        return wire.daemon_message(events) if events else None

    async def _open(self, request_iterator: AsyncIterator[Any],
                    context: grpc.aio.ServicerContext) -> ClientSession:
        try:
            first = await asyncio.wait_for(anext(request_iterator), OPEN_TIMEOUT_SECONDS)
        except (StopAsyncIteration, asyncio.TimeoutError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the session stream must start with open_session_id")
        try:
            if not first.open_session_id:
                raise InvalidArgument("the session stream must start with open_session_id")
            session = self.cache.sessions.get(first.open_session_id)
            if session.streaming:
                raise FailedPrecondition("this session already has a stream")
            self.cache.open(session)
            try:
                self._apply(session, first)  # checks everything before it applies anything
            except CacheError:
                # A session without its stream is dead; it was told nothing yet.
                self.end_session(session, detached=True)
                raise
            if session.is_scheduler:  # its loads in flight were declared just now
                self.cache.reattached(session)
                self._tell_namespace(session.namespace)
        except Exception as exc:
            await _abort(context, exc)
        return session

    async def _read(self, session: ClientSession, request_iterator: AsyncIterator[Any],
                    wake: asyncio.Event) -> None:
        try:
            async for message in request_iterator:
                if not session.alive:
                    return
                if message.open_session_id:
                    raise InvalidArgument("open_session_id may only appear once")
                self._apply(session, message)
        finally:
            wake.set()

    def _apply(self, session: ClientSession, message: Any) -> None:
        """Acknowledgements, touches, then the heartbeat (whose echo follows
        the lease renewal). Everything is checked before anything is applied."""
        beat = message.heartbeat if message.HasField("heartbeat") else None
        if beat is not None and beat.hits > beat.lookups:
            raise InvalidArgument("heartbeat counters must satisfy hits <= lookups")
        acks = wire.refs(message.acks, "acks")
        holds = wire.refs(message.holds, "holds")
        touches = wire.touches(message.touches)
        wants = wire.batch(message.wants, "wants")
        releases = wire.batch(message.releases, "releases")
        yields = wire.batch(message.yields, "yields")
        if (acks or holds or touches or (beat is not None and beat.lookups)) \
                and not session.is_scheduler:
            raise FailedPrecondition("only scheduler sessions acknowledge, hold, touch or count "
                                     "lookups")
        if (wants or releases or yields) and not (session.is_scheduler and session.can_load):
            raise FailedPrecondition("only scheduler sessions of consumer or both engines "
                                     "want, release or yield items")
        for mm_hash in (*wants, *releases, *yields):
            validate_mm_hash(mm_hash)
        self.cache.sessions.renew(session)
        if acks:
            self.cache.acknowledge(session, acks)
        if holds:
            self.cache.hold(session, holds)
        if touches:
            self.cache.touch(session, touches)
        if releases:
            self.convergence.release(session, releases)
        if yields:
            self.convergence.step_aside(session, yields)
        if wants:
            self.convergence.want(session, wants)
        if beat is not None:
            if session.is_scheduler:
                self.cache.record_lookups(session, beat.lookups, beat.hits)
            if beat.seq:
                session.send(HeartbeatEcho(beat.seq))
        self.verify()

    # -------------------------------------------------------- second tier

    def _saved(self, key: Key) -> None:
        """A worker's save landed: waiters hit now; publish it (write-behind)."""
        self.convergence.ready(key)
        entry = self.cache.get(*key)  # ready: committed just now, on this loop
        if self.tier is None or entry is None:
            return
        extents, stamp = self.cache.extents(entry), entry.entry_id
        stamps, region_file, nbytes = self.cache.stamps, self.region_file, entry.nbytes

        def read() -> bytearray | None:
            """On the publisher's thread: the bytes, or None when the pages
            were reused meanwhile (their stamp changed: ids never repeat)."""
            data = region_file.read(extents, nbytes)
            return data if stamps.holds(extents, stamp) else None

        self.tier.publish(key[0], key[1], entry.shape, entry.dtype, nbytes, read)

    def _start_promotion(self, key: Key, nbytes: int) -> None:
        task = asyncio.ensure_future(self._promote(key))
        self._promotions.add(task)
        task.add_done_callback(self._promotions.discard)

    def _promoter(self, namespace: str) -> ClientSession:
        """The daemon's own writer in `namespace`: promotions' pending entries
        are its (never in the session table: no client can name it)."""
        promoter = self._promoters.get(namespace)
        if promoter is None:
            now = time.monotonic()
            promoter = self._promoters[namespace] = ClientSession(
                session_id="", index=0, engine_id="ec-daemon", role=BOTH, rank=0,
                world_size=1, namespace=namespace, client_name="second tier", created=now,
                lease_deadline=float("inf"))
        return promoter

    async def _promote(self, key: Key) -> None:
        """Fetch `key` from the second tier (verified), allocate, write, commit.
        Any failure hands the item to a waiting engine to encode, and so does
        a spent promotion budget: the value's bytes are reserved before the
        fetch and released after the write, whatever happens (`remote.budget`)."""
        namespace, mm_hash = key
        loop = asyncio.get_running_loop()
        promoted = False
        started = time.perf_counter()
        reservation = self.tier.reserve(namespace, mm_hash)
        try:
            if reservation is None:
                return  # the budget is spent, or the key's announcement is gone
            value = await loop.run_in_executor(self._pool, self.tier.fetch, namespace, mm_hash,
                                               reservation.nbytes)
            fetched = time.perf_counter()
            if value is None:
                return  # (the tier counted and logged why, and forgot the key)
            promoter = self._promoter(namespace)
            result = await self._allocate(lambda: promoter, mm_hash, value.nbytes,
                                          tuple(value.shape), value.dtype)
            if result.outcome is AllocOutcome.ALREADY_PENDING:  # a worker is saving it
                promoted = True
                self.convergence.await_save(key)
                return
            if result.outcome is not AllocOutcome.ALLOCATED:
                promoted = result.outcome is AllocOutcome.ALREADY_READY
                return
            try:
                await loop.run_in_executor(self._pool, self.region_file.write, result.extents,
                                           value.parts)
            except Exception:  # (cancelled only at shutdown: the write may still run)
                self.cache.abort(promoter, [mm_hash])
                raise
            self.cache.commit(promoter, [mm_hash])
            self.convergence.promoted(key, value.nbytes)
            promoted = True
            log.debug("promoted %s (%d bytes) in %.1f ms (fetch %.1f ms)", mm_hash,
                      value.nbytes, (time.perf_counter() - started) * 1e3,
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
            if not promoted:
                self.convergence.promotion_failed(key)
            self.verify()

    # -------------------------------------------------------------- watch

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Stored and evicted entries for routers (`watch`): a snapshot of the
        ready entries, its end, then live events. A watcher that reads too
        slowly is dropped (RESOURCE_EXHAUSTED), never waited for."""
        try:
            watcher = self.watchers.open(request.namespace, self.cache.entries(),
                                         watch.peer_of(context.peer()))
        except Exception as exc:
            await _abort(context, exc)
        try:
            async for events, snapshot_done in watcher.batches():
                yield wire.watch_message(self.region.generation, events, snapshot_done)
            if watcher.error is not None:
                await _abort(context, watcher.error)
        finally:
            self.watchers.close(watcher)

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
        for session in self.cache.expire_sessions():
            self._ended(session)
            log.warning("session %d expired (engine %r %s): no message for %.1fs",
                        session.index, session.engine_id, session.component,
                        self.lease_seconds)
        for ghost in self.cache.release_ghosts():
            log.info("session %d (engine %r) no longer awaited: its lease ran out",
                     ghost.index, ghost.engine_id)
        self.cache.release_quarantine()
        self.cache.compact_index()
        self.convergence.expire()
        self.verify()

    def close_streams(self) -> None:
        """Shutdown: end every session stream (clients see the stream end)."""
        self.closing = True
        self.watchers.close_all()
        for session in self.cache.sessions:
            session.wake()
        for task in list(self._promotions):
            task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
