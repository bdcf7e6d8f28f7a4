"""ECDaemonConnector's worker half under Model Runner V2, the only way vLLM
0.34 drives an EC connector: vLLM's own `ActiveECConnector` (the GPU class on
CPU tensors, and from 0.34 the CPU class) beside vLLM's own Scheduler, with
a real daemon (tests.vllm.runner_v2). Across steps: new keys saved once,
loads staged in a step without tokens (MRv2's `no_forward`), bit-exact and
never saved back, `start_save_caches` and `get_finished`, a load that fails
(its request re-encodes the item, or fails without its media), a request
finished mid-load; audio and video items as images; and the stats of the
step that ends activity reaching vLLM's stat loggers (what /metrics shows)
while the engine then idles."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import vllm
from packaging.version import Version
from vllm.multimodal.inputs import MultiModalKwargsItem
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from ec_client import vllm_connector, vllm_scheduler_role
from tests import groups
from tests.vllm import runner_v2 as r2
from tests.vllm import scheduler_harness as sh
from tests.vllm import vllm_harness as h

KINDS = [pytest.param("gpu"), pytest.param("cpu", marks=pytest.mark.skipif(
    importlib.util.find_spec(r2.KINDS["cpu"][0]) is None,
    reason=groups.VLLM_LATEST.reason("this vLLM has no CPU ActiveECConnector (0.34 added it)")))]


@pytest.fixture(params=KINDS)
def engines(request, tiny_model, daemon, monkeypatch) -> Iterator[Any]:
    """Engines (vLLM's Scheduler, logging stats, and MRv2's connector class
    of the parameter's kind), all shut down at the end:
    `make(role, instance_id, **extra)`. Their connectors know the workers
    run Model Runner V2 (vLLM 0.32 and 0.33 choose it per engine where Triton
    is, which this CPU lacks)."""
    monkeypatch.setattr(vllm_connector, "workers_run_idle_steps", lambda config: True)
    with sh.engines(tiny_model, daemon.socket,
                    lambda scheduler, config: r2.RunnerV2(scheduler, config, sh.encode,
                                                          kind=request.param),
                    log_stats=True) as make:
        yield make


def calls(runner: r2.RunnerV2, method: str) -> list[Any]:
    """Spy on the WORKER connector's `method` as MRv2's class calls it."""
    spy = mock.MagicMock(wraps=getattr(runner.worker, method))
    setattr(runner.worker, method, spy)  # (the class holds this very object)
    return spy.call_args_list


def published(runner: r2.RunnerV2, *mm_hashes: str) -> None:
    """Wait until `runner`'s scheduler view offers every one of `mm_hashes`."""
    view = runner.connector.scheduler_delegate.view
    h.wait_until(lambda: all(view.get(mm_hash) is not None for mm_hash in mm_hashes))


def produce(engines: Any, *mm_hashes: str) -> r2.RunnerV2:
    """An encoder engine that encoded and saved these items."""
    producer = engines("ec_producer", "encoder")
    sh.run_to_end(producer, *(r2.request(f"e-{m}", m) for m in mm_hashes))
    assert producer.worker.worker_delegate.flush(20)
    return producer


def test_new_keys_are_saved_once_across_steps(engines, daemon):
    engine = engines("ec_producer", "saves")
    started = calls(engine, "start_save_caches")
    saved = calls(engine, "save_caches")
    finished = calls(engine, "get_finished")

    steps = sh.run_to_end(engine, r2.request("r1", "img-a"))
    # img-a stays in MRv2's encoder cache: a later step finds it there and
    # neither encodes nor saves it again; img-b is new.
    steps += sh.run_to_end(engine, r2.request("r2", "img-a"), r2.request("r3", "img-b"))
    assert [s.encoded for s in steps] == [["img-a"], ["img-b"]]
    assert [c.kwargs["mm_hash"] for c in saved] == ["img-a", "img-b"]
    assert engine.worker.worker_delegate.flush(20)
    stats = engine.worker.worker_delegate.stats
    assert stats["saves_done"] == 2 and stats["saves_already_cached"] == 0
    daemon.wait_for(lambda: daemon.stats()["entries"] == 2, what="both entries ready")

    # start_save_caches each step, before the forward, with MRv2's own cache;
    # get_finished each step with the scheduler's finished requests, and
    # nothing held back: vLLM frees each request in the step it finishes.
    assert len(started) == len(finished) == len(steps)
    assert all(c.kwargs["encoder_cache"] is engine.cache.encoder_outputs for c in started)
    assert [c.args[0] for c in finished] == [s.output.finished_req_ids for s in steps]
    assert [sorted(s.finished) for s in steps] == [["r1"], ["r2", "r3"]]


def test_a_consumer_loads_bit_exact_and_never_saves_back_what_it_loaded(engines):
    produce(engines, "img-a")
    engine = engines("ec_both", "loads")
    saved = calls(engine, "save_caches")
    published(engine, "img-a")

    staging, using = sh.run_to_end(engine, r2.request("r1", "img-a"))
    # The request waits a step while its load is staged (MRv2 runs the
    # connector in the step that schedules nothing), then adopts it.
    assert staging.output.total_num_scheduled_tokens == 0 and staging.finished == {}
    assert sh.staged([staging]) == ["img-a"] and sh.adopted([using]) == ["img-a"]
    assert using.encoded == [] and "r1" in using.finished
    assert torch.equal(engine.encoder_cache["img-a"], sh.encode("img-a"))
    # The load put img-a in the cache before MRv2 noted what was there: not new.
    assert saved == [] and engine.worker.worker_delegate.stats["saves_done"] == 0
    assert engine.connector.scheduler_delegate.view.inflight() == 0  # reported
    assert engine.worker.worker_delegate.staging.bytes == 0  # adopted, nothing kept aside
    assert engine.scheduler.ec_connector.take_unavailable_requests() == set()


def corrupt(engine: r2.RunnerV2, spec: Any, region: Any) -> None:
    """Its pages now belong to another entry (which no ordinary event allows)."""
    h.overwrite_stamps(region, spec.extents, spec.entry_id + 1000)


@pytest.mark.writes_region
def test_a_load_that_fails_costs_its_request_a_miss_and_the_engine_goes_on(engines):
    produce(engines, "img-good", "img-bad")
    engine = engines("ec_consumer", "fails")
    published(engine, "img-good", "img-bad")
    engine.scheduler.add_request(r2.request("r1", "img-good"))
    engine.scheduler.add_request(r2.request("r2", "img-bad"))
    output = engine.scheduler.schedule()  # both deferred, their loads staged
    metadata = output.ec_connector_metadata
    bad = next(spec for spec in metadata.loads if spec.mm_hash == "img-bad")
    corrupt(engine, bad, metadata.regions[bad.generation])

    steps = [engine.execute(output)]  # nothing raised
    assert engine.encoder_cache == {}
    while engine.scheduler.has_unfinished_requests():
        assert len(steps) < 5
        steps.append(engine.step())
    assert sh.adopted(steps) == ["img-good"]
    assert [mm for s in steps for mm in s.encoded] == ["img-bad"]  # re-encoded here
    assert torch.equal(engine.encoder_cache["img-bad"], sh.encode("img-bad"))
    finished = {r: out.finish_reason for s in steps for r, out in s.finished.items()}
    assert finished == {"r1": FinishReason.LENGTH, "r2": FinishReason.LENGTH}
    assert engine.worker.worker_delegate.stats["loads_stamp_mismatch"] == 1


@pytest.mark.writes_region
def test_a_metadata_only_item_whose_load_fails_fails_its_request_not_the_engine(engines):
    producer = engines("ec_producer", "encoder")
    (step,) = sh.run_to_end(producer, r2.request("e1", "img-e"))
    params = step.finished["e1"].ec_transfer_params
    assert producer.worker.worker_delegate.flush(20)
    consumer = engines("ec_consumer", "prefill-decode")
    published(consumer, "img-e")
    consumer.scheduler.add_request(r2.request("p1", "img-e", data=MultiModalKwargsItem({}),
                                              ec_transfer_params=params))
    output = consumer.scheduler.schedule()
    (spec,) = output.ec_connector_metadata.loads
    corrupt(consumer, spec, output.ec_connector_metadata.regions[spec.generation])
    steps = [consumer.execute(output)]
    while consumer.scheduler.has_unfinished_requests():
        assert len(steps) < 5
        steps.append(consumer.step())
    assert steps[-1].finished["p1"].finish_reason == FinishReason.ERROR
    assert [mm for s in steps for mm in s.encoded] == [] and "img-e" not in consumer.encoder_cache
    # The engine goes on: a request with its media is served as usual.
    (again,) = sh.run_to_end(consumer, r2.request("p2", "img-new"))
    assert again.encoded == ["img-new"] and again.finished["p2"].finish_reason == \
        FinishReason.LENGTH


def test_a_request_finished_mid_load_keeps_its_entry_until_the_worker_reported(engines):
    produce(engines, "img-a")
    engine = engines("ec_consumer", "aborts")
    published(engine, "img-a")
    view = engine.connector.scheduler_delegate.view
    engine.scheduler.add_request(r2.request("r1", "img-a"))
    output = engine.scheduler.schedule()  # the load is staged...
    assert sh.staged([sh.Step(output)]) == ["img-a"]
    engine.scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)  # ...then aborted
    assert view.inflight() == 1  # its pages stay the entry's while the worker may copy

    step = engine.execute(output)  # the worker stages all the same, and reports
    assert view.inflight() == 0 and step.finished == {}
    assert engine.worker.worker_delegate.staging.bytes == spec_bytes(output)
    assert engine.scheduler.ec_connector.take_unavailable_requests() == set()

    # The engine goes on: the staged copy nobody uses is dropped, and the
    # next request for the item stages and loads it again.
    steps = sh.run_to_end(engine, r2.request("r2", "img-a"))
    assert steps[0].output.ec_connector_metadata.drop == [output.ec_connector_metadata.loads[0]
                                                           .transfer_id]
    assert sh.adopted(steps) == ["img-a"] and [s.encoded for s in steps] == [[], []]
    assert steps[-1].finished["r2"].finish_reason == FinishReason.LENGTH
    assert torch.equal(engine.encoder_cache["img-a"], sh.encode("img-a"))
    assert engine.worker.worker_delegate.staging.bytes == 0


