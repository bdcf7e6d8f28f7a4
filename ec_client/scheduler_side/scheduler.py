"""Scheduler delegate: what vLLM's scheduler side calls each step, on plain values.

Hot-path rules (docs/architecture.md, "The hit-to-load path"): nothing here
waits on the network, and a hit sends nothing. Misses and hits are answered
from the local `ReadyView`, and only while the session is fresh (its
heartbeats are echoed: see `session`). A hit's load goes into the step
metadata with the entry's extents, its stamp (entry_id), its region and a
transfer id minted here; the view keeps the entry's eviction unacknowledged
until every rank reported that transfer through vLLM's worker metadata
(`apply_worker_output`). Recency and load counts reach the daemon as
touches on the next heartbeat. Saves need nothing from the scheduler.

Before vLLM schedules a request with media it asks `ensure`: an item the
view does not hold is *wanted* (one stream message) and the daemon answers:
encode it (nobody else is), or wait for another engine's save or a
promotion from the second tier, which ends with a ready event (then
`has_item` hits); a producer only claims what it encodes (never deferred),
and a consumer given an item without its media learns at once when nobody
will make it (`unobtainable`). What is asked and told, and every bound on
waiting for it, is `ec_client.scheduler_side.wants`'s. This is the one wait
on the scheduler's path, for a miss only, bounded per step; hits never
wait. Wants are sent only where they help: another engine shares the
namespace, or a second tier is on (the daemon says which).

Hits are answered only once every worker rank of the engine has mapped the
daemon's region (the daemon counts their open session streams and says so on
this stream): a rank that cannot map it (another container's /dev/shm,
another node) would fail the load, so the engine misses instead. Every rank
means `world_size` (vLLM: tp x pcp), whatever the ranks attached with, and
only ranks of this engine instance: the daemon counts only the ranks that
present the delegate's `engine_token` (`ec_client.engine_token`: derived
alike in the engine's processes, and in each step's metadata for workers
that could not derive it).

While detached (daemon down or restarting) every lookup misses and the view
is empty; the link re-attaches in the background and the view refills from
the new session's snapshot. A load dispatched before a restart still reads
the old region (workers keep it mapped; nobody reuses its pages).

Threads: vLLM makes every per-step call from its one scheduling thread, so
the delegate's own state (planned, dispatched and unavailable loads) is that
thread's alone and takes no lock. The only lock on a step is the view's,
taken at the step boundary when the step looked anything up.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ec_client.common.contract import LoadSpec, RegionInfo, StepMetadata
from ec_client.common.session import Attachment, LinkListener, SessionLink
from ec_client.common.settings import DEFAULT_ANSWER_WAIT_SECONDS, DEFAULT_MAX_DEFER_SECONDS
from ec_client.common.trust import attached_socket_owner, open_region
from ec_client.scheduler_side.view import ReadyView, Ref, Refs, ViewEntry
from ec_client.scheduler_side.wants import Wants
from ec_protocol.protocol import (
    BOTH,
    LOADING_ROLES,
    MAX_BATCH,
    Layout,
    Role,
    pb,
)
from ec_protocol.transport import DEFAULT_DEADLINE_SECONDS, Transport

log = logging.getLogger(__name__)

# A dispatched load whose ranks never all reported is given up after this
# (a backstop: vLLM returns every step's worker output, and a load takes
# milliseconds). Its eviction is then acknowledged, logged.
INFLIGHT_TTL_SECONDS = 120.0
# Ranks still not all mapped this long after an attach or a rank's loss is
# worth a warning (engines start their scheduler before their workers, and
# stop their workers first).
UNMAPPED_WARNING_SECONDS = 30.0
class _Current(NamedTuple):
    """The attachment hits are answered for, the view epoch it filled, the
    lineage its loads in flight count in, and its namespace."""

    region: RegionInfo
    epoch: int
    lineage: int
    namespace: str


@dataclass(slots=True)
class _Transfer:
    ref: Ref
    lineage: int
    generation: int
    left: int  # rank reports still to come
    request_ids: list[str]
    started: float
    failed: bool = False


class SchedulerDelegate(LinkListener):
    def __init__(self, socket: str, *, engine_id: str, layout: Layout, role: Role = BOTH,
                 ranks: int = 1, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
                 client_name: str = "", token_file: str | None = None,
                 tls_ca: str | None = None, start: bool = True,
                 max_defer_seconds: float = DEFAULT_MAX_DEFER_SECONDS,
                 answer_wait_seconds: float = DEFAULT_ANSWER_WAIT_SECONDS,
                 metadata_type: type[StepMetadata] = StepMetadata,
                 world_size: int = 0, engine_token: str = "") -> None:
        """`ranks`: how many worker ranks load (and report) each dispatched load.
        `world_size`: how many distinct worker ranks must have mapped the
        region before hits are answered (0: `ranks`; the daemon's count of
        what the ranks attached with, if larger).
        `engine_token`: this engine instance's secret (`ec_client.engine_token`),
        put in every step's metadata for its workers to present; empty: the
        daemon counts every rank attached under `engine_id` without one.
        `metadata_type`: what `build_step_metadata` returns (the vLLM
        connector's subclass, so the step's metadata is built once)."""
        self.role = role
        self.max_defer_seconds = max_defer_seconds
        self._wanting = False  # wants help here (NamespaceInfo, from the link thread)
        self._producer_claims = False  # the daemon takes a producer's wants (at attach)
        # Every worker rank mapped the session's region (EngineRanks, link thread).
        self._ranks_mapped = False
        self._ranks_seen = (0, 1)  # (mapped, needed), as last told
        self._unmapped_since: float | None = None  # warned about on a heartbeat past a bound
        self.can_load = role in LOADING_ROLES
        self.ranks = ranks
        self.world_size = world_size or ranks
        self.engine_token = engine_token
        self._metadata_type = metadata_type
        self.transport = Transport(socket, deadline_seconds, token_file=token_file,
                                   tls_ca=tls_ca)
        self.view = ReadyView()
        self.wants = Wants(self.view, self._send_items, max_defer_seconds=max_defer_seconds,
                           answer_wait_seconds=answer_wait_seconds)
        self._current: _Current | None = None
        self._ids = itertools.count(1)
        self._planned: dict[str, tuple[LoadSpec, list[str], _Current]] = {}
        self._dispatched: dict[int, _Transfer] = {}
        self._unavailable: set[str] = set()
        self._hits_this_step: dict[str, tuple[ViewEntry, _Current]] = {}
        self._loading: dict[int, int] = {}  # generation -> loads in flight
        self._keep: tuple[int | None, frozenset[int]] | None = None  # (current, keep)
        self._generation: int | None = None  # of the last attachment, kept while detached
        self._next_expiry = 0.0
        self._taken: dict[str, tuple[int, int]] = {}
        # Since the last take_stats (plain ints: the hot path counts them).
        self._loads = self._load_bytes = self._load_failures = 0
        self.link = SessionLink(
            self.transport, engine_id=engine_id, role=role, layout=layout, rank=None,
            client_name=client_name, listener=self, engine_token=engine_token)
        if start:
            self.link.start()

    # --------------------------------------------------- per-step calls

    def has_item(self, mm_hash: str) -> bool:
        """Is `mm_hash` cached and loadable? Local; a yes stays loadable
        until this step's `build_step_metadata`."""
        # The attachment first: a re-attach clears the view before it
        # publishes the new one, so a hit never pairs an old entry with a
        # new region. The other way round (a re-attach after `current` was
        # read, then the new view's entry) the epoch has moved by the time
        # the claim returns: a miss, since entry ids restart with the daemon
        # and the old region may carry the same stamp on other bytes.
        current = self._current
        if current is None or not self.can_load or not self.link.fresh():
            return False
        # A ready entry is a miss while the ranks map.
        entry = self.view.claim(mm_hash, current.epoch, self._ranks_mapped)
        if entry is None:
            return False
        self._hits_this_step[mm_hash] = (entry, current)
        return True

    @property
    def wanting(self) -> bool:
        """Are wants sent (`ensure`)? Another engine shares the namespace, or
        a second tier may hold what this host misses (the daemon says)."""
        return self._wanting

    @property
    def mapped_ranks(self) -> tuple[int, int]:
        """(worker ranks of this engine instance the daemon counted with the
        region mapped, how many hits need), as last told."""
        return self._ranks_seen

    def holds(self, mm_hash: str) -> bool:
        """Is `mm_hash` ready in the daemon, as far as this view knows (any
        role: a producer's view follows its namespace too)? Claims nothing."""
        return self._current is not None and self.view.get(mm_hash) is not None

    def serving(self) -> bool:
        """Would a lookup of a ready item hit now? Attached and fresh, the
        snapshot in, and every worker rank mapped the region."""
        return self._current is not None and self._ranks_mapped and self.view.synced \
            and self.link.fresh()

    def ensure(self, mm_hashes: Iterable[str], request_id: str = "") -> bool:
        """May request `request_id`, needing these items, be scheduled now?
        False defers it (vLLM asks again next step): another engine or a
        promotion is making an item, or the daemon has not answered yet.
        Waits only for the answers to items wanted here for the first time,
        `answer_wait_seconds` per step in all. Items this engine was told to
        encode are offered to waiting engines at the step's end if no request
        needing them ran (`build_step_metadata`); `request_finished` releases
        them. A producer (it cannot load) claims the items it is about to
        encode and is never deferred."""
        if not self._wanting or not self.link.fresh():
            return True
        if not self.can_load:
            if self._producer_claims:  # (an older daemon refuses a producer's wants)
                self.wants.claim(mm_hashes, request_id)
            return True
        if not self._ranks_mapped:
            return True
        return self.wants.ensure(mm_hashes, request_id)

    def unobtainable(self, mm_hashes: Iterable[str], request_id: str = "") -> list[str]:
        """Of these items, which this engine cannot encode (they came without
        media), those nobody will make: not ready, not being saved, claimed
        by no engine (a producer's save was dropped or refused, or the
        producer is gone). Asks the daemon about each once, whether or not
        another engine shares the namespace, and waits for the answers as
        `ensure` does. An item being made, or not answered yet, is not
        listed: the caller bounds that wait. Empty while detached or stale."""
        if not self.can_load or self._current is None or not self.link.fresh():
            return []
        return self.wants.lost(mm_hashes, request_id)

    def request_finished(self, request_id: str, mm_hashes: Iterable[str]) -> None:
        """Request `request_id`, which needed these items, finished or was
        aborted: those no other request of this engine needs, that this
        engine was to encode and did not start, or waits for, are released
        (a waiting engine encodes them at once instead of after its bound)."""
        self.wants.request_finished(request_id, mm_hashes)

    def _send_items(self, field_name: str, mm_hashes: list[str]) -> None:
        """`mm_hashes` as the repeated `field_name` of stream messages."""
        for start in range(0, len(mm_hashes), MAX_BATCH):
            message = pb.ClientMessage()
            getattr(message, field_name).extend(mm_hashes[start:start + MAX_BATCH])
            self.link.send(message)

    def after_alloc(self, request_id: str, mm_hash: str) -> bool:
        """vLLM allocated encoder space for this item; plan its load if it
        was a hit. Returns True when the item will be loaded."""
        planned = self._planned.get(mm_hash)
        if planned is not None:
            planned[1].append(request_id)
            return True
        hit = self._hits_this_step.get(mm_hash)
        if hit is None:  # computed by the engine (and saved by its worker)
            self.wants.computing(mm_hash)
            return False
        entry, current = hit
        spec = LoadSpec(mm_hash, next(self._ids), entry.entry_id, current.region.generation,
                        entry.nbytes, entry.shape, entry.dtype, entry.extents, entry.checksum)
        self._planned[mm_hash] = (spec, [request_id], current)
        return True

    def build_step_metadata(self, scheduled: Container[str] | None = None) -> StepMetadata:
        """The step's loads; marks them in flight in the view (which then
        withholds their evictions' acknowledgements). Items this engine was
        told to encode for requests none of which ran this step (none among
        the `scheduled` request ids: no KV room, no budget, waiting for
        another item; with None, any not being encoded) are offered to an
        engine that waits for them (`yields`): it encodes, this one waits.
        Returns an instance of the delegate's `metadata_type`."""
        self.wants.step_end(scheduled)
        if self._hits_this_step:
            self._hits_this_step.clear()
        now = time.monotonic()
        if (self._dispatched or self.wants) and now >= self._next_expiry:
            self._expire(now)
        view, attached = self.view, self._current  # read once: the link thread may replace it
        metadata = self._metadata_type()
        metadata.engine_token = self.engine_token
        lineage = view.lineage
        planned = self._planned
        if not planned:
            view.end_step((), lineage, self._send)
        else:
            self._planned = {}
            loads, regions, dispatched = metadata.loads, metadata.regions, self._dispatched
            loading, ranks = self._loading, self.ranks
            in_view: Refs = []  # loads the view counts (older ones: see has_item)
            nbytes = 0
            for spec, request_ids, current in planned.values():
                ref = (spec.mm_hash, spec.entry_id)
                generation = spec.generation
                dispatched[spec.transfer_id] = _Transfer(ref, current.lineage, generation,
                                                         ranks, request_ids, now)
                count = loading.get(generation, 0)
                loading[generation] = count + 1
                if not count:
                    self._keep = None
                if current.lineage == lineage:
                    in_view.append(ref)
                loads.append(spec)
                regions[generation] = current.region
                nbytes += spec.nbytes
            view.end_step(in_view, lineage, self._send)
            self._loads += len(loads)
            self._load_bytes += nbytes
        if attached is None:
            metadata.keep = self._keep_now(None)
        else:
            metadata.keep = self._keep_now(attached.region.generation)
            metadata.namespace = attached.namespace
        return metadata

    def apply_worker_output(self, done: Iterable[int] = (),
                            failed: Iterable[int] = ()) -> None:
        """One report per rank and transfer: `done` landed and verified,
        `failed` must not be used (their requests become unavailable)."""
        failed = tuple(failed)
        for transfer_id in failed:
            transfer = self._dispatched.get(transfer_id)
            if transfer is not None and not transfer.failed:
                transfer.failed = True
                self._unavailable.update(transfer.request_ids)
                self._load_failures += 1
        finished: list[_Transfer] = []
        self._reported(failed, finished)
        self._reported(done, finished)
        if finished:
            self._finish(finished)

    def take_unavailable_requests(self) -> set[str]:
        if not self._unavailable:
            return set()
        taken, self._unavailable = self._unavailable, set()
        return taken

    def take_stats(self) -> Counter[str]:
        """Counters since the previous call (vLLM's connector stats)."""
        lookups, hits = self._counts_since("stats")
        stats = Counter(lookups=lookups, hits=hits, loads=self._loads,
                        load_bytes=self._load_bytes, load_failures=self._load_failures,
                        **self.wants.take_stats())
        self._loads = self._load_bytes = self._load_failures = 0
        return +stats  # without zero counts

    def close(self) -> None:
        self.link.stop()
        self.transport.close()

    # ------------------------------------------------------------ helpers

    def _reported(self, transfer_ids: Iterable[int], finished: list[_Transfer]) -> None:
        """One rank reported each of `transfer_ids`; those all ranks reported
        go to `finished`."""
        dispatched = self._dispatched
        for transfer_id in transfer_ids:
            transfer = dispatched.get(transfer_id)
            if transfer is None:
                continue
            transfer.left -= 1
            if transfer.left <= 0:
                del dispatched[transfer_id]
                finished.append(transfer)

    def _finish(self, transfers: list[_Transfer]) -> None:
        """These loads landed on every rank: the view may acknowledge."""
        lineage = self.view.lineage
        loading = self._loading
        refs: Refs = []
        for transfer in transfers:
            left = loading.get(transfer.generation, 0) - 1
            if left > 0:
                loading[transfer.generation] = left
            elif loading.pop(transfer.generation, None) is not None:
                self._keep = None  # the generation left StepMetadata.keep
            if transfer.lineage == lineage:
                refs.append(transfer.ref)
        self.view.finish(refs, lineage, self._send)

    def _keep_now(self, generation: int | None) -> frozenset[int]:
        """StepMetadata.keep while attached to region `generation`, rebuilt
        only when it changed."""
        cached = self._keep
        if cached is not None and cached[0] == generation:
            return cached[1]
        keep = frozenset(self._loading) | ({generation} if generation is not None else set())
        self._keep = (generation, keep)
        return keep

    def _counts_since(self, reader: str) -> tuple[int, int]:
        """(lookups, hits) since `reader` last asked; each reader (the
        heartbeat, vLLM's stats) sees every lookup once."""
        counts = self.view.counts()
        taken = self._taken.get(reader, (0, 0))
        self._taken[reader] = counts
        return counts[0] - taken[0], counts[1] - taken[1]

    def _expire(self, now: float) -> None:
        self._next_expiry = now + 1.0
        self.wants.expire(now)
        stale = [t for t, x in self._dispatched.items()
                 if now - x.started > INFLIGHT_TTL_SECONDS]
        for transfer_id in stale:
            transfer = self._dispatched.pop(transfer_id)
            log.warning("ec-daemon load %d of %s: %d rank report(s) missing after %.0fs; "
                        "releasing the entry", transfer_id, transfer.ref[0], transfer.left,
                        INFLIGHT_TTL_SECONDS)
            self._finish([transfer])

    # ------------------------------------------------- link callbacks

    def opening_message(self, attachment: Attachment) -> Any:
        """The new session's first message: when its region is the one this
        view loaded from (a restarted daemon adopted it), the loads still in
        flight (`holds`), so the daemon keeps their pages for this session
        before it lets the previous daemon's ghost of this engine go. At most
        MAX_BATCH distinct entries: far more than one engine loads at once."""
        if attachment.region.generation != self._generation:
            return None
        loading = self.view.loading()
        if len(loading) > MAX_BATCH:
            log.warning("ec-daemon: %d entries loading across the restart; %d declared",
                        len(loading), MAX_BATCH)
        return pb.ClientMessage(holds=[pb.EntryRef(mm_hash=h, entry_id=e)
                                       for h, e in loading[:MAX_BATCH]])

    def on_attached(self, attachment: Attachment) -> None:
        """A new session: the view starts over. When the region is the one
        this view loaded from (a restarted daemon adopted it), loads in flight
        stay counted (they were declared in the opening message)."""
        owner = attached_socket_owner(self.transport.uri)  # a stranger's socket raises
        # Hits are answered only for a region this host's workers can map: a
        # region missing here (a client left in a restarted container's old
        # /dev/shm) or not the daemon's raises, and the link tries again later.
        os.close(open_region(attachment.region.path, owner))
        self._wanting = False  # until the new session's NamespaceInfo
        self._producer_claims = attachment.producer_claims
        self._ranks_mapped = False  # until the new session's EngineRanks
        self._unmapped_since = time.monotonic()  # said on a heartbeat if it lasts
        self.wants.clear()  # answers of the old daemon mean nothing to the new one
        same_region = attachment.region.generation == self._generation
        self._generation = attachment.region.generation
        self.view.clear(keep_loads=same_region)
        self._current = _Current(attachment.region, self.view.epoch, self.view.lineage,
                                 attachment.namespace)
        log.info("ec-daemon scheduler session %d attached (generation %016x%s, namespace %r)",
                 attachment.index, attachment.region.generation,
                 ", the same region" if same_region else "", attachment.namespace)

    def on_detached(self) -> None:
        self._current = None
        self._wanting = False
        self._ranks_mapped = False
        # Loads in flight stay counted until the next attachment says whether
        # its region is the same one.
        self.view.clear(keep_loads=True)

    def on_message(self, message: Any) -> None:
        self.view.apply(message, self._send)  # ready events before the answers
        if message.answers:
            self.wants.answered(message.answers)
        if message.HasField("namespace_info"):
            info = message.namespace_info
            wanting = info.engines > 1 or info.remote_tier
            if wanting != self._wanting:
                log.info("ec-daemon: %d engine(s) share this namespace%s: misses %s asked about",
                         info.engines, ", a second tier is on" if info.remote_tier else "",
                         "are" if wanting else "are no longer")
            self._wanting = wanting
        if message.HasField("ranks"):
            self._ranks_changed(message.ranks.mapped, message.ranks.world_size)

    def _ranks_changed(self, mapped: int, world_size: int) -> None:
        """The daemon counted `mapped` distinct worker ranks of this engine
        instance (of a world of `world_size`, as they attached) with the
        region mapped; this engine needs its own `world_size` of them."""
        needed = max(self.world_size, world_size, 1)
        ready = mapped >= needed
        self._ranks_seen = (mapped, needed)
        if ready and not self._ranks_mapped:
            log.info("ec-daemon: all %d worker ranks mapped the region; hits are answered", mapped)
            self._unmapped_since = None
        elif not ready and self._ranks_mapped:  # a rank went away (or the engine stops)
            self._unmapped_since = time.monotonic()  # said on a heartbeat if it lasts
        self._ranks_mapped = ready

    def _unmapped_warning(self) -> None:
        mapped, needed = self._ranks_seen
        log.warning("ec-daemon: %d of %d worker ranks mapped the region; every lookup misses "
                    "until all have (a rank in another /dev/shm, container or node cannot load "
                    "from this daemon)", mapped, needed)

    def _send(self, acks: Refs) -> bool:
        return self.link.send_acks(acks)

    def beat_due(self) -> bool:
        """Loads to touch: the daemon's LRU hears of them within
        EARLY_BEAT_SECONDS, not a whole heartbeat interval later."""
        return self.view.has_touches()

    def heartbeat_message(self) -> Any:
        since = self._unmapped_since
        if since is not None and not self._ranks_mapped \
                and time.monotonic() - since > UNMAPPED_WARNING_SECONDS:
            self._unmapped_since = None  # once per attachment (or per rank lost)
            self._unmapped_warning()
        lookups, hits = self._counts_since("heartbeat")
        touches = self.view.take_touches()
        return pb.ClientMessage(
            heartbeat=pb.Heartbeat(lookups=lookups, hits=hits),
            touches=[pb.Touch(mm_hash=h, entry_id=e, loads=n) for h, e, n in touches])
