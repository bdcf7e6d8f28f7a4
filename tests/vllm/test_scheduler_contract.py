"""ECDaemonConnector under vLLM's own Scheduler (tests.vllm.scheduler_harness):
what vLLM expects of an EC connector where the behaviour is the scheduler's,
with a real daemon."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.multimodal.inputs import MultiModalKwargsItem
from vllm.v1.engine import FinishReason

from tests import groups
from tests.vllm import scheduler_harness as sh
from tests.vllm import vllm_harness as h


@pytest.fixture
def engines(tiny_model, daemon) -> Iterator[Any]:
    """Engines (vLLM's Scheduler + the model runner's stand-in), all shut
    down at the end: `make(role, instance_id, encoder_cache_items, **extra)`."""
    def runner(scheduler: Any, config: Any) -> sh.RunnerStandIn:
        return sh.RunnerStandIn(scheduler, config, sh.encode)

    with sh.engines(tiny_model, daemon.socket, runner) as make:
        yield make


def test_an_item_vllm_evicts_and_allocates_again_in_one_pass_is_never_loaded_over(engines):
    """vLLM evicts img-a and allocates it again in one scheduling pass (its
    encoder cache holds two images): the worker never freed it. Nothing was
    staged for it (vLLM held it when it asked), so it is encoded again, and
    no load ever lands over the tensor the worker holds."""
    engine = engines("ec_both", "keeps", encoder_cache_items=2)
    sh.run_to_end(engine, sh.request("r-a", "img-a"), sh.request("r-b", "img-b"))
    assert engine.worker.worker_delegate.flush(20)
    view = engine.connector.scheduler_delegate.view
    h.wait_until(lambda: view.get("img-a") is not None and view.get("img-b") is not None)
    loads_done = engine.worker.worker_delegate.stats["loads_done"]

    engine.scheduler.add_request(sh.request("r-c", "img-c"))  # a miss: evicts img-a
    engine.scheduler.add_request(sh.request("r-a2", "img-a"))  # evicts img-b
    step = engine.step()
    metadata = step.output.ec_connector_metadata
    assert (metadata.loads, metadata.adopt, metadata.inline) == ([], [], [])
    assert sorted(step.encoded) == ["img-a", "img-c"]
    assert step.output.free_encoder_mm_hashes == ["img-b"]
    assert torch.equal(engine.encoder_cache["img-a"], sh.encode("img-a"))
    assert engine.worker.worker_delegate.stats["loads_done"] == loads_done
    assert set(step.finished) == {"r-c", "r-a2"}


@pytest.mark.writes_region
def test_a_hit_on_an_idle_engine_is_staged_by_the_schedulers_process(engines):
    """vLLM's V1 runner runs no connector in a step that schedules nothing:
    a lone request's load is copied and verified by the scheduler's process
    and carried whole by the step that uses it (where vLLM has that runner)."""
    producer = engines("ec_producer", "encoder")
    sh.run_to_end(producer, sh.request("e1", "img-a"), sh.request("e2", "img-bad"))
    assert producer.worker.worker_delegate.flush(20)
    engine = engines("ec_consumer", "idle")
    if engine.idle_steps_run:
        pytest.skip(groups.VLLM.reason("this vLLM has no V1 model runner (0.34 removed it)"))
    view = engine.connector.scheduler_delegate.view
    h.wait_until(lambda: view.get("img-a") is not None and view.get("img-bad") is not None)
    bad = view.get("img-bad")
    region = engine.connector.scheduler_delegate.link.attachment.region
    with open(region.path, "r+b") as f:  # another process rewrites 64 of its bytes
        f.seek(bad.extents[0][0] + 100)
        f.write(bytes(range(64)))
    bad_stamp = bad.entry_id + 1000
    h.overwrite_stamps(region, bad.extents, bad_stamp)

    steps = sh.run_to_end(engine, sh.request("r1", "img-a"), sh.request("r2", "img-bad"))
    assert steps[0].output.total_num_scheduled_tokens == 0  # both deferred: an idle step
    assert sh.staged(steps) == [] and sh.adopted(steps) == ["img-a"]
    assert [s.output.ec_connector_metadata.inline[0].mm_hash for s in steps
            if s.output.ec_connector_metadata.inline] == ["img-a"]
    assert torch.equal(engine.encoder_cache["img-a"], sh.encode("img-a"))
    assert [mm for s in steps for mm in s.encoded] == ["img-bad"]  # encoded, not loaded
    assert {r for s in steps for r in s.finished} == {"r1", "r2"}


def test_items_vllm_holds_are_never_asked_about_nor_deferred(engines, daemon):
    """Another engine shares the namespace (so wants are sent) and claims
    img-x; this engine already holds img-x in vLLM's encoder cache (a
    consumer: never in the daemon). A request for it needs no transfer."""
    engine = engines("ec_consumer", "holder")
    sh.run_to_end(engine, sh.request("r1", "img-x"))
    assert "img-x" in engine.encoder_cache
    assert engine.connector.scheduler_delegate.view.get("img-x") is None

    other = engines("ec_both", "claimant")
    h.wait_until(lambda: engine.connector.scheduler_delegate.wanting)
    assert other.connector.ensure_cache_available(sh.request("o1", "img-x"), 0)  # claims it
    wants = daemon.stats()["convergence"]["wants"]

    steps = sh.run_to_end(engine, sh.request("r2", "img-x"))
    assert len(steps) == 1 and steps[0].encoded == []  # not deferred, not encoded again
    assert "r2" in steps[0].finished
    assert daemon.stats()["convergence"]["wants"] == wants  # nothing asked


def test_a_producer_reports_vllms_ec_transfer_params_and_a_consumer_loads_metadata_only_items(
        engines):
    """E/PD: the producer's finished request carries vLLM's per-item
    `ec_transfer_params`; vLLM's token-in-token-out protocol accepts them
    for metadata-only items; the consumer, given such an item (no media),
    loads it from the cache and never schedules the encoder for it."""
    producer = engines("ec_producer", "encoder")
    (step,) = sh.run_to_end(producer, sh.request("e1", "img-e"))
    params = step.finished["e1"].ec_transfer_params
    assert list(params) == ["img-e"] and sh.reported(params["img-e"])
    GenerateRequest.model_validate({
        "token_ids": [2, 5, 7], "sampling_params": {}, "ec_transfer_params": params,
        "features": {"mm_hashes": {"image": ["img-e"]},
                     "mm_placeholders": {"image": [{"offset": 1, "length": 1}]},
                     "mm_metadata": {"image": ["metadata-only"]}}})
    assert producer.worker.worker_delegate.flush(20)

    consumer = engines("ec_consumer", "prefill-decode")
    metadata_only = MultiModalKwargsItem({})  # what is left of an item without its media
    steps = sh.run_to_end(consumer, sh.request("p1", "img-e", metadata_only, params))
    assert [s.encoded for s in steps] == [[]] * len(steps)  # never encoded here
    assert sh.adopted(steps) == ["img-e"]
    assert torch.equal(consumer.encoder_cache["img-e"], sh.encode("img-e"))
    assert steps[-1].finished["p1"].finish_reason == FinishReason.LENGTH


def test_a_metadata_only_item_the_cache_never_gets_fails_its_request_not_the_engine(engines):
    consumer = engines("ec_consumer", "pd", ec_daemon_max_defer_seconds=0.5)
    params = {"img-never": {"item_indices": [0], "metadata": {}}}
    consumer.scheduler.add_request(sh.request("p1", "img-never", MultiModalKwargsItem({}),
                                              params))
    finished: dict[str, Any] = {}
    h.wait_until(lambda: finished.update(consumer.step().finished) or "p1" in finished,
                 timeout=30)
    assert finished["p1"].finish_reason == FinishReason.ERROR
    assert "img-never" not in consumer.encoder_cache  # the encoder never ran on it
    # The engine goes on: a request with its media is encoded as usual.
    steps = sh.run_to_end(consumer, sh.request("p2", "img-media"))
    assert [mm for s in steps for mm in s.encoded] == ["img-media"]


def test_a_metadata_only_request_fails_at_once_when_the_producers_save_was_dropped(
        engines, daemon):
    """The encoder instance's worker drops the save (its queue is full)
    after vLLM finished the request in the same step, so the producer
    announced the item without knowing. It had claimed the item, and its
    worker reports the dropped save to the daemon at once: the consumer,
    which has no media to encode from, fails the request at once, not after
    ec_daemon_max_defer_seconds (120 s here)."""
    consumer = engines("ec_consumer", "pd", ec_daemon_max_defer_seconds=120)
    producer = engines("ec_producer", "encoder", ec_daemon_save_queue_bytes=1)
    h.wait_until(lambda: producer.connector.scheduler_delegate.wanting
                 and consumer.connector.scheduler_delegate.wanting)
    (step,) = sh.run_to_end(producer, sh.request("e1", "img-d"))
    params = step.finished["e1"].ec_transfer_params
    assert list(params) == ["img-d"]  # announced: the drop was not known yet
    assert daemon.stats()["convergence"]["claims"] == 1  # claimed before encoding
    assert producer.worker.worker_delegate.stats["saves_skipped_busy"] == 1

    consumer.scheduler.add_request(sh.request("p1", "img-d", MultiModalKwargsItem({}), params))
    finished: dict[str, Any] = {}
    h.wait_until(lambda: finished.update(consumer.step().finished) or "p1" in finished,
                 timeout=60)  # (half the deferral's bound: told by the daemon)
    assert finished["p1"].finish_reason == FinishReason.ERROR
    assert "img-d" not in consumer.encoder_cache
