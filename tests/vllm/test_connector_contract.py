"""ECDaemonConnector against real vLLM: built by vLLM's factory from a real
VllmConfig, driven through the calls vLLM's scheduler and model runner make,
with its stats fed to vLLM's own logger and Prometheus classes."""

from __future__ import annotations

import gc
import multiprocessing
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorLogging, ECConnectorProm
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from ec_client.vllm_connector import ECDaemonConnectorMetadata, ECDaemonWorkerMetadata
from ec_client.vllm_engine import expected_reports
from ec_client.vllm_metrics import ECDaemonStats
from ec_protocol.protocol import pb
from tests import cuda_model
from tests.integration.daemon import Daemon
from tests.vllm import vllm_harness as h
from tests.vllm.slow_copy import SlowLoadBackend

try:  # vLLM 0.32's older Ray executor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0); gone in 0.33
    from vllm.v1.executor.ray_executor import RayDistributedExecutor
except ImportError:
    RayDistributedExecutor = None

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def engine(tiny_model, daemon):
    scheduler, worker = h.start_engine(str(tiny_model), daemon.socket, "ec_both", "contract")
    yield scheduler, worker
    scheduler.shutdown()
    worker.shutdown()


def hit_cycle(scheduler: Any, worker: Any, mm_hash: str, seed: int) -> dict[str, torch.Tensor]:
    """A miss whose output the engine computes and saves, then a hit that
    loads it (staged in the step before); returns the encoder cache of the
    hit's steps."""
    h.save_and_publish(scheduler, worker, mm_hash, h.encoder_output(seed))
    cache, hits = h.serve(scheduler, worker, [h.request(f"r2-{mm_hash}", mm_hash)])
    assert hits == [True]
    return cache


def test_factory_builds_both_roles(engine):
    from ec_client.vllm_connector import ECDaemonConnector

    scheduler, worker = engine
    assert isinstance(scheduler, ECDaemonConnector) and isinstance(worker, ECDaemonConnector)
    assert scheduler.scheduler_delegate is not None and scheduler.worker_delegate is None
    assert worker.worker_delegate is not None and worker.scheduler_delegate is None
    assert scheduler.is_producer and scheduler.is_consumer


def test_miss_then_save_then_hit_loads_bit_exact(engine, daemon):
    scheduler, worker = engine
    tensor = h.encoder_output(1)
    _, hits = h.step(scheduler, worker, [h.request("r1", "img-1")], {"img-1": tensor})
    assert hits == [False]
    h.forget(scheduler, ["img-1"])
    assert worker.worker_delegate.flush(20)
    h.wait_until(lambda: scheduler.scheduler_delegate.view.get("img-1") is not None)

    request = h.request("r2", "img-1")
    metadata = h.dispatch(scheduler, [request])  # deferred: its load is staged this step
    assert isinstance(metadata, ECDaemonConnectorMetadata)
    (spec,) = metadata.loads
    assert spec.mm_hash == "img-1" and spec.generation in metadata.regions
    assert scheduler.scheduler_delegate.view.inflight() == 1
    cache: dict[str, torch.Tensor] = {}
    meta = h.load(worker, metadata, cache)
    assert cache == {}  # staged aside, not yet in vLLM's encoder cache
    assert isinstance(meta, ECDaemonWorkerMetadata) and meta.done == [spec.transfer_id]
    scheduler.update_connector_output(h.ECConnectorOutput(ec_connector_worker_meta=meta))
    assert scheduler.scheduler_delegate.view.inflight() == 0  # the one rank reported

    metadata = h.use(scheduler, [request])  # a hit now: the step adopts the staged load
    assert metadata.loads == [] and [a.transfer_id for a in metadata.adopt] == [spec.transfer_id]
    h.load(worker, metadata, cache)
    assert torch.equal(cache["img-1"], tensor) and cache["img-1"].dtype == tensor.dtype
    assert scheduler.take_unavailable_requests() == set()
    # The load made no call at all; the daemon learns of it from a heartbeat.
    assert scheduler.scheduler_delegate.transport.calls_from_this_thread() == 0
    daemon.wait_for(lambda: daemon.stats()["loads"] == 1, what="the load's touch")


