"""Scheduler delegate: what vLLM's scheduler side calls each step, on plain values.

Hot-path rules (docs/architecture.md, "The hit-to-load path"): nothing here
waits on the network but a cold miss's bounded wait for its answer
(`ec_client.scheduler_side.wants`), and a hit sends nothing. Lookups are
answered from the local `ReadyView`, and only while the session is fresh
(its heartbeats are echoed: see `session`).

Before vLLM schedules a request with media it asks `ensure`. An item the
view holds is *staged* (`ec_client.scheduler_side.staging`, which says why):
its load, with the entry's extents, stamp (entry_id), checksum, region and a
transfer id minted here, goes into this step's metadata, the request is
deferred, and every rank copies and verifies it into memory it keeps aside
and reports it through vLLM's worker metadata (`apply_worker_output`); the
view keeps the entry's eviction unacknowledged until every rank reported.
The next time vLLM asks, a staged item is a hit (`has_item`), and the step
that uses it adopts it (`after_alloc`, `build_step_metadata`). A load that
failed on any rank is a miss: the request encodes the item (or, without its
media, fails: the vLLM shell decides). Recency and load counts reach the
daemon as touches on the next heartbeat. Saves need nothing from the
scheduler.

An item the view does not hold is *wanted* (one stream message) and the
daemon answers: encode it (nobody else is), or wait for another engine's
save or a promotion from the second tier, which ends with a ready event
(then it is staged); a producer only claims what it encodes (never
deferred), and a consumer given an item without its media learns at once
when nobody will make it (`unobtainable`). What is asked and told, and every
bound on waiting for it, is `ec_client.scheduler_side.wants`'s. This is the
one wait on the scheduler's path, for a miss only, bounded per step; hits
never wait. Wants are sent only where they help: another engine shares the
namespace, or a second tier is on (the daemon says which).

Hits are answered only once every worker rank of the engine has mapped the
daemon's region (`ec_client.scheduler_side.rank_mapping` says why), and
only ranks of this engine instance count: the daemon counts only the ranks that
present the delegate's `engine_token` (`ec_client.engine_token`: derived
alike in the engine's processes, and in each step's metadata for workers
that could not derive it).

While detached (daemon down or restarting) every lookup misses and the view
is empty; the link re-attaches in the background and the view refills from
the new session's snapshot. A load dispatched before a restart still reads
the old region (workers keep it mapped; nobody reuses its pages). What each
of the link's events does is `ec_client.scheduler_side.attachment`'s; the
counters vLLM's stats and the heartbeat take, `ec_client.scheduler_side.stats`'s.

Threads: vLLM makes every per-step call from its one scheduling thread, so
the delegate's own state (staged loads, wants) is that thread's alone and
takes no lock. The only lock on a step is the view's, taken at the step
boundary when the step staged anything.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Container, Iterable

from ec_client.common.contract import LoadSpec, StepMetadata
from ec_client.common.limits import (
    DEFAULT_ANSWER_WAIT_SECONDS,
    DEFAULT_MAX_DEFER_SECONDS,
    DEFAULT_STAGING_BYTES,
    DEFAULT_VERIFY_CHECKSUM,
)
from ec_client.common.session import Attachment, LinkListener, SessionLink
from ec_client.common.wire import DaemonNews, EntryRef, Outgoing
from ec_client.scheduler_side.attachment import SchedulerAttachment
from ec_client.scheduler_side.rank_mapping import RankMapping
from ec_client.scheduler_side.staging import Stage, Staging
from ec_client.scheduler_side.stats import SchedulerStats
from ec_client.scheduler_side.view import ReadyView, Refs
from ec_client.scheduler_side.wants import Wants
from ec_protocol.protocol import (
    BOTH,
    LOADING_ROLES,
    MAX_BATCH,
    Layout,
    Role,
)
from ec_protocol.transport import DEFAULT_DEADLINE_SECONDS, Transport

log = logging.getLogger(__name__)


class SchedulerDelegate(LinkListener):
    def __init__(self, socket: str, *, engine_id: str, layout: Layout, role: Role = BOTH,
                 ranks: int = 1, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
                 client_name: str = "", token_file: str | None = None,
                 tls_ca: str | None = None, start: bool = True,
                 max_defer_seconds: float = DEFAULT_MAX_DEFER_SECONDS,
                 answer_wait_seconds: float = DEFAULT_ANSWER_WAIT_SECONDS,
                 metadata_type: type[StepMetadata] = StepMetadata,
                 world_size: int = 0, engine_token: str = "",
                 staging_bytes: int = DEFAULT_STAGING_BYTES,
                 workers_run_idle_steps: bool = True,
                 verify_checksum: bool = DEFAULT_VERIFY_CHECKSUM) -> None:
        """`ranks`: how many worker ranks stage (and report) each load.
        `world_size`: how many distinct worker ranks must have mapped the
        region before hits are answered (0: `ranks`; the daemon's count of
        what the ranks attached with, if larger).
        `engine_token`: this engine instance's secret (`ec_client.engine_token`),
        put in every step's metadata for its workers to present; empty: the
        daemon counts every rank attached under `engine_id` without one.
        `metadata_type`: what `build_step_metadata` returns (the vLLM
        connector's subclass, so the step's metadata is built once).
        `staging_bytes`: what the loads staged at once may hold (each rank's
        staging area is as large). `workers_run_idle_steps`: the workers see
        the metadata of a step that schedules no tokens (vLLM's Model Runner
        V2; its V1 runner does not: see `ec_client.scheduler_side.staging`).
        `verify_checksum`: loads staged in this process are checked against
        their entry's checksum (the workers check theirs when they are told
        to, `ec_daemon_verify_checksum`)."""
        self.role = role
        self.max_defer_seconds = max_defer_seconds
        self.can_load = role in LOADING_ROLES
        self.ranks = ranks
        self.world_size = world_size or ranks
        # Every worker rank mapped the session's region (EngineRanks, link thread).
        self.rank_mapping = RankMapping(self.world_size)
        self.engine_token = engine_token
        self.workers_run_idle_steps = workers_run_idle_steps
        self._metadata_type = metadata_type
        self.transport = Transport(socket, deadline_seconds, token_file=token_file,
                                   tls_ca=tls_ca)
        self.view = ReadyView()
        self.wants = Wants(self.view, self._send_items, max_defer_seconds=max_defer_seconds,
                           answer_wait_seconds=answer_wait_seconds)
        self.staging = Staging(self.view, self._send, ranks=ranks, limit_bytes=staging_bytes,
                               admit_seconds=max_defer_seconds, verify_checksum=verify_checksum)
        self.stats = SchedulerStats(self.view, self.staging, self.wants)
        # Which session hits are answered for, and what the link's events do.
        self.attached = SchedulerAttachment(
            self.transport, self._send, view=self.view, wants=self.wants, staging=self.staging,
            rank_mapping=self.rank_mapping, stats=self.stats)
        self._ids = itertools.count(1)
        self._next_expiry = 0.0
        self.link = SessionLink(
            self.transport, engine_id=engine_id, role=role, layout=layout, rank=None,
            client_name=client_name, listener=self, engine_token=engine_token)
        if start:
            self.link.start()

    # --------------------------------------------------- per-step calls

    def stage(self, mm_hash: str, request_id: str, now: float = 0.0) -> Stage:
        """Where request `request_id`'s item `mm_hash` stands: STAGED (a hit
        when vLLM asks), WAIT (its load is staging, or was planned now: defer
        the request), FAILED (it cannot be loaded: encode it, or fail a
        request without its media), ABSENT (not in the cache, or not
        loadable now: a miss)."""
        staged = self.staging.state(mm_hash, request_id, now)
        if staged is not None:
            return staged
        entry = self.view.get(mm_hash)
        if entry is None:
            return Stage.ABSENT
        # The attachment first: a re-attach clears the view before it
        # publishes the new one, so an entry is never paired with another
        # region. The other way round (a re-attach after `current` was read,
        # then the new view's entry) the epoch has moved by the time the
        # hit returns: not staged, since entry ids restart with the daemon
        # and the old region may carry the same stamp on other bytes.
        current = self.attached.current
        if current is None or not self.can_load or not self.link.fresh():
            return Stage.ABSENT
        if self.staging.refused(mm_hash, entry.entry_id, now or time.monotonic()):
            return Stage.FAILED
        if not self.staging.room(entry.nbytes):
            return Stage.ABSENT
        # A ready entry is not staged while the ranks map.
        hit = self.view.hit(mm_hash, current.epoch, self.rank_mapping.ready)
        if hit is None:
            return Stage.ABSENT
        spec = LoadSpec(mm_hash, next(self._ids), hit.entry_id, current.region.generation,
                        hit.nbytes, hit.shape, hit.dtype, hit.extents, hit.checksum)
        self.staging.plan(spec, current.region, current.lineage, request_id)
        return Stage.WAIT

    def has_item(self, mm_hash: str) -> bool:
        """Is `mm_hash` staged on every rank (vLLM's `has_cache_item`)? Local;
        a yes stays one until this step's `build_step_metadata`."""
        hit = self.staging.hit(mm_hash)
        self.view.count(hit)
        return hit

    @property
    def wanting(self) -> bool:
        """Are wants sent (`ensure`)? Another engine shares the namespace, or
        a second tier may hold what this host misses (the daemon says)."""
        return self.attached.wanting

    @property
    def mapped_ranks(self) -> tuple[int, int]:
        """(worker ranks of this engine instance the daemon counted with the
        region mapped, how many hits need), as last told."""
        return self.rank_mapping.seen

    def holds(self, mm_hash: str) -> bool:
        """Is `mm_hash` ready in the daemon, as far as this view knows (any
        role: a producer's view follows its namespace too)? Claims nothing."""
        return self.attached.current is not None and self.view.get(mm_hash) is not None

    def serving(self) -> bool:
        """Would a ready item be staged now? Attached and fresh, the
        snapshot in, and every worker rank mapped the region."""
        return self.attached.current is not None and self.rank_mapping.ready \
            and self.view.synced and self.link.fresh()

    def ensure(self, mm_hashes: Iterable[str], request_id: str = "") -> bool:
        """May request `request_id`, needing these items (each with its
        media), be scheduled now? False defers it (vLLM asks again next
        step): an item's load is staging (or was planned now), another
        engine or a promotion is making one, or the daemon has not answered
        yet. An item whose load failed goes ahead, as a miss. Waits only for
        the answers to items wanted here for the first time,
        `answer_wait_seconds` per step in all (`Wants`). A producer (it
        cannot load) claims the items it is about to encode and is never
        deferred."""
        if not self.can_load:
            if self.attached.producer_claims and self.attached.wanting and self.link.fresh():
                self.wants.claim(mm_hashes, request_id)  # (an older daemon refuses them)
            return True
        ready = True
        misses: list[str] = []
        now = time.monotonic()
        for mm_hash in mm_hashes:
            state = self.stage(mm_hash, request_id, now)
            if state is Stage.WAIT:
                ready = False
            elif state is Stage.ABSENT:
                misses.append(mm_hash)
        if misses and self.attached.wanting and self.rank_mapping.ready and self.link.fresh():
            view = self.view
            if not self.wants.ensure(misses, request_id):
                ready = False
            for mm_hash in misses:  # landed while the step waited for answers
                if view.get(mm_hash) is not None \
                        and self.stage(mm_hash, request_id, now) is Stage.WAIT:
                    ready = False
        return ready

    def unobtainable(self, mm_hashes: Iterable[str], request_id: str = "") -> list[str]:
        """Of these items, which this engine cannot encode (they came without
        media), those nobody will make: not ready, not being saved, claimed
        by no engine (a producer's save was dropped or refused, or the
        producer is gone). Asks the daemon about each once, whether or not
        another engine shares the namespace, and waits for the answers as
        `ensure` does. An item being made, or not answered yet, is not
        listed: the caller bounds that wait. Empty while detached or stale."""
        if not self.can_load or self.attached.current is None or not self.link.fresh():
            return []
        return self.wants.lost(mm_hashes, request_id)

    def request_finished(self, request_id: str, mm_hashes: Iterable[str]) -> None:
        """Request `request_id`, which needed these items, finished or was
        aborted: their staged loads no other request needs are dropped, and
        those this engine was to encode and did not start, or waits for, are
        released (a waiting engine encodes them at once instead of after its
        bound)."""
        mm_hashes = tuple(mm_hashes)
        self.staging.request_finished(request_id, mm_hashes)
        self.wants.request_finished(request_id, mm_hashes)

    def _send_items(self, field_name: str, mm_hashes: list[str]) -> None:
        """`mm_hashes` as the repeated `field_name` of stream messages."""
        for start in range(0, len(mm_hashes), MAX_BATCH):
            message = Outgoing()
            getattr(message, field_name).extend(mm_hashes[start:start + MAX_BATCH])
            self.link.send(message)

    def _send(self, acks: Refs) -> bool:
        """The view's acknowledgements, on the session stream."""
        return self.link.send_acks(acks)

    def after_alloc(self, request_id: str, mm_hash: str) -> bool:
        """vLLM allocated encoder space for this item; the step adopts its
        staged load if it was a hit. Returns True when the item is loaded."""
        if self.staging.adopt(mm_hash):
            return True
        self.wants.computing(mm_hash)  # computed by the engine (and saved by its worker)
        return False

    def build_step_metadata(self, scheduled: Container[str] | None = None,
                            tokens: int | None = None) -> StepMetadata:
        """The step's metadata: the loads planned this step (in flight in the
        view from now), the staged loads it adopts or drops. `tokens`: the
        tokens the step schedules (None: some); a step with none is not run
        by workers that do not run idle steps, so its loads are staged here.
        Items this engine was told to encode for requests none of which ran
        this step (none among the `scheduled` request ids) are offered to an
        engine that waits for them (`Wants.step_end`). Returns an instance
        of the delegate's `metadata_type`."""
        self.wants.step_end(scheduled)
        now = time.monotonic()
        if (self.staging.in_flight() or self.wants) and now >= self._next_expiry:
            self._next_expiry = now + 1.0
            self.staging.expire(now)
            self.wants.expire(now)
        attached = self.attached.current  # read once: the link thread may replace it
        metadata = self._metadata_type()
        metadata.engine_token = self.engine_token
        visible = tokens is None or tokens > 0 or self.workers_run_idle_steps
        self.staging.end_step(metadata, visible, self.view.lineage)
        if attached is None:
            metadata.keep = self.staging.keep(None)
        else:
            metadata.keep = self.staging.keep(attached.region.generation)
            metadata.namespace = attached.namespace
        mismatches = self.staging.take_mismatches()
        if mismatches:
            self._report_mismatches(mismatches)
        return metadata

    def _report_mismatches(self, refs: Refs) -> None:
        """Entries whose bytes a load found wrong: the daemon reads their
        pages itself and hides those that do not match (the next save of
        the key lands); it changes nothing on a report the pages contradict."""
        log.warning("ec-daemon: %d entr%s found with bytes that are not their writer's (told "
                    "to the daemon): %s", len(refs), "y" if len(refs) == 1 else "ies",
                    ", ".join(f"{h} (entry {e})" for h, e in refs[:8]))
        for start in range(0, len(refs), MAX_BATCH):
            self.link.send(Outgoing(mismatches=[
                EntryRef(h, e) for h, e in refs[start:start + MAX_BATCH]]))

    def apply_worker_output(self, done: Iterable[int] = (),
                            failed: Iterable[tuple[int, str]] = ()) -> None:
        """One report per rank and transfer: `done` staged and verified,
        `failed` (transfer id, what failed) must not be used: its requests
        encode the item, or fail without its media."""
        self.staging.reported(done, failed)

    def take_stats(self) -> Counter[str]:
        """Counters since the previous call (vLLM's connector stats)."""
        return self.stats.take()

    def close(self) -> None:
        self.link.stop()
        self.transport.close()
        self.staging.reader.close()

    # ------------------------------------------------- link callbacks

    # The link calls these on its thread (`LinkListener`); the attachment
    # (`ec_client.scheduler_side.attachment`) answers them.

    def opening_message(self, attachment: Attachment) -> Outgoing | None:
        return self.attached.opening_message(attachment)

    def on_attached(self, attachment: Attachment) -> None:
        self.attached.on_attached(attachment)

    def on_detached(self) -> None:
        self.attached.on_detached()

    def on_message(self, message: DaemonNews) -> None:
        self.attached.on_message(message)

    def beat_due(self) -> bool:
        return self.attached.beat_due()

    def heartbeat_message(self) -> Outgoing:
        return self.attached.heartbeat_message()
