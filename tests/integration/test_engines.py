"""Several engine processes share one daemon: one saves, another loads
exactly those bytes; a saver that dies mid-save leaves nothing behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration import engines
from tests.integration.daemon import Daemon
from tests.integration.engines import Proc

pytestmark = pytest.mark.integration


@pytest.fixture
def big_daemon() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="256MiB") as d:
        yield d


def test_engine_b_loads_exactly_what_engine_a_saved(big_daemon, procs):
    count = len(engines.SHAPES) * 2
    hashes = [engines.key(7, i) for i in range(count)]
    producer = Proc(engines.producer_main, big_daemon.socket, "engine-A", 7, count)
    procs.append(producer)
    stats = producer.recv()
    assert stats.get("saves_done") == count, stats
    assert producer.join() == 0

    scheduler = Proc(engines.scheduler_main, big_daemon.socket, "engine-B", 1)
    worker = Proc(engines.worker_main, big_daemon.socket, "engine-B", 0, 1, True)
    procs.extend([scheduler, worker])
    assert (scheduler.recv(), worker.recv()) == ("ready", "ready")
    assert scheduler.call("wait_ranks")  # the view heard that the rank mapped the region
    hits, metadata = scheduler.call("stage", hashes)
    assert hits == [True] * count
    assert [s.mm_hash for s in metadata.loads] == hashes
    done, failed, loaded = worker.call("load", (metadata.loads, metadata.regions))
    assert failed == [] and sorted(done) == sorted(s.transfer_id for s in metadata.loads)
    for i, mm_hash in enumerate(hashes):
        assert loaded[mm_hash] == engines.describe(engines.make_array(7, i)), mm_hash
    assert {dtype for _, dtype, _ in loaded.values()} == {d for d, _, _ in engines.SHAPES}
    assert scheduler.call("report", (done, [])) == 0
    hits, metadata = scheduler.call("use", hashes)  # every load staged: hits
    assert hits == [True] * count and len(metadata.adopt) == count
    # The hit-to-load path made no call to the daemon from the scheduler's thread.
    assert scheduler.call("state")["rpcs_on_scheduler_thread"] == 0
    assert scheduler.call("close") == "closed"  # its last heartbeat carries the touches
    assert worker.call("exit") == "closed"
    big_daemon.wait_for(lambda: big_daemon.stats()["sessions"] == 0, what="detach")
    stats = big_daemon.stats()
    assert stats["saves"] == count and stats["loads"] == count
    assert stats["hits"] == count and stats["misses"] == 0  # counted by B's view
    assert stats["hidden_bytes"] == 0 and stats["pending_bytes"] == 0
    assert stats["ghost_sessions"] == 0


def test_a_saver_killed_mid_save_leaves_nothing_pending(daemon, procs):
    stuck = Proc(engines.stuck_saver_main, daemon.socket, "dying", "victim")
    procs.append(stuck)
    assert stuck.recv() == "ALLOCATED"
    assert daemon.stats()["pending_bytes"] == 1 << 20
    stuck.kill()
    daemon.wait_for(lambda: daemon.stats()["pending_bytes"] == 0, what="pending save dropped")
    stats = daemon.stats()
    assert stats["sessions"] == 0
    # Its pages wait out the quarantine before reuse, in case its copy was still landing.
    assert stats["used_bytes"] == stats["quarantined_bytes"] == 1 << 20
    (result,) = daemon.lookup(engines.LAYOUT, "victim")
    assert result.state == engines.pb.ABSENT
    # The key is free again for another writer.
    again = Proc(engines.stuck_saver_main, daemon.socket, "next", "victim")
    procs.append(again)
    assert again.recv() == "ALLOCATED"
