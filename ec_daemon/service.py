"""The gRPC servicer: a thin asyncio adapter around the cache core.

Each handler converts the request (`wire`), calls the core, converts the
reply; `grpc_errors` maps the core's domain errors to status codes in one
place. Everything runs on one event loop, so the core needs no locks and
each session stream costs a coroutine, not a thread.

Two calls may wait without blocking the loop: an allocation whose victims
await acknowledgements (until pages come back or `alloc_wait_seconds`), and a
load report that overtook its pin on the scheduler's stream (until the pin
arrives, the owner ends, or `REPORT_WAIT_SECONDS`). Waits are keyed (space,
or the pins of the scheduler sessions a report waits on): every step of every
engine lands a pin, and one shared event would wake every waiting report of
every engine for each of them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable
from typing import Any, TypeVar

import grpc

from ec_daemon import wire
from ec_daemon.cache import Cache
from ec_daemon.errors import (
    CacheError,
    FailedPrecondition,
    InvalidArgument,
    InvariantViolated,
)
from ec_daemon.events import AllocOutcome, Verdict
from ec_daemon.limits import validate_mm_hash
from ec_daemon.metrics import rpc_histogram
from ec_daemon.sessions import Session as ClientSession
from ec_protocol.protocol import PROTOCOL_VERSION, ROLES, TRANSFER_ID_SHIFT, pb, rpc

log = logging.getLogger(__name__)

# Below the client's default deadline (5 s), so the worker hears the verdict.
REPORT_WAIT_SECONDS = 2.0
OPEN_TIMEOUT_SECONDS = 10.0
MAX_EVENTS_PER_MESSAGE = 4096
# Well under gRPC's default 4 MiB receive limit, whatever the events hold.
MAX_MESSAGE_BYTES = 1 << 20
# A pin whose ranks never all reported is released after this (a backstop).
PIN_TTL_SECONDS = 60.0

T = TypeVar("T")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]]


def grpc_errors(handler: Handler[T]) -> Handler[T]:
    """Map CacheError subclasses to their gRPC status (nothing was changed)."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        started = time.perf_counter()
        try:
            reply = await handler(self, request, context)
            self.verify()
            return reply
        except CacheError as exc:
            self.verify()
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
            raise AssertionError("unreachable") from exc
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
        cache.on_pins = lambda session: self.wakeups.wake(("pins", session.index))

    def end_session(self, session: ClientSession) -> None:
        self.cache.end_session(session)
        self.wakeups.wake_all()  # its pins, pending pages and reports are gone
        self.verify()

    def verify(self) -> None:
        """With --check-invariants: raise InvariantViolated (INTERNAL) if the
        bookkeeping does not add up. Tests and fuzzing run with it."""
        if not self.check_invariants:
            return
        try:
            self.cache.check_invariants()
        except AssertionError as exc:
            log.critical("cache invariant violated: %s", exc)
            raise InvariantViolated(f"cache invariant violated: {exc}") from exc

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
        heartbeat_ms = max(50, int(self.lease_seconds * 1000 / 5))
        return pb.AttachReply(
            session_id=session.session_id, session_index=session.index, region=self.region,
            namespace=session.namespace, lease_ms=int(self.lease_seconds * 1000),
            heartbeat_ms=heartbeat_ms)

    @grpc_errors
    async def Detach(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        session = self.cache.sessions.get(request.session_id)
        self.end_session(session)
        log.info("detached session %d (engine %r)", session.index, session.engine_id)
        return pb.DetachReply()

    @grpc_errors
    async def Allocate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        deadline = time.monotonic() + self.alloc_wait_seconds
        shape = tuple(request.shape)
        while True:
            session = self.cache.sessions.get(request.session_id)
            result = self.cache.allocate(session, request.mm_hash, request.nbytes, shape,
                                         request.dtype)
            if result.outcome is not AllocOutcome.WAIT:
                return wire.alloc_reply(result)
            if not await self.wakeups.wait((SPACE,), deadline):
                raise self.cache.refuse_waited_save(request.nbytes)

    @grpc_errors
    async def Report(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        session = self.cache.sessions.get(request.session_id)
        saved = wire.batch(request.saved, "saved")
        aborted = wire.batch(request.aborted, "aborted")
        loaded = wire.batch(request.loaded, "loaded")
        if (saved or aborted) and session.rank is None:
            raise FailedPrecondition("only worker sessions report saves")
        for mm_hash in saved + aborted:  # all checks before any change
            validate_mm_hash(mm_hash)
        verdicts = self.cache.report_loaded(session, loaded) if loaded else []
        reply = pb.ReportReply(
            saved=[wire.REPORT_STATUS[s] for s in self.cache.commit(session, saved)],
            aborted=[wire.REPORT_STATUS[s] for s in self.cache.abort(session, aborted)])
        deadline = time.monotonic() + REPORT_WAIT_SECONDS
        while Verdict.WAIT in verdicts:
            waiting = [i for i, v in enumerate(verdicts) if v is Verdict.WAIT]
            owners = {("pins", loaded[i] >> TRANSFER_ID_SHIFT) for i in waiting}
            if not session.alive or not await self.wakeups.wait(owners, deadline):
                for i in waiting:
                    verdicts[i] = Verdict.NOT_HELD
                    self.cache.abandon(loaded[i])
                break
            again = self.cache.report_loaded(session, [loaded[i] for i in waiting])
            for i, verdict in zip(waiting, again, strict=True):
                verdicts[i] = verdict
        reply.loaded.extend(wire.VERDICT[v] for v in verdicts)
        return reply

    @grpc_errors
    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        hashes = wire.batch(request.mm_hashes, "mm_hashes")
        if not request.namespace:
            raise InvalidArgument("namespace is empty (use the one Attach returned)")
        reply = pb.LookupReply()
        for entry in self.cache.lookup(request.namespace, hashes):
            if entry is None:
                reply.results.add(state=pb.ABSENT)
                continue
            state = pb.READY if entry.state.value == "ready" else pb.EVICTING_STATE
            reply.results.add(state=state, entry=wire.entry_info(self.cache, entry),
                              pins=len(entry.pins))
        return reply

    @grpc_errors
    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self.stats_reply()

    def stats_reply(self) -> Any:
        cache = self.cache
        page = cache.page_bytes
        free = cache.allocator.free_pages * page
        reply = pb.StatsReply(
            capacity_bytes=cache.capacity_bytes, used_bytes=cache.capacity_bytes - free,
            free_bytes=free, pinned_bytes=cache.pinned_pages * page,
            pending_bytes=cache.pending_pages * page, hidden_bytes=cache.hidden_pages * page,
            quarantined_bytes=cache.quarantined_pages * page,
            entries=cache.ready_entries, hidden_entries=cache.hidden_entries,
            sessions=len(cache.sessions),
            page_bytes=page, generation=self.region.generation, region_path=self.region.path,
            uptime_s=time.monotonic() - self.started,
            largest_free_bytes=cache.allocator.largest_free_run * page)
        for name in ("hits", "misses", "evictions", "saves", "loads", "refused_saves",
                     "bytes_saved", "bytes_loaded"):
            setattr(reply, name, cache.counters[name])
        for name, counts in cache.namespace_counters.items():
            entries, nbytes = cache.namespace_usage.get(name, (0, 0))
            reply.namespaces.add(namespace=name, entries=entries, bytes=nbytes,
                                 hits=counts["hits"], misses=counts["misses"])
        now = time.monotonic()
        for s in cache.sessions:
            reply.session_list.add(
                session_index=s.index, engine_id=s.engine_id, role=ROLES[s.role],
                component=s.component, namespace=s.namespace, pins=len(s.pins),
                pending=len(s.pending), client_name=s.client_name, age_s=now - s.created)
        return reply

    # ------------------------------------------------------------- stream

    async def Session(self, request_iterator: AsyncIterator[Any],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        session = await self._open(request_iterator, context)
        wake = asyncio.Event()
        session.wake = wake.set
        reader = asyncio.ensure_future(self._read(session, request_iterator, wake))
        try:
            while session.alive and not self.closing:
                if not session.outbox and not reader.done():
                    await wake.wait()
                    wake.clear()
                if reader.done():
                    break
                events: list[Any] = []
                size = 0
                while (session.outbox and len(events) < MAX_EVENTS_PER_MESSAGE
                       and size < MAX_MESSAGE_BYTES):
                    events.append(session.outbox.popleft())
                    size += wire.event_size(events[-1])
                if events:
                    yield wire.daemon_message(events)
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                exc = reader.exception()
                if isinstance(exc, CacheError):
                    await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        finally:
            reader.cancel()
            if session.alive:
                log.info("session %d ended (engine %r %s): stream closed", session.index,
                         session.engine_id, session.component)
            self.end_session(session)

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
        except CacheError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
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
        """Pins, then acknowledgements, then the heartbeat, in that order
        (a malformed heartbeat is refused before anything is applied)."""
        beat = message.heartbeat if message.HasField("heartbeat") else None
        if beat is not None and beat.hits > beat.lookups:
            raise InvalidArgument("heartbeat counters must satisfy hits <= lookups")
        self.cache.sessions.renew(session)
        for pin in message.pins:
            self.cache.pin(session, pin.transfer_id, pin.mm_hash, pin.entry_id)
        if message.acks:
            self.cache.acknowledge(session, ((a.mm_hash, a.entry_id) for a in message.acks))
        if beat is not None and session.is_scheduler:
            self.cache.record_lookups(session, beat.lookups, beat.hits)
        self.verify()

    # ------------------------------------------------------------ upkeep

    async def expire_leases(self) -> None:
        """End sessions whose stream went silent; runs until cancelled."""
        interval = min(1.0, self.lease_seconds / 4)
        while True:
            await asyncio.sleep(interval)
            for session in self.cache.expire_sessions():
                log.warning("session %d expired (engine %r %s): no message for %.1fs",
                            session.index, session.engine_id, session.component,
                            self.lease_seconds)
                self.wakeups.wake_all()
            for transfer in self.cache.expire_transfers(PIN_TTL_SECONDS):
                log.warning("released pin %d of %r after %.0fs: ranks %s never reported",
                            transfer.transfer_id, transfer.entry.mm_hash, PIN_TTL_SECONDS,
                            sorted(transfer.expected - transfer.reported))
            self.cache.release_quarantine()

    def close_streams(self) -> None:
        """Shutdown: end every session stream (clients see the stream end)."""
        self.closing = True
        for session in self.cache.sessions:
            session.wake()
