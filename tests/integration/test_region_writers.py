"""What a process that opens the region (every engine worker does, read-write,
to map it) can do to the daemon, against the real daemon (issue 40): truncate
the file, lock it. It can still change bytes, which loaders detect by
checksum (docs/security.md); it can no longer kill the daemon nor make its
region look alive."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout, pb
from tests.integration.daemon import Daemon, short_tmpdir
from tests.integration.raw import allocate, attach, save

pytestmark = pytest.mark.integration
LAYOUT = Layout("writers-model", "uint8", {"image": 1024})
MiB = 1 << 20
WAIT = 20.0


def served(daemon: Daemon, engine: str, mm_hash: str, data: np.ndarray) -> None:
    """Save `data` as `mm_hash` through an engine's worker, then hit and load
    it through its scheduler: the load returns exactly the saved bytes."""
    scheduler = SchedulerDelegate(daemon.socket, engine_id=engine, layout=LAYOUT)
    worker = WorkerDelegate(daemon.socket, engine_id=engine, layout=LAYOUT)
    try:
        assert scheduler.link.wait_attached(WAIT) and worker.link.wait_attached(WAIT)
        assert worker.save(mm_hash, data) and worker.flush(WAIT)
        daemon.wait_for(lambda: scheduler.serving() and scheduler.has_item(mm_hash),
                        what=f"{mm_hash} in the view")
        assert scheduler.after_alloc("r", mm_hash)
        metadata = scheduler.build_step_metadata()
        result = worker.load(metadata.loads, metadata.regions)
        assert not result.failed and np.array_equal(result.loaded[mm_hash], data)
    finally:
        worker.close()
        scheduler.close()


def test_a_client_that_truncates_the_region_cannot_kill_the_daemon():
    """Finding 4: a client truncated the region (ftruncate(fd, 0)) and the
    next save ended the daemon with SIGBUS (exit -7). The daemon maps no page
    of it now: it survives, gives the file its size back within a second or
    so, drops every entry the truncation cut (never served from a short or
    zeroed file), and saves and loads go on."""
    # (Without invariant checks after every call: between the cut and the next
    # upkeep the stamps are not what the bookkeeping says, by the attack.)
    with Daemon(cpu_bytes="16MiB", check_invariants=False) as daemon:
        attached = attach(daemon.stub, LAYOUT, engine="writer", token="6" * 32)
        writer, size = attached.session_id, attached.region.size_bytes
        for i in range(4):
            save(daemon.stub, writer, f"before-{i}", MiB)
        region = Path(daemon.stats()["region_path"])
        fd = os.open(region, os.O_RDWR)  # as every engine worker opens it
        try:
            os.ftruncate(fd, 0)
            # The next save writes its stamps into the cut table: it was a SIGBUS.
            assert allocate(daemon.stub, writer, "after-cut", MiB).status == pb.ALLOCATED
            daemon.wait_for(lambda: daemon.stats()["region_truncations"] == 1, timeout=WAIT,
                            what="the truncation to be noticed")
            assert daemon.proc is not None and daemon.proc.poll() is None
            assert os.fstat(fd).st_size == size  # given back
        finally:
            os.close(fd)
        assert "was truncated to" in daemon.log() and "the 5 entries it cut are dropped" \
            in daemon.log()
        states = [r.state for r in daemon.lookup(LAYOUT, *(f"before-{i}" for i in range(4)))]
        assert pb.READY not in states  # cut: never served again
        report = daemon.stub.Report(pb.ReportRequest(session_id=writer, saved=["after-cut"]))
        assert list(report.saved) == [pb.UNKNOWN]  # its pages were cut: dropped
        data = np.random.default_rng(4).integers(0, 256, (512, 1024), dtype=np.uint8)
        served(daemon, "engine", "fresh", data)


def test_a_client_holding_a_lock_on_the_region_cannot_make_it_look_alive(shm_folder: Path):
    """Finding 13: a client holding LOCK_SH on the region after its daemon
    stopped made the next start begin empty (the region looked alive) and
    `ec-daemon clean` leave the file. The daemon's liveness lock is on its
    index, which no client can open: the next start adopts the region, and
    clean removes a dead one, whatever lock a client holds on it."""
    folder = short_tmpdir()
    first = Daemon(folder=folder, shm_dir=str(shm_folder), cpu_bytes="4MiB")
    second = Daemon(folder=folder, shm_dir=str(shm_folder), cpu_bytes="4MiB")
    try:
        first.start()
        writer = attach(first.stub, LAYOUT, engine="writer", token="7" * 32).session_id
        save(first.stub, writer, "kept", MiB)
        assert first.stop() == 0
        (region,) = first.own_regions()
        fd = os.open(region, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a client's lock, held across the restart
            second.start()
            assert "adopted region" in second.log() and "1 entries" in second.log()
            assert [r.state for r in second.lookup(LAYOUT, "kept")] == [pb.READY]
            assert second.stop() == 0
            result = subprocess.run(
                [sys.executable, "-m", "ec_daemon", "clean", "--socket", second.socket,
                 "--shm-dir", str(shm_folder)], capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stderr
            assert not region.exists() and not region.with_suffix(".index").exists()
        finally:
            os.close(fd)
    finally:
        second.cleanup()
        first.cleanup()
