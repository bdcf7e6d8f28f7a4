"""Saves on the worker's session stream against the real daemon: no call
per save, the same invariants as the unary calls (a pending entry is never
served, a dead writer's pages are quarantined, a frozen writer never
overwrites, an entry cached already is said so), and the unary calls still
work for tools and old clients."""

from __future__ import annotations

import gc
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from tests import cuda_model, staged
from tests.integration import engines
from tests.integration.daemon import Daemon
from tests.integration.engines import Proc

pytestmark = pytest.mark.integration
LEASE = 2.0
MiB = 1 << 20


@pytest.fixture(scope="module")
def leased() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="64MiB", extra=("--lease-seconds", str(LEASE))) as d:
        yield d


def worker_on(daemon: Daemon, engine_id: str, **options: object) -> WorkerDelegate:
    options.setdefault("role", "producer")
    worker = WorkerDelegate(daemon.socket, engine_id=engine_id, layout=engines.LAYOUT,
                            **options)  # type: ignore[arg-type]
    assert worker.link.wait_attached(10) is not None
    return worker


@pytest.mark.parametrize("backend", ["cpu", "cuda-model"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_saves_land_and_are_served_by_either_path(daemon, stream, backend):
    """With the cpu backend, and with the CUDA copy path under the model of
    CUDA's rules (tests/cuda_model.py: outputs are its device tensors)."""
    engine = f"engine-{stream}-{backend}"
    scheduler = SchedulerDelegate(daemon.socket, engine_id=engine, layout=engines.LAYOUT)
    # The model as an engine runs it: chunks of a page and a half (the saves'
    # and loads' copies are split at them), registered before the copies, and
    # the compute stream busy around every load (its forward pass reads them).
    copies = cuda_model.Backend(chunk_bytes=96 << 10, busy_compute=True, wait_pinned=True) \
        if backend == "cuda-model" else "cpu"
    worker = worker_on(daemon, engine, role="both", stream_saves=stream, backend=copies)
    outputs = {f"{stream}-{backend}-{i}": np.full(300_000 + i, i, np.uint8) for i in range(40)}
    try:
        for mm_hash, output in outputs.items():
            assert worker.save(mm_hash, output if isinstance(copies, str)
                               else copies.model.to_device(torch.from_numpy(output)))
        assert worker.flush(30)
        assert worker.stats["saves_done"] == len(outputs)
        # The stream path makes no call but the Attach; the unary one two a save.
        calls = sum(worker.transport.calls.values())
        assert calls == (1 if stream else 1 + 2 * len(outputs))
        assert (worker.save_messages > 0) == stream
        assert scheduler.link.wait_attached(10) is not None
        daemon.wait_for(lambda: scheduler.serving() and all(scheduler.view.get(h)
                                                             for h in outputs),
                        what="the ready events, every rank mapped")
        result = staged.load(scheduler, worker, list(outputs))
        assert result.failed == {}
        for mm_hash, output in outputs.items():
            assert np.array_equal(np.asarray(result.loaded[mm_hash]), output)
        del result
    finally:
        worker.close()
        scheduler.close()
    if not isinstance(copies, str):
        gc.collect()
        copies.model.drain()
        assert copies.model.violations == [] and copies.model.compute_host_waits == 0
        assert copies.consumed == len(outputs)
    stats = daemon.stats()
    assert stats["pending_bytes"] == 0 and stats["saves"] == len(outputs)


def test_a_key_cached_already_is_said_so_and_a_full_cache_refuses(daemon):
    first, second = worker_on(daemon, "first"), worker_on(daemon, "second")
    try:
        assert first.save("same", np.ones(1000, np.uint8)) and first.flush(10)
        assert second.save("same", np.ones(1000, np.uint8)) and second.flush(10)
        assert second.stats["saves_already_cached"] == 1 and "saves_done" not in second.stats
        assert first.save("huge", np.ones(65 * MiB, np.uint8)) and first.flush(10)
        assert first.stats["saves_refused"] == 1
    finally:
        first.close()
        second.close()
    assert daemon.stats()["pending_bytes"] == 0


def test_a_stream_saver_killed_mid_copy_leaves_nothing_pending(leased, procs):
    saver = Proc(engines.stream_saver_main, leased.socket, "dying", "victim", 4 * MiB, "copy")
    procs.append(saver)
    assert saver.recv() == "copying"
    assert leased.stats()["pending_bytes"] == 4 * MiB
    (result,) = leased.lookup(engines.LAYOUT, "victim")
    assert result.state == engines.pb.ABSENT  # pending: never served
    saver.kill()
    leased.wait_for(lambda: leased.stats()["pending_bytes"] == 0, what="the save dropped")
    stats = leased.stats()
    assert stats["quarantined_bytes"] >= 4 * MiB and stats["saves"] == 0
    assert leased.lookup(engines.LAYOUT, "victim")[0].state == engines.pb.ABSENT
    # The key is free for another writer, on the stream too.
    again = worker_on(leased, "next")
    try:
        assert again.save("victim", np.ones(1000, np.uint8)) and again.flush(10)
        assert again.stats["saves_done"] == 1
    finally:
        again.close()


def test_a_stream_saver_frozen_past_its_lease_never_copies(leased, procs):
    saver = Proc(engines.stream_saver_main, leased.socket, "frozen", "cold", MiB, "check")
    procs.append(saver)
    answered, region_path = saver.recv()
    assert answered == "answered" and leased.stats()["pending_bytes"] == MiB
    saver.signal(signal.SIGSTOP)
    try:
        leased.wait_for(lambda: leased.stats()["pending_bytes"] == 0, timeout=3 * LEASE + 2,
                        what="the frozen saver's session to expire")
        time.sleep(0.5)
    finally:
        saver.signal(signal.SIGCONT)
    saver.send("go")
    stats = saver.recv()
    assert stats.get("saves_stale") == 1 and "saves_done" not in stats \
        and "save_errors" not in stats
    assert leased.lookup(engines.LAYOUT, "cold")[0].state == engines.pb.ABSENT
    with open(region_path, "rb") as region:  # its bytes are nowhere in the region
        assert bytes([0xAB]) * 4096 not in region.read()


def test_a_daemon_frozen_past_the_deadline_mid_save_costs_the_saver_that_deadline_only():
    """A daemon stopped (SIGSTOP) with saves in flight on the stream, for
    longer than the worker's deadline: each save is given up at the
    deadline (the engine's `save` never blocks), the answers that arrive
    after SIGCONT are aborted (nothing stays pending), and saves land again."""
    with Daemon(cpu_bytes="64MiB") as daemon:
        assert daemon.proc is not None
        worker = worker_on(daemon, "frozen-daemon", deadline_seconds=1.0)
        try:
            assert worker.save("before", np.full(MiB, 1, np.uint8)) and worker.flush(10)
            daemon.proc.send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                for i in range(4):
                    assert worker.save(f"during-{i}", np.full(MiB, 2 + i, np.uint8))
                assert time.monotonic() - started < 0.5  # queued, not waited for
                assert worker.flush(10)  # each given up at its deadline
                assert worker.stats["saves_failed"] >= 1
                time.sleep(1.5)  # frozen well past the deadline
            finally:
                daemon.proc.send_signal(signal.SIGCONT)
            daemon.wait_for(lambda: daemon.stats()["pending_bytes"] == 0,
                            what="allocations answered after their deadline aborted")
            # Once the link is fresh again, saves land as before.
            saved = daemon.wait_for(lambda: worker.save(f"after-{time.monotonic()}",
                                                        np.full(MiB, 9, np.uint8))
                                    and worker.flush(5) and worker.stats["saves_done"] >= 2,
                                    what="a save after the daemon came back")
            assert saved
        finally:
            worker.close()
        assert daemon.stats()["pending_bytes"] == 0


def test_a_daemon_killed_and_restarted_mid_save_loses_those_saves_and_serves_later_ones():
    """kill -9 of the daemon with saves in flight on the stream, then a new
    daemon on the same socket: the worker re-attaches, saves land again,
    and every load returns exactly the bytes saved (a save half-done at the
    kill is never served)."""
    with Daemon(cpu_bytes="64MiB") as daemon:
        worker = worker_on(daemon, "restarted", role="both")
        scheduler = SchedulerDelegate(daemon.socket, engine_id="restarted",
                                      layout=engines.LAYOUT)
        outputs: dict[str, np.ndarray] = {}
        try:
            for i in range(16):
                outputs[f"k{i}"] = np.full(MiB + i, i + 1, np.uint8)
                worker.save(f"k{i}", outputs[f"k{i}"])
            daemon.kill()
            assert worker.flush(15)  # every save in flight ended (failed or lost)
            daemon.start()
            for i in range(16, 20):
                outputs[f"k{i}"] = np.full(MiB + i, i + 1, np.uint8)
                daemon.wait_for(lambda i=i: worker.save(f"k{i}", outputs[f"k{i}"])
                                and worker.flush(5) and daemon.lookup(
                                    engines.LAYOUT, f"k{i}")[0].state == engines.pb.READY,
                                timeout=20, what=f"k{i} saved on the new daemon")
            daemon.wait_for(lambda: scheduler.serving(), timeout=20, what="the view back")
            ready = [h for h in outputs if staged.servable(scheduler, h)]
            assert {f"k{i}" for i in range(16, 20)} <= set(ready)
            result = staged.load(scheduler, worker, ready)
            assert result.failed == {} and set(result.loaded) == set(ready)
            for mm_hash in ready:
                assert np.array_equal(result.loaded[mm_hash], outputs[mm_hash])
        finally:
            worker.close()
            scheduler.close()
        assert daemon.stats()["pending_bytes"] == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_saves_that_make_no_entry_are_listed_as_dropped_and_no_others(daemon, stream):
    """What a producer's scheduler hears (`take_dropped`, through vLLM's
    worker output) to announce no metadata for an item: a save skipped for a
    full queue, or refused by a full cache, makes no entry; one cached
    already by another engine, or saved, is not dropped."""
    first = worker_on(daemon, f"first-{stream}", stream_saves=stream)
    second = worker_on(daemon, f"second-{stream}", stream_saves=stream,
                       save_queue_bytes=8 * MiB)
    try:
        assert first.save(f"shared-{stream}", np.full(MiB, 1, np.uint8)) and first.flush(30)
        assert second.save(f"shared-{stream}", np.full(MiB, 1, np.uint8))  # cached already
        assert second.save(f"saved-{stream}", np.full(MiB, 2, np.uint8))
        assert not second.save(f"skipped-{stream}", np.full(9 * MiB, 3, np.uint8))
        assert second.flush(30)
        assert second.stats["saves_already_cached"] == 1 and second.stats["saves_done"] == 1
        assert second.take_dropped() == [f"skipped-{stream}"]
        assert second.take_dropped() == []  # each told once
        with Daemon(cpu_bytes="4MiB") as small:  # an output larger than the whole cache
            tiny = worker_on(small, f"tiny-{stream}", stream_saves=stream)
            try:
                assert tiny.save(f"refused-{stream}", np.full(6 * MiB, 4, np.uint8))
                assert tiny.flush(30) and tiny.stats["saves_refused"] == 1
                assert tiny.take_dropped() == [f"refused-{stream}"]
            finally:
                tiny.close()
    finally:
        first.close()
        second.close()
