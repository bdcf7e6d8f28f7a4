"""Drive ECDaemonConnector the way vLLM's scheduler and model runner do.

Connectors are built through vLLM's own ECConnectorFactory from a real
VllmConfig; requests are real vLLM Request objects carrying multimodal
features. Functions here run in the test process or in spawned processes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.engine.arg_utils import EngineArgs
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request

from ec_client import vllm_connector
from ec_client.common.contract import RegionInfo
from ec_client.copy.mapping import RegionMapping
from ec_client.ranks import LoadingRank
from ec_protocol.stamps import StampTable
from tests.vllm.cpu_platform import allow_configs_without_triton_cpu

# vLLM 0.34 builds no config on an x86 CPU without triton-cpu (the module says why).
allow_configs_without_triton_cpu()

IMAGE_TOKENS = 16
HIDDEN = 128
NOWHERE = "unix:///nonexistent/ec.sock"  # a socket no daemon listens on
# vLLM's `embedding_model_identity`: with it, the store keys are vLLM's own.
STORE_IDENTITY = {"embedding_model_identity": "tiny-paligemma@release-1"}


def make_config(model: Path, socket: str, role: str = "ec_both", instance_id: str = "",
                tensor_parallel_size: int = 1, **extra: Any) -> VllmConfig:
    """A real VllmConfig with the connector; `extra` adds extra-config keys."""
    args = EngineArgs(
        model=str(model), enforce_eager=True, enable_prefix_caching=False, max_model_len=128,
        limit_mm_per_prompt={"image": 1}, tensor_parallel_size=tensor_parallel_size,
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECDaemonConnector", ec_connector_module_path="ec_client.vllm_connector",
            ec_role=role, ec_connector_extra_config={"ec_daemon_socket": socket,
                                                     "ec_daemon_copy_backend": "cpu", **extra}))
    config = args.create_engine_config()
    if instance_id:
        config.instance_id = instance_id
    return config


def connector(config: VllmConfig, role: ECConnectorRole) -> Any:
    return ECConnectorFactory.create_connector(config, role)


def rank_worker(config: VllmConfig, rank: int) -> Any:
    """The WORKER connector of tensor-parallel rank `rank` (vLLM's process
    group is not set up here: the connector is told its rank instead)."""
    world = int(config.parallel_config.tensor_parallel_size)
    with mock.patch.object(vllm_connector, "loading_rank_of",
                           lambda _: LoadingRank(rank, world)):
        return connector(config, ECConnectorRole.WORKER)


def request(request_id: str, mm_hash: str) -> Request:
    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=mm_hash,
                                    mm_position=PlaceholderRange(offset=1,
                                                                 length=IMAGE_TOKENS))
    return Request(request_id=request_id, prompt_token_ids=[2] + [5] * IMAGE_TOKENS + [7],
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   mm_features=[feature])


def empty_output(tokens: int = 0, freed: list[str] | None = None) -> SchedulerOutput:
    """A step's output with no request in it, but `tokens` scheduled (a step
    without tokens is one vLLM's V1 runner runs no connector in), and the
    encoder outputs vLLM's scheduler frees in it."""
    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=list(freed or ()))


def forget(scheduler: Any, mm_hashes: list[str]) -> None:
    """vLLM's scheduler freed these encoder outputs (its encoder cache needed
    the room): the next request for one asks the connector again."""
    scheduler.build_connector_meta(empty_output(freed=mm_hashes))


