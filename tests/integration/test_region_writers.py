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
from ec_protocol.checksums import checksum
from ec_protocol.protocol import Layout, pb
from ec_protocol.stamps import file_bytes
from tests import staged
from tests.integration.daemon import Daemon, short_tmpdir
from tests.integration.raw import RawStream, allocate, attach, save

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
        daemon.wait_for(lambda: staged.servable(scheduler, mm_hash),
                        what=f"{mm_hash} in the view")
        result = staged.load(scheduler, worker, [mm_hash])
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
            assert os.fstat(fd).st_size == file_bytes(size)  # given back, its trailer too
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


def test_a_saved_entrys_checksum_travels_and_a_report_is_checked_against_the_pages():
    """Writes by another process are detected: the saver reports the checksum
    of the bytes that landed, the daemon records it and sends it with the
    entry (a view's LoadSpec carries it). A loader's report that an entry
    does not match is checked by the daemon against the pages: a report the
    pages contradict changes nothing (a lying client evicts nothing); one they
    confirm (64 bytes rewritten, or a stamp) hides the entry, and the next
    save of the key lands (finding 7's daemon side)."""
    rng = np.random.default_rng(9)
    data = {key: rng.integers(0, 256, (256, 1024), dtype=np.uint8)
            for key in ("intact", "scribbled", "restamped")}
    # (Without invariant checks after every call: a rewritten stamp is not what
    # the bookkeeping says, by the attack, until the daemon is told of it.)
    with Daemon(cpu_bytes="16MiB", check_invariants=False) as daemon:
        scheduler = SchedulerDelegate(daemon.socket, engine_id="E", layout=LAYOUT)
        worker = WorkerDelegate(daemon.socket, engine_id="E", layout=LAYOUT)
        reporter = attach(daemon.stub, LAYOUT, engine="R", rank=None)
        view = RawStream(daemon.stub, reporter.session_id)
        try:
            assert scheduler.link.wait_attached(WAIT) and worker.link.wait_attached(WAIT)
            for key, array in data.items():
                assert worker.save(key, array)
            assert worker.flush(WAIT) and worker.stats["saves_done"] == 3
            found = dict(zip(data, daemon.lookup(LAYOUT, *data), strict=True))
            for key, result in found.items():
                assert result.entry.checksum == checksum([data[key].tobytes()])
            daemon.wait_for(lambda: staged.servable(scheduler, "intact"),
                            what="the entries in the view")
            assert scheduler.view.get("intact").checksum == found["intact"].entry.checksum
            _, metadata = staged.plan(scheduler, ["intact"])
            (spec,) = metadata.loads
            assert spec.checksum == found["intact"].entry.checksum

            def ref(key: str) -> pb.EntryRef:
                return pb.EntryRef(mm_hash=key, entry_id=found[key].entry.entry_id)

            view.send(mismatches=[ref("intact")])  # a lie: the pages say otherwise
            whole = f"entry {found['intact'].entry.entry_id} (intact) is whole"
            daemon.wait_for(lambda: whole in daemon.log(), what="the daemon's check of the lie")
            region = Path(reporter.region.path)
            (offset, _), *_ = [(e.offset, e.length) for e in found["scribbled"].entry.extents]
            with open(region, "r+b") as f:  # any region writer: 64 bytes rewritten
                f.seek(offset + 1000)
                f.write(bytes(b ^ 0xFF for b in data["scribbled"].tobytes()[1000:1064]))
                first_page = (found["restamped"].entry.extents[0].offset
                              - reporter.region.data_offset) // reporter.region.page_bytes
                f.seek(8 * first_page)  # and one stamp
                f.write((12345).to_bytes(8, "little"))
            view.send(mismatches=[ref("scribbled"), ref("restamped")])
            daemon.wait_for(lambda: daemon.stats()["checksum_mismatches"] == 2,
                            what="the reported entries to be found changed")
            stats = daemon.stats()
            assert stats["mismatch_reports"] == 3
            states = {key: r.state for key, r in zip(data, daemon.lookup(LAYOUT, *data),
                                                     strict=True)}
            assert states["intact"] == pb.READY
            assert pb.READY not in (states["scribbled"], states["restamped"])
            daemon.stub.Detach(pb.DetachRequest(session_id=reporter.session_id))  # acks all
            daemon.wait_for(lambda: all(r.state == pb.ABSENT for r in daemon.lookup(
                LAYOUT, "scribbled", "restamped")), what="the hidden entries to be reclaimed")
            assert worker.save("scribbled", data["scribbled"]) and worker.flush(WAIT)
            assert worker.stats["saves_done"] == 4  # the key saved again
        finally:
            view.close()
            worker.close()
            scheduler.close()
