"""vLLM's Scheduler with ECDaemonConnector's worker half driven by Model
Runner V2's own EC connector class, stepped as MRv2's `execute_model` steps.

From vLLM 0.34 workers drive an EC connector only through MRv2's
`ActiveECConnector` (`vllm/v1/worker/gpu/ec_connector.py`, in 0.32 and 0.33
too; `vllm/v1/worker/cpu/ec_connector.py`, 0.34's standalone CPU runner).
`RunnerV2` uses vLLM's class itself, built by vLLM's `get_ec_connector`
around the runner's `EncoderCache`, with the WORKER connector vLLM's worker
makes at start-up (`ensure_ec_transfer_initialized`). Each step, as MRv2
does: free the encoder outputs the scheduler freed, then inside
`maybe_get_output` (bind the metadata, `start_save_caches` on producers,
`start_load_caches` on consumers; after the forward `save_caches` for every
key new in the encoder cache, `get_finished`, the worker metadata) run the
encoder for the scheduled items the cache lacks and that carry data, as
MRv2's `prepare_mm_inputs` does; a step with nothing scheduled goes through
`no_forward`. The GPU class runs on CPU tensors here: it never touches a
device itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from vllm.config import VllmConfig
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from tests.vllm import scheduler_harness as sh
from tests.vllm import vllm_harness as h

# MRv2's runners: its EC connector module and its encoder cache's.
KINDS = {"gpu": ("vllm.v1.worker.gpu.ec_connector", "vllm.v1.worker.gpu.mm.encoder_cache"),
         "cpu": ("vllm.v1.worker.cpu.ec_connector", "vllm.v1.worker.cpu.encoder_cache")}


def media(rows: int) -> MultiModalKwargsItem:
    """An item's processed media (what the encoder would read)."""
    return MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(
        data=torch.zeros(rows), field=MultiModalBatchedField())})


def request(request_id: str, mm_hash: str, modality: str = "image",
            data: MultiModalKwargsItem | None = None, embeds: int = h.IMAGE_TOKENS,
            ec_transfer_params: dict[str, Any] | None = None,
            max_tokens: int = 1) -> Request:
    """A one-item request that ends after `max_tokens` tokens: the item's
    placeholder spans IMAGE_TOKENS positions, of which the first `embeds`
    are its encoder output's rows (vLLM's `is_embed`, as audio has). `data`:
    its media by default; `MultiModalKwargsItem({})` sends it metadata-only."""
    is_embed = None
    if embeds != h.IMAGE_TOKENS:
        is_embed = torch.arange(h.IMAGE_TOKENS) < embeds
    feature = MultiModalFeatureSpec(
        data=media(embeds) if data is None else data, modality=modality, identifier=mm_hash,
        mm_position=PlaceholderRange(offset=1, length=h.IMAGE_TOKENS, is_embed=is_embed))
    extra = {"ec_transfer_params": ec_transfer_params} if ec_transfer_params else None
    return Request(request_id=request_id, prompt_token_ids=[2] + [5] * h.IMAGE_TOKENS + [7],
                   sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra),
                   pooling_params=None, mm_features=[feature])


class RunnerV2:
    """One engine with one rank: vLLM's Scheduler (and its SCHEDULER
    connector), the WORKER connector, and MRv2's `ActiveECConnector` of
    `kind` over the runner's encoder cache. `encode(mm_hash, rows)` stands
    in for the encoder."""

    def __init__(self, scheduler: Scheduler, config: VllmConfig,
                 encode: Callable[[str, int], torch.Tensor], kind: str = "gpu") -> None:
        ec_module, cache_module = (importlib.import_module(name) for name in KINDS[kind])
        self.scheduler = scheduler
        self.connector = scheduler.get_ec_connector()
        self.encode = encode
        self.cache = cache_module.EncoderCache()
        # vLLM's worker makes its WORKER connector the process's EC agent at
        # start-up; the agent is set only while MRv2's class is built, so
        # several engines can live in this one process.
        with mock.patch.object(ec_transfer_state, "_EC_CONNECTOR_AGENT", None):
            ec_transfer_state.ensure_ec_transfer_initialized(config)
            self.worker = ec_transfer_state.get_ec_transfer()
            self.active = ec_module.get_ec_connector(config, self.cache)
        assert isinstance(self.active, ec_module.ActiveECConnector)

    @property
    def encoder_cache(self) -> dict[str, torch.Tensor]:
        """MRv2's encoder outputs by mm_hash (the dict its connector sees)."""
        return dict(self.cache.encoder_outputs)

    def step(self) -> sh.Step:
        return self.execute(self.scheduler.schedule())

    def execute(self, output: SchedulerOutput) -> sh.Step:
        """The model runner's half of a step, then vLLM's update_from_output."""
        step = sh.Step(output)
        for mm_hash in output.free_encoder_mm_hashes:  # (MRv2's free_states)
            self.cache.free_encoder_cache(mm_hash)
        if output.total_num_scheduled_tokens == 0:
            ec_output = self.active.no_forward(output).ec_connector_output
        else:
            with self.active.maybe_get_output(output) as ec_output:
                self._run_encoder(output, step)
        sh.finish(self.scheduler, step, ec_output)
        return step

    def _run_encoder(self, output: SchedulerOutput, step: sh.Step) -> None:
        for req_id, inputs in output.scheduled_encoder_inputs.items():
            for index in inputs:
                feature = self.scheduler.requests[req_id].mm_features[index]
                if feature.data is None or feature.identifier in self.cache.encoder_outputs:
                    continue  # (as MRv2's prepare_mm_inputs skips them)
                rows = feature.mm_position.get_num_embeds()
                self.cache.encoder_outputs[feature.identifier] = self.encode(
                    feature.identifier, rows)
                step.encoded.append(feature.identifier)

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

