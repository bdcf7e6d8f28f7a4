"""The calls that stream to clients (session streams, Watch), cut when their
client stops reading or what they stream for has ended.

Why: a handler blocked writing to a client that does not read cannot see
anything else; it holds the message it is writing (up to 1 MiB) and its
call for as long as the client keeps the connection. Unread session streams
whose sessions had expired stayed blocked so, counting against no cap
(600 of them: 701 -> 2,120 MiB), and a dropped Watch call kept its slot.
So each streaming handler says when it starts and ends a write
(`writing`, `wrote`), and once a second (`upkeep`) a call blocked in a write
is cut: at once when what it streams for has ended (its session ended, its
watcher was dropped), and after `stall_seconds` otherwise, its session or
watcher ended first as a reader too slow (`on_stall`). Cutting sends the
client a status (the call ends for it too: a client re-attaches) and
cancels the handler, which releases what it held as any end of the call
does. A client that reads, however slowly its messages are made, is never
cut: only a write that does not complete is.

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from ec_daemon.core.limits import STREAM_UPKEEP_SECONDS
from ec_daemon.core.records import Session
from ec_daemon.plane.watch import Watcher

log = logging.getLogger(__name__)

Ended = tuple[grpc.StatusCode, str]  # the status a call that has ended is told


@dataclass(eq=False)
class Stream:
    """One streaming call: what it streams for, its handler and context."""

    what: Session | Watcher
    ended: Callable[[], Ended | None]  # why what it streams for has ended, or None
    context: grpc.aio.ServicerContext
    task: asyncio.Task[Any] | None
    writing_since: float | None = None
    cut: bool = field(default=False)


class Streams:
    def __init__(self, stall_seconds: float,
                 on_stall: Callable[[Session | Watcher], str]) -> None:
        """`on_stall(what)`: end the session or watcher of a stalled stream,
        counted; returns the message the client is told."""
        self.stall_seconds = stall_seconds
        self.on_stall = on_stall
        self._open: set[Stream] = set()
        self._cutting: set[asyncio.Future[None]] = set()  # (held until they ran)

    def add(self, what: Session | Watcher, ended: Callable[[], Ended | None],
            context: grpc.aio.ServicerContext) -> Stream:
        """A streaming call began, on the current task (its handler)."""
        stream = Stream(what, ended, context, asyncio.current_task())
        self._open.add(stream)
        return stream

    def remove(self, stream: Stream) -> None:
        self._open.discard(stream)

    @staticmethod
    def writing(stream: Stream) -> None:
        stream.writing_since = time.monotonic()

    @staticmethod
    def wrote(stream: Stream) -> None:
        stream.writing_since = None

    def __len__(self) -> int:
        return len(self._open)

    async def upkeep(self) -> None:
        """Cut blocked calls once a second; runs until cancelled."""
        while True:
            await asyncio.sleep(STREAM_UPKEEP_SECONDS)
            try:
                self.check()
            except Exception:  # never stop: unread calls would pile up again
                log.exception("checking the streaming calls failed")

    def check(self) -> None:
        now = time.monotonic()
        for stream in list(self._open):
            since = stream.writing_since
            if since is None or stream.cut:
                continue
            why = stream.ended()
            if why is None and now - since >= self.stall_seconds:
                why = (grpc.StatusCode.RESOURCE_EXHAUSTED, self.on_stall(stream.what))
            if why is not None:
                self._cut(stream, why)

    def _cut(self, stream: Stream, why: Ended) -> None:
        """End the call for the client (a status) and cancel its handler."""
        stream.cut = True
        self._open.discard(stream)
        cutting = asyncio.ensure_future(_abort_then_cancel(stream, why))
        self._cutting.add(cutting)
        cutting.add_done_callback(self._cutting.discard)


async def _abort_then_cancel(stream: Stream, why: Ended) -> None:
    with contextlib.suppress(BaseException):  # abort raises AbortError here, by design
        await stream.context.abort(*why)
    if stream.task is not None and not stream.task.done():
        stream.task.cancel()
