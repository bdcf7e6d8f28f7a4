"""A daemon that dies and comes back: clients re-attach by themselves and
never read the old generation as valid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ec_client.scheduler import SchedulerDelegate
from ec_client.worker import WorkerDelegate
from ec_protocol.protocol import Layout
from tests.integration.daemon import Daemon, short_tmpdir

pytestmark = pytest.mark.integration
LAYOUT = Layout("restart-model", "float32", {"image": 4096})


def load_one(daemon, scheduler, worker, mm_hash):
    daemon.wait_for(lambda: scheduler.has_item(mm_hash), what=f"{mm_hash} in the view")
    scheduler.after_alloc("req", mm_hash)
    loads = scheduler.build_step_metadata().loads
    return loads, worker.load(loads)


def test_clients_reattach_and_old_generation_loads_fail():
    folder = short_tmpdir()
    first = Daemon(folder=folder).start()
    second = None
    scheduler = SchedulerDelegate(first.socket, engine_id="E", layout=LAYOUT)
    worker = WorkerDelegate(first.socket, engine_id="E", layout=LAYOUT)
    data = np.arange(1024 * 100, dtype=np.float32).reshape(100, 1024)
    try:
        old = worker.link.wait_attached(10)
        assert old is not None and scheduler.link.wait_attached(10)
        assert worker.save("k", data) and worker.flush(10)
        _, result = load_one(first, scheduler, worker, "k")
        assert np.array_equal(result.loaded["k"], data)
        scheduler.has_item("k")
        scheduler.after_alloc("req-2", "k")
        stale = scheduler.build_step_metadata().loads  # dispatched, then the daemon dies

        first.kill()
        second = Daemon(folder=folder).start()
        for delegate in (scheduler, worker):
            second.wait_for(lambda d=delegate: d.link.attachment is not None
                            and d.link.attachment.generation != old.generation,
                            what="re-attach")
        new = worker.link.attachment
        assert new is not None
        assert not Path(old.region_path).exists()  # the dead daemon's region was cleaned
        assert Path(new.region_path).exists()

        result = worker.load(stale)
        assert result.failed == [stale[0].transfer_id] and result.loaded == {}
        assert not scheduler.has_item("k")  # the new daemon starts cold

        assert worker.save("k", data) and worker.flush(10)
        _, result = load_one(second, scheduler, worker, "k")
        assert np.array_equal(result.loaded["k"], data)
        stats = second.stats()
        assert stats["sessions"] == 2 and stats["loads"] == 1
    finally:
        scheduler.close()
        worker.close()
        first.cleanup()
        if second is not None:
            second.cleanup()


def test_engine_keeps_going_while_the_daemon_is_down():
    folder = short_tmpdir()
    daemon = Daemon(folder=folder)  # not started yet
    scheduler = SchedulerDelegate(daemon.socket, engine_id="E", layout=LAYOUT)
    worker = WorkerDelegate(daemon.socket, engine_id="E", layout=LAYOUT)
    try:
        assert not scheduler.has_item("k")  # misses, no waiting
        assert not scheduler.after_alloc("req", "k")
        assert scheduler.build_step_metadata().loads == []
        assert not worker.save("k", np.zeros(10, np.float32))  # skipped
        daemon.start()
        assert worker.link.wait_attached(15) and scheduler.link.wait_attached(15)
        assert worker.save("k", np.zeros(10, np.float32)) and worker.flush(10)
        daemon.wait_for(lambda: scheduler.has_item("k"), what="the late daemon to serve")
    finally:
        scheduler.close()
        worker.close()
        daemon.cleanup()
