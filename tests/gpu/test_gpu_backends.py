"""CUDA copy backends, both of them: bit-exact saves and loads through a
registered /dev/shm region while the compute stream is busy, saves ordered
after the producing stream (on the producer's thread or another), loads that
leave the compute stream running, and mappings that outlive their copies.
Skipped without CUDA (`make gpu-test` fails instead)."""

from __future__ import annotations

import random
import threading

import pytest

torch = pytest.importorskip("torch")

from tests.copy_views import VIEWS, non_contiguous  # noqa: E402
from tests.gpu.support import (  # noqa: E402
    NEEDS_TWO_GPUS,
    get_backend_or_skip,
    needs_cuda,
    pattern,
    row_major_bytes,
    shm_region,
    stored_bytes,
    wait_pinned,
)

pytestmark = [pytest.mark.gpu, needs_cuda]
BACKENDS = ["torch", "cupy"]
MiB = 1 << 20
# torch.cuda._sleep cycles: about 0.1 s at the H200's 2 GHz, long enough for a
# copy that does not wait for the producing stream to read the old bytes.
PRODUCER_DELAY_CYCLES = 200_000_000
# About 0.5 s: far longer than a load of a few MiB (well under 10 ms).
COMPUTE_CYCLES = 1_000_000_000


@pytest.fixture
def mapping():
    with shm_region(64 * MiB) as m:
        yield m


@pytest.fixture(params=BACKENDS)
def backend(request, mapping):
    b = get_backend_or_skip(request.param)
    b.attach(mapping)
    assert wait_pinned(b, mapping), f"{request.param}: a 64 MiB region was never pinned"
    yield b
    b.detach(mapping)


