"""Clients killed in the middle of saves and loads, again and again.

After each kill: nothing pending, no pin held for the dead, no evicted entry
waiting on its acknowledgement, every page accounted for (the daemon checks
its invariants after every call), and the survivors carry on. A killed
client's session ends when its socket closes; a hung one within the lease.
KILL_ITERATIONS sets the iterations per scenario (CI: 6; `make soak`: more).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from ec_client.scheduler import SchedulerDelegate
from ec_client.worker import WorkerDelegate
from tests.integration import engines
from tests.integration.daemon import Daemon
from tests.integration.test_engines import Proc

pytestmark = pytest.mark.integration
ITERATIONS = int(os.environ.get("KILL_ITERATIONS", "6"))
RELEASE_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="64MiB", extra=("--lease-seconds", "2")) as d:
        yield d


@pytest.fixture(scope="module")
def survivor(daemon: Daemon) -> Iterator[tuple[SchedulerDelegate, WorkerDelegate]]:
    """An engine that lives through every kill and must keep working."""
    scheduler = SchedulerDelegate(daemon.socket, engine_id="survivor", layout=engines.LAYOUT)
    worker = WorkerDelegate(daemon.socket, engine_id="survivor", layout=engines.LAYOUT)
    assert scheduler.link.wait_attached(10) and worker.link.wait_attached(10)
    yield scheduler, worker
    scheduler.close()
    worker.close()


def round_trip(daemon: Daemon, survivor: tuple[SchedulerDelegate, WorkerDelegate],
               key: str) -> None:
    scheduler, worker = survivor
    data = np.random.default_rng(len(key)).integers(0, 256, 70000, dtype=np.uint8)
    assert worker.save(key, data) and worker.flush(10)
    daemon.wait_for(lambda: scheduler.view.get(key), what="survivor's save")
    assert scheduler.has_item(key)
    scheduler.after_alloc("r", key)
    result = worker.load(scheduler.build_step_metadata().loads)
    assert np.array_equal(result.loaded[key], data)


def wait_released(daemon: Daemon, sessions: int) -> float:
    """Seconds until only `sessions` remain and nothing is pending or pinned."""
    started = time.monotonic()

    def clean() -> bool:
        s = daemon.stats()
        return (s["sessions"] == sessions and s["pending_bytes"] == 0
                and s["pinned_bytes"] == 0 and s["hidden_bytes"] == 0
                and s["used_bytes"] + s["free_bytes"] == s["capacity_bytes"])

    daemon.wait_for(clean, timeout=RELEASE_TIMEOUT, what="the dead client's release")
    return time.monotonic() - started


def test_savers_killed_mid_copy(daemon, survivor):
    releases = []
    for i in range(ITERATIONS):
        victim = Proc(engines.copying_saver_main, daemon.socket, f"saver-{i}", f"victim-{i}")
        try:
            assert victim.recv() == "ALLOCATED"
            assert daemon.stats()["pending_bytes"] >= 4 << 20
            time.sleep(0.05 * (i % 4))  # somewhere in the middle of copying
        finally:
            victim.kill()
        releases.append(wait_released(daemon, sessions=2))
        (result,) = daemon.lookup(engines.LAYOUT, f"victim-{i}")
        assert result.state == engines.pb.ABSENT  # never visible, never served
        round_trip(daemon, survivor, f"after-saver-{i}")
    print(f"\nsaver kills: {ITERATIONS}, release max {max(releases) * 1000:.0f} ms")


@pytest.mark.parametrize("who", ["worker", "scheduler"])
def test_loads_killed_mid_copy(daemon, survivor, who):
    worker = survivor[1]
    data = np.arange(300000, dtype=np.uint8)
    assert worker.save(f"shared-{who}", data) and worker.flush(10)
    releases = []
    for i in range(ITERATIONS):
        engine = f"{who}-victim-{i}"
        loader = Proc(engines.copying_loader_main, daemon.socket, engine)
        pinner = None
        try:
            assert loader.recv() == "attached"  # the engine's worker rank is up
            pinner = Proc(engines.pinning_scheduler_main, daemon.socket, engine,
                          f"shared-{who}")
            hit, loads = pinner.recv()
            assert hit and len(loads) == 1
            daemon.wait_for(lambda: daemon.lookup(engines.LAYOUT, f"shared-{who}")[0].pins,
                            what="the victim's pin")
            loader.conn.send(loads)
            assert loader.recv() == "copying"
        finally:
            victim = loader if who == "worker" or pinner is None else pinner
            victim.kill()
        assert pinner is not None
        if who == "worker":
            # The scheduler side lives on, but its load stops waiting for the dead rank.
            daemon.wait_for(
                lambda: daemon.lookup(engines.LAYOUT, f"shared-{who}")[0].pins == 0,
                timeout=RELEASE_TIMEOUT, what="pin released")
            pinner.kill()
        else:
            loader.kill()
        releases.append(wait_released(daemon, sessions=2))
        assert daemon.lookup(engines.LAYOUT, f"shared-{who}")[0].state == engines.pb.READY
        round_trip(daemon, survivor, f"after-{who}-{i}")
    print(f"\n{who} kills mid-load: {ITERATIONS}, release max {max(releases) * 1000:.0f} ms")


def test_a_hung_client_is_released_within_the_lease(daemon, survivor):
    victim = Proc(engines.copying_saver_main, daemon.socket, "hung", "hung-key")
    try:
        assert victim.recv() == "ALLOCATED"
        assert victim.process.pid is not None
        os.kill(victim.process.pid, signal.SIGSTOP)  # alive, socket open, silent
        started = time.monotonic()
        daemon.wait_for(lambda: daemon.stats()["pending_bytes"] == 0, timeout=10,
                        what="lease expiry")
        elapsed = time.monotonic() - started
        assert elapsed < 2 + 1.5  # the lease (2 s) plus the sweep interval
        assert "expired" in daemon.log()
    finally:
        victim.kill()
    wait_released(daemon, sessions=2)
    round_trip(daemon, survivor, "after-hung")
