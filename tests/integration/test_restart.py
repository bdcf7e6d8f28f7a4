"""A daemon that dies and comes back with a fresh region (--fresh-start; a
warm restart that adopts the region is in test_warm_restart): clients
re-attach by themselves, a load dispatched before the restart still reads
the saved bytes, and nothing of the old generation is offered for new hits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout
from tests import staged
from tests.integration.daemon import Daemon, short_tmpdir

pytestmark = pytest.mark.integration
LAYOUT = Layout("restart-model", "float32", {"image": 4096})


def dispatch(daemon, scheduler, mm_hash):
    daemon.wait_for(lambda: staged.servable(scheduler, mm_hash), what=f"{mm_hash} in the view")
    hits, metadata = staged.plan(scheduler, [mm_hash])
    assert hits == [True]
    return metadata


# Protects: a load names its region generation and the worker keeps that
# mapping (the dead daemon's pages are never reused), so a load dispatched
# from the old daemon's view returns exactly the saved bytes after a restart;
# the new daemon's views start empty.
def test_a_load_dispatched_before_a_restart_reads_the_saved_bytes(shm_folder):
    folder = short_tmpdir()
    first = Daemon(folder=folder, shm_dir=str(shm_folder)).start()
    second = None
    scheduler = SchedulerDelegate(first.socket, engine_id="E", layout=LAYOUT)
    worker = WorkerDelegate(first.socket, engine_id="E", layout=LAYOUT)
    data = np.arange(1024 * 100, dtype=np.float32).reshape(100, 1024)
    try:
        old = worker.link.wait_attached(10)
        assert old is not None and scheduler.link.wait_attached(10)
        assert worker.save("k", data) and worker.flush(10)
        metadata = dispatch(first, scheduler, "k")
        result = worker.load(metadata.loads, metadata.regions)
        assert np.array_equal(result.loaded["k"], data)
        scheduler.apply_worker_output(result.done)
        stale = dispatch(first, scheduler, "k")  # dispatched, then the daemon dies

        first.kill()
        second = Daemon(folder=folder, shm_dir=str(shm_folder), extra=("--fresh-start",)).start()
        for delegate in (scheduler, worker):
            second.wait_for(lambda d=delegate: d.link.attachment is not None
                            and d.link.attachment.region.generation != old.region.generation,
                            what="re-attach")
        new = worker.link.attachment
        assert new is not None
        # One region file per live daemon: the dead one's was removed at the restart.
        assert second.region_files() == [Path(new.region.path)]
        assert not Path(old.region.path).exists()

        # The worker still maps the old region: the load returns the saved bytes.
        result = worker.load(stale.loads, stale.regions)
        assert result.failed == {} and result.done == [stale.loads[0].transfer_id]
        assert np.array_equal(result.loaded["k"], data)
        scheduler.apply_worker_output(result.done)
        assert scheduler.view.inflight() == 0
        # A rank that never mapped the old region cannot read it any more: it
        # reports the load failed rather than returning anything.
        fresh = WorkerDelegate(second.socket, engine_id="E", layout=LAYOUT, start=False)
        try:
            result = fresh.load(stale.loads, stale.regions)
            assert result.loaded == {} and stale.loads[0].transfer_id in result.failed
        finally:
            fresh.close()

        # The new daemon's view offers nothing of the old generation.
        assert second.wait_for(lambda: scheduler.view.synced, what="the new snapshot")
        assert len(scheduler.view) == 0 and not staged.servable(scheduler, "k")
        hits, metadata = staged.plan(scheduler, ["k"])
        assert hits == [False] and metadata.loads == []

        assert worker.save("k", data) and worker.flush(10)
        metadata = dispatch(second, scheduler, "k")
        assert list(metadata.regions) == [new.region.generation]
        result = worker.load(metadata.loads, metadata.regions)
        assert np.array_equal(result.loaded["k"], data)
        stats = second.stats()
        assert stats["sessions"] == 2 and stats["saves"] == 1
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
        assert scheduler.ensure(["k"], "req")  # misses, no waiting
        assert not scheduler.has_item("k") and not scheduler.after_alloc("req", "k")
        assert scheduler.build_step_metadata().loads == []
        assert not worker.save("k", np.zeros(10, np.float32))  # skipped
        daemon.start()
        assert worker.link.wait_attached(15) and scheduler.link.wait_attached(15)
        assert worker.save("k", np.zeros(10, np.float32)) and worker.flush(10)
        daemon.wait_for(lambda: staged.servable(scheduler, "k"), what="the late daemon to serve")
    finally:
        scheduler.close()
        worker.close()
        daemon.cleanup()


@pytest.fixture
def small_tmpfs():
    """A 40 MiB tmpfs of our own (root only), so a daemon can be short of space."""
    import subprocess
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="ecd-tmpfs-", dir="/tmp"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m,mode=0700", "tmpfs",
                              str(folder)], capture_output=True)
    if mounted.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)
    folder.rmdir()


# Protects: after a kill -9 restart that starts a fresh region, clients still map
# the dead daemon's region
# for a few seconds (loads dispatched before the restart read it); a tmpfs sized
# for one region is short meanwhile, and the new daemon waits for the space,
# saying so, instead of failing to start.
def test_a_restart_waits_for_the_previous_regions_space(small_tmpfs):
    folder = short_tmpdir()
    first = Daemon(folder=folder, shm_dir=str(small_tmpfs), cpu_bytes="24MiB").start()
    second = None
    worker = WorkerDelegate(first.socket, engine_id="E", layout=LAYOUT)
    try:
        assert worker.link.wait_attached(10) is not None  # maps the 24 MiB region
        first.kill()
        second = Daemon(folder=folder, shm_dir=str(small_tmpfs), cpu_bytes="24MiB",
                        extra=("--fresh-start",))
        second.start(wait=False)
        second.wait_serving(timeout=60)
        assert "waiting up to" in second.log()  # it said what it was waiting for
        assert len(second.region_files()) == 1
        assert worker.link.wait_attached(20) is not None
    finally:
        worker.close()
        if second is not None:
            second.cleanup()
        first.cleanup()


# Protects: a writer copies only while its session is known alive; one that
# was frozen past its lease (and maybe its quarantine) aborts instead of
# writing into pages that may belong to a newer entry by now.
def test_a_writer_whose_session_is_not_fresh_aborts_instead_of_copying(daemon):
    worker = WorkerDelegate(daemon.socket, engine_id="E", layout=LAYOUT)
    copies: list[int] = []
    try:
        assert worker.link.wait_attached(10) is not None
        real_save = worker.backend.save
        worker.backend.save = lambda *a, **k: (copies.append(1), real_save(*a, **k))
        worker.link.fresh = lambda: False  # as after a long freeze
        assert worker.save("k", np.ones((16, 1024), np.float32)) and worker.flush(10)
        assert copies == [] and worker.stats["saves_stale"] == 1
        stats = daemon.stats()
        assert stats["pending_bytes"] == 0 and stats["entries"] == 0  # aborted, not left
    finally:
        worker.close()
