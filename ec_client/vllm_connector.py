"""ECDaemonConnector: vLLM's EC connector over ec-daemon.

A thin role-routed shell, as vLLM's own connectors are: the SCHEDULER role
(in EngineCore) builds a `SchedulerDelegate`, the WORKER role (in each worker
process) a `WorkerDelegate`; each forwards vLLM's calls with plain values.
vLLM is imported only in this module (and `vllm_namespace`, `vllm_metrics`, `vllm_items`,
`vllm_plugin`, `vllm_names`: every vLLM name they use is listed there).

    vllm serve MODEL --ec-transfer-config '{
      "ec_connector": "ECDaemonConnector",
      "ec_connector_module_path": "ec_client.vllm_connector",
      "ec_role": "ec_both",
      "ec_connector_extra_config": {"ec_daemon_socket": "unix:///run/ec-daemon/ec.sock"}}'

The module path may be left out: the package's vLLM plugin (`vllm_plugin`)
registers the name with vLLM's connector factory. So may the socket (here
the systemd unit's): the default is the daemon's default socket.

Extra-config keys (all optional): `ec_client.common.settings` declares them, with
their defaults and meaning (docs/vllm.md's table is printed from it).

Loads are staged a step before the step that uses them
(`ec_client.scheduler_side.staging` says why): `ensure_cache_available`
finds an item in the cache, puts its load (extents, stamp, checksum, region)
into the step's metadata and defers the request; every worker rank copies
it into memory it keeps aside, verifies it, and reports it in its worker
metadata, which vLLM aggregates over the ranks into
`update_connector_output` (the scheduler's view keeps the entry's eviction
unacknowledged until all ranks reported). The next time vLLM asks, the item
is a hit, and the step that uses it moves the staged output into vLLM's
encoder cache (`adopt`). A load any rank could not use (its pages reused or
rewritten by another process, a bogus entry, a region it cannot map) is a
miss: vLLM encodes the item, or a request without its media fails through
`take_unavailable_requests`; the engine goes on. No load involves the daemon.

The namespace is the layout fingerprint every process of an engine computes
alike at construction (`ec_client.vllm_namespace` says what it holds).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from ec_client.common.contract import StepMetadata
from ec_client.common.limits import STATS_INTERVAL_SECONDS
from ec_client.common.settings import ConnectorSettings
from ec_client.engine_token import derived_engine_token, new_engine_token
from ec_client.ranks import LoadingRank, loading_rank, loading_world
from ec_client.vllm_items import RequestItems
from ec_client.vllm_metrics import ECDaemonPromMetrics, ECDaemonStats, merge_stats
from ec_client.vllm_namespace import engine_identity, layout_of
from ec_protocol.protocol import (
    BOTH,
    CONSUMER,
    PRODUCER,
    Layout,
    Role,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from ec_client.scheduler_side.scheduler import SchedulerDelegate
    from ec_client.worker_side.worker import WorkerDelegate

# Under "vllm", the one logger vLLM gives a handler and level: outside it
# the start-up line below (the namespace, the weights' identity) was dropped.
logger = init_logger(f"vllm.{__name__}")


def _log_through_vllm() -> None:
    """The client library's own loggers (the session link, the scheduler and
    worker delegates) log through vLLM's handler and level too, unless the
    application configured logging itself: their INFO lines (attached,
    every rank mapped, the namespace shared) were dropped before."""
    vllm_logger = logging.getLogger("vllm")
    if logging.getLogger().handlers or not vllm_logger.handlers:
        return
    for name in ("ec_client", "ec_protocol"):
        library = logging.getLogger(name)
        if library.handlers:
            continue
        for handler in vllm_logger.handlers:
            library.addHandler(handler)
        library.setLevel(vllm_logger.level)
        library.propagate = False


_log_through_vllm()

ROLES: dict[str, Role] = {"ec_producer": PRODUCER, "ec_consumer": CONSUMER, "ec_both": BOTH}


@dataclass
class ECDaemonConnectorMetadata(StepMetadata, ECConnectorMetadata):
    """Scheduler -> workers each step: `StepMetadata` (the loads, with
    extents, the regions they name by generation, the generations to keep
    mapped, the namespace) as vLLM's metadata type. The scheduler delegate
    builds it directly (`metadata_type`): no copy per step."""


@dataclass
class ECDaemonWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler each step: one entry per rank and transfer staged
    (`done`) or not (`failed`: with what failed), the items whose save ended
    without an entry (`dropped`: the scheduler's producer announces no
    metadata for them), and the worker's counters (vLLM aggregates over the
    ranks)."""

    done: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    failed: list[tuple[int, str]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, ECDaemonWorkerMetadata)
        self.done.extend(other.done)
        self.failed.extend(other.failed)
        self.dropped.extend(other.dropped)
        self.stats = merge_stats(self.stats, other.stats)
        return self


class ECDaemonConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        assert ec is not None
        self.settings = ConnectorSettings.from_extra_config(ec.ec_connector_extra_config or {})
        self._ec_role: Role = ROLES.get(str(ec.ec_role), BOTH)
        self._scheduler: SchedulerDelegate | None = None
        self._worker: WorkerDelegate | None = None
        self._worker_stats: dict[str, Any] = {}
        self._next_stats = 0.0
        # Requests with items from when vLLM first asks about them until they
        # finish: when none is left, the stats go out (get_ec_connector_stats).
        self._active: set[str] = set()
        # `vllm:ec_daemon_attached` as vLLM was last told (-1: not yet).
        self._attached_said = -1
        self._done: list[int] = []
        self._failed: list[tuple[int, str]] = []
        self._load_seconds: list[float] = []
        lora = vllm_config.lora_config
        # vLLM names an item `lora_name:mm_hash` when a LoRA adapter changes the
        # encoder (tower/connector LoRA): an adapter retrained under the same
        # name would be served its predecessor's outputs, so such items are
        # never cached.
        self._adapter_items = bool(lora is not None
                                   and getattr(lora, "enable_tower_connector_lora", False))
        # The scheduler side's knowledge of vLLM's items (unused by workers).
        self._items = RequestItems(vllm_config.model_config, self.settings.max_defer_seconds)
        layout = layout_of(vllm_config, self.settings.namespace, self.settings.weights_id,
                           self.settings)
        engine_id = engine_identity(vllm_config)
        if role == ECConnectorRole.SCHEDULER:
            from ec_client.scheduler_side.scheduler import (
                SchedulerDelegate,  # (never in a worker process)
            )

            self._scheduler = SchedulerDelegate(
                self.settings.socket, engine_id=engine_id, layout=layout, role=self._ec_role,
                ranks=expected_reports(vllm_config), world_size=_loading_world(vllm_config),
                engine_token=derived_engine_token(engine_id, vllm_config.instance_id)
                or new_engine_token(),
                max_defer_seconds=self.settings.max_defer_seconds,
                answer_wait_seconds=self.settings.answer_wait_seconds,
                staging_bytes=self.settings.staging_bytes,
                workers_run_idle_steps=workers_run_idle_steps(vllm_config),
                verify_checksum=self.settings.verify_checksum,
                metadata_type=ECDaemonConnectorMetadata, **self.settings.transport)
        elif role == ECConnectorRole.WORKER:
            self._worker = self._make_worker(vllm_config, engine_id, layout)
        else:
            raise ValueError(f"unknown ECConnectorRole {role}")
        logger.info("ECDaemonConnector %s for engine %s on %s (%s)", role.name, engine_id,
                    self.settings.socket, layout)

    @property
    def scheduler_delegate(self) -> SchedulerDelegate | None:
        """The scheduler role's delegate (None in a worker process)."""
        return self._scheduler

    @property
    def worker_delegate(self) -> WorkerDelegate | None:
        """The worker role's delegate (None in the scheduler's process)."""
        return self._worker

    def _make_worker(self, vllm_config: VllmConfig, engine_id: str,
                     layout: Layout) -> WorkerDelegate:
        # Deferred: the worker path may import CUDA libraries.
        from ec_client.copy import get_backend
        from ec_client.worker_side.worker import WorkerDelegate

        rank, world = _loading_rank(vllm_config)
        backend = get_backend(self.settings.copy_backend)
        check_backend_device(self.settings.copy_backend, backend.device,
                             _worker_device(str(vllm_config.device_config.device_type)))
        # Loads land in the backend's `empty`: on the worker's device, ordered
        # for the backend's copy stream (the cpu backend's are host arrays).
        return WorkerDelegate(
            self.settings.socket, engine_id=engine_id, layout=layout, rank=rank,
            world_size=world, role=self._ec_role, backend=backend,
            engine_token=derived_engine_token(engine_id, vllm_config.instance_id),
            save_queue_bytes=self.settings.save_queue_bytes, hold_saves=True,
            staging_bytes=self.settings.staging_bytes,
            verify_checksum=self.settings.verify_checksum, **self.settings.transport)

    def _private(self, identifier: str) -> bool:
        """An item whose encoder output depends on a LoRA adapter."""
        return self._adapter_items and ":" in identifier

    # ------------------------------------------------------------ worker

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        """A step begins (the worker's side): while it runs, the regions its
        metadata says the scheduler may still load from stay mapped."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata,
                                                   ECDaemonConnectorMetadata):
            self._worker.regions.step(connector_metadata.keep)
            self._worker.join(connector_metadata.engine_token)
            self._worker.follow_scheduler(connector_metadata.namespace)

    def clear_connector_metadata(self) -> None:
        """The step ended."""
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.regions.step_done()

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Before the step's forward: the staged loads it uses go into vLLM's
        encoder cache, those no step will use are dropped, and the loads it
        planned are staged (copied, verified, kept aside) and reported. A
        load that fails is reported, never raised: its request encodes the
        item or fails, and nothing unverified enters the encoder cache."""
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ECDaemonConnectorMetadata)
        worker = self._worker
        if metadata.adopt or metadata.inline:
            self._adopt(metadata, encoder_cache)
        if metadata.drop:
            worker.drop(metadata.drop)
        if not metadata.loads:
            return
        started = time.perf_counter()
        result = worker.stage(metadata.loads, metadata.regions, metadata.step)
        self._load_seconds.append(time.perf_counter() - started)
        self._done.extend(result.done)
        self._failed.extend((t, result.kinds[t]) for t in result.failed)

    def _adopt(self, metadata: ECDaemonConnectorMetadata,
               encoder_cache: dict[str, torch.Tensor]) -> None:
        """This step's hits into vLLM's encoder cache: staged here, or carried
        whole (`inline`). An item vLLM's encoder cache still holds keeps its
        tensor (vLLM's contract, as its example connector does): the
        scheduler can adopt a load for one it evicted and re-allocated in the
        same pass, which the worker never freed."""
        assert self._worker is not None
        worker = self._worker
        for adopt in metadata.adopt:
            output = worker.adopt(adopt.transfer_id)
            if adopt.mm_hash in encoder_cache:
                continue
            if output is None:  # every rank reported it staged: never
                raise RuntimeError(
                    f"ec-daemon: the staged load {adopt.transfer_id} of {adopt.mm_hash} is not "
                    "on this rank (a bug; or an executor that hands the scheduler one rank's "
                    "reports only, and this rank failed to stage it)")
            encoder_cache[adopt.mm_hash] = torch.as_tensor(output)  # (no copy: numpy from cpu)
        for inline in metadata.inline:
            if inline.mm_hash not in encoder_cache:
                encoder_cache[inline.mm_hash] = _from_payload(inline, worker.backend.device)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str,
                    **kwargs: Any) -> None:
        assert self._worker is not None
        if self.is_producer and not self._private(mm_hash):
            self._worker.save(mm_hash, encoder_cache[mm_hash])

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        # Load times from one rank only: every rank loads the same entries.
        stats = self._worker.take_stats(self._load_seconds if self._worker.rank == 0 else None)
        self._load_seconds = []
        dropped = self._worker.take_dropped()
        if not self._done and not self._failed and not stats and not dropped:
            return None
        meta = ECDaemonWorkerMetadata(self._done, stats, self._failed, dropped)
        self._done, self._failed = [], []
        return meta

    # --------------------------------------------------------- scheduler

    def has_cache_item(self, identifier: str) -> bool:
        assert self._scheduler is not None
        if self._adapter_items and ":" in identifier:  # (`_private`, inline: per lookup)
            return False
        return self._scheduler.has_item(identifier)

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
        scheduler = self._scheduler
        if scheduler is None:
            return True
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
        assert self._scheduler is not None
        self._active.add(request.request_id)
        mm_hash = request.mm_features[index].identifier
        loaded = self._scheduler.after_alloc(request.request_id, mm_hash)
        self._items.allocated(mm_hash, request.request_id, encoded=not loaded)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        assert self._scheduler is not None
        self._items.freed(scheduler_output.free_encoder_mm_hashes)  # as the workers drop them
        metadata = self._scheduler.build_step_metadata(
            scheduler_output.num_scheduled_tokens, scheduler_output.total_num_scheduled_tokens)
        assert isinstance(metadata, ECDaemonConnectorMetadata)  # (metadata_type)
        return metadata

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        if self._scheduler is None:
            return
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(meta, ECDaemonWorkerMetadata):
            self._scheduler.apply_worker_output(meta.done, meta.failed)
            if meta.dropped:
                self._items.saves_dropped(meta.dropped)
            if meta.stats:
                self._worker_stats = merge_stats(self._worker_stats, meta.stats)

    def take_unavailable_requests(self) -> set[str]:
        if self._scheduler is None:
            return set()
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
        if self._scheduler is None or not request.mm_features:
            return False, None
        scheduler, items = self._scheduler, self._items
        scheduler.request_finished(request.request_id,
                                   (f.identifier for f in request.mm_features))
        params = None
        if self.is_producer:
            reachable = scheduler.link.fresh()  # else its workers' saves were skipped
            params = items.transfer_params(request, lambda mm_hash: (
                reachable and not self._private(mm_hash)
                and items.announced(request.request_id, mm_hash, scheduler.holds)))
        items.finished(request)
        return False, params

    # ------------------------------------------------------------ metrics

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
        if self._scheduler is None:
            return None
        now = time.monotonic()
        attached = self._attached()
        paced = now < self._next_stats and bool(self._active)
        data: dict[str, Any] = {}
        if not paced:
            data = merge_stats(dict(self._scheduler.take_stats()), self._worker_stats)
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
        assert self._scheduler is not None
        link = self._scheduler.link
        return int(link.attachment is not None and link.fresh())

    def has_pending_push_work(self) -> bool:
        """True while `vllm:ec_daemon_attached` has changed and vLLM has not
        been told: vLLM asks for connector stats only inside a step, and an
        idle engine runs none, so this keeps its loop stepping (empty steps)
        until the stats that say it went out. vLLM asks every loop
        iteration: two attribute reads and a clock read."""
        return self._scheduler is not None and self._attached() != self._attached_said

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECDaemonStats:
        return ECDaemonStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ECDaemonPromMetrics:
        return ECDaemonPromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    # ------------------------------------------------------------ shared

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()