def encoder_output(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(IMAGE_TOKENS, HIDDEN, generator=generator)


def wait_attached(conn: Any, timeout: float = 20.0) -> None:
    delegate = conn.scheduler_delegate or conn.worker_delegate
    if delegate.link.wait_attached(timeout) is None:
        raise RuntimeError(f"connector not attached: {delegate.link.last_error}")


def step(scheduler: Any, worker: Any, requests: list[Request],
         computed: dict[str, torch.Tensor],
         encoder_cache: dict[str, torch.Tensor] | None = None, busy: bool = True,
         ) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """One engine step: the scheduler's calls, then the model runner's.

    A request `ensure_cache_available` defers is not scheduled (its items'
    loads are staged this step). `computed` holds what the encoder produced
    this step for items the connector did not have. `busy`: other requests
    run in the step too (else a step of deferred requests only schedules no
    tokens, which vLLM's V1 runner runs no connector in: the scheduler's
    process stages their loads). Returns the worker's encoder cache and the
    has_cache_item answers of the requests scheduled."""
    hits = []
    misses = []
    tokens = int(busy)
    for req in requests:
        if not scheduler.ensure_cache_available(req, 0):
            continue
        tokens += req.num_prompt_tokens
        for index, feature in enumerate(req.mm_features):
            hit = scheduler.has_cache_item(feature.identifier)
            hits.append(hit)
            if not hit:
                misses.append(feature.identifier)
            scheduler.update_state_after_alloc(req, index)
    output = empty_output(tokens)
    output.ec_connector_metadata = scheduler.build_connector_meta(output)

    encoder_cache = {} if encoder_cache is None else encoder_cache
    worker.bind_connector_metadata(output.ec_connector_metadata)
    if worker.is_consumer:
        worker.start_load_caches(encoder_cache)
    for mm_hash in misses:  # the encoder runs for the misses
        if mm_hash in computed:
            encoder_cache[mm_hash] = computed[mm_hash]
            worker.save_caches(encoder_cache, mm_hash)
    result = ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    scheduler.update_connector_output(result)
    return encoder_cache, hits


def serve(scheduler: Any, worker: Any, requests: list[Request],
          computed: dict[str, torch.Tensor] | None = None,
          steps: int = 4, busy: bool = True) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """Steps until each request ran once (a hit's load is staged in the step
    before): the encoder cache, and the has_cache_item answers."""
    encoder_cache: dict[str, torch.Tensor] = {}
    hits: list[bool] = []
    for _ in range(steps):
        _, answers = step(scheduler, worker, requests, computed or {}, encoder_cache, busy)
        hits += answers
        if len(hits) == sum(len(r.mm_features) for r in requests):
            return encoder_cache, hits
    raise AssertionError(f"requests still deferred after {steps} steps: {hits}")


def dispatch(scheduler: Any, requests: list[Request]) -> Any:
    """The scheduler's half of the step that stages these requests' items
    (each in the cache): they are deferred, and the step's metadata carries
    their loads (other requests run in it). Returns the metadata bound to
    the workers."""
    for req in requests:
        assert not scheduler.ensure_cache_available(req, 0), req.request_id
    return scheduler.build_connector_meta(empty_output(tokens=1))


def load(worker: Any, metadata: Any, encoder_cache: dict[str, torch.Tensor]) -> Any:
    """The worker's half of a step (it stages, adopts, drops what the
    metadata says); returns its worker metadata."""
    worker.bind_connector_metadata(metadata)
    try:
        worker.start_load_caches(encoder_cache)
        return worker.build_connector_worker_meta()
    finally:
        worker.clear_connector_metadata()


def use(scheduler: Any, requests: list[Request]) -> Any:
    """The scheduler's half of the step that schedules these requests, each
    item a hit (staged): the metadata whose workers adopt them."""
    tokens = 0
    for req in requests:
        assert scheduler.ensure_cache_available(req, 0), req.request_id
        tokens += req.num_prompt_tokens
        for index, feature in enumerate(req.mm_features):
            assert scheduler.has_cache_item(feature.identifier), feature.identifier
            scheduler.update_state_after_alloc(req, index)
    return scheduler.build_connector_meta(empty_output(tokens))


def save_and_publish(scheduler: Any, worker: Any, mm_hash: str, tensor: torch.Tensor) -> None:
    """Engine computed `tensor` as `mm_hash`: save it and wait until the
    scheduler's view offers it. The request is stepped until it is scheduled:
    where misses are asked about (another engine shares the namespace, or a
    second tier is on), a step whose answer is late defers it, and a deferred
    request computes (and saves) nothing."""
    req = request(f"save-{mm_hash}", mm_hash)
    deadline = time.monotonic() + 30.0
    while True:
        _, hits = step(scheduler, worker, [req], {mm_hash: tensor})
        if hits:
            assert hits == [False], f"{mm_hash} was not computed here: {hits}"
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"the request for {mm_hash} was still deferred after 30 s")
        time.sleep(0.05)
    forget(scheduler, [mm_hash])
    assert worker.worker_delegate.flush(20)
    wait_until(lambda: scheduler.scheduler_delegate.view.get(mm_hash) is not None)


def overwrite_stamps(region: RegionInfo, extents: Any, stamp: int) -> None:
    """Write `stamp` over the stamp-table slots of these extents' pages, as
    the daemon would if it gave the pages to another entry."""
    mapping = RegionMapping(region.path, region.size, region.generation)
    table = StampTable(mapping.view[:region.data_offset], region.page_bytes,
                       region.data_offset)
    try:
        for offset, length in extents:
            first = (offset - region.data_offset) // region.page_bytes
            pages = -(-length // region.page_bytes)
            table.write([(first, pages)], stamp)
    finally:
        table.release()
        mapping.close()


def wait_until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def start_engine(model: str, socket: str, role: str, instance_id: str,
                 **extra: Any) -> tuple[Any, Any]:
    """Both connectors of one engine, attached; `extra` adds extra-config keys."""
    config = make_config(Path(model), socket, role, instance_id=instance_id, **extra)
    scheduler = connector(config, ECConnectorRole.SCHEDULER)
    worker = connector(config, ECConnectorRole.WORKER)
    wait_attached(scheduler)
    wait_attached(worker)
    wait_until(lambda: scheduler.scheduler_delegate.serving())  # its worker mapped the region
    return scheduler, worker


def producer_engine_main(model: str, socket: str, seeds: list[int], conn: Any) -> None:
    """Engine 1 (ec_producer): computes and saves encoder outputs."""
    scheduler, worker = start_engine(model, socket, "ec_producer", "engine-1")
    for seed in seeds:
        step(scheduler, worker, [request(f"p{seed}", f"img-{seed}")],
             {f"img-{seed}": encoder_output(seed)})
    assert worker.worker_delegate.flush(30)
    conn.send(dict(worker.worker_delegate.stats))
    scheduler.shutdown()
    worker.shutdown()


def consumer_engine_main(model: str, socket: str, seeds: list[int], conn: Any) -> None:
    """Engine 2 (ec_consumer, another process): loads them back."""
    scheduler, worker = start_engine(model, socket, "ec_consumer", "engine-2")
    exact = 0
    all_hits = []
    for seed in seeds:
        cache, hits = serve(scheduler, worker, [request(f"c{seed}", f"img-{seed}")])
        all_hits += hits
        got = cache.get(f"img-{seed}")
        exact += got is not None and torch.equal(got, encoder_output(seed))
    conn.send({"hits": all_hits, "exact": exact,
               "unavailable": sorted(scheduler.take_unavailable_requests()),
               "scheduler_rpcs": scheduler.scheduler_delegate.transport.calls_from_this_thread()})
    scheduler.shutdown()
    worker.shutdown()