def spec_bytes(output: Any) -> int:
    return sum(spec.nbytes for spec in output.ec_connector_metadata.loads)


@pytest.mark.parametrize(("modality", "embeds"), [("audio", 10), ("video", h.IMAGE_TOKENS)])
def test_audio_and_video_items_are_saved_and_loaded_like_images(engines, modality, embeds):
    """An encoder instance's audio (its placeholder has positions that are
    not embeddings: vLLM's `is_embed`) or video item, announced in vLLM's
    `ec_transfer_params` (with its modality from 0.33) and sent to the
    PD instance without media: loaded, bit-exact, never encoded there."""
    producer = engines("ec_producer", "encoder")
    (step,) = sh.run_to_end(producer, r2.request("e1", "clip-1", modality, embeds=embeds))
    assert step.encoded == ["clip-1"]
    assert producer.worker.worker_delegate.flush(20)
    assert producer.worker.worker_delegate.stats["saves_done"] == 1
    params = step.finished["e1"].ec_transfer_params
    assert list(params) == ["clip-1"] and params["clip-1"]["item_indices"] == [0]
    if Version(vllm.__version__) >= Version("0.33"):  # (0.32's params do not say)
        assert params["clip-1"]["modality"] == modality

    consumer = engines("ec_consumer", "prefill-decode")
    published(consumer, "clip-1")
    steps = sh.run_to_end(consumer, r2.request("p1", "clip-1", modality,
                                               MultiModalKwargsItem({}), embeds, params))
    assert [s.encoded for s in steps] == [[]] * len(steps)
    assert sh.staged(steps) == sh.adopted(steps) == ["clip-1"]
    loaded = consumer.encoder_cache["clip-1"]
    assert loaded.shape == (embeds, h.HIDDEN) and torch.equal(loaded, sh.encode("clip-1", embeds))
    assert steps[-1].finished["p1"].finish_reason == FinishReason.LENGTH