def busy_compute_stream():
    """Queue a long matmul chain on the current stream."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    return a


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_save_then_load_is_bit_exact_under_compute(backend, mapping, dtype):
    source = torch.randn(1000, 1152, device=backend.device).to(dtype)
    nbytes = source.numel() * source.element_size()
    extents = [(8 * MiB + 4096, nbytes // 2), (1 * MiB, nbytes - nbytes // 2)]  # scattered
    busy_compute_stream()
    produced = source * 1  # written by the compute stream right before the save
    backend.save(produced, mapping, extents, backend.prepare_save(produced))
    busy_compute_stream()
    out = backend.empty(tuple(source.shape), str(dtype).removeprefix("torch."))
    assert out.device == source.device and out.dtype == dtype
    backend.load(mapping, extents, out)
    assert torch.equal(out, source)  # on the compute stream: after the load's event


def test_a_load_leaves_the_compute_stream_running(backend, mapping):
    """The compute stream waits on the load's event; the host never waits for
    the compute stream (vLLM queues the next step while this one computes)."""
    source = torch.randn(512, 1152, device=backend.device).to(torch.bfloat16)
    extents = [(2 * MiB, source.numel() * 2)]
    backend.save(source, mapping, extents, backend.prepare_save(source))
    out = backend.empty((512, 1152), "bfloat16")
    compute = torch.cuda.current_stream(out.device)
    torch.cuda.synchronize()
    torch.cuda._sleep(COMPUTE_CYCLES)
    backend.load(mapping, extents, out)
    still_busy = not compute.query()
    loaded = out.clone()  # on the compute stream, after the load's event
    torch.cuda.synchronize()
    assert still_busy, "the load waited for the compute stream (a host synchronisation)"
    assert torch.equal(loaded, source)


def test_auto_picks_torch_on_cuda():
    from ec_client.copy import get_backend

    assert get_backend("auto").name == "torch"


@pytest.mark.parametrize("name", BACKENDS)
def test_worker_load_through_regions_checks_stamps_on_gpu(name):
    """The worker's load path on CUDA: copy into a device tensor, then the
    stamp check; a re-stamped page fails the load instead of serving it."""
    from ec_client.common.contract import LoadSpec, RegionInfo
    from ec_client.worker_side.worker import WorkerDelegate
    from ec_protocol.protocol import Layout
    from ec_protocol.stamps import table_bytes

    page, pages = 64 << 10, 64
    offset = table_bytes(pages, page)
    backend = get_backend_or_skip(name)
    with shm_region(offset + pages * page) as region:
        info = RegionInfo(region.path, region.size, 7, page, offset)
        worker = WorkerDelegate("unix:///nonexistent.sock", engine_id="e", layout=Layout(
            "m", "float16", {"x": 2}), backend=backend, start=False,
            allocate_out=backend.empty)
        try:
            source = torch.randn(512, 1152, device=backend.device).to(torch.float16)
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
def test_regions_never_unmap_under_a_running_copy(monkeypatch, name):
    """A daemon restart retires the old region while a CUDA copy reads it:
    the mapping (and its host registration) must outlive the copy."""
    from ec_client.common.contract import RegionInfo
    from ec_client.worker_side import regions as regions_module
    from ec_client.worker_side.regions import Regions
    from ec_protocol.stamps import table_bytes

    monkeypatch.setattr(regions_module, "RETIRE_SECONDS", 0.0)
    page, pages = 1 * MiB, 256
    offset = table_bytes(pages, page)
    backend = get_backend_or_skip(name)
    with shm_region(offset + pages * page) as region:
        info = RegionInfo(region.path, region.size, 9, page, offset)
        regions = Regions(on_map=backend.attach, on_unmap=backend.detach)
        regions.make_current(info)
        source = torch.randint(0, 255, (pages * page,), dtype=torch.uint8,
                               device=backend.device)
        ready = backend.prepare_save(source)  # on the producing thread
        extents = [(offset, pages * page)]
        copying, retired = threading.Event(), threading.Event()
        out = backend.empty((pages * page,), "uint8")

        def copy() -> None:
            with regions.use(info) as (mapping, _):
                backend.save(source, mapping, extents, ready)
                copying.set()
                retired.wait(10)
                backend.load(mapping, extents, out)  # after the retirement and a prune

        thread = threading.Thread(target=copy)
        thread.start()
        assert copying.wait(60)
        regions.make_current(None)  # the daemon went away
        regions.prune()
        assert regions.generations() == [9]  # still mapped: a copy uses it
        retired.set()
        thread.join(60)
        torch.cuda.synchronize()
        assert torch.equal(out, source)
        regions.prune()
        assert regions.generations() == []
        regions.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", VIEWS)
def test_a_non_contiguous_output_is_saved_in_row_major_order(backend, mapping, kind, dtype):
    source = non_contiguous(kind, torch.randn(600, 1152, device=backend.device).to(dtype))
    expected = source.contiguous()
    nbytes = expected.numel() * expected.element_size()
    extents = [(4 * MiB, nbytes // 2), (4096, nbytes - nbytes // 2)]  # scattered
    backend.save(source, mapping, extents, backend.prepare_save(source))
    assert stored_bytes(mapping, extents) == row_major_bytes(expected)
    out = backend.empty(tuple(expected.shape), str(dtype).removeprefix("torch."))
    backend.load(mapping, extents, out)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kind", VIEWS)
def test_the_cupy_backend_saves_a_non_contiguous_cupy_array_in_row_major_order(mapping, kind):
    backend = get_backend_or_skip("cupy")
    import cupy

    backend.attach(mapping)
    try:
        source = non_contiguous(kind, cupy.random.standard_normal((64, 96), dtype=cupy.float32))
        expected = cupy.ascontiguousarray(source)
        extents = [(1 * MiB, expected.nbytes)]
        backend.save(source, mapping, extents, backend.prepare_save(source))
        assert stored_bytes(mapping, extents) == expected.get().tobytes()
        out = cupy.empty_like(expected)
        backend.load(mapping, extents, out)
        cupy.cuda.get_current_stream().synchronize()
        assert bool((out == expected).all())
    finally:
        backend.detach(mapping)


def test_the_cupy_backend_never_serves_a_host_output_it_did_not_fill(mapping):
    """A host array as the load's output (the worker's default before it had
    a device): the load fills it or refuses it, never copies into a device
    temporary and returns the host array's old bytes as a good load."""
    import numpy as np

    backend = get_backend_or_skip("cupy")
    backend.attach(mapping)
    try:
        source = torch.randint(0, 255, (4096,), dtype=torch.uint8, device=backend.device)
        extents = [(5 * MiB, 4096)]
        backend.save(source, mapping, extents, backend.prepare_save(source))
        out = np.zeros(4096, dtype=np.uint8)
        try:
            backend.load(mapping, extents, out)
        except (TypeError, ValueError):
            return  # refused: the worker fails the load instead of serving it
        torch.cuda.synchronize()
        assert out.tobytes() == source.cpu().numpy().tobytes()
    finally:
        backend.detach(mapping)


def test_a_non_contiguous_load_destination_is_refused(backend, mapping):
    out = torch.empty(64, 32, device=backend.device).T
    with pytest.raises(TypeError, match="not contiguous"):
        backend.load(mapping, [(0, out.numel() * out.element_size())], out)


def _produce_late(backend, kind):
    """A tensor the producer's own stream writes after a delay, its ready
    event and the final values: a save that does not wait reads zeros."""
    written = torch.zeros(512, 768, device=backend.device, dtype=torch.float16)
    final = torch.randn(512, 768, device=backend.device).to(torch.float16)
    torch.cuda.synchronize()
    producer = torch.cuda.Stream(backend.device)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(PRODUCER_DELAY_CYCLES)
        written.copy_(final)
        source = written.T if kind == "transposed" else written
        ready = backend.prepare_save(source)
    return source, ready, final.T if kind == "transposed" else final


