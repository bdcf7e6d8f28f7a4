"""vLLM's own Scheduler with ECDaemonConnector, stepped as EngineCore steps it.

The Scheduler is vLLM's (it builds the SCHEDULER connector through vLLM's
factory, keeps vLLM's encoder cache manager, calls `ensure_cache_available`,
`has_cache_item`, `update_state_after_alloc`, `build_connector_meta`,
`request_finished` and `take_unavailable_requests` where vLLM calls them).
The model runner is stood in for by `RunnerStandIn`, which does what vLLM's
V1 GPU model runner (its EC mixin, removed in 0.34; `runner_v2` drives Model
Runner V2's own class) does with the connector each step, in its order: drop the
encoder outputs the scheduler freed, bind the metadata, `start_load_caches`,
run the encoder for the scheduled inputs and `save_caches` each, then the
worker metadata into `ModelRunnerOutput.ec_connector_output`; and in a step
that schedules no tokens, nothing of the connector (its `execute_model`
returns before `_preprocess`), where this vLLM has that runner (0.32, 0.33;
on 0.34 it runs the connector in every step, as Model Runner V2 does). Every
request samples one token when its prompt is done (`max_tokens=1` ends it
there).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.vllm import vllm_harness as h

BLOCK = 16
KV_BLOCKS = 64
TOKEN = 5


def make_scheduler(config: VllmConfig, encoder_cache_items: int = 0,
                   log_stats: bool = False) -> Scheduler:
    """vLLM's Scheduler on `config`; `encoder_cache_items`: an encoder cache
    that holds that many images (0: vLLM's default size); `log_stats`: its
    steps' outputs carry SchedulerStats (what reaches vLLM's /metrics)."""
    if encoder_cache_items:
        embeds = encoder_cache_items * h.IMAGE_TOKENS
        config.scheduler_config.encoder_cache_size = embeds
        config.scheduler_config.max_num_encoder_input_tokens = embeds
    config.cache_config.num_gpu_blocks = KV_BLOCKS
    kv = KVCacheConfig(num_blocks=KV_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1,
                                                      head_size=32, dtype=torch.float32))])
    return Scheduler(vllm_config=config, kv_cache_config=kv, block_size=BLOCK,
                     structured_output_manager=StructuredOutputManager(config),
                     log_stats=log_stats)


def request(request_id: str, mm_hash: str, data: Any = None,
            ec_transfer_params: dict[str, Any] | None = None) -> Request:
    """A one-image request that ends after its first token."""
    feature = MultiModalFeatureSpec(data=data, modality="image", identifier=mm_hash,
                                    mm_position=PlaceholderRange(offset=1,
                                                                 length=h.IMAGE_TOKENS))
    extra = {"ec_transfer_params": ec_transfer_params} if ec_transfer_params else None
    req = Request(request_id=request_id, prompt_token_ids=[2] + [5] * h.IMAGE_TOKENS + [7],
                  sampling_params=SamplingParams(max_tokens=1, extra_args=extra),
                  pooling_params=None, mm_features=[feature])
    return req


def reported(item: dict[str, Any]) -> bool:
    """Is `item` what vLLM's `collect_ec_item_metadata` reports for the
    one image of a request of this model (no placeholder fields to publish;
    vLLM 0.33 adds the modality)?"""
    return (item["item_indices"] == [0] and item["metadata"] == {}
            and item.get("modality", "image") == "image")


@dataclass
class Step:
    output: SchedulerOutput
    encoded: list[str] = field(default_factory=list)  # mm_hashes the encoder ran for
    finished: dict[str, EngineCoreOutput] = field(default_factory=dict)  # by request id
    # What this step handed vLLM's stat loggers (SchedulerStats.ec_connector_stats).
    ec_stats: dict[str, Any] | None = None


def finish(scheduler: Scheduler, step: Step, ec_output: ECConnectorOutput | None) -> None:
    """The model runner's output for `step` (one token for each request whose
    prompt is done) into vLLM's `update_from_output`; `step` takes what it
    returned."""
    req_ids = list(step.output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = scheduler.requests.get(req_id)  # (schedule() counted its tokens)
        done = req is not None and req.num_computed_tokens >= req.num_prompt_tokens
        sampled.append([TOKEN] if done else [])  # (none for a request aborted meanwhile)
    fields: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled,
                              "ec_connector_output": ec_output}
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # (gone in vLLM 0.34)
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    for outputs in scheduler.update_from_output(step.output,
                                                ModelRunnerOutput(**fields)).values():
        for out in outputs.outputs:
            if out.finish_reason is not None:
                step.finished[out.request_id] = out
        stats = outputs.scheduler_stats
        if stats is not None and stats.ec_connector_stats:
            step.ec_stats = stats.ec_connector_stats


def adopted(steps: list[Step]) -> list[str]:
    """The items these steps' workers moved into vLLM's encoder cache from
    the daemon (staged by them, or by the scheduler's process: `inline`)."""
    return [item.mm_hash for s in steps for item in (*s.output.ec_connector_metadata.adopt,
                                                      *s.output.ec_connector_metadata.inline)]


def staged(steps: list[Step]) -> list[str]:
    """The items these steps' workers were told to stage."""
    return [spec.mm_hash for s in steps for spec in s.output.ec_connector_metadata.loads]


class RunnerStandIn:
    """The worker side of one engine with one rank: the WORKER connector and
    the encoder cache vLLM's model runner keeps (`encoder_cache`)."""

    def __init__(self, scheduler: Scheduler, config: VllmConfig,
                 encode: Callable[[str], torch.Tensor]) -> None:
        self.scheduler = scheduler
        self.connector = scheduler.get_ec_connector()
        self.worker = h.connector(config, ECConnectorRole.WORKER)
        self.encode = encode
        self.encoder_cache: dict[str, torch.Tensor] = {}
        # vLLM 0.34 has no V1 runner: its runners all run the connector when idle.
        self.idle_steps_run = getattr(type(config), "use_v2_model_runner", None) is None

    def step(self) -> Step:
        output = self.scheduler.schedule()
        step = Step(output)
        for mm_hash in output.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        if output.total_num_scheduled_tokens == 0 and not self.idle_steps_run:
            finish(self.scheduler, step, None)  # (the V1 runner's EMPTY_MODEL_RUNNER_OUTPUT)
            return step
        worker = self.worker
        worker.bind_connector_metadata(output.ec_connector_metadata)
        if worker.is_consumer:
            worker.start_load_caches(self.encoder_cache)
        for req_id, inputs in output.scheduled_encoder_inputs.items():
            req = self.scheduler.requests[req_id]
            for index in inputs:
                mm_hash = req.mm_features[index].identifier
                self.encoder_cache[mm_hash] = self.encode(mm_hash)
                step.encoded.append(mm_hash)
                worker.save_caches(self.encoder_cache, mm_hash)
        ec_output = ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        finish(self.scheduler, step, ec_output)
        return step

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


def encode(mm_hash: str, rows: int = h.IMAGE_TOKENS) -> torch.Tensor:
    """What the stand-in encoders compute for an item: the same tensor for
    the same key (and rows), in every process."""
    generator = torch.Generator().manual_seed(sum(mm_hash.encode()))
    return torch.randn(rows, h.HIDDEN, generator=generator)


def run_to_end(runner: Any, *requests: Request, seconds: float = 60.0) -> list[Step]:
    """Add `requests` to `runner`'s scheduler, then step until it has none
    unfinished, within `seconds` (bounded by time: on a busy machine a
    session not fresh for a moment defers a request a few steps more)."""
    for req in requests:
        runner.scheduler.add_request(req)
    done: list[Step] = []
    deadline = time.monotonic() + seconds
    while runner.scheduler.has_unfinished_requests():
        assert time.monotonic() < deadline, f"requests did not finish in {len(done)} steps"
        done.append(runner.step())
        if len(done) > 10:
            time.sleep(0.01)  # (waiting for something: do not spin)
    return done


@contextmanager
def engines(model: Path, socket: str, runner: Callable[[Scheduler, VllmConfig], Any],
            log_stats: bool = False) -> Iterator[Callable[..., Any]]:
    """Engines on `socket`, each vLLM's Scheduler and `runner(scheduler,
    config)` (a `RunnerStandIn`, or `runner_v2.RunnerV2`), attached and
    serving when made, all shut down at the end: yields
    `make(role, instance_id, encoder_cache_items=0, **extra)`."""
    made: list[Any] = []

    def make(role: str, instance_id: str, encoder_cache_items: int = 0, **extra: Any) -> Any:
        config = h.make_config(Path(model), socket, role, instance_id=instance_id, **extra)
        engine = runner(make_scheduler(config, encoder_cache_items, log_stats), config)
        made.append(engine)
        h.wait_attached(engine.connector)
        h.wait_attached(engine.worker)
        h.wait_until(lambda: engine.connector.scheduler_delegate.serving())
        return engine

    try:
        yield make
    finally:
        for engine in made:
            engine.shutdown()
