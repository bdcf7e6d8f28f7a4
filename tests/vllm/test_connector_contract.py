"""ECDaemonConnector against real vLLM: built by vLLM's factory from a real
VllmConfig, driven through the calls vLLM's scheduler and model runner make."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

from tests.vllm import vllm_harness as h

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def engine(tiny_model, daemon):
    scheduler, worker = h.start_engine(str(tiny_model), daemon.socket, "ec_both", "contract")
    yield scheduler, worker
    scheduler.shutdown()
    worker.shutdown()


def test_factory_builds_both_roles(engine):
    from ec_client.vllm_connector import ECDaemonConnector

    scheduler, worker = engine
    assert isinstance(scheduler, ECDaemonConnector) and isinstance(worker, ECDaemonConnector)
    assert scheduler._scheduler is not None and scheduler._worker is None
    assert worker._worker is not None and worker._scheduler is None
    assert scheduler.is_producer and scheduler.is_consumer


def test_miss_then_save_then_hit_loads_bit_exact(engine, daemon):
    scheduler, worker = engine
    tensor = h.encoder_output(1)
    _, hits = h.step(scheduler, worker, [h.request("r1", "img-1")], {"img-1": tensor})
    assert hits == [False]
    assert worker._worker.flush(20)
    h.wait_until(lambda: scheduler._scheduler.view.get("img-1") is not None)

    cache, hits = h.step(scheduler, worker, [h.request("r2", "img-1")], {})
    assert hits == [True]
    assert torch.equal(cache["img-1"], tensor) and cache["img-1"].dtype == tensor.dtype
    assert scheduler.take_unavailable_requests() == set()
    stats = daemon.stats()
    assert stats["loads"] == 1 and stats["pinned_bytes"] == 0
    assert scheduler._scheduler.transport.calls_from_this_thread() == 0


def test_a_load_that_cannot_be_served_fails_the_request_not_the_engine(engine, daemon):
    scheduler, worker = engine
    tensor = h.encoder_output(2)
    h.step(scheduler, worker, [h.request("r1", "img-2")], {"img-2": tensor})
    worker._worker.flush(20)
    h.wait_until(lambda: scheduler._scheduler.view.get("img-2") is not None)

    req = h.request("doomed", "img-2")
    assert scheduler.has_cache_item("img-2")
    scheduler.update_state_after_alloc(req, 0)
    output = h.empty_output()
    output.ec_connector_metadata = scheduler.build_connector_meta(output)
    daemon.kill()  # the daemon dies between dispatch and the worker's copy

    cache: dict[str, torch.Tensor] = {}
    worker.bind_connector_metadata(output.ec_connector_metadata)
    worker.start_load_caches(cache)  # must not raise
    assert torch.count_nonzero(cache["img-2"]) == 0  # a placeholder, never stale bytes
    meta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    scheduler.update_connector_output(h.ECConnectorOutput(ec_connector_worker_meta=meta))
    assert scheduler.take_unavailable_requests() == {"doomed"}
    # The view goes with the session, as soon as the link notices the daemon died.
    h.wait_until(lambda: scheduler._scheduler.view.get("img-2") is None, timeout=10)
    assert not scheduler.has_cache_item("img-2")


def test_engines_start_and_serve_without_a_daemon(tiny_model, tmp_path):
    config = h.make_config(tiny_model, f"unix://{tmp_path}/none.sock", "ec_both")
    scheduler = h.connector(config, ECConnectorRole.SCHEDULER)
    worker = h.connector(config, ECConnectorRole.WORKER)
    try:
        cache, hits = h.step(scheduler, worker, [h.request("r", "img-x")],
                             {"img-x": h.encoder_output(3)})
        assert hits == [False] and set(cache) == {"img-x"}
        assert worker._worker.stats["saves_skipped_detached"] == 1
        assert scheduler.take_unavailable_requests() == set()
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_two_engine_processes_share_outputs_bit_exact(tiny_model, daemon):
    seeds = [11, 12, 13]
    procs = []
    try:
        for target in (h.producer_engine_main, h.consumer_engine_main):
            parent, child = SPAWN.Pipe()
            proc = SPAWN.Process(target=target, args=(str(tiny_model), daemon.socket, seeds,
                                                      child), daemon=True)
            proc.start()
            procs.append(proc)
            assert parent.poll(180), f"{target.__name__} sent nothing"
            result = parent.recv()
            proc.join(60)
            assert proc.exitcode == 0
            if target is h.producer_engine_main:
                assert result.get("saves_done") == len(seeds), result
        assert result["hits"] == [True] * len(seeds)
        assert result["exact"] == len(seeds) and result["unavailable"] == []
        assert result["scheduler_rpcs"] == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
