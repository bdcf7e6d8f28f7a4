"""Several engine processes share one daemon: saves, loads, TP, and deaths."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration import engines
from tests.integration.daemon import Daemon

pytestmark = pytest.mark.integration
SPAWN = multiprocessing.get_context("spawn")
RECV_TIMEOUT = 60


class Proc:
    """A spawned engine process with a pipe; killed by pid if it outlives the test."""

    def __init__(self, target: Any, *args: Any) -> None:
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=target, args=(*args, child), daemon=True)
        self.process.start()

    def recv(self) -> Any:
        if not self.conn.poll(RECV_TIMEOUT):
            raise AssertionError(f"{self.process.name} sent nothing in {RECV_TIMEOUT}s")
        return self.conn.recv()

    def send(self, command: str, payload: Any = None) -> None:
        self.conn.send((command, payload))

    def join(self) -> int:
        self.process.join(RECV_TIMEOUT)
        assert self.process.exitcode is not None, "process did not end"
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.kill()


@pytest.fixture
def big_daemon() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="256MiB") as d:
        yield d


def test_engine_b_loads_exactly_what_engine_a_saved(big_daemon, procs):
    count = len(engines.SHAPES) * 2
    producer = Proc(engines.producer_main, big_daemon.socket, "engine-A", 7, count)
    procs.append(producer)
    stats = producer.recv()
    assert stats.get("saves_done") == count, stats
    assert producer.join() == 0

    consumer = Proc(engines.consumer_main, big_daemon.socket, "engine-B", 7, count)
    procs.append(consumer)
    result = consumer.recv()
    assert consumer.join() == 0
    assert result["hits"] == count and result["failed"] == 0
    assert result["exact"] == count, result
    assert set(result["dtypes"]) == {d for d, _, _ in engines.SHAPES}
    assert result["rpcs_on_scheduler_thread"] == 0
    stats = big_daemon.stats()
    assert stats["saves"] == count and stats["loads"] == count
    assert stats["pinned_bytes"] == 0 and stats["pending_bytes"] == 0
    assert stats["hits"] == count  # reported by B's view on its heartbeats


def test_tp2_load_is_released_only_after_both_ranks_report(daemon, procs):
    from ec_client.scheduler import SchedulerDelegate

    ranks = [Proc(engines.worker_rank_main, daemon.socket, "tp-engine", r, 2) for r in (0, 1)]
    procs.extend(ranks)
    assert [r.recv() for r in ranks] == ["attached", "attached"]
    ranks[0].send("save", (3, 1))
    assert ranks[0].recv().get("saves_done") == 1
    mm_hash = engines.key(3, 1)
    want = engines.raw(engines.make_array(3, 1))

    scheduler = SchedulerDelegate(daemon.socket, engine_id="tp-engine", layout=engines.LAYOUT)
    try:
        assert scheduler.link.wait_attached(20)
        daemon.wait_for(lambda: scheduler.has_item(mm_hash), what="ready event in the view")
        scheduler.after_alloc("req", mm_hash)
        loads = scheduler.build_step_metadata().loads

        ranks[0].send("load", loads)
        done, failed, data = ranks[0].recv()
        assert (done, failed) == ([loads[0].transfer_id], []) and data[mm_hash] == want
        (result,) = daemon.lookup(engines.LAYOUT, mm_hash)
        assert result.pins == 1  # rank 1 has not reported yet

        ranks[1].send("load", loads)
        done, failed, data = ranks[1].recv()
        assert failed == [] and data[mm_hash] == want
        (result,) = daemon.lookup(engines.LAYOUT, mm_hash)
        assert result.pins == 0
        assert daemon.stats()["loads"] == 1
    finally:
        scheduler.close()
        for r in ranks:
            r.send("exit")
            assert r.join() == 0


def test_a_saver_killed_mid_save_leaves_nothing_pending(daemon, procs):
    stuck = Proc(engines.stuck_saver_main, daemon.socket, "dying", "victim")
    procs.append(stuck)
    assert stuck.recv() == "ALLOCATED"
    assert daemon.stats()["pending_bytes"] == 1 << 20
    stuck.kill()
    daemon.wait_for(lambda: daemon.stats()["pending_bytes"] == 0, what="pending save dropped")
    stats = daemon.stats()
    assert stats["sessions"] == 0
    # Its pages wait out a lease before reuse, in case its copy was still landing.
    assert stats["used_bytes"] == stats["quarantined_bytes"] == 1 << 20
    (result,) = daemon.lookup(engines.LAYOUT, "victim")
    assert result.state == engines.pb.ABSENT
    # The key is free again for another writer.
    again = Proc(engines.stuck_saver_main, daemon.socket, "next", "victim")
    procs.append(again)
    assert again.recv() == "ALLOCATED"


def test_a_scheduler_killed_after_dispatch_releases_its_pins(daemon, procs):
    saver = Proc(engines.producer_main, daemon.socket, "saver", 5, 1)
    procs.append(saver)
    assert saver.recv().get("saves_done") == 1
    mm_hash = engines.key(5, 0)
    engine = Proc(engines.pinning_engine_main, daemon.socket, "pinner", mm_hash)
    procs.append(engine)
    hit, loads = engine.recv()
    assert hit and len(loads) == 1
    daemon.wait_for(lambda: daemon.lookup(engines.LAYOUT, mm_hash)[0].pins == 1,
                    what="the pin to land")
    assert daemon.stats()["pinned_bytes"] > 0
    engine.kill()
    daemon.wait_for(lambda: daemon.stats()["pinned_bytes"] == 0, what="pins released")
    assert daemon.lookup(engines.LAYOUT, mm_hash)[0].state == engines.pb.READY
    daemon.wait_for(lambda: daemon.stats()["sessions"] == 0, what="sessions gone")