# ------------------------------------------------------------------ stats


def loads_reported(steps: list[sh.Step]) -> list[int]:
    """The loads each step handed vLLM's stat loggers."""
    return [(s.ec_stats or {}).get("loads", 0) for s in steps]


def test_the_step_that_ends_activity_hands_vllm_every_count(engines, monkeypatch):
    """vLLM asks for connector stats only in a step's update_from_output: a
    count held back for the interval would reach /metrics only at the next
    request, however long the engine idles. The step in which the last
    request finishes hands out all that is pending; while requests run, the
    interval still paces the handouts."""
    produce(engines, "img-a", "img-b", "img-c")
    engine = engines("ec_consumer", "idles")
    published(engine, "img-a", "img-b", "img-c")
    monkeypatch.setattr(vllm_scheduler_role, "STATS_INTERVAL_SECONDS", 3600.0)

    # (Each load is staged in a step that defers its request, then adopted.)
    assert loads_reported(sh.run_to_end(engine, r2.request("r1", "img-a"))) == [1, 0]
    # Within the interval, and the engine then idles: handed out all the same.
    assert loads_reported(sh.run_to_end(engine, r2.request("r2", "img-b"))) == [0, 1]
    # A request still decoding after its load: paced until the step it ends.
    steps = sh.run_to_end(engine, r2.request("r3", "img-c", max_tokens=3))
    assert loads_reported(steps) == [0, 0, 0, 1]
    assert steps[-1].ec_stats is not None and steps[-1].ec_stats["lookups"] == 1


def test_an_idle_engine_tells_vllms_metrics_whether_it_is_attached(engines, daemon):
    """`vllm:ec_daemon_attached`: vLLM asks for connector stats only in a
    step, and an idle engine runs none. The connector keeps vLLM's loop
    stepping (`has_pending_push_work`, which vLLM's `has_requests` asks) until
    the stats that say the change went out; then the engine idles again."""
    engine = engines("ec_both", "idle")
    scheduler = engine.scheduler
    assert scheduler.has_requests()  # nothing to run, but /metrics must hear "attached"
    step = engine.step()
    assert not step.output.num_scheduled_tokens and step.ec_stats == {"attached": 1}
    assert not scheduler.has_requests()  # told: the loop may idle
    daemon.kill()
    h.wait_until(scheduler.has_requests, timeout=20)  # the link noticed
    assert engine.step().ec_stats == {"attached": 0}
    assert not scheduler.has_requests()