def test_a_load_dispatched_before_the_daemon_died_returns_the_saved_bytes(engine, daemon):
    scheduler, worker = engine
    tensor = h.encoder_output(2)
    h.save_and_publish(scheduler, worker, "img-2", tensor)
    request = h.request("r", "img-2")
    metadata = h.dispatch(scheduler, [request])
    daemon.kill()  # between dispatch and the worker's copy; nobody reuses its pages

    cache: dict[str, torch.Tensor] = {}
    meta = h.load(worker, metadata, cache)
    scheduler.update_connector_output(h.ECConnectorOutput(ec_connector_worker_meta=meta))
    h.load(worker, h.use(scheduler, [request]), cache)  # staged: no daemon needed
    assert torch.equal(cache["img-2"], tensor)
    assert scheduler.take_unavailable_requests() == set()
    # The view goes with the session as soon as the link notices the daemon died.
    h.wait_until(lambda: scheduler.scheduler_delegate.view.get("img-2") is None, timeout=10)
    assert scheduler.ensure_cache_available(h.request("r2", "img-2"), 0)  # a miss now
    assert not scheduler.has_cache_item("img-2")


@pytest.mark.writes_region
def test_a_load_whose_stamp_no_longer_matches_costs_its_request_not_the_engine(engine):
    scheduler, worker = engine
    h.save_and_publish(scheduler, worker, "img-good", h.encoder_output(3))
    h.save_and_publish(scheduler, worker, "img-bad", h.encoder_output(4))
    good, bad_request = h.request("r1", "img-good"), h.request("r2", "img-bad")
    metadata = h.dispatch(scheduler, [good, bad_request])
    bad = next(spec for spec in metadata.loads if spec.mm_hash == "img-bad")
    # Its pages now belong to another entry (which no ordinary event allows).
    h.overwrite_stamps(metadata.regions[bad.generation], bad.extents, bad.entry_id + 1000)

    kept = torch.ones(2)
    cache = {"already-there": kept}
    meta = h.load(worker, metadata, cache)  # no exception: the failure is reported
    assert cache == {"already-there": kept} and cache["already-there"] is kept
    assert worker.worker_delegate.stats["loads_stamp_mismatch"] == 1
    scheduler.update_connector_output(h.ECConnectorOutput(ec_connector_worker_meta=meta))
    # The good item is a hit; the bad one a miss its request encodes.
    assert scheduler.ensure_cache_available(good, 0)
    assert scheduler.ensure_cache_available(bad_request, 0)
    assert scheduler.has_cache_item("img-good") and not scheduler.has_cache_item("img-bad")
    assert scheduler.take_unavailable_requests() == set()


def test_engines_start_and_serve_without_a_daemon(tiny_model, tmp_path):
    config = h.make_config(tiny_model, f"unix://{tmp_path}/none.sock", "ec_both")
    scheduler = h.connector(config, ECConnectorRole.SCHEDULER)
    worker = h.connector(config, ECConnectorRole.WORKER)
    try:
        cache, hits = h.step(scheduler, worker, [h.request("r", "img-x")],
                             {"img-x": h.encoder_output(3)})
        assert hits == [False] and set(cache) == {"img-x"}
        assert worker.worker_delegate.stats["saves_skipped_detached"] == 1
        assert scheduler.take_unavailable_requests() == set()
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_a_copy_backend_is_chosen_by_class_name(tiny_model, tmp_path):
    socket = f"unix://{tmp_path}/none.sock"
    name = "tests.vllm.slow_copy:SlowLoadBackend"
    config = h.make_config(tiny_model, socket, ec_daemon_copy_backend=name)
    worker = h.connector(config, ECConnectorRole.WORKER)
    try:
        assert isinstance(worker.worker_delegate.backend, SlowLoadBackend)
    finally:
        worker.shutdown()
    malformed = h.make_config(tiny_model, socket, ec_daemon_copy_backend="tests.vllm.slow_copy:")
    with pytest.raises(ValueError, match="malformed copy backend"):
        h.connector(malformed, ECConnectorRole.WORKER)


def _model_step(tiny_model: Any, daemon: Any, old_pattern: bool = False) -> Any:
    """A save and a hit through the connector's worker half on the CUDA copy
    path (the torch and cupy backends' one path) under the model of CUDA's
    rules, whose compute stream has the engine's work queued around every
    load (tests.cuda_model:EngineBackend). `old_pattern`: the load made the
    host wait for the compute stream, as it once did. Returns the model."""
    name = "tests.cuda_model:EngineBackend"
    scheduler, worker = h.start_engine(str(tiny_model), daemon.socket, "ec_both", "model",
                                       ec_daemon_copy_backend=name)
    try:
        backend = worker.worker_delegate.backend
        assert isinstance(backend, cuda_model.Backend)
        model = backend.model
        if old_pattern:
            wait = model.wait
            model.wait = lambda stream, event: (  # type: ignore[method-assign]
                wait(stream, event),
                stream is model.compute and model.synchronize_stream(stream))
        cache = hit_cycle(scheduler, worker, "img-m", 11)
        assert torch.equal(cache["img-m"], h.encoder_output(11))
        del cache
    finally:
        scheduler.shutdown()
        worker.shutdown()
    gc.collect()
    model.drain()
    assert backend.consumed == 1  # the forward pass read the loaded output
    return model


