"""ECDaemonConnector: vLLM's EC connector over ec-daemon.

A thin role-routed shell, as vLLM's own connectors are: the SCHEDULER role
(in EngineCore) builds a `SchedulerDelegate`, the WORKER role (in each worker
process) a `WorkerDelegate`; each forwards vLLM's calls with plain values.
vLLM is imported only in this module.

    vllm serve MODEL --ec-transfer-config '{
      "ec_connector": "ECDaemonConnector",
      "ec_connector_module_path": "ec_client.vllm_connector",
      "ec_role": "ec_both",
      "ec_connector_extra_config": {"ec_daemon_socket": "unix:///run/ec-daemon/ec.sock"}}'

Extra-config keys (all optional): `ec_daemon_socket` (else $EC_DAEMON_SOCKET,
else the daemon's default), `ec_daemon_copy_backend` (auto|torch|cupy|cpu,
default auto), `ec_daemon_rpc_deadline_s` (default 5), `ec_daemon_namespace`
(extra text in the layout fingerprint, default ""), and for a TCP daemon
`ec_daemon_token_file` and `ec_daemon_tls_ca` (else $EC_DAEMON_TOKEN_FILE and
$EC_DAEMON_TLS_CA).

Worker completion reports go to the daemon directly (the worker needs the
verdict before handing a load to the model, and a scheduler-side relay would
put reports on the scheduler's path); the workers' metadata only tells the
scheduler which transfers finished or failed, so it can fail requests whose
loads failed through `take_unavailable_requests`. A failed load leaves a
zero placeholder in the encoder cache so the engine does not crash on a
missing entry; the request is then failed by the scheduler.

The namespace is the layout fingerprint both roles can compute at
construction: model, revision, dtype, quantization and the LM embedding row
width. vLLM measures encoder output widths only in producers and only after
the workers' connectors exist, so they cannot be part of a key a consumer
must match; each entry carries its own shape instead, and the loads restore it.
"""

from __future__ import annotations

import os
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

from ec_client.scheduler import LoadSpec, SchedulerDelegate
from ec_protocol.protocol import SOCKET_ENV, Layout, default_socket_uri
from ec_protocol.transport import DEFAULT_DEADLINE_SECONDS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from ec_client.worker import WorkerDelegate

logger = init_logger(__name__)

ROLES = {"ec_producer": "producer", "ec_consumer": "consumer", "ec_both": "both"}


@dataclass
class ECDaemonConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> workers each step: the loads, with extents."""

    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class ECDaemonWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler each step: transfers finished and failed."""

    done: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, ECDaemonWorkerMetadata)
        self.done.extend(other.done)
        self.failed.extend(other.failed)
        return self


@dataclass(frozen=True)
class ConnectorSettings:
    socket: str
    copy_backend: str
    deadline_seconds: float
    namespace: str
    token_file: str | None
    tls_ca: str | None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorSettings:
        return cls(
            socket=str(extra.get("ec_daemon_socket") or os.environ.get(SOCKET_ENV)
                       or default_socket_uri()),
            copy_backend=str(extra.get("ec_daemon_copy_backend", "auto")),
            deadline_seconds=float(extra.get("ec_daemon_rpc_deadline_s",
                                             DEFAULT_DEADLINE_SECONDS)),
            namespace=str(extra.get("ec_daemon_namespace", "")),
            token_file=extra.get("ec_daemon_token_file"),
            tls_ca=extra.get("ec_daemon_tls_ca"),
        )

    @property
    def transport(self) -> dict[str, Any]:
        return {"deadline_seconds": self.deadline_seconds, "token_file": self.token_file,
                "tls_ca": self.tls_ca}


def engine_identity(vllm_config: VllmConfig) -> str:
    """Shared by an engine's EngineCore and its workers (same config)."""
    ec = vllm_config.ec_transfer_config
    base = (ec.engine_id if ec is not None and ec.engine_id else "") or vllm_config.instance_id
    return f"{base}_dp{vllm_config.parallel_config.data_parallel_index}"


