"""A worker's copies when another process cuts (truncates) the region file
(issue 40, finding 4, the engines' side): no copy touches the region's pages
with the CPU (a page past the file's end is a SIGBUS that ends the process),
a load the cut reached fails, and pinned pages the cut orphaned never pass
for the file's (the canary). Regions are made as the daemon makes them
(`ec_daemon.durable.region.Region`: the trailer, the canary, the stamps); the
CUDA path runs under the model of CUDA's rules (tests/cuda_model.py), whose
registrations keep their old pages when a cut takes them out of the file."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ec_client.common.contract import LoadSpec, RegionInfo
from ec_client.copy import get_backend
from ec_client.copy.mapping import RegionCut, RegionDamaged, RegionMapping
from ec_client.worker_side.regions import Regions
from ec_client.worker_side.worker import WorkerDelegate
from ec_daemon.durable.region import Region
from ec_protocol.checksums import checksum
from ec_protocol.protocol import Layout
from ec_protocol.stamps import file_bytes, table_bytes
from tests import cuda_model

LAYOUT = Layout("m", "uint8", {"image": 4096})
PAGE = 4096
PAGES = 32
OFFSET = table_bytes(PAGES, PAGE)
SIZE = OFFSET + PAGES * PAGE
EXTENTS = ((OFFSET + 5 * PAGE, PAGE), (OFFSET + 2 * PAGE, 2 * PAGE), (OFFSET + 20 * PAGE, 100))
NBYTES = sum(length for _, length in EXTENTS)
ROOT = Path(__file__).resolve().parents[2]


class DaemonRegion:
    """A region file as the daemon makes and repairs it, written by the test."""

    def __init__(self, folder: Path) -> None:
        self.region = Region.create(folder, SIZE)
        self.stamps = self.region.stamps(PAGE, OFFSET)

    @property
    def info(self) -> RegionInfo:
        r = self.region
        return RegionInfo(str(r.path), SIZE, r.generation, PAGE, OFFSET, r.canary)

    def save(self, data: bytes, entry_id: int) -> LoadSpec:
        self.stamps.write([((o - OFFSET) // PAGE, -(-n // PAGE)) for o, n in EXTENTS], entry_id)
        self.region.write(EXTENTS, [data])
        return LoadSpec("a", entry_id, entry_id, self.region.generation, len(data),
                        (len(data),), "uint8", EXTENTS)

    def cut(self, size: int, *, regrow: bool = True) -> None:
        """What any worker may do: ftruncate, and (a bug, or on purpose) back."""
        with open(self.region.path, "r+b") as f:
            os.ftruncate(f.fileno(), size)
            if regrow:
                os.ftruncate(f.fileno(), file_bytes(SIZE))

    def repair(self) -> None:
        """What the daemon's upkeep does: the size back, a new canary."""
        self.region.restore()
        self.region.renew_canary()

    def close(self) -> None:
        self.region.close()


@pytest.fixture
def shm() -> Iterator[DaemonRegion]:
    region = DaemonRegion(Path("/dev/shm"))  # tmpfs, as the daemon's
    yield region
    region.close()


def data(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, NBYTES, dtype=np.uint8).tobytes()


def model_backend(**options: Any) -> cuda_model.Backend:
    """The CUDA copy path over the model, registered before it copies, in
    chunks smaller than the region."""
    return cuda_model.Backend(chunk_bytes=8 * PAGE, wait_pinned=True, **options)


@pytest.fixture(params=["cpu", "cuda-model"])
def worker(request) -> Iterator[WorkerDelegate]:
    backend: Any = get_backend("cpu") if request.param == "cpu" else model_backend()
    w = WorkerDelegate("unix:///nonexistent/ec.sock", engine_id="E", layout=LAYOUT,
                       backend=backend, start=False)
    yield w
    w.close()
    if request.param != "cpu":
        gc.collect()
        backend.model.drain()
        assert backend.model.violations == []


