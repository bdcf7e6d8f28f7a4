"""The CUDA copy path (the torch and cupy backends' `CudaBackend`) under the
model of CUDA's rules (tests/cuda_model.py), on the CPU: chunked pinning
and copies split at its boundaries, the worker's device current on every
thread, no host memory as a device array, the compute stream never waited
for by the host, a producer's event waited for on the copy stream, a refused
registration falling back to unpinned copies. The same tests run on a GPU
in tests/gpu."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from ec_client.copy import pinning
from ec_client.copy.mapping import RegionMapping
from ec_client.copy.pinning import pieces
from tests.copy_views import VIEWS, non_contiguous
from tests.cuda_model import GARBAGE, Backend, ModelRuntime, RuleBroken

CHUNK = 64 << 10
SIZE = 8 * CHUNK


@pytest.fixture
def mapping(tmp_path) -> Iterator[RegionMapping]:
    path = tmp_path / "region"
    path.write_bytes(b"\0" * SIZE)
    m = RegionMapping(str(path), SIZE, generation=1)
    yield m
    m.close()


@pytest.fixture
def model() -> ModelRuntime:
    return ModelRuntime(device=1)


@pytest.fixture
def backend(model, mapping) -> Iterator[Backend]:
    b = on_thread(lambda: Backend(model, chunk_bytes=CHUNK))  # built off the main thread too
    b.attach(mapping)
    assert b.pinning(mapping).done.wait(30)
    yield b
    b.detach(mapping)
    assert model.violations == []


def on_thread(fn):  # type: ignore[no-untyped-def]
    """Run `fn` on a new thread (whose current CUDA device is 0) and return its result."""
    result: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]
    return result[0] if result else None


def payload(nbytes: int, seed: int = 0) -> torch.Tensor:
    """Host bytes (`model.to_device` makes a device array of them)."""
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8))


def stored(mapping: RegionMapping, extents) -> bytes:  # type: ignore[no-untyped-def]
    return b"".join(bytes(mapping.view[o:o + n]) for o, n in extents)


# Scattered, out of order, two of them across chunk boundaries.
EXTENTS = [(3 * CHUNK - 1000, 5000), (CHUNK // 2, CHUNK), (6 * CHUNK + 7, 100)]
TOTAL = sum(n for _, n in EXTENTS)


def test_pieces_never_cross_a_chunk_and_cover_the_extents():
    got = list(pieces(EXTENTS, CHUNK))
    assert all(o // CHUNK == (o + n - 1) // CHUNK for o, n, _ in got)
    assert sum(n for _, n, _ in got) == TOTAL
    assert [done for _, _, done in got] == [0, 1000, 5000, 5000 + CHUNK // 2, 5000 + CHUNK]


def test_extents_across_registration_chunks_round_trip_pinned(backend, mapping, model):
    assert backend.pinned(mapping) and model.registered_bytes() == SIZE
    source = model.to_device(payload(TOTAL, 1))
    on_thread(lambda: backend.save(source, mapping, EXTENTS, backend.prepare_save(source)))
    assert stored(mapping, EXTENTS) == source.numpy().tobytes()
    out = backend.load(mapping, EXTENTS, backend.empty((TOTAL,), "uint8"))
    assert torch.equal(out, source)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_save_waits_for_the_producers_event_on_the_copy_stream(backend, mapping, model,
                                                                 dtype):
    final = torch.randn(40, 64).to(dtype)
    source = model.to_device(torch.zeros_like(final))
    model.launch(lambda: source.copy_(final))  # the encoder, still running on the GPU
    ready = backend.prepare_save(source)
    extents = [(CHUNK - 512, source.numel() * source.element_size())]
    on_thread(lambda: backend.save(source, mapping, extents, ready))  # the saver's thread
    assert stored(mapping, extents) == final.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("kind", VIEWS)
def test_a_non_contiguous_output_is_saved_in_row_major_order_after_the_producer(
        backend, mapping, model, kind):
    final = torch.randn(32, 48)
    written = model.to_device(torch.zeros_like(final))
    model.launch(lambda: written.copy_(final))
    source = non_contiguous(kind, written)
    ready = backend.prepare_save(source)
    expected = non_contiguous(kind, final).contiguous()
    extents = [(2 * CHUNK - 300, expected.numel() * 4)]
    backend.save(source, mapping, extents, ready)
    assert stored(mapping, extents) == expected.numpy().tobytes()


def test_a_load_never_makes_the_host_wait_for_the_compute_stream(backend, mapping, model):
    source = model.to_device(payload(TOTAL, 2))
    backend.save(source, mapping, EXTENTS, backend.prepare_save(source))
    model.launch(lambda: None)  # the previous step's kernels, still queued
    out = backend.empty((TOTAL,), "uint8")
    loaded = backend.load(mapping, EXTENTS, out)
    assert model.compute_host_waits == 0
    assert torch.equal(loaded, source)  # the host saw the copy land (for the stamps)
    seen: list[bytes] = []
    model.launch(lambda: seen.append(out.numpy().tobytes()))  # the forward pass
    model.drain()
    assert seen == [source.numpy().tobytes()]


def test_a_load_into_the_callers_memory_waits_for_the_compute_stream_on_the_device(
        backend, mapping, model):
    """Memory not from `empty` may still be read by queued compute work: the
    copy stream waits for it (on the device) before overwriting it."""
    source = model.to_device(payload(TOTAL, 3))
    backend.save(source, mapping, EXTENTS, backend.prepare_save(source))
    out = model.to_device(torch.zeros(TOTAL, dtype=torch.uint8))
    read_before: list[int] = []
    model.launch(lambda: read_before.append(int(out.sum())))  # a kernel still reading it
    backend.load(mapping, EXTENTS, out)
    assert read_before == [0] and torch.equal(out, source)


def test_host_memory_is_never_a_device_array(backend, mapping, model):
    """cupy.asarray of host memory copies it to a temporary device array: a
    load into it would leave the host array unwritten and pass the stamps."""
    backend.save(model.to_device(payload(TOTAL)), mapping, EXTENTS)
    with pytest.raises(TypeError, match="host memory"):
        backend.load(mapping, EXTENTS, np.empty(TOTAL, np.uint8))
    region_view = torch.frombuffer(mapping.view, dtype=torch.uint8)[:TOTAL]
    with pytest.raises(TypeError, match="host region"):
        backend.load(mapping, EXTENTS, region_view)


def test_an_array_on_another_device_is_refused(backend, mapping, model):
    other = model.place(torch.zeros(TOTAL, dtype=torch.uint8), device=0)
    with pytest.raises(TypeError, match="device 0"):
        backend.load(mapping, EXTENTS, other)
    with pytest.raises(TypeError, match="device 0"):
        backend.save(other, mapping, EXTENTS)


def test_every_thread_sets_the_workers_device_before_a_cuda_call(model, mapping):
    """Threads start on device 0: a call without cudaSetDevice would make a
    context on GPU 0 (and a stream there), which the model refuses."""
    backend = on_thread(lambda: Backend(model, chunk_bytes=CHUNK))
    on_thread(lambda: backend.attach(mapping))  # the link's thread
    assert backend.pinning(mapping).done.wait(30)  # the registrar's thread
    source = model.to_device(payload(TOTAL, 4))
    on_thread(lambda: backend.save(source, mapping, EXTENTS, on_thread(
        lambda: backend.prepare_save(source))))
    out = on_thread(lambda: backend.load(mapping, EXTENTS, backend.empty((TOTAL,), "uint8")))
    on_thread(lambda: backend.detach(mapping))
    assert model.violations == [] and torch.equal(out, source)
    assert model.registered_bytes() == 0


def test_the_model_catches_a_call_without_the_device(model):
    with pytest.raises(RuleBroken, match="device 0 current"):
        on_thread(model.current_stream)


def test_a_refused_registration_falls_back_to_unpinned_copies_logged_once(
        model, mapping, tmp_path, caplog):
    model.refuse_registration = lambda offset, length: offset == 3 * CHUNK
    monkey_logged = pinning._refusal_logged
    pinning._refusal_logged = False
    try:
        with caplog.at_level(logging.WARNING, logger="ec_client.copy.pinning"):
            backend = Backend(model, chunk_bytes=CHUNK)
            backend.attach(mapping)
            assert backend.pinning(mapping).done.wait(30)
            second = tmp_path / "second"
            second.write_bytes(b"\0" * SIZE)
            other = RegionMapping(str(second), SIZE, generation=2)
            backend.attach(other)
            assert backend.pinning(other).done.wait(30)
    finally:
        pinning._refusal_logged = monkey_logged
    assert model.registered_bytes() == 0  # the three chunks before it rolled back
    assert not backend.pinned(mapping) and backend.stats["pin_refused"] == 2
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    source = model.to_device(payload(TOTAL, 5))
    backend.save(source, mapping, EXTENTS, backend.prepare_save(source))
    assert torch.equal(backend.load(mapping, EXTENTS, backend.empty((TOTAL,), "uint8")), source)
    backend.detach(other)
    other.close()
    backend.detach(mapping)
    assert model.violations == []


def test_attach_returns_while_registering_and_copies_meanwhile_are_correct(model, mapping):
    """Registration (~0.1 s per GB per process) runs in the background: the
    session opens at once, copies of chunks not pinned yet are unpinned, and
    a chunk is never registered while a copy of it runs."""
    in_chunk_2, release = threading.Event(), threading.Event()

    def slow(offset: int, length: int) -> bool:
        if offset == 2 * CHUNK:
            in_chunk_2.set()
            release.wait(30)
        return False

    model.refuse_registration = slow
    backend = Backend(model, chunk_bytes=CHUNK)
    backend.attach(mapping)  # returns while chunk 2 registers
    assert in_chunk_2.wait(30) and not backend.pinned(mapping)
    extents = [(5 * CHUNK + 10, 3000)]  # chunk 5: not pinned yet
    source = model.to_device(payload(3000, 6))
    backend.save(source, mapping, extents, backend.prepare_save(source))
    loaded: list[torch.Tensor] = []
    blocked = threading.Thread(target=lambda: loaded.append(backend.load(
        mapping, [(2 * CHUNK, 100)], backend.empty((100,), "uint8"))))
    blocked.start()  # chunk 2 is being registered: this copy waits for it
    blocked.join(0.2)
    assert blocked.is_alive()
    release.set()
    blocked.join(30)
    assert loaded and backend.pinning(mapping).done.wait(30) and backend.pinned(mapping)
    out = backend.load(mapping, extents, backend.empty((3000,), "uint8"))
    assert torch.equal(out, source)
    backend.detach(mapping)
    assert model.violations == [] and model.registered_bytes() == 0


def test_a_load_output_from_empty_lives_on_the_workers_device_uninitialised(backend, model):
    out = backend.empty((4, 8), "bfloat16")
    model.check_device(out)  # the model's device memory, not host memory
    assert out.dtype == torch.bfloat16 and out.shape == (4, 8)
    assert set(out.view(torch.uint8).reshape(-1).tolist()) == {GARBAGE}


def test_the_torch_runtime_clears_the_error_of_a_refused_registration(monkeypatch):
    """torch's cudaHostRegister binding returns the error and leaves it set:
    uncleared, it would surface at the next unrelated kernel launch."""
    from ec_client.copy import torch_backend

    calls: list[str] = []

    class Cudart:
        def cudaHostRegister(self, pointer: int, length: int, flags: int) -> int:
            calls.append("register")
            return 712  # cudaErrorHostMemoryAlreadyRegistered

        def cudaHostUnregister(self, pointer: int) -> int:
            calls.append("unregister")
            return 0

    class Runtime:
        def cudaGetLastError(self) -> int:
            calls.append("cudaGetLastError")
            return 712

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch_backend, "_loaded_cudart", lambda: Runtime())
    runtime = torch_backend.TorchRuntime()
    assert runtime.device == "cuda:3"
    with pytest.raises(pinning.PinRefused, match="712"):
        runtime.register(torch.zeros(64, dtype=torch.uint8), 0, 64)
    assert calls == ["register", "cudaGetLastError"]
    with pytest.raises(TypeError, match="cuda:3"):
        runtime.check_device(torch.zeros(4))  # a CPU tensor is not the worker's device


def test_a_load_never_waits_for_a_queued_saves_producer(backend, mapping, model):
    """A save queued on the copy path waits (on the device) for its encoder
    on the compute stream; a load behind it must not inherit that wait, or
    the engine's thread would wait for the compute stream after all."""
    source = model.to_device(payload(TOTAL, 7))
    backend.save(source, mapping, EXTENTS)  # an entry to load
    small = model.to_device(payload(100, 8))
    model.launch(lambda: None)  # the next encoder, still running
    ready = backend.prepare_save(small)
    queued, release = threading.Event(), threading.Event()
    synchronize = model.synchronize

    def held_on_the_saver(event) -> None:  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "saver":
            queued.set()  # its copies are queued; it waits for them here
            release.wait(30)
        synchronize(event)

    model.synchronize = held_on_the_saver  # type: ignore[method-assign]
    saver = threading.Thread(name="saver", target=lambda: backend.save(
        small, mapping, [(7 * CHUNK, 100)], ready))
    saver.start()
    try:
        assert queued.wait(30)
        out = backend.load(mapping, EXTENTS, backend.empty((TOTAL,), "uint8"))
        assert torch.equal(out, source)
        assert model.compute_host_waits_by_thread.get("MainThread", 0) == 0
    finally:
        release.set()
        saver.join(30)
    assert stored(mapping, [(7 * CHUNK, 100)]) == small.numpy().tobytes()


def test_a_cpu_tensor_is_host_memory_not_a_device_array(backend, mapping):
    """The torch form of the old default: a host tensor as a CUDA load's output."""
    with pytest.raises(TypeError, match="never allocated is host memory"):
        backend.load(mapping, EXTENTS, torch.empty(TOTAL, dtype=torch.uint8))
