"""The scheduler role's half of `ECDaemonConnector`, in the EngineCore.

`SchedulerRole` answers vLLM's scheduler-side connector calls over a
`SchedulerDelegate` (the cache's view, staged loads, the daemon's answers)
and `RequestItems` (what it knows of vLLM's own items): lookups, deferrals
while loads are staged, each step's metadata, the workers' reports, a
finished request's `ec_transfer_params`, and the engine's EC stats with the
`vllm:ec_daemon_attached` state. The connector's shell
(`ec_client.vllm_connector`) routes vLLM's calls here and never builds this
half in a worker process; the scheduler side is imported when it is built.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ec_client.common.limits import STATS_INTERVAL_SECONDS
from ec_client.engine_token import derived_engine_token, new_engine_token
from ec_client.vllm_items import RequestItems
from ec_client.vllm_metadata import ECDaemonConnectorMetadata, ECDaemonWorkerMetadata
from ec_client.vllm_metrics import ECDaemonStats, merge_stats

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from ec_client.common.settings import ConnectorSettings
    from ec_client.scheduler_side.scheduler import SchedulerDelegate
    from ec_protocol.protocol import Layout, Role


class SchedulerRole:
    def __init__(self, settings: ConnectorSettings, *, engine_id: str, layout: Layout,
                 role: Role, model_config: ModelConfig, instance_id: str, ranks: int,
                 world_size: int, workers_run_idle_steps: bool, producer: bool,
                 adapter_items: bool) -> None:
        """`ranks`: how many worker ranks report each load; `world_size`:
        how many load each hit (`ec_client.vllm_engine`); `producer`: it
        announces what its engine encoded; `adapter_items`: an item named
        `lora_name:mm_hash` is a LoRA adapter's, never cached."""
        from ec_client.scheduler_side.scheduler import (
            SchedulerDelegate,  # (never in a worker process)
        )

        self._producer = producer
        self._adapter_items = adapter_items
        self._worker_stats: dict[str, Any] = {}
        self._next_stats = 0.0
        # Requests with items from when vLLM first asks about them until they
        # finish: when none is left, the stats go out (get_ec_connector_stats).
        self._active: set[str] = set()
        # `vllm:ec_daemon_attached` as vLLM was last told (-1: not yet).
        self._attached_said = -1
        # What this side knows of vLLM's items.
        self._items = RequestItems(model_config, settings.max_defer_seconds)
        self.delegate: SchedulerDelegate = SchedulerDelegate(
            settings.socket, engine_id=engine_id, layout=layout, role=role,
            ranks=ranks, world_size=world_size,
            engine_token=derived_engine_token(engine_id, instance_id) or new_engine_token(),
            max_defer_seconds=settings.max_defer_seconds,
            answer_wait_seconds=settings.answer_wait_seconds,
            staging_bytes=settings.staging_bytes,
            workers_run_idle_steps=workers_run_idle_steps,
            verify_checksum=settings.verify_checksum,
            metadata_type=ECDaemonConnectorMetadata, **settings.transport)

    def _private(self, identifier: str) -> bool:
        """An item whose encoder output depends on a LoRA adapter."""
        return self._adapter_items and ":" in identifier

    def has_cache_item(self, identifier: str) -> bool:
        if self._adapter_items and ":" in identifier:  # (`_private`, inline: per lookup)
            return False
        return self.delegate.has_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """False defers the request a step: an item it still needs is in the
        cache and its load is being staged (it is a hit next time), or it is
        being made by another engine of this host or promoted from the second
        tier (bounded; see `SchedulerDelegate.ensure`), or came without media
        and is not in the cache yet (`RequestItems.fetched`: failed at once
        when nobody will make it). An item whose load failed is encoded, or
        fails a request without its media. A producer claims the items it is
        about to encode and is never deferred. Items
        already computed, or held in vLLM's encoder cache, need no transfer
        and are not asked about (vLLM asks every step, decodes included)."""
        scheduler = self.delegate
        request_id = request.request_id
        self._active.add(request_id)
        items, private = self._items, self._adapter_items
        # Only an item a producer announced can be metadata-only (vLLM asks
        # every step, for waiting requests again and again: one pass here).
        announced = bool(request.ec_transfer_params)
        encodable: list[str] = []
        fetch: list[str] = []
        for feature in request.mm_features:
            position = feature.mm_position
            mm_hash = feature.identifier
            if position.offset + position.length <= num_computed_tokens \
                    or (private and ":" in mm_hash) or items.held(mm_hash):
                continue
            if announced and items.metadata_only(request, feature):
                fetch.append(mm_hash)
            else:
                encodable.append(mm_hash)
        ready = not encodable or scheduler.ensure(encodable, request_id)
        fetched = not fetch or items.fetched(
            request_id, fetch, lambda mm_hash: scheduler.stage(mm_hash, request_id),
            scheduler.unobtainable)
        return ready and fetched

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._active.add(request.request_id)
        mm_hash = request.mm_features[index].identifier
        loaded = self.delegate.after_alloc(request.request_id, mm_hash)
        self._items.allocated(mm_hash, request.request_id, encoded=not loaded)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECDaemonConnectorMetadata:
        self._items.freed(scheduler_output.free_encoder_mm_hashes)  # as the workers drop them
        metadata = self.delegate.build_step_metadata(
            scheduler_output.num_scheduled_tokens, scheduler_output.total_num_scheduled_tokens)
        assert isinstance(metadata, ECDaemonConnectorMetadata)  # (metadata_type)
        return metadata

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(meta, ECDaemonWorkerMetadata):
            self.delegate.apply_worker_output(meta.done, meta.failed)
            if meta.dropped:
                self._items.saves_dropped(meta.dropped)
            if meta.stats:
                self._worker_stats = merge_stats(self._worker_stats, meta.stats)

    def take_unavailable_requests(self) -> set[str]:
        return self._items.take_unavailable()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Items the request was to have encoded here, or waited for, are
        released (an aborted request must not keep other engines waiting).
        A producer reports vLLM's `ec_transfer_params` for its items
        (`RequestItems.transfer_params`): a consumer given them with
        metadata-only items loads those from the cache. Metadata is announced
        only for an item the cache holds, or that this request encoded and
        whose save was not reported dropped: one dropped in this very step is
        not known yet, and the daemon tells a consumer that asks (see
        `RequestItems`)."""
        self._active.discard(request.request_id)
        if not request.mm_features:
            return False, None
        scheduler, items = self.delegate, self._items
        scheduler.request_finished(request.request_id,
                                   (f.identifier for f in request.mm_features))
        params = None
        if self._producer:
            reachable = scheduler.link.fresh()  # else its workers' saves were skipped
            params = items.transfer_params(request, lambda mm_hash: (
                reachable and not self._private(mm_hash)
                and items.announced(request.request_id, mm_hash, scheduler.holds)))
        items.finished(request)
        return False, params

    def get_ec_connector_stats(self) -> ECDaemonStats | None:
        """This engine's EC counters since the previous call (scheduler side:
        lookups, hits, loads; workers' saves and load times arrive through
        their metadata).

        vLLM asks in every step's `update_from_output`, and only there (its
        Scheduler, 0.32-0.34), after the step's finished requests and worker
        output; its logger and Prometheus sum what they get. A summary every
        STATS_INTERVAL_SECONDS keeps this off the hot path while requests
        with items run; the step in which the last of them finishes hands
        out all that is pending, since an engine that then idles is not
        asked again until its next request, and /metrics would lag by the
        last interval's counts meanwhile."""
        now = time.monotonic()
        attached = self._attached()
        paced = now < self._next_stats and bool(self._active)
        data: dict[str, Any] = {}
        if not paced:
            data = merge_stats(dict(self.delegate.take_stats()), self._worker_stats)
            data = merge_stats(data, self._items.take_stats())
            self._worker_stats = {}
            if any(data.values()):
                self._next_stats = now + STATS_INTERVAL_SECONDS
        if attached != self._attached_said:  # a state goes out at once, counts or not
            data["attached"] = self._attached_said = attached
        stats = ECDaemonStats(data=data)
        return None if stats.is_empty() else stats

    def _attached(self) -> int:
        """1 while the scheduler's session is attached and fresh (hits can be
        answered), else 0: `vllm:ec_daemon_attached`."""
        link = self.delegate.link
        return int(link.attachment is not None and link.fresh())

    def has_pending_push_work(self) -> bool:
        """True while `vllm:ec_daemon_attached` has changed and vLLM has not
        been told: vLLM asks for connector stats only inside a step, and an
        idle engine runs none, so this keeps its loop stepping (empty steps)
        until the stats that say it went out. vLLM asks every loop
        iteration: two attribute reads and a clock read."""
        return self._attached() != self._attached_said

    def close(self) -> None:
        self.delegate.close()