def raw(out: Any) -> bytes:
    return out.tobytes() if isinstance(out, np.ndarray) else cuda_model.as_host(out).tobytes()


# --------------------------------------------------------------- copies


def test_the_cpu_backend_copies_with_pread_and_pwrite_and_maps_nothing(shm):
    """The cpu backend and the stamp and checksum reads never map the region
    (nothing of it can fault); a load the cut made short fails with
    RegionCut; a save into a cut file extends it and faults nothing."""
    mapping = RegionMapping(shm.info.path, SIZE, shm.info.generation)
    backend = get_backend("cpu")
    try:
        assert mapping.watch_canary() == shm.region.canary
        source = np.frombuffer(data(1), dtype=np.uint8)
        backend.save(source, mapping, EXTENTS)
        out = np.empty(NBYTES, dtype=np.uint8)
        assert backend.load(mapping, EXTENTS, out) is out and out.tobytes() == source.tobytes()
        assert checksum(mapping.chunks(EXTENTS, chunk_bytes=1000)) == checksum([source])
        assert mapping._view is None  # never mapped
        shm.cut(OFFSET + 3 * PAGE, regrow=False)
        with pytest.raises(RegionCut):
            backend.load(mapping, EXTENTS, out)
        errors = backend.load_all([(mapping, EXTENTS, out), (mapping, EXTENTS[1:2], out[:PAGE])])
        assert isinstance(errors[0], RegionCut) and isinstance(errors[1], ValueError)
        backend.save(source, mapping, EXTENTS)  # extends the file: no fault
        assert not mapping.intact() and mapping.damaged
    finally:
        mapping.close()


CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np
    from ec_client.common.contract import LoadSpec, RegionInfo
    from ec_client.copy import get_backend
    from ec_client.worker_side.worker import WorkerDelegate
    from ec_protocol.protocol import Layout
    from ec_protocol.stamps import StampTable, table_bytes
    path, which = sys.argv[1], sys.argv[2]
    page, pages = 4096, 16
    offset = table_bytes(pages, page)
    size = offset + pages * page
    with open(path, "w+b") as f:
        f.truncate(size)
        stamps = bytearray(offset)
        table = StampTable(memoryview(stamps), page, offset)
        table.write([(0, 4)], 7)
        table.release()
        f.write(bytes(stamps) + bytes(range(256)) * 64)
    if which == "cpu":
        backend = get_backend("cpu")
    else:
        from tests import cuda_model
        backend = cuda_model.Backend(chunk_bytes=size)  # registered in the background
    worker = WorkerDelegate("unix:///nonexistent/ec.sock", engine_id="E",
                            layout=Layout("m", "uint8", {"image": 4096}), backend=backend,
                            start=False)
    info = RegionInfo(path, size, 1, page, offset)  # (an older daemon's: no canary)
    spec = LoadSpec("a", 1, 7, 1, 4 * page, (4 * page,), "uint8", ((offset, 4 * page),))
    first = worker.load([spec], {1: info})
    assert not first.failed, first.failed
    with open(path, "r+b") as f:  # another worker cuts the file
        os.ftruncate(f.fileno(), offset)
    second = worker.load([spec], {1: info})
    def raw(out):
        return bytes(np.asarray(out).reshape(-1).view(np.uint8))
    exact = "a" in second.loaded and raw(second.loaded["a"]) == raw(first.loaded["a"])
    print("alive", "exact" if exact else sorted(second.failed.values()), flush=True)
    os._exit(0)  # (not close: that would join the model's registrar)
