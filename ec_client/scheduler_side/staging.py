"""Staged loads, the scheduler's side: a hit is copied and verified by every
rank a step before the step that uses it (docs/architecture.md, "Staged
loads").

Why. A load that cannot return the saved bytes (pages rewritten by another
process of the region, a stamp that moved, an entry its loader refuses) must
cost its request, never the engine. Once vLLM runs a step, a worker cannot
fail one request: vLLM's V1 model runner (0.32, 0.33) gathers every
scheduled item from its encoder cache and asserts it is there, Model Runner
V2 (0.32-0.34) likewise, and a placeholder would stay in vLLM's encoder
cache and the KV computed from it in its prefix cache. vLLM asks the
connector `ensure_cache_available` for every waiting and running request
with media before it schedules it (`Scheduler.schedule`, 0.32-0.34): that
is where a request can be deferred, or failed through
`take_unavailable_requests`. So:

- `plan` (from `ensure`): an item ready in the view is hit and its load
  planned; the request is deferred (vLLM asks again next step).
- `end_step` sends the step's planned loads in its metadata (`loads`); every
  rank copies each into memory it keeps aside, checks the stamps (and the
  checksum) and reports it in its worker metadata; the load is in flight in
  the view (its eviction unacknowledged) until every rank reported it.
- Every rank staged it: a hit (`hit`: vLLM's `has_cache_item`), and
  `adopt` (`update_state_after_alloc`) names it in that step's `adopt`: the
  ranks move the staged output into vLLM's encoder cache, no copy.
- A rank could not: a miss for its requests (`state` is FAILED): vLLM
  encodes the item, or a request without its media fails cleanly; a bytes
  mismatch is reported to the daemon (`take_mismatches`), and that entry is
  not staged again by this engine (`ec_client.scheduler_side.refusals`).
- Staged loads no request will use (finished, aborted) are dropped in the
  next step's `drop`, as are those not adopted within ADOPT_STEPS steps (a
  request preempted or held back by KV pressure stages again later); a
  worker drops what it holds past STAGED_STEPS itself.

Steps the workers never see. vLLM's V1 model runner runs no EC connector in
a step that schedules no tokens (its `execute_model` returns before
`_preprocess`, where the connector's context runs); Model Runner V2 does
(`ActiveECConnector.no_forward`). When every request is deferred for its
loads, the step schedules nothing, and on V1 its `loads` would reach no
worker: then this process stages them itself (`RegionReader`: a private
copy, stamps checked after it, the checksum over it), and the step that
adopts them carries the verified bytes (`inline`). That costs a copy on the
scheduler's thread, in a step with nothing else to run, and the bytes'
trip through vLLM's step broadcast; a busy engine's steps carry tokens and
its workers stage.

With vLLM's async scheduling the step after the one that staged is
scheduled before its worker output is in: the hit comes a step later, and
nothing else changes. The cost of a hit is one deferred step (measured in
docs/performance.md, sections 1 and 10).

Not thread-safe: vLLM's scheduling thread calls everything here.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ec_client.common.contract import (
    UNUSABLE,
    Adopt,
    InlineLoad,
    LoadSpec,
    RegionInfo,
    StepMetadata,
)
from ec_client.common.limits import ADOPT_STEPS, INFLIGHT_TTL_SECONDS
from ec_client.common.readback import LoadRefused, RegionReader
from ec_client.scheduler_side.kept_regions import KeptRegions
from ec_client.scheduler_side.refusals import Refusals
from ec_client.scheduler_side.view import ReadyView, Ref, Refs, Send

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    """What `plan` and `state` tell the caller about an item."""

    STAGED = "staged"  # every rank holds it, verified: a hit when vLLM asks
    WAIT = "wait"  # being staged: defer the request
    FAILED = "failed"  # it cannot be loaded: encode it, or fail a request without media
    ABSENT = "absent"  # not staged and not stageable now (not in the view, no room)


_PLANNED, _STAGING, _STAGED = range(3)


@dataclass(slots=True)
class _Staged:
    spec: LoadSpec
    ref: Ref
    lineage: int  # of the view's loads in flight it counts in
    region: RegionInfo
    requests: set[str]
    state: int = _PLANNED
    left: int = 0  # rank reports still to come
    staged_ok: int = 0  # ranks that reported it staged
    kind: str = ""  # the first failure reported
    step: int = 0  # the worker step that staged it
    sent: float = 0.0
    payload: bytearray | None = None  # staged in this process (`inline`)


@dataclass
class Counts:
    """Since the owner last reset them (plain ints: the scheduling thread)."""

    loads: int = 0
    load_bytes: int = 0
    load_failures: int = 0
    inline: int = 0


class Staging:
    def __init__(self, view: ReadyView, send_acks: Send, *, ranks: int, limit_bytes: int,
                 admit_seconds: float, verify_checksum: bool = False,
                 reader: RegionReader | None = None) -> None:
        """`ranks`: the reports each staged load needs. `limit_bytes`: what
        may be planned, staging or staged at once (each rank's staging area
        holds as much). `admit_seconds`: how long a request waits for a load
        still staging before it goes on as a miss. `verify_checksum`: loads
        staged here are checked against their entry's checksum, as the
        workers check theirs."""
        self.view = view
        self.verify_checksum = verify_checksum
        self._send = send_acks
        self.ranks = ranks
        self.limit_bytes = limit_bytes
        self.admit_seconds = admit_seconds
        self.reader = reader or RegionReader()
        self.region_owner: int | None = None  # the daemon's user (inline reads)
        self.bytes = 0
        self.step = 0  # steps the workers ran (what StepMetadata.step counts)
        self.counts = Counts()
        self._items: dict[str, _Staged] = {}  # by mm_hash: one staged load per item
        self._planned: list[_Staged] = []
        self._transfers: dict[int, _Staged] = {}  # sent, reports to come
        self._hits: dict[str, _Staged] = {}  # `hit` this step
        self._adopting: dict[str, _Staged] = {}
        self._drops: list[int] = []
        self.refusals = Refusals()  # entries not to stage again
        # The requests a failed load was for, by item, until they end: told
        # FAILED whatever the view holds by then.
        self._failed_for: dict[str, set[str]] = {}
        self.regions = KeptRegions(self.reader)  # those of the loads in flight

    # ------------------------------------------------ scheduling thread

    def state(self, mm_hash: str, request_id: str, now: float = 0.0) -> Stage | None:
        """The item's staged load, which `request_id` now waits for too;
        None when there is none."""
        staged = self._items.get(mm_hash)
        if staged is None:
            failed = self._failed_for.get(mm_hash)
            return Stage.FAILED if failed is not None and request_id in failed else None
        staged.requests.add(request_id)
        if staged.state == _STAGED:
            return Stage.STAGED
        if staged.state == _STAGING and (now or time.monotonic()) - staged.sent \
                > self.admit_seconds:
            return Stage.FAILED  # (its reports are still awaited for the view)
        return Stage.WAIT

    def refused(self, mm_hash: str, entry_id: int, now: float) -> bool:
        """Is this entry one this engine must not stage (it failed before)?"""
        return self.refusals.refused(mm_hash, entry_id, now)

    def room(self, nbytes: int) -> bool:
        return self.bytes + nbytes <= self.limit_bytes

    def plan(self, spec: LoadSpec, region: RegionInfo, lineage: int,
             request_id: str) -> None:
        """Stage `spec` (hit in the view this step) with this step."""
        staged = _Staged(spec, (spec.mm_hash, spec.entry_id), lineage, region, {request_id})
        self._items[spec.mm_hash] = staged
        self._planned.append(staged)
        self.bytes += spec.nbytes

    def hit(self, mm_hash: str) -> bool:
        """vLLM's `has_cache_item`: staged on every rank (kept until the step ends)."""
        staged = self._items.get(mm_hash)
        if staged is None or staged.state != _STAGED:
            return False
        self._hits[mm_hash] = staged
        return True

    def adopt(self, mm_hash: str) -> bool:
        """vLLM allocated encoder space for this item: if it was a hit this
        step, the step adopts its staged load. Returns True then."""
        if mm_hash in self._adopting:
            return True
        staged = self._hits.get(mm_hash)
        if staged is None:
            return False
        self._adopting[mm_hash] = staged
        return True

    def request_finished(self, request_id: str, mm_hashes: Iterable[str]) -> None:
        """Staged loads no other request needs are dropped (a load still
        staging is dropped when its reports are in)."""
        for mm_hash in mm_hashes:
            failed = self._failed_for.get(mm_hash)
            if failed is not None:
                failed.discard(request_id)
                if not failed:
                    del self._failed_for[mm_hash]
            staged = self._items.get(mm_hash)
            if staged is None or request_id not in staged.requests:
                continue
            staged.requests.discard(request_id)
            if staged.requests or mm_hash in self._adopting:
                continue
            if staged.state == _PLANNED:  # not sent yet: never will be
                self._planned.remove(staged)
                self._forget(staged, drop=False)
            elif staged.state == _STAGED:
                self._forget(staged, drop=True)
            # (one still staging is dropped when its reports are in)

    def end_step(self, metadata: StepMetadata, visible: bool, view_lineage: int) -> None:
        """Fill the step's staging part of `metadata`: adoptions, drops, and
        the loads planned this step (sent to the workers when they run this
        step, `visible`, else staged here). Marks the sent loads in flight
        in the view (whose hits the step's end releases)."""
        if visible:
            self.step += 1
            metadata.step = self.step
            self._adopt_into(metadata)
            self._expire_staged()
            if self._drops:
                metadata.drop, self._drops = self._drops, []
        self._hits.clear()
        in_view: Refs = []
        loaded: Refs = []  # staged here: touched, not in flight
        if self._planned:
            planned, self._planned = self._planned, []
            for staged in planned:
                if self._items.get(staged.spec.mm_hash) is not staged:
                    continue  # (never: one plan per item)
                if visible:
                    self._send_load(staged, metadata, in_view, view_lineage)
                elif self._stage_here(staged) and staged.lineage == view_lineage:
                    loaded.append(staged.ref)
        # After the copies made here: until now the hits kept their pages.
        self.view.end_step(in_view, view_lineage, self._send, loaded)

    def _adopt_into(self, metadata: StepMetadata) -> None:
        if not self._adopting:
            return
        adopting, self._adopting = self._adopting, {}
        for mm_hash, staged in adopting.items():
            spec = staged.spec
            if staged.payload is not None:
                metadata.inline.append(InlineLoad(mm_hash, spec.transfer_id, spec.shape,
                                                  spec.dtype, staged.payload))
            else:
                metadata.adopt.append(Adopt(mm_hash, spec.transfer_id))
            self._forget(staged, drop=False)

    def _send_load(self, staged: _Staged, metadata: StepMetadata, in_view: Refs,
                   view_lineage: int) -> None:
        spec = staged.spec
        staged.state, staged.left, staged.step = _STAGING, self.ranks, self.step
        staged.sent = time.monotonic()
        self._transfers[spec.transfer_id] = staged
        self.regions.sent(spec.generation)
        if staged.lineage == view_lineage:
            in_view.append(staged.ref)
        metadata.loads.append(spec)
        metadata.regions[spec.generation] = staged.region
        self.counts.loads += 1
        self.counts.load_bytes += spec.nbytes

    def _stage_here(self, staged: _Staged) -> bool:
        """A step the workers do not run: copy and verify the entry in this
        process; the step that adopts it carries the bytes. Returns whether
        it was staged."""
        spec = staged.spec
        try:
            staged.payload = self.reader.read(spec, staged.region, self.region_owner,
                                              self.verify_checksum)
        except LoadRefused as refused:
            self._failed(staged, refused.kind, str(refused))
            return False
        staged.state = _STAGED
        self.counts.loads += 1
        self.counts.inline += 1
        self.counts.load_bytes += spec.nbytes
        return True

    def reported(self, done: Iterable[int], failed: Iterable[tuple[int, str]]) -> None:
        """One report per rank and transfer: `done` staged and verified,
        `failed` with what failed (`ec_client.common.contract`)."""
        finished: list[_Staged] = []
        for transfer_id in done:
            staged = self._transfers.get(transfer_id)
            if staged is not None:
                staged.staged_ok += 1
                self._count_report(staged, finished)
        for transfer_id, kind in failed:
            staged = self._transfers.get(transfer_id)
            if staged is not None:
                staged.kind = staged.kind or kind or UNUSABLE
                self._count_report(staged, finished)
        if finished:
            self._finish(finished)

    def _count_report(self, staged: _Staged, finished: list[_Staged]) -> None:
        staged.left -= 1
        if staged.left <= 0:
            del self._transfers[staged.spec.transfer_id]
            finished.append(staged)

    def _finish(self, finished: Sequence[_Staged]) -> None:
        """These loads were reported by every rank: no longer in flight."""
        lineage = self.view.lineage
        refs: Refs = []
        for staged in finished:
            self.regions.landed(staged.spec.generation)
            if staged.lineage == lineage:
                refs.append(staged.ref)
            if staged.kind:
                if staged.staged_ok:  # the ranks that staged it hold it
                    self._drops.append(staged.spec.transfer_id)
                self._failed(staged, staged.kind, "")
            else:
                staged.state = _STAGED
                if self._items.get(staged.spec.mm_hash) is not staged or not staged.requests:
                    self._forget(staged, drop=True)
        self.view.finish(refs, lineage, self._send)

    def _failed(self, staged: _Staged, kind: str, reason: str) -> None:
        """A miss for its requests from now on; the entry is not staged again
        (for a while, unless its bytes were wrong)."""
        spec = staged.spec
        self.counts.load_failures += 1
        self.refusals.failed(staged.ref, kind, time.monotonic())
        log.error("ec-daemon: the load of %s (entry %d) failed (%s%s): its request(s) %s "
                  "encode it or fail, the engine goes on", spec.mm_hash, spec.entry_id, kind,
                  f": {reason}" if reason else "; see the worker's log",
                  ", ".join(sorted(staged.requests)) or "(none left)")
        if staged.requests:
            self._failed_for.setdefault(spec.mm_hash, set()).update(staged.requests)
        if self._items.get(spec.mm_hash) is staged:
            del self._items[spec.mm_hash]
            self.bytes -= spec.nbytes

    def _forget(self, staged: _Staged, *, drop: bool) -> None:
        """Out of the records (adopted, or dropped: the workers are told)."""
        spec = staged.spec
        if self._items.get(spec.mm_hash) is staged:
            del self._items[spec.mm_hash]
            self.bytes -= spec.nbytes
        if drop and staged.payload is None and staged.state == _STAGED:
            self._drops.append(spec.transfer_id)
        staged.payload = None

    def _expire_staged(self) -> None:
        """Staged loads no step adopted within ADOPT_STEPS are dropped (their
        requests stage them again when they are next scheduled)."""
        old = [s for s in self._items.values()
               if s.state == _STAGED and self.step - s.step >= ADOPT_STEPS]
        for staged in old:
            self._forget(staged, drop=True)

    def take_mismatches(self) -> Refs:
        """Entries whose bytes a load found wrong, since the previous call
        (for the daemon, which checks and hides them)."""
        return self.refusals.take_mismatches()

    def expire(self, now: float) -> None:
        """Loads whose ranks never all reported, after INFLIGHT_TTL_SECONDS."""
        stale = [s for s in self._transfers.values() if now - s.sent > INFLIGHT_TTL_SECONDS]
        for staged in stale:
            del self._transfers[staged.spec.transfer_id]
            log.warning("ec-daemon load %d of %s: %d rank report(s) missing after %.0fs; "
                        "releasing the entry", staged.spec.transfer_id, staged.spec.mm_hash,
                        staged.left, INFLIGHT_TTL_SECONDS)
            staged.kind = staged.kind or UNUSABLE
        if stale:
            self._finish(stale)

    def in_flight(self) -> bool:
        return bool(self._transfers)

    def keep(self, generation: int | None) -> frozenset[int]:
        """StepMetadata.keep while attached to region `generation`: those of
        the loads in flight and that one (`KeptRegions`)."""
        return self.regions.keep(generation)
