"""Wanted items: one encode per item among the engines of a host (and the
second tier), as the scheduler's side takes part (docs/architecture.md, "One
encode per item, and the second tier").

An item a request needs that the view does not hold is *wanted*: one stream
message, and the daemon answers: encode it (nobody else is), or wait for
another engine's save or a promotion, which ends with a ready event. `ensure`
waits for that answer, a fraction of a millisecond, up to
`answer_wait_seconds` per step in all: a cold miss then costs one round trip
instead of a deferred step, and engines that miss one image at once still
encode it once (the daemon orders their wants). An answer later than that
defers the request to the next step. Every deferral is bounded
(`max_defer_seconds`, and ANSWER_SECONDS for an answer).

Items this engine was told to encode that it encodes (vLLM allocated their
encoder outputs) are said to the daemon at the step's end (`encoding`): a
claim its engine says nothing of passes to a waiting engine within seconds.
Items this engine was told to encode that no running request needed at a
step's end are offered to engines that wait for them (`yields`); a finished
request releases what no other request of this engine needs (`releases`).

Threads: `ensure`, `computing`, `step_end`, `request_finished` and `expire`
run on vLLM's scheduling thread; `on_answers` on the link's thread (it only
writes a want's verdict and deadline, then notifies).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import Any

from ec_protocol.protocol import pb

log = logging.getLogger(__name__)

# A want unanswered this long (a daemon that dropped it) is encoded.
ANSWER_SECONDS = 1.0
# Items wanted and remembered at once; beyond, items are encoded without asking.
MAX_WANTS = 1 << 14
WAITS = (pb.VERDICT_PROMOTING, pb.VERDICT_ENCODING)
# SendItems(field of pb.ClientMessage, mm_hashes)
SendItems = Callable[[str, list[str]], None]


@dataclass(slots=True)
class _Want:
    asked: float
    deadline: float  # defer no longer than this
    verdict: int = 0  # pb.Verdict; 0 until answered (written by the link thread)
    gave_up: bool = False
    computing: bool = False  # vLLM allocated its encoder output: this engine encodes it
    requests: set[str] = field(default_factory=set)  # of this engine that need it


class Wants:
    def __init__(self, send_items: SendItems, *, max_defer_seconds: float,
                 answer_wait_seconds: float) -> None:
        self.max_defer_seconds = max_defer_seconds
        self.answer_wait_seconds = answer_wait_seconds
        self._send_items = send_items
        self._wants: dict[str, _Want] = {}
        # Notified when answers arrive (link thread); `ensure` waits on it for
        # at most `_wait_left` more this step.
        self._answered = threading.Condition()
        self._wait_left = answer_wait_seconds
        # Items this engine was told to encode that `ensure` saw this step:
        # mm_hash -> the requests that needed them (`step_end`).
        self._claimed: dict[str, set[str]] = {}
        # Items it was told to encode that vLLM allocated this step.
        self._encoding: list[str] = []
        # Since the last `take_counts` (plain ints: the scheduler's thread).
        self.deferred = self.defer_timeouts = 0
        self.answer_waits = self.answer_wait_us = 0

    def __bool__(self) -> bool:
        return bool(self._wants)

    def ensure(self, mm_hashes: Iterable[str], request_id: str,
               in_view: Callable[[str], bool]) -> bool:
        """May `request_id`, needing these items (none in the view), go
        ahead? False defers it: another engine or a promotion is making one,
        or the daemon has not answered yet. An item `in_view` once the answers
        came (it landed meanwhile) is the caller's to stage."""
        wants = self._wants
        now = 0.0
        fresh: list[str] = []
        ready = True
        for mm_hash in mm_hashes:
            want = wants.get(mm_hash)
            if want is None:
                if len(wants) >= MAX_WANTS:
                    continue
                now = now or time.monotonic()
                wants[mm_hash] = _Want(now, now + ANSWER_SECONDS, requests={request_id})
                fresh.append(mm_hash)
                continue
            want.requests.add(request_id)
            if not self._settled(mm_hash, want, request_id):
                ready = False
        if fresh:
            self._send_items("wants", fresh)
            if self._wait_left > 0:
                self._await_answers(wants, fresh)
        return self._fresh_settled(fresh, request_id, in_view) and ready

    def _fresh_settled(self, fresh: list[str], request_id: str,
                       in_view: Callable[[str], bool]) -> bool:
        ready = True
        for mm_hash in fresh:
            if not in_view(mm_hash) and not self._settled(mm_hash, self._wants[mm_hash],
                                                          request_id):
                self.deferred += 1
                ready = False
        return ready

    def _settled(self, mm_hash: str, want: _Want, request_id: str) -> bool:
        """May `request_id` go ahead as far as this wanted item goes? Told to
        encode it (a claim), or it was ready (and is gone again), or its
        deferral is over."""
        verdict = want.verdict
        if verdict and verdict not in WAITS:
            if verdict == pb.VERDICT_ENCODE and not want.computing:
                self._claimed.setdefault(mm_hash, set()).add(request_id)
            return True
        now = time.monotonic()
        if now < want.deadline:
            return False
        if not want.gave_up:
            want.gave_up = True
            self.defer_timeouts += 1
            log.warning("ec-daemon: %s still not ready after %.1fs (%s); encoding it here",
                        mm_hash, now - want.asked,
                        pb.Verdict.Name(verdict) if verdict else "no answer")
        return True

    def _await_answers(self, wants: dict[str, _Want], fresh: list[str]) -> None:
        """Until every item of `fresh` is answered, or this step's answer
        wait is spent."""
        started = time.monotonic()
        deadline = started + self._wait_left
        with self._answered:
            while any(wants[h].verdict == 0 for h in fresh):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._answered.wait(left)
        waited = time.monotonic() - started
        self._wait_left -= waited
        self.answer_waits += 1
        self.answer_wait_us += int(waited * 1e6)

    def computing(self, mm_hash: str) -> None:
        """vLLM allocated this item's encoder output: this engine encodes it
        (said at the step's end when the daemon told it to)."""
        want = self._wants.get(mm_hash)
        if want is not None:
            if not want.computing and want.verdict == pb.VERDICT_ENCODE:
                self._encoding.append(mm_hash)
            want.computing = True
            self._claimed.pop(mm_hash, None)

    def step_end(self, scheduled: Container[str] | None) -> None:
        """Items this engine was told to encode for requests none of which
        ran this step (none among the `scheduled` request ids; with None,
        any not being encoded) are offered to an engine that waits for
        them (`yields`): it encodes, this one waits."""
        self._wait_left = self.answer_wait_seconds
        if self._encoding:
            encoding, self._encoding = self._encoding, []
            self._send_items("encoding", encoding)
        if not self._claimed:
            return
        claimed, self._claimed = self._claimed, {}
        idle = [h for h, requests in claimed.items()
                if scheduled is None or not any(r in scheduled for r in requests)]
        self._send_items("yields", idle)

    def request_finished(self, request_id: str, mm_hashes: Iterable[str]) -> None:
        """Items no other request of this engine needs, that it was to
        encode and did not start, or waits for, are released (a waiting
        engine encodes them at once instead of after its bound)."""
        if not self._wants:
            return
        released = []
        for mm_hash in mm_hashes:
            want = self._wants.get(mm_hash)
            if want is None:
                continue
            want.requests.discard(request_id)
            if want.requests:
                continue  # another request of this engine still needs it
            del self._wants[mm_hash]
            self._claimed.pop(mm_hash, None)
            if not want.computing and want.verdict != pb.VERDICT_READY:
                released.append(mm_hash)
        self._send_items("releases", released)

    def expire(self, now: float) -> None:
        """Answered or given-up wants are kept a while (vLLM asks every step
        until the request runs), then forgotten."""
        horizon = now - 2 * self.max_defer_seconds
        for mm_hash in [h for h, w in list(self._wants.items()) if w.asked < horizon]:
            self._wants.pop(mm_hash, None)

    def reset(self) -> None:
        """A new session: answers of the old daemon mean nothing to the new one."""
        self._wants = {}

    def on_answers(self, answers: Any) -> None:
        """The daemon's answers (link thread)."""
        wants, patience = self._wants, self.max_defer_seconds
        for answer in answers:
            want = wants.get(answer.mm_hash)
            if want is not None:
                if answer.verdict in WAITS:
                    want.deadline = want.asked + patience
                want.verdict = answer.verdict
        with self._answered:
            self._answered.notify_all()
