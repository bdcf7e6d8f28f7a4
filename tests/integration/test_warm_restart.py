"""A daemon that restarts keeps its cache: the next daemon on the same socket
adopts the region (same file, same generation, same entries and ids), the
engines re-attach by themselves and hit at once, and a load in flight across
the restart, however slow, reads exactly the saved bytes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from tests import staged
from tests.integration import engines
from tests.integration.daemon import Daemon, short_tmpdir
from tests.integration.engines import Proc
from tests.integration.raw import UNCAPPED, Filler

pytestmark = pytest.mark.integration
LAYOUT = engines.LAYOUT
LEASE = 2.0
# Long enough that only the engine's own view, not the previous daemon's
# ghost (one lease), can be what still protects a load.
SLOW_STEP_SECONDS = 3 * LEASE
CHURN_SECONDS = float(os.environ.get("WARM_RESTART_CHURN_SECONDS", "45"))


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, (40, 4096), dtype=np.uint8)


# A slow step keeps its loads' pages --ack-wait-seconds and a lease: well
# past SLOW_STEP_SECONDS here (tests/integration/test_leases.py: past it).
FLAGS = ("--lease-seconds", str(LEASE), "--quarantine-seconds", str(LEASE),
         "--alloc-wait-seconds", "0.5", "--ack-wait-seconds", str(10 * LEASE), *UNCAPPED)


class Host:
    """Daemons started one after another on one socket and tmpfs, and the
    engine-side delegates attached to them; everything stops at the end."""

    def __init__(self, shm: Path, flags: tuple[str, ...] = FLAGS) -> None:
        self.folder = short_tmpdir()
        self.shm = shm
        self.flags = flags
        self.daemons: list[Daemon] = []
        self.delegates: list[Any] = []

    def start(self, *extra: str) -> Daemon:
        daemon = Daemon(folder=self.folder, shm_dir=str(self.shm), cpu_bytes="16MiB",
                        extra=(*self.flags, *extra))
        self.daemons.append(daemon)
        return daemon.start()

    @property
    def daemon(self) -> Daemon:
        return self.daemons[-1]

    def scheduler(self, engine_id: str = "E") -> SchedulerDelegate:
        scheduler = SchedulerDelegate(self.daemon.socket, engine_id=engine_id, layout=LAYOUT)
        self.delegates.append(scheduler)
        return scheduler

    def worker(self, engine_id: str = "E") -> WorkerDelegate:
        worker = WorkerDelegate(self.daemon.socket, engine_id=engine_id, layout=LAYOUT)
        self.delegates.append(worker)
        return worker

    def reattached(self, *delegates: Any) -> None:
        """Wait until each delegate is attached to the current daemon (a view synced)."""
        for d in delegates:
            self.daemon.wait_for(lambda d=d: d.link.attachment is not None and d.link.fresh()
                                 and (not hasattr(d, "serving") or d.serving()), timeout=20,
                                 what="the engine to attach again")

    def close(self) -> None:
        for delegate in self.delegates:
            delegate.close()
        for daemon in reversed(self.daemons):
            daemon.cleanup()


@pytest.fixture
def host(shm_folder: Path) -> Iterator[Host]:
    h = Host(shm_folder)
    yield h
    h.close()


def dispatch(scheduler: SchedulerDelegate, mm_hash: str):
    """The step that sends `mm_hash`'s load (staged, as vLLM's hits are)."""
    hits, metadata = staged.plan(scheduler, [mm_hash])
    assert hits == [True]
    return metadata


# Protects: kill -9 or a graceful stop: the next daemon adopts the region and
# its entries (the log's first word on it says so); the same engine and a new
# one hit at once and load the saved bytes, with no save in between.
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_restarted_daemon_serves_what_the_previous_one_held(host, how):
    first = host.start()
    scheduler, worker = host.scheduler(), host.worker()
    host.reattached(scheduler, worker)
    generation = worker.link.attachment.region.generation
    for i in range(3):
        assert worker.save(f"k{i}", data(i))
    assert worker.flush(10)
    first.wait_for(lambda: all(scheduler.view.get(f"k{i}") for i in range(3)))
    ids = {f"k{i}": scheduler.view.get(f"k{i}").entry_id for i in range(3)}
    assert first.stop(how) in (0, -signal.SIGKILL)
    second = host.start()
    assert "adopted region" in second.log() and "3 entries" in second.log()
    host.reattached(scheduler, worker)
    assert worker.link.attachment.region.generation == generation
    assert {h: scheduler.view.get(h).entry_id for h in ids} == ids
    for i in range(3):
        metadata = dispatch(scheduler, f"k{i}")
        result = worker.load(metadata.loads, metadata.regions)
        scheduler.apply_worker_output(result.done)
        assert np.array_equal(result.loaded[f"k{i}"], data(i))
    other, its_worker = host.scheduler("new"), host.worker("new")
    host.reattached(other, its_worker)
    assert all(staged.servable(other, f"k{i}") for i in range(3))
    stats = second.stats()
    assert stats["entries"] == 3 and stats["saves"] == 0


# Protects: a load in flight across a warm restart, in a step slower than any
# lease: whether its entry was evicted before the crash (it comes back hidden)
# or by the new daemon, its pages are kept until the engine's re-attached view
# says the load ended; then they are freed.
@pytest.mark.parametrize("evicted", ["before the crash", "after the restart"])
def test_a_slow_load_across_a_warm_restart_reads_the_saved_bytes(host, evicted):
    first = host.start()
    scheduler, worker = host.scheduler(), host.worker()
    host.reattached(scheduler, worker)
    assert worker.save("k", data(7)) and worker.flush(10)
    first.wait_for(lambda: scheduler.view.get("k"))
    metadata = dispatch(scheduler, "k")  # in flight: its copy starts much later
    if evicted == "before the crash":
        filler = Filler(first.stub, LAYOUT)
        assert not filler.evict_all(first.stats())  # withheld by the view
        assert first.lookup(LAYOUT, "k")[0].state == engines.pb.HIDDEN
    first.kill()
    second = host.start()
    host.reattached(scheduler, worker)
    if evicted == "after the restart":
        filler = Filler(second.stub, LAYOUT)
        assert not filler.evict_all(second.stats())
    time.sleep(SLOW_STEP_SECONDS)  # the previous daemon's ghost is long gone
    (entry,) = second.lookup(LAYOUT, "k")
    assert entry.state == engines.pb.HIDDEN and entry.awaiting == 1  # the engine's view
    result = worker.load(metadata.loads, metadata.regions)
    assert result.failed == {} and np.array_equal(result.loaded["k"], data(7))
    scheduler.apply_worker_output(result.done)
    second.wait_for(lambda: second.lookup(LAYOUT, "k")[0].state == engines.pb.ABSENT,
                    what="the pages to come back once the load ended")


# Protects: when the next daemon must start a fresh region (--fresh-start, a
# new size...), a worker busy with a slow step keeps the old region mapped for
# as long as the step's metadata says the scheduler may load from it, not for
# a fixed grace: a copy that starts long after the daemon died still reads
# the saved bytes. Once steps say otherwise, or the engine idles, it goes.
def test_a_slow_load_across_a_fresh_start_reads_the_saved_bytes(host):
    first = host.start()
    scheduler, worker = host.scheduler(), host.worker()
    host.reattached(scheduler, worker)
    old = worker.link.attachment.region.generation
    assert worker.save("k", data(3)) and worker.flush(10)
    first.wait_for(lambda: scheduler.view.get("k"))
    metadata = dispatch(scheduler, "k")
    assert metadata.keep == {old}
    # The worker is busy with the step before the one that carries the load.
    worker.regions.step(scheduler.build_step_metadata().keep)
    first.kill()
    host.start("--fresh-start")
    host.reattached(scheduler, worker)
    assert worker.link.attachment.region.generation != old
    time.sleep(SLOW_STEP_SECONDS)  # longer than any fixed grace
    worker.regions.prune()
    assert old in worker.regions.generations()
    worker.regions.step_done()
    worker.regions.step(metadata.keep)  # the step with the load, at last
    result = worker.load(metadata.loads, metadata.regions)
    worker.regions.step_done()
    assert result.failed == {} and np.array_equal(result.loaded["k"], data(3))
    scheduler.apply_worker_output(result.done)
    # Steps of the new region: the old one's memory goes back.
    later = scheduler.build_step_metadata()
    assert old not in later.keep
    worker.regions.step(later.keep)
    worker.regions.step_done()
    assert old not in worker.regions.generations()


# Protects: an idle engine (no steps) does not pin a replaced region's memory:
# the new daemon of a fresh start gets its tmpfs space back within seconds.
def test_an_idle_worker_lets_a_replaced_region_go(host):
    first = host.start()
    scheduler, worker = host.scheduler(), host.worker()
    host.reattached(scheduler, worker)
    old = worker.link.attachment.region.generation
    worker.regions.step(scheduler.build_step_metadata().keep)  # names the old region
    worker.regions.step_done()
    first.kill()
    second = host.start("--fresh-start")
    host.reattached(scheduler, worker)
    second.wait_for(lambda: old not in worker.regions.generations(), timeout=15,
                    what="the idle worker to unmap the replaced region")


# Protects: the daemon may die at any instruction. Engines churn saves, loads
# and evictions on a small region while the daemon is killed with kill -9 at
# random moments and restarted, many times: every start adopts, the daemon
# checks its bookkeeping and every stamp at start and after every call
# (--check-invariants), and every load the engines made returned the key's
# own bytes.
def test_kill_9_at_random_moments_never_serves_wrong_bytes(host):
    rng = np.random.default_rng(1)
    daemon = host.start()
    churners = [Proc(engines.churn_main, daemon.socket, f"churn-{i}", i, 24,
                     CHURN_SECONDS) for i in range(2)]
    restarts = 0
    try:
        for proc in churners:
            assert proc.recv() == "ready"
        deadline = time.monotonic() + CHURN_SECONDS - 5
        while time.monotonic() < deadline:
            time.sleep(float(rng.uniform(0.2, 2.0)))
            host.daemon.kill()
            daemon = host.start()
            restarts += 1
            # (one log for every start on this host)
            assert daemon.log().count("adopted region") == restarts, daemon.log()[-3000:]
        totals = [proc.recv(CHURN_SECONDS + 60) for proc in churners]
        stats = daemon.stats()
        assert stats["used_bytes"] + stats["free_bytes"] == stats["capacity_bytes"]
    finally:
        for proc in churners:
            proc.kill()
    loads = sum(t["loads"] for t in totals)
    print(f"\n{restarts} kill -9 restarts; {loads} loads, "
          f"{sum(t['saves'] for t in totals)} saves, {stats['evictions']} evictions since the "
          f"last start")
    assert restarts >= 5 and loads > 50
    assert sum(t["wrong"] for t in totals) == 0
    assert sum(t["failed"] for t in totals) == 0


# Protects: one socket spelled two ways (/var/run/... and /run/...: a parent
# folder that is a link) is one socket: its region is adopted, not stranded
# in the tmpfs beside a new one.
def test_the_same_socket_through_a_linked_folder_adopts_the_region(shm_folder):
    real = short_tmpdir()
    link = real.parent / f"{real.name}-link"
    link.symlink_to(real)

    def daemon(socket_folder: Path) -> Daemon:
        d = Daemon(folder=real, shm_dir=str(shm_folder))
        d.socket = f"unix://{socket_folder}/s/ec.sock"
        d.args[d.args.index("--socket") + 1] = d.socket
        return d

    first = daemon(real).start()
    second = None
    try:
        (region,) = first.region_files()
        first.kill()
        second = daemon(link).start()  # the same socket, through the link
        assert second.region_files() == [region] and "adopted region" in second.log()
    finally:
        if second is not None:
            second.cleanup()
        first.cleanup()
        link.unlink()


# Protects: after a warm restart of a full cache, saves go on as soon as the
# engines are back. The previous daemon's views are awaited one ghost per
# engine, each released when its engine re-attaches and declares its loads,
# not for a whole lease (a lease longer than the test here): no save is
# refused, and the cache loses only what the saves need.
def test_saves_into_a_full_cache_go_on_right_after_a_warm_restart(shm_folder):
    host = Host(shm_folder, ("--lease-seconds", "60", "--quarantine-seconds", "60",
                             "--alloc-wait-seconds", "1", *UNCAPPED))
    try:
        host.start()
        scheduler, other, worker = host.scheduler(), host.scheduler("F"), host.worker()
        others_worker = host.worker("F")
        host.reattached(scheduler, other, worker, others_worker)
        for i in range(85):  # 85 entries of 3 pages (160 KiB) of the 256: full
            assert worker.save(f"old-{i}", data(i))
        assert worker.flush(30)
        host.daemon.kill()
        second = host.start()
        assert "85 entries" in second.log()
        host.reattached(scheduler, other, worker, others_worker)
        before = dict(worker.stats)
        for i in range(20):
            assert worker.save(f"new-{i}", data(100 + i))
        assert worker.flush(30)
        saved = worker.stats["saves_done"] - before.get("saves_done", 0)
        refused = worker.stats["saves_refused"] - before.get("saves_refused", 0)
        assert (saved, refused) == (20, 0)
        assert second.stats()["evictions"] <= 20 + 256 // 64 + 1  # what the saves needed
    finally:
        host.close()
