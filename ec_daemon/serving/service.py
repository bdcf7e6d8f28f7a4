"""The gRPC servicer: a thin asyncio adapter around the data plane.

Each handler converts the request (`wire`), calls the data plane
(`dataplane`: the cache and everything that listens to it), converts the
reply; `_abort` maps the core's domain errors to status codes in one place,
and anything unexpected is logged with its stack and answered INTERNAL.
Everything runs on one event loop, so the core needs no locks and each
session stream costs a coroutine, not a thread: the stream handler moves a
session's outbox into messages and the client's messages into the data plane.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from ec_daemon.core.events import ReadySnapshot
from ec_daemon.core.limits import (
    MAX_MESSAGE_BYTES,
    MAX_SESSION_EVENTS_PER_MESSAGE,
    OPEN_TIMEOUT_SECONDS,
)
from ec_daemon.core.records import Session as ClientSession
from ec_daemon.errors import CacheError, FailedPrecondition, InvalidArgument
from ec_daemon.plane import watch
from ec_daemon.plane.dataplane import DataPlane
from ec_daemon.serving import wire
from ec_daemon.serving.metrics import rpc_histogram
from ec_daemon.serving.streams import Ended, Streams
from ec_protocol.protocol import PROTOCOL_VERSION, pb, rpc

log = logging.getLogger(__name__)


T = TypeVar("T")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]]


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status of `exc`: a CacheError's own code, and
    INTERNAL (logged with its stack) for anything else."""
    if isinstance(exc, CacheError):
        await context.abort(wire.status_code(exc), str(exc))
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
            self.plane.verify()
            return reply
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            if isinstance(exc, CacheError):
                self.plane.verify()
            await _abort(context, exc)
        finally:
            self.rpc_seconds.labels(handler.__name__).observe(time.perf_counter() - started)

    return wrapper


def _why_ended(session: ClientSession) -> Ended | None:
    """Why a session's stream has nothing more to send, or None: read too
    slowly (RESOURCE_EXHAUSTED), or ended by the daemon (ABORTED, saying why)."""
    if session.overflowed:
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "session detached: events were read too slowly"
    if not session.alive and session.ended_why:
        return grpc.StatusCode.ABORTED, f"session ended: {session.ended_why}"
    return None


def _why_dropped(watcher: watch.Watcher) -> Ended | None:
    return None if watcher.error is None else (wire.status_code(watcher.error),
                                               str(watcher.error))


