"""A worker's saves, on plain values: allocations (waiting for pages that
come back), reports, and both as messages of the session stream.

The unary calls (`Allocate`, `Report`) and the stream take the same paths.
On the stream each allocation and report is answered with its request id
(`AllocationAnswer`, `ReportAnswer` in the session's outbox): an allocation
at once when the cache has room or refuses, or from a task when it must
wait for hidden pages, so the stream (heartbeats, the other saves) goes on
meanwhile. A refusal is an answer, not the stream's end. Every allocation
belongs to its session as with the unary calls: when the session ends its
pending saves are quarantined, and a session that ended while its
allocation waited allocates nothing.

Allocations waiting for pages are bounded on both paths alike: per session
(WAITING_PER_SESSION), for all tokenless clients together and in all
(`limits`); one more is refused at once (RESOURCE_EXHAUSTED). Unbounded,
8,000 unary Allocate calls parked by one client were each woken by every
page that came back (763 ms of latency for everyone). The daemon's own
writer (promotions) is bounded by its budget instead.

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

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
from ec_daemon.core.limits import MAX_WAITING_SAVES, MAX_WAITING_SAVES_TOKENLESS, validate_mm_hash
from ec_daemon.core.records import Session
from ec_daemon.core.sessions import tokenless
from ec_daemon.errors import CacheError, FailedPrecondition, ResourceExhausted
from ec_daemon.plane.convergence import Convergence
from ec_daemon.plane.wakeups import Wakeups

log = logging.getLogger(__name__)

# A save waits this part of --alloc-wait-seconds for hidden pages to come
# back before it evicts more ready entries instead.
HIDDEN_PATIENCE_FRACTION = 0.1
SPACE = "space"  # the Wakeups key of pages coming back
# The most stream allocations of one session waiting for pages at once (a
# client saves SAVE_BATCH at a time); past it one is refused at once, so a
# misbehaving client cannot make every page coming back wake thousands.
WAITING_PER_SESSION = 64


class Saves:
    def __init__(self, cache: Cache, convergence: Convergence, wakeups: Wakeups,
                 alloc_wait_seconds: float) -> None:
        self.cache = cache
        self.convergence = convergence
        self.wakeups = wakeups
        self.alloc_wait_seconds = alloc_wait_seconds
        self._waiting: set[asyncio.Future[None]] = set()  # stream saves waiting for pages
        # Allocations waiting for pages (both paths): by session id, the
        # tokenless ones, all
        self._waiting_of: dict[str, int] = {}
        self._waiting_tokenless = 0
        self._waiting_total = 0

    async def allocate(self, session_id: str, mm_hash: str, nbytes: int,
                       shape: tuple[int, ...], dtype: str) -> AllocResult:
        """A worker's save asks for pages (`allocate_waiting`). Raises
        ResourceExhausted when none came free in time: an engine waiting for
        this save encodes it instead."""
        try:
            return await self.allocate_waiting(lambda: self.cache.sessions.get(session_id),
                                               mm_hash, nbytes, shape, dtype)
        except ResourceExhausted:
            session = self.cache.sessions.find(session_id)
            if session is not None:
                self.convergence.save_given_up((session.namespace, mm_hash), session.engine_key)
            raise

    async def allocate_waiting(self, session_of: Callable[[], Session], mm_hash: str,
                               nbytes: int, shape: tuple[int, ...], dtype: str, *,
                               counted: bool = False) -> AllocResult:
        """Allocate for the session `session_of()` returns (it may end while
        this waits), waiting for hidden pages within --alloc-wait-seconds.
        Raises ResourceExhausted when it would wait past the bounds on waiting
        allocations (`counted`: the caller took its place already)."""
        started = time.monotonic()
        deadline = started + self.alloc_wait_seconds
        # Past this, hidden pages held back (a load in flight, a ghost) no
        # longer count as coming back: more ready entries are evicted instead.
        patience = started + self.alloc_wait_seconds * HIDDEN_PATIENCE_FRACTION
        impatient = False  # once only: the victims it hides are then counted as coming
        waiting: Session | None = None  # the session whose place this wait holds
        try:
            while True:
                session = session_of()
                count_hidden = impatient or time.monotonic() < patience
                impatient = impatient or not count_hidden
                result = self.cache.allocate(session, mm_hash, nbytes, shape, dtype,
                                             count_hidden=count_hidden)
                if result.outcome is not AllocOutcome.WAIT:
                    return result
                if waiting is None and not counted and session.session_id:
                    self._enter_wait(session)
                    waiting = session
                wake_by = deadline if impatient else patience
                if not await self.wakeups.wait((SPACE,), wake_by) \
                        and time.monotonic() >= deadline:
                    raise self.cache.refuse_waited_save(nbytes)
        finally:
            if waiting is not None:
                self._leave_wait(waiting.session_id, waiting.engine_key)

    def _enter_wait(self, session: Session) -> None:
        """One more of `session`'s allocations waits for pages; raises
        ResourceExhausted (nothing counted) past a bound."""
        held = self._waiting_of.get(session.session_id, 0)
        if held >= WAITING_PER_SESSION:
            raise ResourceExhausted(f"{held} saves of this session already wait for pages")
        shared = tokenless(session.engine_key)
        if shared and self._waiting_tokenless >= MAX_WAITING_SAVES_TOKENLESS:
            raise ResourceExhausted(
                f"{self._waiting_tokenless} saves of clients without an engine token already "
                "wait for pages")
        if self._waiting_total >= MAX_WAITING_SAVES:
            raise ResourceExhausted(f"{self._waiting_total} saves already wait for pages")
        self._waiting_of[session.session_id] = held + 1
        self._waiting_tokenless += shared
        self._waiting_total += 1

    def _leave_wait(self, session_id: str, instance: str) -> None:
        left = self._waiting_of.pop(session_id, 1) - 1
        if left:
            self._waiting_of[session_id] = left
        self._waiting_tokenless -= tokenless(instance)
        self._waiting_total -= 1

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
        task, so the stream goes on meanwhile. A refusal is an answer too."""
        try:
            result = self.cache.allocate(session, asked.mm_hash, asked.nbytes, asked.shape,
                                         asked.dtype)
        except CacheError as exc:
            self._refuse_on_stream(session, asked, exc)
            return
        if result.outcome is AllocOutcome.WAIT:
            try:
                self._enter_wait(session)
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
        self._leave_wait(session_id, instance)

    async def _allocate_later(self, session: Session, asked: SaveAllocate) -> None:
        """A stream's allocation that waits for pages; a session that ends
        meanwhile allocates nothing (NotFound: its answer goes nowhere)."""
        try:
            result = await self.allocate_waiting(
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
