"""CUDA copy backends: bit-exact saves and loads through the registered
region, while the default stream is busy with compute. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from ec_client.copy import get_backend  # noqa: E402
from ec_client.mapping import RegionMapping  # noqa: E402
from tests.copy_views import VIEWS, non_contiguous  # noqa: E402

pytestmark = pytest.mark.gpu
BACKENDS = ["torch", "cupy"]


@pytest.fixture
def mapping(tmp_path):
    path = tmp_path / "region"
    with open(path, "wb") as f:
        f.truncate(64 << 20)
    m = RegionMapping(str(path), 64 << 20, generation=1)
    yield m
    m.close()


@pytest.fixture(params=BACKENDS)
def backend(request, mapping):
    if request.param == "cupy":
        pytest.importorskip("cupy")
    b = get_backend(request.param)
    b.attach(mapping)
    yield b
    b.detach(mapping)


def busy_default_stream():
    """Queue a long matmul chain on the current stream."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    return a


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_save_then_load_is_bit_exact_under_compute(backend, mapping, dtype):
    rows = 1000
    source = torch.randn(rows, 1152, device="cuda").to(dtype)
    nbytes = source.numel() * source.element_size()
    extents = [(8 << 20, nbytes // 2), (1 << 20, nbytes - nbytes // 2)]  # scattered
    busy_default_stream()
    produced = source * 1  # written by the compute stream right before the save
    ready = backend.prepare_save(produced)
    backend.save(produced, mapping, extents, ready)
    busy_default_stream()
    out = torch.empty_like(source)
    backend.load(mapping, extents, out)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out, source)


def test_auto_picks_torch_on_cuda():
    assert get_backend("auto").name == "torch"


def _region_file(path, payload_pages: int, page: int):
    """A region file as the daemon lays it out: stamp table, then payload."""
    from ec_protocol.stamps import table_bytes

    offset = table_bytes(payload_pages, page)
    with open(path, "wb") as f:
        f.truncate(offset + payload_pages * page)
    return offset


@pytest.mark.parametrize("name", BACKENDS)
def test_worker_load_through_regions_checks_stamps_on_gpu(tmp_path, name):
    """The worker's load path on CUDA: copy into a device tensor, then the
    stamp check; a re-stamped page fails the load instead of serving it."""
    if name == "cupy":
        pytest.importorskip("cupy")
    from ec_client.contract import LoadSpec, RegionInfo
    from ec_client.worker import WorkerDelegate
    from ec_protocol.protocol import Layout

    page, pages = 64 << 10, 64
    offset = _region_file(tmp_path / "r", pages, page)
    info = RegionInfo(str(tmp_path / "r"), offset + pages * page, 7, page, offset)
    backend = get_backend(name)
    worker = WorkerDelegate("unix:///nonexistent.sock", engine_id="e", layout=Layout(
        "m", "float16", {"x": 2}), backend=backend, start=False,
        allocate_out=lambda shape, dtype: torch.empty(shape, dtype=getattr(torch, dtype),
                                                     device="cuda"))
    try:
        source = torch.randn(512, 1152, device="cuda").to(torch.float16)
        nbytes = source.numel() * 2
        extents = ((offset + 8 * page, nbytes),)
        with worker.regions.use(info) as (mapping, stamps):
            backend.save(source, mapping, extents, backend.prepare_save(source))
            stamps.write([(8, -(-nbytes // page))], 42)
        spec = LoadSpec("k", 1, 42, 7, nbytes, (512, 1152), "float16", extents)
        result = worker.load([spec], {7: info})
        assert torch.equal(result.loaded["k"], source) and result.done == [1]
        with worker.regions.use(info) as (_, stamps):
            stamps.write([(8, 1)], 43)  # the first page now belongs to another entry
        result = worker.load([spec], {7: info})
        assert not result.loaded and 1 in result.failed
    finally:
        worker.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_regions_never_unmap_under_a_running_copy(tmp_path, monkeypatch, name):
    """A daemon restart retires the old region while a CUDA copy reads it:
    the mapping (and its host registration) must outlive the copy."""
    if name == "cupy":
        pytest.importorskip("cupy")
    import threading

    from ec_client import regions as regions_module
    from ec_client.contract import RegionInfo
    from ec_client.regions import Regions

    monkeypatch.setattr(regions_module, "RETIRE_SECONDS", 0.0)
    page, pages = 1 << 20, 256
    offset = _region_file(tmp_path / "r", pages, page)
    info = RegionInfo(str(tmp_path / "r"), offset + pages * page, 9, page, offset)
    backend = get_backend(name)
    regions = Regions(on_map=backend.attach, on_unmap=backend.detach)
    regions.make_current(info)
    source = torch.randint(0, 255, (pages * page,), dtype=torch.uint8, device="cuda")
    extents = [(offset, pages * page)]
    copying, retired = threading.Event(), threading.Event()
    out = torch.empty_like(source)

    def load() -> None:
        with regions.use(info) as (mapping, _):
            backend.save(source, mapping, extents)
            copying.set()
            retired.wait(10)
            backend.load(mapping, extents, out)  # after the retirement and a prune

    thread = threading.Thread(target=load)
    thread.start()
    assert copying.wait(30)
    regions.make_current(None)  # the daemon went away
    regions.prune()
    assert regions.generations() == [9]  # still mapped: a copy uses it
    retired.set()
    thread.join(30)
    torch.cuda.synchronize()
    assert torch.equal(out, source)
    regions.prune()
    assert regions.generations() == []
    regions.close()


# About 0.1 s of a spinning kernel: long enough for a copy that does not wait
# for the producing stream to read the old bytes.
PRODUCER_DELAY_CYCLES = 200_000_000


def row_major_bytes(tensor) -> bytes:
    return tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def stored_bytes(mapping, extents) -> bytes:
    return b"".join(bytes(mapping.view[offset:offset + length]) for offset, length in extents)


@pytest.mark.parametrize("kind", VIEWS)
def test_a_non_contiguous_tensor_is_saved_in_row_major_order(backend, mapping, kind):
    source = non_contiguous(kind, torch.randn(600, 1152, device="cuda").to(torch.float16))
    expected = source.contiguous()
    nbytes = expected.numel() * expected.element_size()
    extents = [(4 << 20, nbytes // 2), (0, nbytes - nbytes // 2)]  # scattered
    backend.save(source, mapping, extents, backend.prepare_save(source))
    assert stored_bytes(mapping, extents) == row_major_bytes(expected)
    out = torch.empty_like(expected)
    backend.load(mapping, extents, out)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kind", VIEWS)
def test_the_cupy_backend_saves_a_non_contiguous_cupy_array_in_row_major_order(mapping, kind):
    cupy = pytest.importorskip("cupy")
    backend = get_backend("cupy")
    backend.attach(mapping)
    try:
        source = non_contiguous(kind, cupy.random.standard_normal((64, 96), dtype=cupy.float32))
        expected = cupy.ascontiguousarray(source)
        extents = [(1 << 20, expected.nbytes)]
        backend.save(source, mapping, extents, backend.prepare_save(source))
        assert stored_bytes(mapping, extents) == expected.get().tobytes()
        out = cupy.empty_like(expected)
        backend.load(mapping, extents, out)
        assert bool((out == expected).all())
    finally:
        backend.detach(mapping)


def test_a_non_contiguous_load_destination_is_refused(backend, mapping):
    out = torch.empty(64, 32, device="cuda").T
    with pytest.raises(TypeError, match="not contiguous"):
        backend.load(mapping, [(0, out.numel() * out.element_size())], out)


@pytest.mark.parametrize("kind", ["contiguous", "transposed"])
def test_a_save_copies_what_the_producing_stream_wrote(backend, mapping, kind):
    """The producer writes on its own stream after a delay and the save is
    asked for at once: the saved bytes must be the final ones (a contiguous
    copy made before waiting for the producer's event reads the old ones)."""
    written = torch.zeros(512, 768, device="cuda", dtype=torch.float16)
    final = torch.randn(512, 768, device="cuda").to(torch.float16)
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(PRODUCER_DELAY_CYCLES)
        written.copy_(final)
        source = written.T if kind == "transposed" else written
        ready = backend.prepare_save(source)
    extents = [(0, written.numel() * written.element_size())]
    backend.save(source, mapping, extents, ready)
    assert stored_bytes(mapping, extents) == row_major_bytes(
        final.T if kind == "transposed" else final)
    torch.cuda.synchronize()
