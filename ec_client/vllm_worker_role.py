"""The worker role's half of `ECDaemonConnector`, in each worker process.

`WorkerRole` answers vLLM's worker-side connector calls over a
`WorkerDelegate`: a step's metadata binds the regions it may load from, the
staged loads a step uses go into vLLM's encoder cache (or are dropped), the
loads it planned are staged and reported back in the rank's
`ECDaemonWorkerMetadata`, and a producer's encoder outputs are saved. The
connector's shell (`ec_client.vllm_connector`) routes vLLM's calls here and
never builds this half in the scheduler's process; the worker side and the
copy backends are imported when it is built, since the worker path may
import CUDA libraries.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from ec_client.engine_token import derived_engine_token
from ec_client.vllm_engine import current_worker_device
from ec_client.vllm_metadata import ECDaemonConnectorMetadata, ECDaemonWorkerMetadata

if TYPE_CHECKING:
    from ec_client.common.settings import ConnectorSettings
    from ec_client.ranks import LoadingRank
    from ec_client.worker_side.worker import WorkerDelegate
    from ec_protocol.protocol import Layout, Role


class WorkerRole:
    def __init__(self, settings: ConnectorSettings, *, engine_id: str, layout: Layout,
                 role: Role, rank: LoadingRank, instance_id: str, device_type: str,
                 producer: bool, adapter_items: bool) -> None:
        """`rank`: this worker's among the engine's loading ranks;
        `device_type`: vLLM's (the backend must copy on this worker's
        device); `producer`: it saves what it encodes; `adapter_items`: an
        item named `lora_name:mm_hash` is a LoRA adapter's, never saved."""
        # Deferred: the worker path may import CUDA libraries.
        from ec_client.copy import get_backend
        from ec_client.worker_side.worker import WorkerDelegate

        self._producer = producer
        self._adapter_items = adapter_items
        self._done: list[int] = []
        self._failed: list[tuple[int, str]] = []
        self._load_seconds: list[float] = []
        loading, world = rank
        backend = get_backend(settings.copy_backend)
        check_backend_device(settings.copy_backend, backend.device,
                             current_worker_device(device_type))
        # Loads land in the backend's `empty`: on the worker's device, ordered
        # for the backend's copy stream (the cpu backend's are host arrays).
        self.delegate: WorkerDelegate = WorkerDelegate(
            settings.socket, engine_id=engine_id, layout=layout, rank=loading,
            world_size=world, role=role, backend=backend,
            engine_token=derived_engine_token(engine_id, instance_id),
            save_queue_bytes=settings.save_queue_bytes, hold_saves=True,
            staging_bytes=settings.staging_bytes,
            verify_checksum=settings.verify_checksum, **settings.transport)

    def bind(self, metadata: ECDaemonConnectorMetadata) -> None:
        """A step begins: while it runs, the regions its metadata says the
        scheduler may still load from stay mapped."""
        self.delegate.regions.step(metadata.keep)
        self.delegate.join(metadata.engine_token)
        self.delegate.follow_scheduler(metadata.namespace)

    def step_done(self) -> None:
        self.delegate.regions.step_done()

    def start_load_caches(self, metadata: ECDaemonConnectorMetadata,
                          encoder_cache: dict[str, torch.Tensor]) -> None:
        """Before the step's forward: the staged loads it uses go into vLLM's
        encoder cache, those no step will use are dropped, and the loads it
        planned are staged (copied, verified, kept aside) and reported. A
        load that fails is reported, never raised: its request encodes the
        item or fails, and nothing unverified enters the encoder cache."""
        worker = self.delegate
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
        worker = self.delegate
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

    def save(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        """A producer's encoder output, queued for the daemon (never a LoRA
        adapter's: see `ECDaemonConnector`)."""
        if self._producer and not (self._adapter_items and ":" in mm_hash):
            self.delegate.save(mm_hash, encoder_cache[mm_hash])

    def build_worker_meta(self) -> ECDaemonWorkerMetadata | None:
        """This rank's reports since the previous step, or None when it has
        none."""
        # Load times from one rank only: every rank loads the same entries.
        stats = self.delegate.take_stats(self._load_seconds if self.delegate.rank == 0 else None)
        self._load_seconds = []
        dropped = self.delegate.take_dropped()
        if not self._done and not self._failed and not stats and not dropped:
            return None
        meta = ECDaemonWorkerMetadata(self._done, stats, self._failed, dropped)
        self._done, self._failed = [], []
        return meta

    def close(self) -> None:
        self.delegate.close()


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
