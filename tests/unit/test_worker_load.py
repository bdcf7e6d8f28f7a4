"""WorkerDelegate without a daemon: loads from region files made here (a
stamp table, then the payload), staged until a step adopts them, and the
byte bound of the save queue."""

from __future__ import annotations

import gc
import mmap
import os
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ec_client.common.contract import (
    CHECKSUM_MISMATCH,
    STAMP_MISMATCH,
    UNUSABLE,
    LoadSpec,
    RegionInfo,
)
from ec_client.common.limits import STAGED_STEPS
from ec_client.common.session import Attachment
from ec_client.copy import empty_host, get_backend
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.checksums import checksum
from ec_protocol.protocol import Layout
from ec_protocol.stamps import StampTable, table_bytes
from tests import cuda_model

LAYOUT = Layout("m", "float32", {"image": 4096})
PAGE = 4096
PAGES = 16
OFFSET = table_bytes(PAGES, PAGE)
SIZE = OFFSET + PAGES * PAGE


def page(p: int) -> int:
    """Byte offset of payload page `p` in the region."""
    return OFFSET + p * PAGE


def runs_of(extents: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    return [((offset - OFFSET) // PAGE, -(-length // PAGE)) for offset, length in extents]


class Region:
    """A region file as a daemon lays it out, written by the test."""

    def __init__(self, folder: Path, generation: int) -> None:
        self.path = folder / f"region-{generation:x}"
        self.path.write_bytes(bytes(SIZE))
        self.info = RegionInfo(str(self.path), SIZE, generation, PAGE, OFFSET)

    def save(self, data: np.ndarray, extents: tuple[tuple[int, int], ...],
             entry_id: int) -> None:
        """Stamp the pages under `extents`, then write `data` into them."""
        self.stamp(extents, entry_id)
        raw = data.tobytes()
        with open(self.path, "r+b") as f:
            done = 0
            for offset, length in extents:
                f.seek(offset)
                f.write(raw[done:done + length])
                done += length

    def stamp(self, extents: tuple[tuple[int, int], ...], entry_id: int) -> None:
        """What the daemon does when it gives these pages to another entry."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            with mmap.mmap(fd, OFFSET) as table:
                view = memoryview(table)
                stamps = StampTable(view, PAGE, OFFSET)
                stamps.write(runs_of(extents), entry_id)
                stamps.release()
                view.release()
        finally:
            os.close(fd)


def spec_for(region: Region, data: np.ndarray, extents: tuple[tuple[int, int], ...],
             entry_id: int, transfer_id: int = 1, mm_hash: str = "a") -> LoadSpec:
    """The load of `data` saved at `extents`, with its writer's checksum."""
    return LoadSpec(mm_hash, transfer_id, entry_id, region.info.generation, data.nbytes,
                    tuple(data.shape), str(data.dtype), extents, checksum([data.tobytes()]))


def attachment(region: Region) -> Attachment:
    return Attachment(session_id="s", index=1, namespace="ns", region=region.info,
                      lease_ms=10000, heartbeat_ms=2000)


def payload(seed: int, nbytes: int = 3 * PAGE - 100) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 31, nbytes // 4, dtype=np.int32)


# Scattered, out of order, the last one a partial page.
EXTENTS = ((page(5), PAGE), (page(2), PAGE), (page(9), PAGE - 100))


# Registration chunks of a page and a half: pinned copies of EXTENTS cross
# their boundaries (a copy must be split there).
CHUNK = 3 * PAGE // 2


def model_backend(**options: Any) -> cuda_model.Backend:
    """The CUDA copy path under the model, as an engine runs it: small
    registration chunks, registered before copies, the compute stream busy
    before every allocation and load, and reading every loaded output."""
    return cuda_model.Backend(chunk_bytes=CHUNK, busy_compute=True, wait_pinned=True, **options)


def check_model(backend: cuda_model.Backend) -> None:
    """After a test: the outputs it dropped are freed, the forward passes
    queued on the compute stream run, and no rule was broken on the way; the
    host never waited for the compute stream."""
    gc.collect()
    backend.model.drain()
    assert backend.model.violations == []
    assert backend.model.compute_host_waits == 0


@pytest.fixture(params=["cpu", "cuda-model", "cuda-model-no-batch"])
def worker(request) -> Iterator[WorkerDelegate]:
    """A worker copying with the cpu backend, and with the CUDA copy path
    under the model of CUDA's rules (tests/cuda_model.py), with and without
    cudaMemcpyBatchAsync."""
    backend: Any = get_backend("cpu") if request.param == "cpu" else model_backend(
        runtime=cuda_model.ModelRuntime(batches=request.param == "cuda-model"))
    w = WorkerDelegate("unix:///nonexistent/ec.sock", engine_id="E", layout=LAYOUT,
                       backend=backend, start=False)
    yield w
    w.close()
    if request.param != "cpu":
        check_model(backend)


def raw(out: Any) -> bytes:
    """A loaded output's bytes (a numpy array, or a tensor of the model's device)."""
    return out.tobytes() if isinstance(out, np.ndarray) else cuda_model.as_host(out).tobytes()


def test_a_load_returns_the_saved_bytes_exactly(tmp_path, worker):
    region = Region(tmp_path, 0xA)
    data = payload(1)
    region.save(data, EXTENTS, entry_id=3)
    worker.on_attached(attachment(region))
    result = worker.load([spec_for(region, data, EXTENTS, 3, transfer_id=11)],
                         {0xA: region.info})
    assert result.failed == {} and result.done == [11]
    out = result.loaded["a"]
    assert str(out.dtype).removeprefix("torch.") == str(data.dtype)
    assert tuple(out.shape) == data.shape and raw(out) == data.tobytes()
    assert worker.take_stats() == {"loads_done": 1}
    assert sum(worker.transport.calls.values()) == 0  # no daemon call on the load path


def test_a_load_maps_the_region_it_names_without_an_attachment(tmp_path, worker):
    region = Region(tmp_path, 0xA)
    data = payload(2)
    region.save(data, EXTENTS, entry_id=3)
    result = worker.load([spec_for(region, data, EXTENTS, 3)], {0xA: region.info})
    assert raw(result.loaded["a"]) == data.tobytes()


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "not verified"])
def test_bytes_another_process_rewrote_fail_the_load_when_loads_are_verified(tmp_path, worker,
                                                                             verify):
    """Any process that maps the region read-write can rewrite an entry's
    bytes and leave its stamps alone: with `verify_checksum` the load is
    refused (on the cpu backend its output is checked, on CUDA the pages)."""
    region = Region(tmp_path, 0xA)
    data = payload(5)
    region.save(data, EXTENTS, entry_id=3)
    with open(region.path, "r+b") as f:  # 64 bytes of its second extent, rewritten
        f.seek(EXTENTS[1][0] + 100)
        f.write(bytes(range(64)))
    worker.verify_checksum = verify
    result = worker.load([spec_for(region, data, EXTENTS, 3, transfer_id=13)],
                         {0xA: region.info})
    if verify:
        assert result.loaded == {} and result.kinds == {13: CHECKSUM_MISMATCH}
        assert "another process rewrote them" in result.failed[13]
        assert worker.stats["loads_checksum_mismatch"] == 1
    else:  # the stamps hold: what the region holds is loaded
        assert result.done == [13] and raw(result.loaded["a"]) != data.tobytes()
    intact = payload(6)
    region.save(intact, EXTENTS, entry_id=4)
    worker.verify_checksum = True
    result = worker.load([spec_for(region, intact, EXTENTS, 4, transfer_id=14)],
                         {0xA: region.info})
    assert result.done == [14] and raw(result.loaded["a"]) == intact.tobytes()
    spec = spec_for(region, intact, EXTENTS, 4, transfer_id=15)._replace(checksum=0)
    assert worker.load([spec], {0xA: region.info}).done == [15]  # none recorded: none checked


def test_a_staged_load_is_kept_aside_until_a_step_adopts_it(tmp_path, worker):
    region = Region(tmp_path, 0xA)
    data = payload(1)
    region.save(data, EXTENTS, entry_id=3)
    result = worker.stage([spec_for(region, data, EXTENTS, 3, transfer_id=11)],
                          {0xA: region.info}, step=1)
    assert result.done == [11] and result.failed == {} and result.loaded == {}
    assert worker.staging.bytes == data.nbytes
    region.save(payload(2), EXTENTS, entry_id=3)  # rewritten after it was staged
    out = worker.adopt(11)
    assert raw(out) == data.tobytes()  # what was verified, not what is there now
    assert worker.adopt(11) is None and worker.staging.bytes == 0
    assert worker.take_stats() == {"loads_done": 1, "loads_adopted": 1}


def test_a_failed_staging_keeps_nothing_and_says_what_failed(tmp_path, worker):
    region = Region(tmp_path, 0xA)
    data = payload(1)
    region.save(data, EXTENTS, entry_id=3)
    region.stamp(EXTENTS[:1], 4)
    missing = LoadSpec("b", 12, 5, 0xB, 4, (1,), "float32", ((page(0), 4),))
    result = worker.stage([spec_for(region, data, EXTENTS, 3, transfer_id=11), missing],
                          {0xA: region.info}, step=1)
    assert result.done == [] and result.kinds == {11: STAMP_MISMATCH, 12: UNUSABLE}
    assert len(worker.staging) == 0 and worker.adopt(11) is None


def test_the_staging_area_holds_its_bound_and_drops_what_no_step_adopts(tmp_path):
    region = Region(tmp_path, 0xA)
    data = payload(1, nbytes=PAGE)
    one = ((page(1), PAGE),)
    region.save(data, one, entry_id=3)
    w = WorkerDelegate("unix:///nonexistent/ec.sock", engine_id="E", layout=LAYOUT,
                       start=False, staging_bytes=2 * PAGE)
    try:
        specs = [spec_for(region, data, one, 3, transfer_id=t, mm_hash=f"k{t}")
                 for t in (1, 2, 3)]
        result = w.stage(specs, {0xA: region.info}, step=1)
        assert result.done == [1, 2] and result.kinds == {3: UNUSABLE}  # no room for a third
        assert "ec_daemon_staging_bytes" in result.failed[3]
        w.drop([2, 99])
        assert w.staging.bytes == PAGE and w.stats["staged_dropped"] == 1
        assert w.stage([specs[2]], {0xA: region.info}, step=2).done == [3]
        # Staged at steps 1 and 2, and never adopted: gone STAGED_STEPS steps later.
        w.stage([], {}, step=STAGED_STEPS)
        assert len(w.staging) == 2
        w.stage([], {}, step=1 + STAGED_STEPS)
        assert w.stats["staged_expired"] == 1 and len(w.staging) == 1
        w.stage([], {}, step=2 + STAGED_STEPS)
        assert w.stats["staged_expired"] == 2 and w.staging.bytes == 0
    finally:
        w.close()


@pytest.mark.parametrize("stamp", [4, 0], ids=["reused", "freed"])
def test_pages_stamped_for_another_entry_fail_the_load(tmp_path, worker, stamp):
    region = Region(tmp_path, 0xA)
    data = payload(3)
    region.save(data, EXTENTS, entry_id=3)
    region.stamp(EXTENTS[1:2], stamp)  # one page of the three went elsewhere
    result = worker.load([spec_for(region, data, EXTENTS, 3, transfer_id=12)],
                         {0xA: region.info})
    assert result.loaded == {} and result.done == []
    assert "stamp mismatch" in result.failed[12]
    assert worker.stats["loads_stamp_mismatch"] == 1 and worker.stats["loads_failed"] == 1


def test_pages_reused_during_the_copy_fail_the_load(tmp_path, worker):
    """The stamps are checked after the copy: a daemon that reused the pages
    while the bytes were being read is caught."""
    region = Region(tmp_path, 0xA)
    data = payload(4)
    region.save(data, EXTENTS, entry_id=3)

    class ReusedDuringTheCopy:
        name = "cpu"

        def __init__(self) -> None:
            self._cpu = get_backend("cpu")
            self.copies = 0

        def __getattr__(self, attr: str) -> Any:
            return getattr(self._cpu, attr)

        def load_all(self, loads: Any) -> list[Exception | None]:
            errors = self._cpu.load_all(loads)
            self.copies += 1
            region.stamp(EXTENTS, 8)  # the bytes it read may be half new
            return errors

    backend = ReusedDuringTheCopy()
    worker.backend = backend
    result = worker.load([spec_for(region, data, EXTENTS, 3, transfer_id=13)],
                         {0xA: region.info})
    assert backend.copies == 1
    assert result.loaded == {} and result.done == [] and "stamp" in result.failed[13]


def test_a_load_without_its_region_fails(tmp_path, worker):
    region = Region(tmp_path, 0xA)
    data = payload(5)
    region.save(data, EXTENTS, entry_id=3)
    result = worker.load([spec_for(region, data, EXTENTS, 3, transfer_id=14)], {})
    assert result.loaded == {} and "no region of generation" in result.failed[14]


def test_a_failed_load_does_not_fail_the_others_in_the_step(tmp_path, worker):
    region = Region(tmp_path, 0xA)
    a, b = payload(6, PAGE), payload(7, PAGE)
    region.save(a, ((page(0), PAGE),), entry_id=1)
    region.save(b, ((page(1), PAGE),), entry_id=2)
    specs = [spec_for(region, a, ((page(0), PAGE),), 1, transfer_id=1, mm_hash="a"),
             spec_for(region, b, ((page(1), PAGE),), 5, transfer_id=2, mm_hash="b")]
    result = worker.load(specs, {0xA: region.info})
    assert result.done == [1] and list(result.failed) == [2]
    assert list(result.loaded) == ["a"] and raw(result.loaded["a"]) == a.tobytes()


def test_an_old_generations_load_reads_the_old_file_after_a_restart(tmp_path, worker):
    old, new = Region(tmp_path, 0xA), Region(tmp_path, 0xB)
    data = payload(8)
    old.save(data, EXTENTS, entry_id=3)
    new.save(payload(9), EXTENTS, entry_id=3)  # entry ids restart: same id, other bytes
    worker.on_attached(attachment(old))
    worker.on_detached()
    worker.on_attached(attachment(new))
    old.path.unlink()  # the old daemon removed its file on exit
    result = worker.load([spec_for(old, data, EXTENTS, 3)], {0xA: old.info, 0xB: new.info})
    assert result.failed == {}
    assert raw(result.loaded["a"]) == data.tobytes()  # the old region's, not the new


def test_a_load_of_a_gone_region_no_longer_mapped_fails(tmp_path, worker):
    region = Region(tmp_path, 0xA)
    data = payload(10)
    region.save(data, EXTENTS, entry_id=3)
    region.path.unlink()
    result = worker.load([spec_for(region, data, EXTENTS, 3, transfer_id=15)],
                         {0xA: region.info})
    assert result.loaded == {} and "FileNotFoundError" in result.failed[15]


# ------------------------------------------------------------- saves


class Saver:
    """Stands in for the saver's daemon calls: blocks until let go."""

    def __init__(self, fail: bool = False) -> None:
        self.started = threading.Semaphore(0)
        self.go = threading.Event()
        self.fail = fail
        self.saved: list[str] = []

    def __call__(self, mm_hash: str, output: Any, ready: Any) -> None:
        self.started.release()
        assert self.go.wait(10)
        if self.fail:
            raise RuntimeError("the copy failed")
        self.saved.append(mm_hash)


@pytest.fixture
def saving(tmp_path) -> Iterator[WorkerDelegate]:
    w = WorkerDelegate("unix:///nonexistent/ec.sock", engine_id="E", layout=LAYOUT,
                       save_queue_bytes=3000, start=False)
    w.link._attachment = attachment(Region(tmp_path, 0xA))  # as if attached
    yield w
    w.close()


@pytest.mark.parametrize("fail", [False, True], ids=["saved", "failed"])
def test_the_save_queue_is_bounded_in_bytes(saving, fail):
    saver = Saver(fail)
    saving.saver._save_one = saver
    def chunk() -> np.ndarray:
        return np.zeros(1000, np.uint8)

    try:
        assert saving.save("a", chunk())
        assert saver.started.acquire(timeout=10)  # being saved: still counted
        assert saving.save("b", chunk()) and saving.save("c", chunk())
        assert saving.queued_bytes == 3000
        assert not saving.save("d", chunk())  # 4000 bytes would be held
        assert not saving.save("e", np.zeros(1, np.uint8))
        assert saving.stats["saves_skipped_busy"] == 2
    finally:
        saver.go.set()
    assert saving.flush(10)
    assert saving.queued_bytes == 0
    assert saver.saved == ([] if fail else ["a", "b", "c"])
    assert saving.stats["save_errors"] == (3 if fail else 0)
    assert saving.save("f", np.zeros(3000, np.uint8))  # room again
    assert saving.flush(10)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_the_save_queue_counts_the_memory_outputs_keep_alive_once(saving, kind):
    """A slice of a larger output keeps all of it alive; the items vLLM
    splits out of one batch's output hold that output once, not once each."""
    saver = Saver()
    saving.saver._save_one = saver
    batch = np.zeros((6, 500), np.uint8) if kind == "numpy" else torch.zeros(6, 500,
                                                                             dtype=torch.uint8)
    try:
        assert saving.save("i0", batch[0])
        assert saver.started.acquire(timeout=10)
        assert saving.queued_bytes == 3000  # the whole batch, not the 500 bytes of a row
        assert all(saving.save(f"i{i}", batch[i]) for i in range(1, 6))
        assert saving.queued_bytes == 3000  # still once
        assert not saving.save("other", np.zeros(1, np.uint8))  # a new buffer: full
    finally:
        saver.go.set()
    assert saving.flush(10) and saving.queued_bytes == 0
    assert sorted(saver.saved) == [f"i{i}" for i in range(6)]


def test_a_save_the_backend_refuses_is_not_cached_and_never_raises(saving):
    class Refusing:
        name, device, stats = "refusing", "cpu", Counter()

        def prepare_save(self, source: Any) -> Any:
            raise TypeError("not the worker's device")

    saving.saver.backend = Refusing()
    assert not saving.save("a", np.zeros(10, np.uint8))
    assert saving.stats["save_errors"] == 1 and saving.queued_bytes == 0
    assert saving.flush(1)


def test_a_detached_worker_skips_saves(worker):
    assert not worker.save("a", np.zeros(10, np.uint8))
    assert worker.stats["saves_skipped_detached"] == 1 and worker.queued_bytes == 0


def test_only_the_save_rank_saves(tmp_path):
    w = WorkerDelegate("unix:///nonexistent/ec.sock", engine_id="E", layout=LAYOUT, rank=1,
                       world_size=2, start=False)
    try:
        w.link._attachment = attachment(Region(tmp_path, 0xA))
        assert not w.save("a", np.zeros(10, np.uint8))
        assert w.queued_bytes == 0
    finally:
        w.close()


def test_a_cuda_worker_never_loads_into_host_memory(tmp_path):
    """A host array as a CUDA load's output (the old default) fails the load
    instead of returning it unwritten: cupy.asarray would have copied it to a
    temporary device array, the copy landed there, and the stamps passed."""
    backend = model_backend()
    worker = WorkerDelegate("unix:///nonexistent/ec.sock", engine_id="E", layout=LAYOUT,
                            backend=backend, allocate_out=empty_host, start=False)
    region = Region(tmp_path, 0xA)
    data = payload(9)
    region.save(data, EXTENTS, entry_id=3)
    try:
        result = worker.load([spec_for(region, data, EXTENTS, 3, transfer_id=5)],
                             {0xA: region.info})
    finally:
        worker.close()
    assert result.loaded == {} and "host memory" in result.failed[5]


# ------------------------------------------------------------- saves held


@pytest.fixture
def held(tmp_path) -> Iterator[WorkerDelegate]:
    """A worker that holds its saves until it hears its scheduler's namespace
    (the vLLM connector's), attached with namespace "ns"."""
    w = WorkerDelegate("unix:///nonexistent/ec.sock", engine_id="E", layout=LAYOUT,
                       save_queue_bytes=3000, start=False, hold_saves=True)
    w.link._attachment = attachment(Region(tmp_path, 0xA))  # as if attached
    yield w
    w.close()


def test_saves_wait_until_the_worker_hears_its_schedulers_namespace(held):
    saver = Saver()
    saver.go.set()
    held.saver._save_one = saver
    def chunk() -> np.ndarray:  # a buffer of its own each (one buffer is counted once)
        return np.zeros(1000, np.uint8)

    assert held.save("a", chunk()) and held.save("b", chunk())
    held.follow_scheduler("")  # a step of a scheduler not attached (yet): still held
    assert not held.flush(0.3)
    assert saver.saved == [] and held.queued_bytes == 2000
    # Held within the save queue's bytes.
    assert held.save("c", chunk()) and not held.save("d", chunk())
    assert held.stats["saves_held"] == 3 and held.stats["saves_skipped_busy"] == 1
    held.follow_scheduler("ns")  # the worker's own: saved, in order
    assert held.flush(10) and saver.saved == ["a", "b", "c"]
    assert held.save("e", chunk()) and held.flush(10) and saver.saved[-1] == "e"
    assert held.stats["saves_held"] == 3  # no longer held


def test_saves_held_under_another_namespace_than_the_schedulers_are_dropped(held, caplog):
    import weakref

    saver = Saver()
    saver.go.set()
    held.saver._save_one = saver
    output = np.zeros(1000, np.uint8)
    kept = weakref.ref(output)
    assert held.save("a", output) and held.save("b", np.zeros(1000, np.uint8))
    del output
    held.follow_scheduler("other-weights")
    assert held.flush(1) and held.queued_bytes == 0 and saver.saved == []
    assert kept() is None  # the output held for saving was let go (no cycle: at once)
    assert not held.saves_enabled and not held.save("c", np.zeros(10, np.uint8))
    assert held.stats["saves_off_namespace"] == 3  # the worker's, and its two held saves
    assert "2 held saves dropped" in caplog.text
