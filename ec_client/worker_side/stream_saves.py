"""A worker's saves on its session stream: requests matched to answers.

The saver thread asks for a batch of allocations in one stream message
(`allocate`), then waits for each answer by its request id (`wait`) while
the daemon answers the others: several are outstanding at once, answered in
any order. It reports the copies that landed (or were given up) in one
message as well (`report`); each report's answer is handed to a callback.
The link's thread brings the daemon's answers in (`on_message`) and says
when the stream is lost (`detached`).

Every request ends: with its answer, or with None when the stream is lost
(the daemon ended the session: its pending saves are quarantined, never
served) or the deadline passes. An allocation given up at its deadline
whose answer still comes and says ALLOCATED is aborted at once on the
stream, so no pending entry waits for the session's end. A batch's reports
may ride on the next batch's allocations (one message, reports applied
first), so a busy saver sends one message per batch. Requests are sent
only on the attachment they were made for (`SessionLink.send_on`): the
extents of an answer are in that attachment's region.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ec_client.common.session import Attachment
from ec_client.common.wire import (
    AllocStatus,
    DaemonNews,
    Outgoing,
    SaveAllocate,
    SaveAllocation,
    SaveReport,
)

# (mm_hash, nbytes, shape, dtype)
SaveAsk = tuple[str, int, Sequence[int], str]
# The status of a report (a ReportStatus), None: no answer came.
OnReported = Callable[[str, int | None], None]


@dataclass
class Report:
    """Saves to report: copies that landed (each answered through
    `on_reported`) and saves given up (not answered)."""

    saved: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    on_reported: OnReported = lambda mm_hash, status: None
    # The checksum of each saved entry's bytes, read back after its copy.
    checksums: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.saved or self.aborted)


class StreamSaves:
    def __init__(self, send_on: Callable[[Attachment, Outgoing], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`send_on(attachment, message)` queues a ClientMessage on that
        attachment's stream, False when it is not the current one."""
        self._send_on = send_on
        self._clock = clock
        self.messages = 0  # stream messages sent (saves per message: the batching)
        self._lock = threading.Condition()
        self._next_id = 0
        # Allocations: request id -> (attachment, mm_hash, sent at).
        self._asked: dict[int, tuple[Attachment, str, float]] = {}
        self._answers: dict[int, SaveAllocation | None] = {}  # request id -> answer, None: lost
        self._abandoned: dict[int, tuple[Attachment, str]] = {}
        # Reports: request id -> (mm_hash, sent at, callback).
        self._reports: dict[int, tuple[str, float, OnReported]] = {}

    @property
    def outstanding(self) -> int:
        """Allocations not yet taken by `wait`, and reports not answered yet
        (nor given up)."""
        with self._lock:
            return len(self._asked) + len(self._reports)

    def allocate(self, attachment: Attachment, saves: Sequence[SaveAsk],
                 reports: Report | None = None) -> list[int] | None:
        """Ask for `saves` in one message (with `reports`, applied first:
        see `report`); their request ids, or None when `attachment` is no
        longer the link's (nothing was asked or reported)."""
        message = Outgoing()
        now = self._clock()
        with self._lock:
            ids = []
            for mm_hash, nbytes, shape, dtype in saves:
                request_id = self._take_id()
                ids.append(request_id)
                self._asked[request_id] = (attachment, mm_hash, now)
                message.allocations.append(SaveAllocate(request_id, mm_hash, nbytes, shape, dtype))
            reported = self._add_reports(message, reports, now) if reports else []
        if self._send_on(attachment, message):
            self.messages += 1
            return ids
        with self._lock:
            for request_id in ids:
                self._asked.pop(request_id, None)
                self._answers.pop(request_id, None)
            for request_id in reported:
                self._reports.pop(request_id, None)
        return None

    def wait(self, request_id: int, deadline_seconds: float) -> SaveAllocation | None:
        """The answer to allocation `request_id`, or
        None when the stream was lost or none came within `deadline_seconds`
        of its sending (given up: aborted if it comes and allocated)."""
        with self._lock:
            asked = self._asked.get(request_id)
            if asked is None:
                return self._answers.pop(request_id, None)
            attachment, mm_hash, sent = asked

            def answered() -> bool:
                return request_id in self._answers

            while not answered():
                left = sent + deadline_seconds - self._clock()
                if left <= 0 or not self._lock.wait(left):
                    break
            self._asked.pop(request_id, None)
            if request_id in self._answers:
                return self._answers.pop(request_id)
            self._abandoned[request_id] = (attachment, mm_hash)
            return None

    def report(self, attachment: Attachment, reports: Report) -> bool:
        """Report saves in one message: `reports.saved` (their copies
        landed) are each answered through `reports.on_reported(mm_hash,
        status)` (status None: no answer, the stream was lost or the
        deadline passed, see `expire`); `reports.aborted` are not answered.
        False when `attachment` is no longer the link's (nothing was
        reported; the daemon ended that session)."""
        return self.allocate(attachment, (), reports) is not None

    def _add_reports(self, message: Outgoing, reports: Report, now: float) -> list[int]:
        ids = []
        for mm_hash in reports.saved:
            request_id = self._take_id()
            ids.append(request_id)
            self._reports[request_id] = (mm_hash, now, reports.on_reported)
            message.reports.append(SaveReport(mm_hash, True, request_id,
                                              reports.checksums.get(mm_hash, 0)))
        for mm_hash in reports.aborted:
            message.reports.append(SaveReport(mm_hash, False))
        return ids

    def expire(self, deadline_seconds: float) -> int:
        """Give up reports unanswered for `deadline_seconds` (their callback
        gets None); how many."""
        now = self._clock()
        with self._lock:
            late = [i for i, (_, sent, _) in self._reports.items()
                    if now - sent >= deadline_seconds]
            gone = [(i, self._reports.pop(i)) for i in late]
        for _, (mm_hash, _, on_reported) in gone:
            on_reported(mm_hash, None)
        return len(gone)

    def on_message(self, message: DaemonNews) -> None:
        """A DaemonMessage's answers (on the link's thread)."""
        aborts: list[tuple[Attachment, str]] = []
        reported: list[tuple[OnReported, str, int]] = []
        with self._lock:
            for answer in message.allocations:
                request_id = answer.request_id
                if request_id in self._asked:
                    self._answers[request_id] = answer
                    continue
                abandoned = self._abandoned.pop(request_id, None)
                if abandoned is not None and answer.status == AllocStatus.ALLOCATED:
                    aborts.append(abandoned)
            for report in message.reported:
                waiting = self._reports.pop(report.request_id, None)
                if waiting is not None:
                    reported.append((waiting[2], waiting[0], report.status))
            self._lock.notify_all()
        for attachment, mm_hash in aborts:  # answered too late: nobody copies into it
            self._send_on(attachment, Outgoing(reports=[SaveReport(mm_hash, False)]))
        for on_reported, mm_hash, status in reported:
            on_reported(mm_hash, status)

    def detached(self) -> None:
        """The stream is lost: every outstanding request ends with None (the
        daemon ended the session; its pending saves are quarantined)."""
        with self._lock:
            for request_id in self._asked:
                self._answers[request_id] = None
            self._abandoned.clear()
            gone = list(self._reports.values())
            self._reports.clear()
            self._lock.notify_all()
        for mm_hash, _, on_reported in gone:
            on_reported(mm_hash, None)

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id
