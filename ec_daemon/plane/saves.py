"""A worker's saves, on plain values: allocations, reports, and both as
messages of the session stream.

The unary calls (`Allocate`, `Report`) and the stream take the same paths.
On the stream each allocation and report is answered with its request id
(`AllocationAnswer`, `ReportAnswer` in the session's outbox): an allocation
at once when the cache has room or refuses, or from a task when it must
wait for hidden pages (`room`), so the stream (heartbeats, the other saves)
goes on meanwhile. A refusal is an answer, not the stream's end. Every
allocation belongs to its session as with the unary calls: when the session
ends its pending saves are quarantined, and a session that ended while its
allocation waited allocates nothing. A save given up (aborted, refused for
room) passes its item's claim on (`convergence`).

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

import asyncio
import logging

from ec_daemon.core.cache import Cache
from ec_daemon.core.events import (
    AllocationAnswer,
    AllocOutcome,
    AllocResult,
    ReportAnswer,
    ReportStatus,
    SaveAllocate,
    SaveReport,
)
from ec_daemon.core.limits import validate_mm_hash
from ec_daemon.core.records import Session
from ec_daemon.errors import CacheError, FailedPrecondition, ResourceExhausted
from ec_daemon.plane.convergence import Convergence
from ec_daemon.plane.room import Room

log = logging.getLogger(__name__)


class Saves:
    def __init__(self, cache: Cache, convergence: Convergence, room: Room) -> None:
        self.cache = cache
        self.convergence = convergence
        self.room = room
        self._waiting: set[asyncio.Future[None]] = set()  # stream saves waiting for pages

    async def allocate(self, session_id: str, mm_hash: str, nbytes: int,
                       shape: tuple[int, ...], dtype: str) -> AllocResult:
        """A worker's save asks for pages (`Room.allocate`). Raises
        ResourceExhausted when none came free in time: an engine waiting for
        this save encodes it instead."""
        try:
            return await self.room.allocate(lambda: self.cache.sessions.get(session_id),
                                            mm_hash, nbytes, shape, dtype)
        except ResourceExhausted:
            session = self.cache.sessions.find(session_id)
            if session is not None:
                self.convergence.save_given_up((session.namespace, mm_hash), session.engine_key)
            raise

    def report(self, session: Session, saved: list[str], aborted: list[str],
               checksums: list[int] | None = None) -> tuple[list[ReportStatus],
                                                           list[ReportStatus]]:
        """A worker's saves landed (`saved` become ready, each with its
        checksum from `checksums` if given) or were given up (`aborted`,
        allocated or not: a waiting engine encodes them); the status of each.
        Raises FailedPrecondition or InvalidArgument, having changed nothing."""
        if session.rank is None:
            raise FailedPrecondition("only worker sessions report saves")
        for mm_hash in aborted:  # before any save is applied: an error changes nothing
            validate_mm_hash(mm_hash)
        statuses = self.cache.commit(session, saved, checksums or ())  # validates all first
        aborts = self.cache.abort(session, aborted)
        for mm_hash in aborted:  # allocated or not (a skipped save is reported too)
            self.convergence.save_given_up((session.namespace, mm_hash), session.engine_key)
        return statuses, aborts

    # ------------------------------------------------------------- stream

    def on_stream(self, session: Session, reports: list[SaveReport],
                  allocations: list[SaveAllocate]) -> None:
        """A stream message's reports (their keys checked already), then its
        allocations, each answered on the stream."""
        if reports:
            self._report_on_stream(session, reports)
        for allocation in allocations:
            self._allocate_on_stream(session, allocation)

    def cancel(self) -> None:
        """Shutdown: stop the stream saves still waiting for pages."""
        for task in list(self._waiting):
            task.cancel()

    def _report_on_stream(self, session: Session, reports: list[SaveReport]) -> None:
        """`report` for a stream's reports (checked already), each answered
        by its request id."""
        saved = [r for r in reports if r.saved]
        aborted = [r for r in reports if not r.saved]
        statuses, aborts = self.report(session, [r.mm_hash for r in saved],
                                       [r.mm_hash for r in aborted],
                                       [r.checksum for r in saved])
        for report, status in (*zip(saved, statuses, strict=True),
                               *zip(aborted, aborts, strict=True)):
            if report.request_id:
                session.send(ReportAnswer(report.request_id, status))

    def _allocate_on_stream(self, session: Session, asked: SaveAllocate) -> None:
        """A stream's allocation, answered on the stream by its request id:
        at once, or, when it must wait for pages (`allocate_waiting`), from a
        task, so the stream goes on meanwhile (`Room`). A refusal is an answer too."""
        try:
            result = self.cache.allocate(session, asked.mm_hash, asked.nbytes, asked.shape,
                                         asked.dtype)
        except CacheError as exc:
            self._refuse_on_stream(session, asked, exc)
            return
        if result.outcome is AllocOutcome.WAIT:
            try:
                self.room.enter(session)
            except ResourceExhausted as exc:
                self._refuse_on_stream(session, asked, exc)
                return
            task = asyncio.ensure_future(self._allocate_later(session, asked))
            self._waiting.add(task)
            task.add_done_callback(
                lambda t: self._done_waiting(t, session.session_id, session.engine_key))
            return
        session.send(AllocationAnswer(asked.request_id, result))

    def _done_waiting(self, task: asyncio.Future[None], session_id: str, instance: str) -> None:
        self._waiting.discard(task)
        self.room.leave(session_id, instance)

    async def _allocate_later(self, session: Session, asked: SaveAllocate) -> None:
        """A stream's allocation that waits for pages; a session that ends
        meanwhile allocates nothing (NotFound: its answer goes nowhere)."""
        try:
            result = await self.room.allocate(
                lambda: self.cache.sessions.get(session.session_id), asked.mm_hash,
                asked.nbytes, asked.shape, asked.dtype, counted=True)
        except Exception as exc:
            if not isinstance(exc, CacheError):
                log.error("internal error: %s", exc, exc_info=exc)
            self._refuse_on_stream(session, asked, exc)
            return
        session.send(AllocationAnswer(asked.request_id, result))

    def _refuse_on_stream(self, session: Session, asked: SaveAllocate,
                          exc: Exception) -> None:
        if isinstance(exc, ResourceExhausted):  # an engine waiting for it encodes it
            self.convergence.save_given_up((session.namespace, asked.mm_hash),
                                           session.engine_key)
        session.send(AllocationAnswer(asked.request_id, None, exc))