def test_the_worker_half_keeps_cudas_rules_under_the_model(tiny_model, daemon):
    """Saves, then a hit whose tensor comes from the backend's `empty` and
    lands bit-exact, with no rule broken and the compute stream, busy with
    the engine's work, never waited for by the host."""
    model = _model_step(tiny_model, daemon)
    assert model.violations == [] and model.compute_host_waits == 0


def test_the_host_wait_check_fails_with_the_old_pattern_put_back(tiny_model, daemon):
    """The check above can fail: a load that makes the host wait for the
    compute stream is counted, since the engine's work is queued there."""
    assert _model_step(tiny_model, daemon, old_pattern=True).compute_host_waits > 0


def test_a_copy_backend_for_another_device_is_refused_at_start():
    """The cpu backend on a CUDA worker would put CPU tensors into vLLM's
    encoder cache and fail every save; a CUDA backend on a CPU worker the
    reverse: refused when the worker starts, with what to choose."""
    from ec_client.vllm_worker_role import check_backend_device

    with pytest.raises(ValueError, match="'cpu' copies cpu memory, but this vLLM worker runs "
                                         "on cuda"):
        check_backend_device("cpu", "cpu", "cuda")
    with pytest.raises(ValueError, match="use 'auto'"):
        check_backend_device("torch", "cuda:1", "cpu")
    check_backend_device("cupy", "cuda:1", "cuda")  # no index known: the type matches
    # A backend built on another GPU than the worker's (checked by index too).
    with pytest.raises(ValueError, match="copies on cuda:0, but this vLLM worker runs on cuda:1"):
        check_backend_device("torch", "cuda:0", "cuda:1")
    check_backend_device("cupy", "cuda:1", "cuda:1")


# ----------------------------------------------------------------- stats


def test_stats_count_this_engines_lookups_hits_and_loads(engine):
    scheduler, worker = engine
    first = scheduler.get_ec_connector_stats()  # nothing happened yet: attached, said once
    assert first is not None and first.data == {"attached": 1}
    assert scheduler.get_ec_connector_stats() is None
    hit_cycle(scheduler, worker, "img-5", 5)

    stats = scheduler.get_ec_connector_stats()
    assert isinstance(stats, ECDaemonStats)
    data = dict(stats.data)
    load_seconds = data.pop("load_seconds")
    assert data == {"lookups": 2, "hits": 1, "loads": 1, "load_bytes": 16 * 128 * 4,
                    "saves_done": 1, "loads_done": 1, "loads_adopted": 1}
    assert len(load_seconds) == 1 and 0 < load_seconds[0] < 10
    assert scheduler.get_ec_connector_stats() is None  # each step's counters once
    # By design the worker role reports None: its counters travel in its
    # worker metadata and reach vLLM in the scheduler's stats (docs/vllm.md, Metrics).
    assert worker.get_ec_connector_stats() is None


def test_stats_reach_vllm_at_most_once_an_interval_and_nothing_is_lost(engine, monkeypatch):
    # vLLM asks every step: a summary per interval keeps the hot path cheap.
    from ec_client import vllm_scheduler_role

    scheduler, worker = engine
    monkeypatch.setattr(vllm_scheduler_role, "STATS_INTERVAL_SECONDS", 3600.0)
    hit_cycle(scheduler, worker, "img-7", 7)
    first = scheduler.get_ec_connector_stats()
    assert first is not None and first.data["hits"] == 1
    hit_cycle(scheduler, worker, "img-8", 8)  # another hit
    assert scheduler.get_ec_connector_stats() is None
    scheduler._scheduler._next_stats = 0.0  # the interval is over
    later = scheduler.get_ec_connector_stats()
    assert later is not None and later.data["hits"] == 1 and later.data["loads"] == 1


@pytest.fixture
def prometheus() -> Iterator[None]:
    unregister_vllm_metrics()
    yield
    unregister_vllm_metrics()  # the next test may register the same names


