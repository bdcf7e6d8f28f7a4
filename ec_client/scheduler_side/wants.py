"""Wanted items: what an engine's scheduler asks the daemon about the items
it misses, and what it was told (`ec_daemon.plane.convergence` answers).

Three kinds of engine ask, for three reasons:

- An engine that can load and encode (`ensure`) asks before it encodes a
  cold item: the daemon tells it to encode (it holds the claim), or to wait
  for another engine's save or a promotion, and the request is deferred
  until the item is ready (then it hits) or the deferral's bound passes
  (then it encodes). The answer is waited for a fraction of a millisecond,
  `answer_wait_seconds` per step in all (a cold miss costs a round trip, not
  a deferred step); a later one defers the request a step.
- A producer (`claim`) asks only so that the daemon records it as encoding
  the item: it encodes whatever the answer (it cannot load), and is never
  deferred. That claim is what makes a consumer that asks meanwhile wait
  for the producer's save instead of encoding the item again (or, for an
  item it has no media for, failing), and a producer that dies or drops
  the save passes it on at once (the daemon sees its session end and its
  worker's report).
- A consumer given an item without its media (`lost`: vLLM's metadata-only
  items, announced by a producer) cannot encode it: it asks whether anyone
  will make it. "Encode it yourself" (nobody holds it, pending or claimed:
  its save was dropped, or refused, or its producer died) or "ready" for an
  entry that is gone again means it never will, and the request is failed
  at once rather than after the deferral's bound.

Items this engine was told to encode that it encodes (vLLM allocated their
encoder outputs) are said to the daemon at the step's end (`encoding`): a
claim its engine says nothing of passes to a waiting engine within seconds
(the daemon's CLAIM_START_SECONDS), so a view that wanted an item and never
encoded it holds nobody else's request for long.

Each item is asked about once while any request of this engine needs it;
answers arrive on the link's thread (`answered`), everything else runs on
vLLM's scheduling thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

from ec_client.common.limits import ANSWER_SECONDS, MAX_WANTS
from ec_client.common.wire import Answer, Verdict, verdict_name
from ec_client.scheduler_side.view import ReadyView

log = logging.getLogger(__name__)

WAITS = (Verdict.PROMOTING, Verdict.ENCODING)
# What tells an engine without the media that nobody will make an item:
# encode it (nobody holds it, pending or claimed), or ready but gone again.
NEVER = (Verdict.ENCODE, Verdict.READY)


@dataclass(slots=True)
class Want:
    asked: float
    deadline: float  # defer no longer than this
    verdict: int = Verdict.UNANSWERED  # until answered (written by the link thread)
    gave_up: bool = False
    computing: bool = False  # vLLM allocated its encoder output: this engine encodes it
    requests: set[str] = field(default_factory=set)  # of this engine that need it


class Wants:
    def __init__(self, view: ReadyView, send: Callable[[str, list[str]], None], *,
                 max_defer_seconds: float, answer_wait_seconds: float) -> None:
        """`send(field, mm_hashes)`: a stream message with `mm_hashes` as its
        repeated `field` ("wants", "yields", "releases", "encoding")."""
        self.view = view
        self.send = send
        self.max_defer_seconds = max_defer_seconds
        self.answer_wait_seconds = answer_wait_seconds
        self._wants: dict[str, Want] = {}
        # Notified when answers arrive (link thread); waits take at most
        # `_wait_left` more this step.
        self._answered = threading.Condition()
        self._wait_left = answer_wait_seconds
        # Items this engine was told to encode that `ensure` saw this step:
        # mm_hash -> the requests that needed them (`step_end`).
        self._claimed: dict[str, set[str]] = {}
        # Items it was told to encode that vLLM allocated this step (`step_end`).
        self._encoding: list[str] = []
        self.deferred = self.defer_timeouts = 0
        self.answer_waits = self.answer_wait_us = 0

    def __bool__(self) -> bool:
        return bool(self._wants)

    # ------------------------------------------------ vLLM's scheduling thread

    def ensure(self, mm_hashes: Iterable[str], request_id: str) -> bool:
        """May `request_id`, needing these items, be scheduled now? (An
        engine that can load; see the module's docstring.)"""
        fresh, known = self._ask(mm_hashes, request_id)
        ready = True
        for mm_hash in known:
            if not self._settled(mm_hash, self._wants[mm_hash], request_id):
                ready = False
        if fresh:
            self._await(fresh)
            for mm_hash in fresh:
                if self.view.get(mm_hash) is None \
                        and not self._settled(mm_hash, self._wants[mm_hash], request_id):
                    self.deferred += 1
                    ready = False
        return ready

    def claim(self, mm_hashes: Iterable[str], request_id: str) -> None:
        """A producer is about to encode these items for `request_id`: each
        is asked about once, so the daemon records it as their encoder. No
        wait, whatever the answer."""
        self._ask(mm_hashes, request_id)

    def lost(self, mm_hashes: Iterable[str], request_id: str) -> list[str]:
        """Of these items, which this engine cannot encode (no media), the
        ones the daemon says nobody will make (see the module's docstring).
        Waits for the answers as `ensure` does; an item not answered yet, or
        being made, is not lost (the caller bounds that wait)."""
        mm_hashes = [h for h in mm_hashes if self.view.get(h) is None]
        fresh, _ = self._ask(mm_hashes, request_id)
        if fresh:
            self._await(fresh)
        return [h for h in mm_hashes if self.view.get(h) is None
                and (want := self._wants.get(h)) is not None and want.verdict in NEVER]

    def computing(self, mm_hash: str) -> None:
        """vLLM allocated this item's encoder output: this engine encodes it
        (said at the step's end when the daemon told it to; if it saves, its
        save ends the claim)."""
        want = self._wants.get(mm_hash)
        if want is not None:
            # Told to encode it, or not answered yet (a producer's claim, asked
            # and encoded in one step): the daemon, which reads the stream in
            # order, takes it only from the claim's holder.
            if not want.computing and want.verdict in (Verdict.UNANSWERED, Verdict.ENCODE):
                self._encoding.append(mm_hash)
            want.computing = True
            self._claimed.pop(mm_hash, None)

    def request_finished(self, request_id: str, mm_hashes: Iterable[str]) -> None:
        """Items no other request of this engine needs, that this engine was
        to encode and did not start, or waits for, are released (a waiting
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
            if not want.computing and want.verdict != Verdict.READY:
                released.append(mm_hash)
        self.send("releases", released)

    def step_end(self, scheduled: Container[str] | None) -> None:
        """Items this engine was told to encode for requests none of which
        ran this step (none among `scheduled`; with None, any not being
        encoded) are offered to an engine that waits for them (`yields`):
        it encodes, this one waits. The items it started encoding this step
        are said (`encoding`). The next step may wait for answers again."""
        if self._encoding:
            encoding, self._encoding = self._encoding, []
            self.send("encoding", encoding)
        if self._claimed:
            claimed, self._claimed = self._claimed, {}
            idle = [h for h, requests in claimed.items()
                    if scheduled is None or not any(r in scheduled for r in requests)]
            self.send("yields", idle)
        self._wait_left = self.answer_wait_seconds

    def expire(self, now: float) -> None:
        """Answered or given-up wants are kept a while (vLLM asks every step
        until the request runs), then forgotten."""
        horizon = now - 2 * self.max_defer_seconds
        for mm_hash in [h for h, w in list(self._wants.items()) if w.asked < horizon]:
            self._wants.pop(mm_hash, None)

    def clear(self) -> None:
        """A new session: the old daemon's answers mean nothing to the new one."""
        self._wants = {}
        self._encoding = []

    def take_stats(self) -> dict[str, int]:
        stats = {"deferred": self.deferred, "defer_timeouts": self.defer_timeouts,
                 "answer_waits": self.answer_waits, "answer_wait_us": self.answer_wait_us}
        self.deferred = self.defer_timeouts = 0
        self.answer_waits = self.answer_wait_us = 0
        return stats

    # ------------------------------------------------------ the link's thread

    def answered(self, answers: Iterable[Answer]) -> None:
        """The daemon's answers."""
        wants, patience = self._wants, self.max_defer_seconds
        for answer in answers:
            want = wants.get(answer.mm_hash)
            if want is not None:
                if answer.verdict in WAITS:
                    want.deadline = want.asked + patience
                want.verdict = answer.verdict
        with self._answered:
            self._answered.notify_all()

    # ------------------------------------------------------------ helpers

    def _ask(self, mm_hashes: Iterable[str], request_id: str) -> tuple[list[str], list[str]]:
        """Want the items not in the view and not asked about yet (sent now);
        returns (those, the ones asked about before)."""
        wants = self._wants
        now = 0.0
        fresh: list[str] = []
        known: list[str] = []
        for mm_hash in mm_hashes:
            if self.view.get(mm_hash) is not None:
                continue  # ready: a hit
            want = wants.get(mm_hash)
            if want is not None:
                want.requests.add(request_id)
                known.append(mm_hash)
            elif len(wants) < MAX_WANTS:
                now = now or time.monotonic()
                wants[mm_hash] = Want(now, now + ANSWER_SECONDS, requests={request_id})
                fresh.append(mm_hash)
        if fresh:
            self.send("wants", fresh)
        return fresh, known

    def _settled(self, mm_hash: str, want: Want, request_id: str) -> bool:
        """May `request_id` go ahead as far as this wanted item goes? Told to
        encode it (a claim), or it was ready (and is gone again), or its
        deferral is over."""
        verdict = want.verdict
        if verdict and verdict not in WAITS:
            if verdict == Verdict.ENCODE and not want.computing:
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
                        verdict_name(verdict) if verdict else "no answer")
        return True

    def _await(self, fresh: list[str]) -> None:
        """Until every item of `fresh` is answered, or this step's answer
        wait is spent."""
        if self._wait_left <= 0:
            return
        wants = self._wants
        started = time.monotonic()
        deadline = started + self._wait_left
        with self._answered:
            while any(wants[h].verdict == 0 for h in fresh if h in wants):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._answered.wait(left)
        waited = time.monotonic() - started
        self._wait_left -= waited
        self.answer_waits += 1
        self.answer_wait_us += int(waited * 1e6)
