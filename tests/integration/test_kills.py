"""Clients killed in the middle of saves and loads, again and again.

After each kill: nothing pending, no evicted entry waiting on the dead once
its ghost's lease is over, every page accounted for (the daemon checks its
invariants after every call), and the survivors carry on. A killed client's
session ends when its socket closes; a hung one within the lease.
KILL_ITERATIONS sets the iterations per scenario (CI: 6; `make soak`: more).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from tests import staged
from tests.integration import engines
from tests.integration.daemon import Daemon
from tests.integration.engines import Proc
from tests.integration.raw import UNCAPPED, Filler

pytestmark = pytest.mark.integration
ITERATIONS = int(os.environ.get("KILL_ITERATIONS", "6"))
LEASE = 2.0
# A ghost is released one lease after its session ended (the upkeep runs
# every lease/4); the rest is slack for a loaded machine.
RELEASE_TIMEOUT = 3 * LEASE + 2.0


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="64MiB", extra=("--lease-seconds", str(LEASE),
                                          "--alloc-wait-seconds", "0.2", *UNCAPPED)) as d:
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
    assert staged.servable(scheduler, key)
    result = staged.load(scheduler, worker, [key])
    assert np.array_equal(result.loaded[key], data)


def wait_released(daemon: Daemon) -> float:
    """Seconds until only the survivor's sessions remain and nothing is
    pending, hidden or awaited by a ghost."""
    started = time.monotonic()

    def clean() -> bool:
        s = daemon.stats()
        return ({x["engine_id"] for x in s["session_list"]} <= {"survivor", "filler"}
                and s["pending_bytes"] == 0 and s["hidden_bytes"] == 0
                and s["ghost_sessions"] == 0
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
        releases.append(wait_released(daemon))
        (result,) = daemon.lookup(engines.LAYOUT, f"victim-{i}")
        assert result.state == engines.pb.ABSENT  # never visible, never served
        round_trip(daemon, survivor, f"after-saver-{i}")
    # Their pages are quarantined (--quarantine-seconds, 300 s here), not reused.
    assert daemon.stats()["quarantined_bytes"] >= ITERATIONS * (4 << 20)
    print(f"\nsaver kills: {ITERATIONS}, release max {max(releases) * 1000:.0f} ms")


# Protects: a load in flight keeps its entry's pages from reuse whichever
# process of the loading engine dies: a dead worker rank never reports, so
# the view keeps withholding; a dead scheduler is awaited as a ghost. Once
# the engine is gone (closed, or its ghost's lease over) nothing is left.
@pytest.mark.parametrize("who", ["worker", "scheduler"])
def test_loads_killed_mid_copy(daemon, survivor, who):
    worker = survivor[1]
    filler = Filler(daemon.stub, engines.LAYOUT)
    releases = []
    try:
        for i in range(ITERATIONS):
            key, engine = f"shared-{who}-{i}", f"{who}-victim-{i}"
            data = np.arange(300000, dtype=np.uint8)
            assert worker.save(key, data) and worker.flush(10)
            loader = Proc(engines.worker_main, daemon.socket, engine, 0, 1, True)
            scheduler = Proc(engines.scheduler_main, daemon.socket, engine, 1)
            try:
                assert (loader.recv(), scheduler.recv()) == ("ready", "ready")
                assert scheduler.call("wait_hit", key)
                hits, metadata = scheduler.call("step", ([key], True))
                assert hits == [True] and len(metadata.loads) == 1
                assert loader.call("copy_forever", (metadata.loads[0], metadata.regions)) \
                    == "copying"
                assert not filler.evict_all(daemon.stats())  # the victim's view withholds
                (result,) = daemon.lookup(engines.LAYOUT, key)
                assert result.state == engines.pb.HIDDEN and result.awaiting == 1
                killed = time.monotonic()
                (loader if who == "worker" else scheduler).kill()
                daemon.wait_for(lambda e=engine: len(daemon.components(e)) == 1,
                                what="the victim's session to end")
                # Still held: by the live view (its load was never reported), or
                # by the ghost while its lease lasts.
                (result,) = daemon.lookup(engines.LAYOUT, key)
                if who == "worker" or time.monotonic() - killed < LEASE:
                    assert result.state == engines.pb.HIDDEN
                if who == "worker":
                    assert scheduler.call("close") == "closed"
            finally:
                loader.kill()
                scheduler.kill()
            releases.append(wait_released(daemon))
            assert daemon.lookup(engines.LAYOUT, key)[0].state == engines.pb.ABSENT
            round_trip(daemon, survivor, f"after-{who}-{i}")
    finally:
        filler.close()
    print(f"\n{who} kills mid-load: {ITERATIONS}, release max {max(releases) * 1000:.0f} ms")


def test_a_hung_client_is_released_within_the_lease(daemon, survivor):
    victim = Proc(engines.copying_saver_main, daemon.socket, "hung", "hung-key")
    try:
        assert victim.recv() == "ALLOCATED"
        victim.signal(signal.SIGSTOP)  # alive, socket open, silent
        started = time.monotonic()
        daemon.wait_for(lambda: daemon.stats()["pending_bytes"] == 0, timeout=10,
                        what="lease expiry")
        elapsed = time.monotonic() - started
        assert elapsed < LEASE + 1.5  # the lease plus the upkeep interval
        assert "expired (engine 'hung'" in daemon.log()
    finally:
        victim.kill()
    wait_released(daemon)
    round_trip(daemon, survivor, "after-hung")