def test_vllms_logger_and_prometheus_take_the_stats(engine, tiny_model, prometheus):
    scheduler, worker = engine
    hit_cycle(scheduler, worker, "img-6", 6)
    stats = scheduler.get_ec_connector_stats()
    assert stats is not None
    # A CUDA worker whose region could not be pinned counts it (a CPU worker never does).
    assert "pin_refused" not in stats.data
    # And saves given up (here: a region file cut under the copy) reach it too.
    assert "saves_region_cut" not in stats.data
    data = dict(stats.data, pin_refused=1, saves_region_cut=1)
    config = h.make_config(tiny_model, "unix:///nonexistent.sock")

    # The console logger: rebuilds the stats from the plain dict, sums steps.
    logging = ECConnectorLogging(config.ec_transfer_config)
    logging.observe(data)
    logging.observe(data)
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert "lookups=4" in line and "hits=2" in line and "loads=2" in line
    assert "attached=1" in line  # a state, not summed over the steps
    assert "hit_rate=0.5" in line and "avg_load_ms=" in line

    # /metrics, built as vLLM's PrometheusStatLogger builds it.
    prom = ECConnectorProm(config, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(data, 0)
    prom.observe(data, 0)
    labels = {"model_name": "m", "engine": "0"}

    def sample(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    assert sample("vllm:ec_daemon_lookups_total") == 4
    assert sample("vllm:ec_daemon_hits_total") == 2
    assert sample("vllm:ec_daemon_loads_total") == 2
    assert data["attached"] == 1 and sample("vllm:ec_daemon_attached") == 1  # a state
    prom.observe({"attached": 0}, 0)  # the daemon went away
    assert sample("vllm:ec_daemon_attached") == 0
    assert sample("vllm:ec_daemon_load_bytes_total") == 2 * data["load_bytes"]
    assert sample("vllm:ec_daemon_saves_total") == 2
    assert sample("vllm:ec_daemon_pin_refused_total") == 2
    assert sample("vllm:ec_daemon_saves_region_cut_total") == 2
    assert sample("vllm:ec_daemon_saves_lost_total") == 0  # (none lost)
    assert sample("vllm:ec_daemon_load_seconds_count") == 2
    assert sample("vllm:ec_daemon_load_seconds_sum") == pytest.approx(
        2 * sum(data["load_seconds"]))


def test_every_counter_a_worker_keeps_reaches_metrics_or_says_why_not():
    """A worker counts what became of each save and load (`stats[...]` in
    ec_client.worker_side and ec_client.copy); each such counter is a
    `vllm:ec_daemon_*` metric, or listed in NOT_EXPORTED with its reason: a
    new way to lose a save is never invisible on /metrics."""
    import ec_client.copy
    import ec_client.worker_side
    from ec_client import vllm_metrics

    counted: set[str] = set()
    for package in (ec_client.worker_side, ec_client.copy):
        for source in Path(package.__file__).parent.glob("*.py"):
            for index in re.findall(r"stats\[([^\]]+)\]", source.read_text()):
                counted.update(re.findall(r'"(\w+)"', index))
    assert {"saves_done", "saves_lost", "saves_region_cut", "pin_refused"} <= counted
    known = vllm_metrics.COUNTERS.keys() | vllm_metrics.GAUGES.keys()
    assert not counted - known - vllm_metrics.NOT_EXPORTED.keys()
    assert not known & vllm_metrics.NOT_EXPORTED.keys()
    assert vllm_metrics.NOT_EXPORTED.keys() <= counted  # (no reason kept for a gone counter)


# -------------------------------------------------------- tensor parallel


class NamedOtherwise(MultiprocExecutor):
    """A MultiprocExecutor by another name (as vLLM 0.33's "ray", RayExecutorV2)."""


def test_expected_reports_count_the_ranks_whose_output_vllm_aggregates(tiny_model):
    config = h.make_config(tiny_model, "unix:///nonexistent.sock", tensor_parallel_size=2)
    parallel = config.parallel_config
    assert parallel.distributed_executor_backend == "mp"
    assert expected_reports(config) == 2
    parallel.prefill_context_parallel_size = 2
    assert expected_reports(config) == 4
    # By the executor's class, not its name: a MultiprocExecutor subclass
    # aggregates every rank's output however it is named.
    parallel.distributed_executor_backend = f"{__name__}.NamedOtherwise"
    assert expected_reports(config) == 4
    parallel.distributed_executor_backend = NamedOtherwise
    assert expected_reports(config) == 4
    # These deliver one rank's output.
    if RayDistributedExecutor is not None:
        parallel.distributed_executor_backend = RayDistributedExecutor
        assert expected_reports(config) == 1
    parallel.distributed_executor_backend = UniProcExecutor
    assert expected_reports(config) == 1
    single = h.make_config(tiny_model, "unix:///nonexistent.sock")
    assert expected_reports(single) == 1


@pytest.fixture
def tp2_engine(tiny_model) -> Iterator[tuple[Daemon, Any, list[Any]]]:
    """A small daemon (16 pages: one entry each; a save that finds no room
    is refused after 0.1 s) and an engine with two tensor-parallel ranks."""
    with Daemon(cpu_bytes="1MiB", extra=("--alloc-wait-seconds", "0.1")) as daemon:
        config = h.make_config(tiny_model, daemon.socket, "ec_both", "tp2",
                               tensor_parallel_size=2)
        scheduler = h.connector(config, ECConnectorRole.SCHEDULER)
        workers = [h.rank_worker(config, rank) for rank in (0, 1)]
        try:
            for conn in (scheduler, *workers):
                h.wait_attached(conn)
            h.wait_until(lambda: scheduler.scheduler_delegate.serving())  # both ranks mapped it
            yield daemon, scheduler, workers
        finally:
            for conn in (scheduler, *workers):
                conn.shutdown()


def lookup_state(daemon: Daemon, scheduler: Any, mm_hash: str) -> Any:
    namespace = scheduler.scheduler_delegate.link.attachment.namespace
    (result,) = daemon.stub.Lookup(pb.LookupRequest(namespace=namespace, mm_hashes=[mm_hash]),
                                   timeout=5).results
    return result


@pytest.mark.parametrize("reports", ["rank0+rank1", "rank1+rank0", "rank0 then rank1"])
def test_tp2_an_entry_stays_protected_until_both_ranks_reported(tp2_engine, reports):
    daemon, scheduler, (rank0, rank1) = tp2_engine
    assert scheduler.scheduler_delegate.ranks == 2
    assert rank0.worker_delegate.saves_enabled and not rank1.worker_delegate.saves_enabled
    tensor = h.encoder_output(7)
    h.save_and_publish(scheduler, rank0, "img-7", tensor)
    request = h.request("r", "img-7")
    metadata = h.dispatch(scheduler, [request])
    caches: list[dict[str, torch.Tensor]] = [{}, {}]
    first = 1 if reports == "rank1+rank0" else 0
    metas = {first: h.load((rank0, rank1)[first], metadata, caches[first])}

    # The entry is evicted while the other rank has not copied yet.
    for seed in range(100, 164):
        if scheduler.scheduler_delegate.view.get("img-7") is None:
            break
        rank0.worker_delegate.save(f"fill-{seed}", h.encoder_output(seed))
        rank0.worker_delegate.flush(20)
    assert lookup_state(daemon, scheduler, "img-7").state == pb.HIDDEN
    if reports == "rank0 then rank1":  # a step that carried rank 0's report only
        scheduler.update_connector_output(h.ECConnectorOutput(ec_connector_worker_meta=metas[0]))
        assert scheduler.scheduler_delegate.view.inflight() == 1
    # More than the cache holds is saved: a page given back would be reused.
    for seed in range(200, 220):
        rank0.worker_delegate.save(f"more-{seed}", h.encoder_output(seed))
        rank0.worker_delegate.flush(20)
    assert lookup_state(daemon, scheduler, "img-7").awaiting == 1

    late = 1 - first
    metas[late] = h.load((rank0, rank1)[late], metadata, caches[late])

    if reports == "rank0 then rank1":
        meta = metas[1]
    else:  # vLLM's aggregator: the first rank's metadata absorbs the others'
        meta = metas[first].aggregate(metas[late])
        (spec,) = metadata.loads
        assert meta.done == [spec.transfer_id, spec.transfer_id]
    scheduler.update_connector_output(h.ECConnectorOutput(ec_connector_worker_meta=meta))
    assert scheduler.scheduler_delegate.view.inflight() == 0
    daemon.wait_for(lambda: lookup_state(daemon, scheduler, "img-7").state == pb.ABSENT,
                    what="the eviction's acknowledgement")
    adopting = h.use(scheduler, [request])  # both ranks staged it: a hit
    for rank, cache in zip((rank0, rank1), caches, strict=True):
        h.load(rank, adopting, cache)
    assert torch.equal(caches[0]["img-7"], tensor) and torch.equal(caches[1]["img-7"], tensor)
    assert scheduler.take_unavailable_requests() == set()


# ------------------------------------------------------- two processes


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