@pytest.mark.parametrize("kind", ["contiguous", "transposed"])
def test_a_save_copies_what_the_producing_stream_wrote(backend, mapping, kind):
    """The save is asked for at once: the saved bytes must be the final ones
    (a contiguous copy made before waiting for the producer's event reads
    the old ones)."""
    source, ready, final = _produce_late(backend, kind)
    extents = [(0, source.numel() * source.element_size())]
    backend.save(source, mapping, extents, ready)
    assert stored_bytes(mapping, extents) == row_major_bytes(final)
    torch.cuda.synchronize()


@pytest.mark.parametrize("kind", ["contiguous", "transposed"])
def test_a_save_from_another_thread_waits_for_the_producers_event(backend, mapping, kind):
    """The saver thread copies what the engine's thread produced: only the
    event recorded on the producer's thread orders the copy (the saver's own
    current stream knows nothing of the producer's)."""
    source, ready, final = _produce_late(backend, kind)
    extents = [(8 * MiB, source.numel() * source.element_size())]
    errors: list[BaseException] = []

    def save() -> None:
        try:
            backend.save(source, mapping, extents, ready)
        except BaseException as exc:
            errors.append(exc)

    saver = threading.Thread(target=save)
    saver.start()
    saver.join(60)
    assert not saver.is_alive() and not errors, errors
    assert stored_bytes(mapping, extents) == row_major_bytes(final)
    torch.cuda.synchronize()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=NEEDS_TWO_GPUS)
@pytest.mark.parametrize("name", BACKENDS)
def test_a_load_on_a_device_that_is_not_device_0(mapping, name):
    """A worker of rank 1 copies on its own device even from a thread whose
    current device is 0 (the link and saver threads never set one)."""
    with torch.cuda.device(1):
        backend = get_backend_or_skip(name)
    assert str(backend.device) == "cuda:1"
    backend.attach(mapping)
    try:
        assert wait_pinned(backend, mapping)
        source = pattern(3, (256, 1152), torch.bfloat16, "cuda:1")
        extents = [(3 * MiB, source.numel() * 2)]
        assert torch.cuda.current_device() == 0
        backend.save(source, mapping, extents, backend.prepare_save(source))
        out = backend.empty((256, 1152), "bfloat16")
        assert out.device == torch.device("cuda", 1)
        backend.load(mapping, extents, out)
        assert torch.equal(out, source)
    finally:
        backend.detach(mapping)


def test_a_steps_fragmented_loads_land_bit_exact_with_one_wait(backend, mapping):
    """Three loads of one step, each over shuffled 64 KiB pages (some
    adjacent: joined), queued together (`load_all`: registered runs in one
    cudaMemcpyBatchAsync where CUDA has it) and waited for once: each
    bit-exact, and the compute stream, busy meanwhile, is not waited for."""
    page = 64 << 10
    pages = random.Random(5).sample(range(512), 3 * 96)
    extents = [[(p * page, page) for p in pages[i * 96:(i + 1) * 96]] for i in range(3)]
    sources = [torch.randint(0, 255, (96 * page,), dtype=torch.uint8, device=backend.device)
               for _ in range(3)]
    for source, where in zip(sources, extents, strict=True):
        backend.save(source, mapping, where, backend.prepare_save(source))
    outs = [backend.empty((96 * page,), "uint8") for _ in range(3)]
    torch.cuda.synchronize()
    torch.cuda._sleep(COMPUTE_CYCLES)
    errors = backend.load_all([(mapping, where, out) for where, out in
                               zip(extents, outs, strict=True)])
    still_busy = not torch.cuda.current_stream(outs[0].device).query()
    loaded = [out.clone() for out in outs]  # on the compute stream, after the loads
    torch.cuda.synchronize()
    assert errors == [None, None, None]
    assert still_busy, "the loads waited for the compute stream (a host synchronisation)"
    for got, source in zip(loaded, sources, strict=True):
        assert torch.equal(got, source)


SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


def test_the_cupy_backend_saves_a_cupy_array_after_cupys_stream(mapping):
    """A CuPy array written on a CuPy stream (not torch's current stream):
    its save waits for that stream, so the saved bytes are the final ones."""
    backend = get_backend_or_skip("cupy")
    import cupy

    backend.attach(mapping)
    try:
        final = cupy.arange(1 << 20, dtype=cupy.uint8)
        source = cupy.zeros(1 << 20, dtype=cupy.uint8)
        cupy.cuda.get_current_stream().synchronize()
        producer = cupy.cuda.Stream(non_blocking=True)
        with producer:
            cupy.RawKernel(SPIN, "spin")((1,), (1,), (cupy.int64(PRODUCER_DELAY_CYCLES),))
            source[...] = final
            ready = backend.prepare_save(source)
        extents = [(6 * MiB, 1 << 20)]
        backend.save(source, mapping, extents, ready)
        assert stored_bytes(mapping, extents) == final.get().tobytes()
    finally:
        backend.detach(mapping)