def workers_run_idle_steps(vllm_config: VllmConfig) -> bool:
    """Do this engine's workers run the EC connector in a step that schedules
    no tokens? Model Runner V2 does (`ActiveECConnector.no_forward`), the V1
    model runner does not (its `execute_model` returns before the connector's
    context). vLLM 0.34 has only V2; 0.32 and 0.33 choose per engine
    (`VllmConfig.use_v2_model_runner`: the environment, Triton, features),
    alike in the scheduler's process and its workers'."""
    chooses = getattr(type(vllm_config), "use_v2_model_runner", None)
    return chooses is None or bool(vllm_config.use_v2_model_runner)


def _from_payload(inline: Any, device: str) -> torch.Tensor:
    """An inline load's bytes as a tensor of its shape and dtype on `device`."""
    dtype = getattr(torch, inline.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {inline.dtype!r}")  # (the scheduler read it: never)
    payload = inline.payload
    if not payload:
        return torch.empty(inline.shape, dtype=dtype, device=device)
    # (A bytearray: writable, so torch takes it without a copy.)
    tensor = torch.frombuffer(payload if isinstance(payload, bytearray) else bytearray(payload),
                              dtype=dtype).reshape(inline.shape)
    return tensor if device == "cpu" else tensor.to(device)


def check_backend_device(name: str, backend_device: str, worker_device: str) -> None:
    """Raise ValueError when the copy backend cannot serve this worker's
    device (`worker_device`: "cuda:1", or the type alone where no index is
    known): its loads would put tensors of another device, or another GPU,
    into vLLM's encoder cache, and its saves would fail on every output."""
    backend_type, _, backend_index = backend_device.partition(":")
    worker_type, _, worker_index = worker_device.partition(":")
    if backend_type != worker_type:
        raise ValueError(
            f"ec_daemon_copy_backend {name!r} copies {backend_device} memory, but this vLLM "
            f"worker runs on {worker_device}: use 'auto' (torch or cupy on CUDA, cpu on CPU)")
    if worker_index and backend_index != worker_index:
        raise ValueError(
            f"ec_daemon_copy_backend {name!r} copies on {backend_device}, but this vLLM worker "
            f"runs on {worker_device}: a backend copies on the device current when it is "
            "built (vLLM's worker sets its own before it builds the connector)")


def _worker_device(device_type: str) -> str:
    """This worker's device: vLLM's worker makes its GPU current before it
    builds the connector, so on CUDA the current device names it."""
    if device_type != "cuda":
        return device_type
    import torch

    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else device_type


def expected_reports(vllm_config: VllmConfig) -> int:
    """How many worker ranks report each load: the tp x pcp ranks of pipeline
    stage 0 (only it runs the EC connector) under an executor that aggregates
    every rank's output (`_aggregates_every_rank`); other executors deliver
    one rank's output, and waiting for reports that cannot come would hold
    the entry until the backstop."""
    pc = vllm_config.parallel_config
    if not _aggregates_every_rank(vllm_config):
        return 1
    return int(pc.tensor_parallel_size) * int(getattr(pc, "prefill_context_parallel_size", 1))


def _loading_world(vllm_config: VllmConfig) -> int:
    """The worker ranks that load each hit and must map the region: tp x pcp
    (`ec_client.ranks`)."""
    pc = vllm_config.parallel_config
    return loading_world(int(pc.tensor_parallel_size),
                         int(getattr(pc, "prefill_context_parallel_size", 1)))


def _aggregates_every_rank(vllm_config: VllmConfig) -> bool:
    """Does the engine's executor hand the scheduler every rank's EC output?
    vLLM's `MultiprocExecutor` does (its EC output aggregator), and so does
    any subclass: "ray" is `RayExecutorV2`, one of them, in vLLM 0.33 (and in
    0.32 unless VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 picks the older
    `RayDistributedExecutor`, which is not). Decided by the class vLLM
    resolves, never by the backend's name."""
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    try:
        executor = Executor.get_class(vllm_config)
    except Exception:  # (Ray's executors without Ray): such an engine never runs.
        # Waiting for every rank is the safe side: a load counted done early
        # could have its pages reused under a rank still copying.
        return True
    return issubclass(executor, MultiprocExecutor)


def _loading_rank(vllm_config: VllmConfig) -> LoadingRank:
    """This worker's rank among its engine's loading ranks (`ec_client.ranks`)."""
    pc = vllm_config.parallel_config
    tp, pcp = int(pc.tensor_parallel_size), int(getattr(pc, "prefill_context_parallel_size", 1))
    if tp * pcp == 1:
        return loading_rank(0, 1)
    from vllm.distributed.parallel_state import get_pcp_group, get_tp_group

    return loading_rank(int(get_tp_group().rank_in_group), tp,
                        int(get_pcp_group().rank_in_group) if pcp > 1 else 0, pcp)