def layout_of(vllm_config: VllmConfig, namespace: str = "") -> Layout:
    model = vllm_config.model_config
    dtype = str(model.dtype).removeprefix("torch.")
    element = torch.empty(0, dtype=model.dtype).element_size()
    width = int(model.get_inputs_embeds_size()) * element
    variant = "|".join(str(v) for v in (model.revision or "", model.quantization or "",
                                        namespace) if v)
    return Layout(model=str(model.model), dtype=dtype, row_bytes={"embeds": width},
                  variant=variant)


class ECDaemonConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        assert ec is not None
        self.settings = ConnectorSettings.from_extra_config(ec.ec_connector_extra_config or {})
        self._ec_role = ROLES.get(str(ec.ec_role), "both")
        self._scheduler: SchedulerDelegate | None = None
        self._worker: WorkerDelegate | None = None
        self._done: list[int] = []
        self._failed: list[int] = []
        layout = layout_of(vllm_config, self.settings.namespace)
        engine_id = engine_identity(vllm_config)
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = SchedulerDelegate(
                self.settings.socket, engine_id=engine_id, layout=layout, role=self._ec_role,
                **self.settings.transport)
        elif role == ECConnectorRole.WORKER:
            self._worker = self._make_worker(vllm_config, engine_id, layout)
        else:
            raise ValueError(f"unknown ECConnectorRole {role}")
        logger.info("ECDaemonConnector %s for engine %s on %s (%s)", role.name, engine_id,
                    self.settings.socket, layout)

    def _make_worker(self, vllm_config: VllmConfig, engine_id: str,
                     layout: Layout) -> WorkerDelegate:
        # Deferred: the worker path may import CUDA libraries.
        from ec_client.copy import get_backend
        from ec_client.worker import WorkerDelegate

        rank, world = _tp_rank_and_size(vllm_config)
        backend = get_backend(self.settings.copy_backend)
        device = torch.device(getattr(backend, "device", "cpu"))

        def allocate_out(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
            return torch.empty(shape, dtype=getattr(torch, dtype), device=device)

        return WorkerDelegate(
            self.settings.socket, engine_id=engine_id, layout=layout, rank=rank,
            world_size=world, role=self._ec_role, backend=backend, allocate_out=allocate_out,
            **self.settings.transport)

    # ------------------------------------------------------------ worker

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ECDaemonConnectorMetadata)
        if not metadata.loads:
            return
        result = self._worker.load(metadata.loads)
        for mm_hash, tensor in result.loaded.items():
            encoder_cache[mm_hash] = tensor
        failed = set(result.failed)
        for spec in metadata.loads:
            if spec.transfer_id in failed and spec.mm_hash not in encoder_cache:
                # The request is failed by the scheduler; keep the engine running.
                encoder_cache[spec.mm_hash] = torch.zeros(
                    spec.shape, dtype=getattr(torch, spec.dtype),
                    device=self._placeholder_device(encoder_cache))
        self._done.extend(result.done)
        self._failed.extend(result.failed)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str,
                    **kwargs: Any) -> None:
        assert self._worker is not None
        if self.is_producer:
            self._worker.save(mm_hash, encoder_cache[mm_hash])

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        if self._worker is None or not (self._done or self._failed):
            return None
        meta = ECDaemonWorkerMetadata(self._done, self._failed)
        self._done, self._failed = [], []
        return meta

    @staticmethod
    def _placeholder_device(encoder_cache: dict[str, torch.Tensor]) -> torch.device:
        for tensor in encoder_cache.values():
            return tensor.device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # --------------------------------------------------------- scheduler

    def has_cache_item(self, identifier: str) -> bool:
        assert self._scheduler is not None
        return self._scheduler.has_item(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request.request_id, request.mm_features[index].identifier)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        assert self._scheduler is not None
        return ECDaemonConnectorMetadata(self._scheduler.build_step_metadata().loads)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        if self._scheduler is None:
            return
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(meta, ECDaemonWorkerMetadata):
            self._scheduler.apply_worker_output(meta.done, meta.failed)

    def take_unavailable_requests(self) -> set[str]:
        if self._scheduler is None:
            return set()
        return self._scheduler.take_unavailable_requests()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # ------------------------------------------------------------ shared

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()


def _tp_rank_and_size(vllm_config: VllmConfig) -> tuple[int, int]:
    world = int(vllm_config.parallel_config.tensor_parallel_size)
    if world == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), world
