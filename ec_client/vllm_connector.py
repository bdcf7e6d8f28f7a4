"""ECDaemonConnector: vLLM's EC connector over ec-daemon.

A thin role-routed shell, as vLLM's own connectors are: the SCHEDULER role
(in EngineCore) builds its half, `vllm_scheduler_role.SchedulerRole` over a
`SchedulerDelegate`, the WORKER role (in each worker process) its half,
`vllm_worker_role.WorkerRole` over a `WorkerDelegate`; each half forwards
vLLM's calls to its delegate with plain values, and the two share only the
metadata types (`vllm_metadata`). The shell reads what vLLM's engine says of
its ranks and model runner (`vllm_engine`) and hands the half plain values.
vLLM is imported only in these modules (and `vllm_namespace`, `vllm_metrics`,
`vllm_items`, `vllm_plugin`, `vllm_names`: every vLLM name they use is
listed there).

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
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from ec_client.common.settings import ConnectorSettings
from ec_client.vllm_engine import (
    expected_reports,
    loading_rank_of,
    loading_world_of,
    workers_run_idle_steps,
)
from ec_client.vllm_metadata import ECDaemonConnectorMetadata, ECDaemonWorkerMetadata
from ec_client.vllm_metrics import ECDaemonPromMetrics, ECDaemonStats
from ec_client.vllm_namespace import engine_identity, layout_of
from ec_client.vllm_scheduler_role import SchedulerRole
from ec_client.vllm_worker_role import WorkerRole
from ec_protocol.protocol import (
    BOTH,
    CONSUMER,
    PRODUCER,
    Role,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from ec_client.scheduler_side.scheduler import SchedulerDelegate
    from ec_client.worker_side.worker import WorkerDelegate

# What vLLM's factory, users and tests import from here: the metadata types are
# declared in `vllm_metadata`, `workers_run_idle_steps` in `vllm_engine`.
__all__ = ["ECDaemonConnector", "ECDaemonConnectorMetadata", "ECDaemonWorkerMetadata",
           "workers_run_idle_steps"]

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


class ECDaemonConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        assert ec is not None
        self.settings = ConnectorSettings.from_extra_config(ec.ec_connector_extra_config or {})
        self._ec_role: Role = ROLES.get(str(ec.ec_role), BOTH)
        self._scheduler: SchedulerRole | None = None
        self._worker: WorkerRole | None = None
        lora = vllm_config.lora_config
        # vLLM names an item `lora_name:mm_hash` when a LoRA adapter changes the
        # encoder (tower/connector LoRA): an adapter retrained under the same
        # name would be served its predecessor's outputs, so such items are
        # never cached.
        adapter_items = bool(lora is not None
                             and getattr(lora, "enable_tower_connector_lora", False))
        layout = layout_of(vllm_config, self.settings.namespace, self.settings.weights_id,
                           self.settings)
        engine_id = engine_identity(vllm_config)
        # What vLLM's engine says of this process's ranks and model runner
        # is read here, where tests replace it (`workers_run_idle_steps`,
        # `loading_rank_of`); each half gets plain values.
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = SchedulerRole(
                self.settings, engine_id=engine_id, layout=layout, role=self._ec_role,
                model_config=vllm_config.model_config, ranks=expected_reports(vllm_config),
                world_size=loading_world_of(vllm_config), instance_id=vllm_config.instance_id,
                workers_run_idle_steps=workers_run_idle_steps(vllm_config),
                producer=self.is_producer, adapter_items=adapter_items)
        elif role == ECConnectorRole.WORKER:
            self._worker = WorkerRole(
                self.settings, engine_id=engine_id, layout=layout, role=self._ec_role,
                rank=loading_rank_of(vllm_config), instance_id=vllm_config.instance_id,
                device_type=str(vllm_config.device_config.device_type),
                producer=self.is_producer, adapter_items=adapter_items)
        else:
            raise ValueError(f"unknown ECConnectorRole {role}")
        logger.info("ECDaemonConnector %s for engine %s on %s (%s)", role.name, engine_id,
                    self.settings.socket, layout)

    @property
    def scheduler_delegate(self) -> SchedulerDelegate | None:
        """The scheduler role's delegate (None in a worker process)."""
        return self._scheduler.delegate if self._scheduler is not None else None

    @property
    def worker_delegate(self) -> WorkerDelegate | None:
        """The worker role's delegate (None in the scheduler's process)."""
        return self._worker.delegate if self._worker is not None else None

    # ------------------------------------------------------------ worker

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        """A step begins (the worker's side): `WorkerRole.bind`."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata,
                                                   ECDaemonConnectorMetadata):
            self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        """The step ended."""
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.step_done()

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """`WorkerRole.start_load_caches`: loads staged, adopted, dropped."""
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ECDaemonConnectorMetadata)
        self._worker.start_load_caches(metadata, encoder_cache)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str,
                    **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save(encoder_cache, mm_hash)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        return self._worker.build_worker_meta() if self._worker is not None else None

    # --------------------------------------------------------- scheduler

    def has_cache_item(self, identifier: str) -> bool:
        assert self._scheduler is not None
        return self._scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """`SchedulerRole.ensure_cache_available`: False defers the request a
        step (a worker's connector never defers)."""
        if self._scheduler is None:
            return True
        return self._scheduler.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def take_unavailable_requests(self) -> set[str]:
        if self._scheduler is None:
            return set()
        return self._scheduler.take_unavailable_requests()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """`SchedulerRole.request_finished`: the request's items released, a
        producer's `ec_transfer_params`."""
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request)

    # ------------------------------------------------------------ metrics

    def get_ec_connector_stats(self) -> ECDaemonStats | None:
        """`SchedulerRole.get_ec_connector_stats`; None in a worker process:
        a worker's counters travel in its worker metadata."""
        if self._scheduler is None:
            return None
        return self._scheduler.get_ec_connector_stats()

    def has_pending_push_work(self) -> bool:
        """`SchedulerRole.has_pending_push_work`: vLLM asks every loop
        iteration."""
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

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
