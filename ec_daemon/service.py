"""The gRPC servicer: a thin asyncio adapter around the cache core.

Each handler converts the request (`wire`), calls the core, converts the
reply; `_abort` maps the core's domain errors to status codes in one place,
and anything unexpected is logged with its stack and answered INTERNAL.
Everything runs on one event loop, so the core needs no locks and each
session stream costs a coroutine, not a thread.

One call may wait without blocking the loop: an allocation whose victims
await acknowledgements (until pages come back or `alloc_wait_seconds`).
Loads make no call at all (see `cache`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable
from typing import Any, NoReturn, TypeVar

import grpc

from ec_daemon import invariants, stats, wire
from ec_daemon.cache import Cache
from ec_daemon.errors import CacheError, FailedPrecondition, InvalidArgument, InvariantViolated
from ec_daemon.events import AllocOutcome, HeartbeatEcho
from ec_daemon.limits import validate_mm_hash
from ec_daemon.metrics import rpc_histogram
from ec_daemon.records import Session as ClientSession
from ec_protocol.protocol import PROTOCOL_VERSION, pb, rpc

log = logging.getLogger(__name__)

OPEN_TIMEOUT_SECONDS = 10.0
# A save waits this part of --alloc-wait-seconds for hidden pages to come
# back before it evicts more ready entries instead.
HIDDEN_PATIENCE_FRACTION = 0.1
MAX_EVENTS_PER_MESSAGE = 4096
# Well under gRPC's default 4 MiB receive limit, whatever the events hold.
MAX_MESSAGE_BYTES = 1 << 20

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
                 alloc_wait_seconds: float, check_invariants: bool = False) -> None:
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

    def end_session(self, session: ClientSession, *, detached: bool = False) -> None:
        self.cache.end_session(session, detached=detached)
        self.verify()

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
        return stats.take(self.cache, generation=self.region.generation,
                          region_path=self.region.path, started=self.started)

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
        started = time.monotonic()
        deadline = started + self.alloc_wait_seconds
        # Past this, hidden pages held back (a load in flight, a ghost) no
        # longer count as coming back: more ready entries are evicted instead.
        patience = started + self.alloc_wait_seconds * HIDDEN_PATIENCE_FRACTION
        shape = tuple(request.shape)
        impatient = False  # once only: the victims it hides are then counted as coming
        while True:
            session = self.cache.sessions.get(request.session_id)
            count_hidden = impatient or time.monotonic() < patience
            impatient = impatient or not count_hidden
            result = self.cache.allocate(session, request.mm_hash, request.nbytes, shape,
                                         request.dtype, count_hidden=count_hidden)
            if result.outcome is not AllocOutcome.WAIT:
                return wire.alloc_reply(result)
            wake_by = deadline if impatient else patience
            if not await self.wakeups.wait((SPACE,), wake_by) and time.monotonic() >= deadline:
                raise self.cache.refuse_waited_save(request.nbytes)

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
        return pb.ReportReply(
            saved=[wire.REPORT_STATUS[s] for s in statuses],
            aborted=[wire.REPORT_STATUS[s] for s in self.cache.abort(session, aborted)])

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
            try:
                self._apply(session, first)
            except CacheError:
                self.end_session(session)  # a session without its stream is dead
                raise
            session.streaming = True
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
        touches = wire.touches(message.touches)
        if (acks or touches or (beat is not None and beat.lookups)) and not session.is_scheduler:
            raise FailedPrecondition("only scheduler sessions acknowledge, touch or count "
                                     "lookups")
        self.cache.sessions.renew(session)
        if acks:
            self.cache.acknowledge(session, acks)
        if touches:
            self.cache.touch(session, touches)
        if beat is not None:
            if session.is_scheduler:
                self.cache.record_lookups(session, beat.lookups, beat.hits)
            if beat.seq:
                session.send(HeartbeatEcho(beat.seq))
        self.verify()

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
            log.warning("session %d expired (engine %r %s): no message for %.1fs",
                        session.index, session.engine_id, session.component,
                        self.lease_seconds)
        for ghost in self.cache.release_ghosts():
            log.info("session %d (engine %r) no longer awaited: its lease ran out",
                     ghost.index, ghost.engine_id)
        self.cache.release_quarantine()
        self.verify()

    def close_streams(self) -> None:
        """Shutdown: end every session stream (clients see the stream end)."""
        self.closing = True
        for session in self.cache.sessions:
            session.wake()
