"""A registered region really cut (truncated) under CUDA copies, on a GPU
(issue 40, finding 4, the engines' side). cudaHostRegister pinned the
mapping's pages; a cut takes them out of the file (regrown at once, the file
looks whole), while the GPU goes on copying to and from the pages it pinned.
The process survives its copies (pinned pages never fault; chunks not
registered go through the bounce buffer, never as pageable memory), the
canary says the file was cut, a worker's load through it fails, and a new
mapping of the repaired file copies bit-exact. Skipped without CUDA
(`make gpu-test` fails instead)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from ec_client.common.contract import LoadSpec, RegionInfo  # noqa: E402
from ec_client.copy.mapping import RegionMapping  # noqa: E402
from ec_client.worker_side.worker import WorkerDelegate  # noqa: E402
from ec_daemon.durable.stamp_file import StampFile  # noqa: E402
from ec_protocol.protocol import Layout  # noqa: E402
from ec_protocol.stamps import file_bytes, table_bytes  # noqa: E402
from tests.gpu.support import (  # noqa: E402
    canary_region,
    file_bytes_at,
    get_backend_or_skip,
    needs_cuda,
    pattern,
    repair,
    row_major_bytes,
    wait_pinned,
)

pytestmark = [pytest.mark.gpu, needs_cuda]
BACKENDS = ["torch", "cupy"]
MiB = 1 << 20
SIZE = 64 * MiB
SHAPE = (1024, 1152)  # bfloat16: 2.25 MiB
NBYTES = 1024 * 1152 * 2
EXTENTS = [(4 * MiB, NBYTES // 2), (40 * MiB, NBYTES - NBYTES // 2)]


def _cut(fd: int, regrow: bool) -> None:
    """What any worker may do to the region it opened read-write."""
    os.ftruncate(fd, 0)
    if regrow:
        os.ftruncate(fd, file_bytes(SIZE))


@pytest.mark.parametrize("regrow", [True, False], ids=["cut-and-regrown", "left-cut"])
@pytest.mark.parametrize("name", BACKENDS)
def test_copies_through_a_registered_region_that_was_cut_fault_nothing_and_are_caught(
        name, regrow):
    backend = get_backend_or_skip(name)
    with canary_region(SIZE) as (path, fd):
        mapping = RegionMapping(path, SIZE, generation=1)
        mapping.watch_canary()
        backend.attach(mapping)
        try:
            assert wait_pinned(backend, mapping), f"{name}: the region was never pinned"
            first = pattern(1, SHAPE, torch.bfloat16, backend.device)
            backend.save(first, mapping, EXTENTS, backend.prepare_save(first))
            assert file_bytes_at(fd, EXTENTS) == row_major_bytes(first) and mapping.intact()
            _cut(fd, regrow)
            second = pattern(2, SHAPE, torch.bfloat16, backend.device)
            backend.save(second, mapping, EXTENTS, backend.prepare_save(second))  # no fault
            out = backend.empty(SHAPE, "bfloat16")
            assert backend.load_all([(mapping, EXTENTS, out)]) == [None]  # no fault
            torch.cuda.synchronize()
            assert not mapping.intact()  # the canary: what they copied is not the file's
            # What the GPU used were the pages it pinned, which the file no
            # longer has (printed for the device check's log).
            print(f"{name} {'regrown' if regrow else 'left cut'}: the GPU read back what it "
                  f"wrote: {torch.equal(out, second)}; the file holds it: "
                  f"{file_bytes_at(fd, EXTENTS) == row_major_bytes(second)}")
        finally:
            backend.detach(mapping)  # unregisters the pages the cut orphaned
            mapping.close()
        repair(fd, SIZE)  # the daemon's
        fresh = RegionMapping(path, SIZE, generation=1)
        fresh.watch_canary()
        backend.attach(fresh)
        try:
            assert wait_pinned(backend, fresh)
            third = pattern(3, SHAPE, torch.bfloat16, backend.device)
            backend.save(third, fresh, EXTENTS, backend.prepare_save(third))
            assert file_bytes_at(fd, EXTENTS) == row_major_bytes(third)
            out = backend.empty(SHAPE, "bfloat16")
            assert backend.load_all([(fresh, EXTENTS, out)]) == [None]
            assert torch.equal(out, third) and fresh.intact()
        finally:
            backend.detach(fresh)
            fresh.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_a_workers_load_through_a_cut_region_fails_and_works_once_repaired(name):
    """Through the worker: a cut past the stamp table (regrown at once)
    leaves the stamps intact; the load fails (the canary), the worker maps
    the repaired file anew, and the same entry saved again loads exactly."""
    backend = get_backend_or_skip(name)
    page = 64 * 1024
    pages = SIZE // page - 1  # the stamp table takes the first page
    offset = table_bytes(pages, page)
    assert offset + pages * page == SIZE
    extents = ((offset + 3 * page, NBYTES),)
    with canary_region(SIZE) as (path, fd):
        stamps = StampFile(fd, page, offset, pages)
        source = pattern(4, SHAPE, torch.bfloat16, "cpu")

        def save(entry_id: int) -> LoadSpec:
            stamps.write([(3, -(-NBYTES // page))], entry_id)
            os.pwrite(fd, row_major_bytes(source), extents[0][0])
            return LoadSpec("a", entry_id, entry_id, 1, NBYTES, SHAPE, "bfloat16", extents)

        worker = WorkerDelegate("unix:///nonexistent/ec.sock", engine_id="E",
                                layout=Layout("m", "bfloat16", {"image": 2304}),
                                backend=backend, start=False)
        try:
            info = RegionInfo(path, SIZE, 1, page, offset, canary=repair(fd, SIZE))
            spec = save(7)
            result = worker.load([spec], {1: info})
            assert not result.failed and torch.equal(result.loaded["a"].cpu(), source)
            os.ftruncate(fd, offset + page)
            os.ftruncate(fd, file_bytes(SIZE))
            assert stamps.holds(extents, 7)  # the stamps survived the cut
            assert "cut" in worker.load([spec], {1: info}).failed[spec.transfer_id]
            repair(fd, SIZE)
            again = save(8)
            result = worker.load([again], {1: info})
            assert not result.failed and torch.equal(result.loaded["a"].cpu(), source)
        finally:
            worker.close()