""")


@pytest.mark.parametrize("which", ["cpu", "cuda-model"])
def test_a_worker_whose_region_another_process_cut_fails_the_load_and_lives(tmp_path, which):
    """Finding 4 on the engines' side: a worker mapped the region, another
    process truncated it, and the next load touched a page past the end:
    SIGBUS, the engine's worker process died (exit -7). Its copies and stamp
    checks read the file with pread now: the load fails, the process lives."""
    path = tmp_path / "region"
    result = subprocess.run([sys.executable, "-c", CHILD, str(path), which],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    # Failed (the cpu backend: the read came short), or, through pages CUDA
    # pinned before the cut (the model's registration keeps them), the bytes
    # the entry had (no canary: a region of an older daemon).
    assert result.stdout.startswith("alive"), result.stdout
    assert "RegionCut" in result.stdout if which == "cpu" else (
        "RegionCut" in result.stdout or "exact" in result.stdout), result.stdout


# -------------------------------------------------------------- regions


def test_a_region_cut_and_not_repaired_is_not_mapped_and_is_mapped_once_repaired(shm):
    """A worker that maps a file whose canary was cut (the daemon has not
    repaired it yet) is refused; once repaired (a new canary) it maps it, with
    the file's new canary as its own (the info's is older)."""
    regions = Regions()
    try:
        info = shm.info
        shm.cut(OFFSET)
        with pytest.raises(RegionDamaged, match="not repaired yet"), regions.use(info):
            pass
        shm.repair()
        with regions.use(info) as (mapping, _):
            assert mapping.canary == shm.region.canary != info.canary
    finally:
        regions.close()


def test_a_damaged_mapping_is_replaced_and_released_once_unused(shm):
    """After copies, a changed canary takes the mapping out of use: copies
    that hold it finish, it is detached (its registrations go) once none
    does, and the next use maps the file anew, once the daemon repaired it."""
    detached = []
    regions = Regions(on_unmap=detached.append)
    try:
        info = shm.info
        with regions.use(info) as (first, _):
            shm.cut(0)
            assert not regions.intact(first)  # the canary, after the copies
            assert detached == []  # this copy still holds it
            with pytest.raises(RegionDamaged), regions.use(info):  # not repaired: not mapped
                pass
            shm.repair()
            with regions.use(info) as (second, _):
                assert second is not first and regions.intact(second)
                assert not first.intact()  # for good
        regions.wait_released(5)
        assert detached == [first]
    finally:
        regions.close()


def test_use_reads_the_canary_before_it_hands_a_mapping_out(shm):
    """A file cut and repaired since the last copy: `use` sees the new canary
    and maps the file anew before anything is copied through the old one."""
    regions = Regions()
    try:
        with regions.use(shm.info) as (first, _):
            pass
        shm.cut(OFFSET + PAGE)
        shm.repair()
        with regions.use(shm.info) as (second, _):
            assert second is not first and second.canary == shm.region.canary
    finally:
        regions.close()


def test_a_mapping_without_a_canary_is_replaced_once_the_region_has_one(shm):
    """Mapped for an older daemon (its info had no canary), the mapping is
    replaced, without failing anything, when a daemon that adopted the region
    says it has one: from then on its copies are checked."""
    regions = Regions()
    try:
        older = RegionInfo(shm.info.path, SIZE, shm.info.generation, PAGE, OFFSET)
        with regions.use(older) as (first, _):
            assert first.canary is None and regions.intact(first)
        with regions.use(shm.info) as (second, _):
            assert second is not first and second.canary == shm.region.canary
        with regions.use(older) as (third, _):
            assert third is second  # a stale info does not undo it
    finally:
        regions.close()


# --------------------------------------------------------------- worker


@pytest.mark.parametrize("cut", [0, OFFSET + 10 * PAGE, SIZE, file_bytes(SIZE) - 1])
def test_loads_through_a_region_cut_under_them_fail_until_the_repair(shm, worker, cut):
    """A cut and regrown file looks whole (its stamps too, when the cut was
    past the table): the loads after it fail (the canary) instead of serving
    zeros; once the daemon repaired the file, the same worker loads again."""
    spec = shm.save(data(2), 7)
    regions = {spec.generation: shm.info}
    first = worker.load([spec], regions)
    assert not first.failed and raw(first.loaded["a"]) == data(2)
    shm.cut(cut)
    if cut > OFFSET:  # the stamps survive: only the canary tells
        assert shm.stamps.holds(spec.extents, 7)
    failed = worker.load([spec], regions)
    assert not failed.loaded and "cut" in failed.failed[spec.transfer_id]
    assert "cut" in worker.load([spec], regions).failed[spec.transfer_id]  # not repaired yet
    shm.repair()
    again = shm.save(data(3), 8)  # (the daemon dropped what was cut; a new save)
    result = worker.load([again], regions)
    assert not result.failed and raw(result.loaded["a"]) == data(3)


def test_orphaned_pinned_pages_never_pass_for_the_files(shm):
    """The case a CPU cannot show: cudaHostRegister pinned the mapping's
    pages; a cut takes them out of the file, which is regrown at once, while
    the registration keeps them. A save then lands in the old pages (the file
    holds zeros), and its read-back checksum vouches for the zeros; a load
    reads the old pages, not what the file holds. Both copies are caught by
    the canary after them."""
    backend = model_backend()
    mapping = RegionMapping(shm.info.path, SIZE, shm.info.generation)
    try:
        mapping.watch_canary()
        backend.attach(mapping)
        model = backend.model
        source = model.to_device(torch.frombuffer(bytearray(data(4)), dtype=torch.uint8))
        model.orphan()
        shm.cut(0)  # and regrown: the file's pages are new (zeros)
        backend.save(source, mapping, EXTENTS, backend.prepare_save(source))
        assert checksum(mapping.chunks(EXTENTS)) == checksum([bytes(NBYTES)])  # vouches zeros
        assert not mapping.intact()
        shm.region.write(EXTENTS, [data(5)])  # the file's bytes now
        out = backend.empty((NBYTES,), "uint8")
        assert backend.load_all([(mapping, EXTENTS, out)]) == [None]
        assert raw(out) == data(4) != data(5)  # the old pages, not the file's
        assert not mapping.intact()
    finally:
        backend.detach(mapping)
        mapping.close()
    assert backend.model.violations == []


@pytest.mark.parametrize("pinned", [True, False])
def test_cuda_copies_of_chunks_not_registered_go_through_page_locked_memory(shm, pinned):
    """A chunk that is not registered (registration refused, or not done
    yet) is never copied as pageable memory (CUDA would touch the mapping
    with the CPU: the model counts that as a broken rule): a save goes
    device -> bounce buffer -> pwrite, a load pread -> bounce -> device, in
    pieces when larger than the buffer, bit-exact."""
    runtime = cuda_model.ModelRuntime()
    if not pinned:
        runtime.refuse_registration = lambda offset, length: True
    backend = cuda_model.Backend(runtime, chunk_bytes=8 * PAGE, wait_pinned=not pinned)
    backend.bounce_bytes = 3 * PAGE + 17  # smaller than a copy: reused
    mapping = RegionMapping(shm.info.path, SIZE, shm.info.generation)
    try:
        mapping.watch_canary()
        backend.attach(mapping)
        if not pinned:
            assert backend.pinning(mapping).done.wait(10) and not backend.pinned(mapping)
        source = runtime.to_device(torch.frombuffer(bytearray(data(6)), dtype=torch.uint8))
        backend.save(source, mapping, EXTENTS, backend.prepare_save(source))
        assert b"".join(shm.region.read(EXTENTS)) == data(6)
        out = backend.empty((NBYTES,), "uint8")
        assert backend.load_all([(mapping, EXTENTS, out)]) == [None] and raw(out) == data(6)
        shm.cut(OFFSET + 3 * PAGE, regrow=False)
        errors = backend.load_all([(mapping, EXTENTS, backend.empty((NBYTES,), "uint8"))])
        assert pinned or isinstance(errors[0], RegionCut)  # (pinned: old pages, the canary's)
        assert not mapping.intact()
    finally:
        backend.detach(mapping)
        mapping.close()
    gc.collect()
    runtime.drain()
    assert runtime.violations == []