class ECDaemonService(rpc.ECDaemonServicer):
    def __init__(self, plane: DataPlane, region: pb.Region) -> None:
        """`region` is the region clients are told."""
        self.plane = plane
        self.region = region
        self.rpc_seconds = rpc_histogram()
        # Calls blocked writing to a client that stopped reading are cut
        # after a lease (a live client's link reads all the time).
        self.streams = Streams(plane.lease_seconds, plane.stalled)

    # -------------------------------------------------------------- unary

    @grpc_errors
    async def Attach(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"protocol version {request.protocol_version} is not supported: this daemon "
                f"speaks version {PROTOCOL_VERSION}; upgrade the client or the daemon")
        if self.plane.closing:
            raise FailedPrecondition("the daemon is shutting down")
        session = self.plane.attach(**wire.attach_fields(request))
        lease_seconds = self.plane.lease_seconds
        # Ten heartbeats a lease: a view stays fresh (able to answer hits) for
        # half a lease after each echoed one, so several may be slow or lost.
        heartbeat_ms = max(50, int(lease_seconds * 1000 / 10))
        if self.plane.region_file is not None:  # renewed by each repair of a cut file
            self.region.canary = self.plane.region_file.canary
        return pb.AttachReply(
            session_id=session.session_id, session_index=session.index, region=self.region,
            namespace=session.namespace, lease_ms=int(lease_seconds * 1000),
            heartbeat_ms=heartbeat_ms, stream_saves=True, producer_claims=True)

    @grpc_errors
    async def Detach(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.plane.detach(request.session_id)
        return pb.DetachReply()

    @grpc_errors
    async def Allocate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        result = await self.plane.saves.allocate(request.session_id, request.mm_hash,
                                                 request.nbytes, tuple(request.shape),
                                                 request.dtype)
        return wire.alloc_reply(result)

    @grpc_errors
    async def Report(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        session = self.plane.session(request.session_id)
        saved = wire.batch(request.saved, "saved")
        aborted = wire.batch(request.aborted, "aborted")
        statuses, aborts = self.plane.saves.report(session, saved, aborted,
                                                   wire.saved_checksums(request))
        return pb.ReportReply(saved=[wire.REPORT_STATUS[s] for s in statuses],
                              aborted=[wire.REPORT_STATUS[s] for s in aborts])

    @grpc_errors
    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        hashes = wire.batch(request.mm_hashes, "mm_hashes")
        entries = self.plane.lookup(request.namespace, hashes)
        return pb.LookupReply(results=[wire.lookup_result(self.plane.cache, entry)
                                       for entry in entries])

    @grpc_errors
    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.stats_reply(self.plane.snapshot(), self.region)

    # ------------------------------------------------------------- stream

    async def Session(self, request_iterator: AsyncIterator[Any],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        session = await self._open(request_iterator, context)
        wake = asyncio.Event()
        session.wake = wake.set
        reader = asyncio.ensure_future(self._read(session, request_iterator, wake))
        stream = self.streams.add(session, lambda: _why_ended(session), context)
        try:
            while session.alive and not self.plane.closing and not session.overflowed:
                if not session.outbox and not reader.done():
                    await wake.wait()
                    wake.clear()
                if reader.done() or session.overflowed:
                    break
                message = self._next_message(session)
                if message is not None:
                    Streams.writing(stream)
                    yield message
                    Streams.wrote(stream)
            if session.overflowed:
                self.plane.drop_slow_reader(session)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    "session detached: events were read too slowly")
            if reader.done() and not reader.cancelled():
                exc = reader.exception()
                if exc is not None:  # a CacheError's own code; anything else INTERNAL, logged
                    await _abort(context, exc)
            ended = _why_ended(session)
            if ended is not None:  # the daemon ended it: its client is told why
                await context.abort(*ended)
        finally:
            self.streams.remove(stream)
            reader.cancel()
            self.plane.stream_ended(session)

    def _next_message(self, session: ClientSession) -> Any:
        """The next message of `session`'s outbox; a snapshot's ready events
        are made here, as they are sent (`events.ReadySnapshot`)."""
        events: list[Any] = []
        size = 0
        outbox = session.outbox
        while outbox and len(events) < MAX_SESSION_EVENTS_PER_MESSAGE and size < MAX_MESSAGE_BYTES:
            head = outbox[0]
            event: object
            if type(head) is ReadySnapshot:
                event = head.next()
                if event is None:
                    outbox.popleft()
                    continue
            else:
                event = outbox.popleft()
            events.append(event)
            size += wire.event_size(event)
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
            return self.plane.open_stream(first.open_session_id,
                                          lambda: wire.client_message(first))
        except Exception as exc:
            await _abort(context, exc)

    async def _read(self, session: ClientSession, request_iterator: AsyncIterator[Any],
                    wake: asyncio.Event) -> None:
        try:
            async for message in request_iterator:
                if not session.alive:
                    return
                if message.open_session_id:
                    raise InvalidArgument("open_session_id may only appear once")
                self.plane.apply(session, wire.client_message(message))
        finally:
            wake.set()

    # -------------------------------------------------------------- watch

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Stored and evicted entries for routers (`watch`): a snapshot of the
        ready entries, its end, then live events. A watcher that reads too
        slowly is dropped (RESOURCE_EXHAUSTED), never waited for."""
        try:
            engine_id, token = wire.watch_engine(request)
            watcher = self.plane.open_watcher(request.namespace, watch.peer_of(context.peer()),
                                              engine_id, token)
        except Exception as exc:
            await _abort(context, exc)
        stream = self.streams.add(watcher, lambda: _why_dropped(watcher), context)
        try:
            async for events, snapshot_done in watcher.batches():
                Streams.writing(stream)
                yield wire.watch_message(self.region.generation, events, snapshot_done)
                Streams.wrote(stream)
            if watcher.error is not None:
                await _abort(context, watcher.error)
        finally:
            self.streams.remove(stream)
            self.plane.close_watcher(watcher)
