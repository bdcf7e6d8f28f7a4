"""Each CUDA, torch or CuPy rule the copy path keeps, broken on purpose: the
CPU suite must catch every one (the model, tests/cuda_model.py, says which
rule broke). Then the cupy backend's own runtime under a stand-in `cupy`
over the model (tests/cupy_model.py), and the batched copies: one
cudaMemcpyBatchAsync and one host wait for a step's loads."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ec_client.copy import cuda, spans
from ec_client.copy.cuda import CudaBackend
from ec_client.copy.mapping import RegionMapping
from ec_client.copy.pinning import pieces, runs
from tests import cupy_model
from tests.cuda_model import Backend, ModelRuntime, as_host

PAGE = 4096
CHUNK = 3 * PAGE // 2  # registration chunks that page-aligned extents cross
SIZE = 32 * PAGE
# Pages out of order, one run of two adjacent pages, one across a chunk boundary.
EXTENTS = [(5 * PAGE, PAGE), (2 * PAGE, PAGE), (3 * PAGE, PAGE), (10 * PAGE, PAGE - 100)]
TOTAL = sum(n for _, n in EXTENTS)


@pytest.fixture
def mapping(tmp_path) -> Iterator[RegionMapping]:
    path = tmp_path / "region"
    data = np.random.default_rng(1).integers(0, 256, SIZE, np.uint8)
    path.write_bytes(data.tobytes())
    m = RegionMapping(str(path), SIZE, generation=1)
    yield m
    m.close()


def stored(mapping: RegionMapping, extents: Any) -> bytes:
    return b"".join(bytes(mapping.view[o:o + n]) for o, n in extents)


def engine(mapping: RegionMapping, **options: Any) -> Backend:
    """The copy path as an engine runs it (busy compute stream, forward
    passes reading the loads), attached and registered."""
    backend = Backend(chunk_bytes=CHUNK, busy_compute=True, wait_pinned=True, **options)
    backend.attach(mapping)
    return backend


def a_step(backend: Backend, mapping: RegionMapping) -> None:
    """One step's load through `empty` and `load_all`, returned bytes checked,
    then the output dropped (vLLM evicts it) before the forward pass ran, and
    the GPU drained."""
    out = backend.empty((TOTAL,), "uint8")
    errors = backend.load_all([(mapping, EXTENTS, out)])
    if errors[0] is None:
        assert as_host(out).tobytes() == stored(mapping, EXTENTS)
    del out
    gc.collect()
    backend.model.drain()


def no_record_stream(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    used_on = backend.model.used_on
    monkeypatch.setattr(backend.model, "used_on", lambda array, stream: None
                        if stream is backend.model.compute else used_on(array, stream))


def empty_on_the_compute_stream(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = backend.model.empty
    monkeypatch.setattr(backend.model, "empty", lambda shape, dtype, stream: empty(
        shape, dtype, backend.model.compute))


def no_split_at_chunks(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda, "pieces", lambda extents, chunk_bytes: spans(extents))


def outputs_never_fresh(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every output treated as the caller's: the copy waits for the compute stream."""
    monkeypatch.setattr(backend, "_take_fresh", lambda out: False)


def host_syncs_compute(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old pattern: the host synchronises the compute stream after the copy."""
    wait = backend.model.wait
    model = backend.model

    def synchronising(stream: Any, event: Any) -> None:
        wait(stream, event)
        if stream is model.compute:
            model.synchronize_stream(stream)

    monkeypatch.setattr(model, "wait", synchronising)


BREAKS: dict[str, tuple[Callable[[Backend, pytest.MonkeyPatch], None], str]] = {
    "no record_stream on the compute stream": (no_record_stream, "record_stream"),
    "the output allocated on the compute stream": (
        empty_on_the_compute_stream, "allocate on the stream that writes first"),
    "a copy across a registration chunk": (no_split_at_chunks, "crosses a registration"),
    "an output not known as fresh": (outputs_never_fresh, "host waits"),
    "the host synchronises the compute stream": (host_syncs_compute, "host waits"),
}


def test_the_copy_path_as_it_is_keeps_every_rule(mapping):
    backend = engine(mapping)
    a_step(backend, mapping)
    assert backend.model.violations == [] and backend.model.compute_host_waits == 0
    assert backend.consumed == 1
    backend.detach(mapping)


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_rule_broken_on_purpose_is_caught(mapping, monkeypatch, name):
    breaks, caught = BREAKS[name]
    backend = engine(mapping)
    breaks(backend, monkeypatch)
    with contextlib.suppress(RuntimeError):  # the model raised at the call that broke it
        a_step(backend, mapping)
    model = backend.model
    if caught == "host waits":
        assert model.compute_host_waits > 0, model.violations
    else:
        assert any(caught in v for v in model.violations), model.violations
    monkeypatch.undo()
    backend.model.violations.clear()
    backend.detach(mapping)


# ------------------------------------------------------------ batches


def test_extents_that_continue_each_other_are_one_copy():
    assert list(runs([(0, 10), (10, 5), (40, 5), (45, 5), (15, 1)])) == [
        (0, 15), (40, 10), (15, 1)]
    assert list(pieces([(PAGE, PAGE), (2 * PAGE, PAGE)], CHUNK)) == [
        (PAGE, CHUNK - PAGE, 0), (CHUNK, 3 * PAGE - CHUNK, CHUNK - PAGE)]


@pytest.mark.parametrize("batches", [True, False], ids=["batch", "no-batch"])
def test_a_steps_loads_are_one_batch_and_one_host_wait(mapping, batches):
    """Three fragmented loads: adjacent extents joined, the registered runs
    of all of them in one cudaMemcpyBatchAsync (or one call per run without
    it), and the host waits once for the step, not once per load."""
    backend = engine(mapping, runtime=ModelRuntime(batches=batches))
    model = backend.model
    shuffled = [(p * PAGE, PAGE) for p in (20, 11, 12, 13, 25, 16)]  # 11-13: one run
    outs = [backend.empty((TOTAL,), "uint8"), backend.empty((6 * PAGE,), "uint8"),
            backend.empty((TOTAL,), "uint8")]
    waits, calls = model.host_waits, (model.copy_calls, model.batch_calls)
    errors = backend.load_all([(mapping, EXTENTS, outs[0]), (mapping, shuffled, outs[1]),
                               (mapping, EXTENTS, outs[2])])
    assert errors == [None, None, None]
    assert model.host_waits - waits == 1
    runs = sum(len(list(pieces(e, CHUNK))) for e in (EXTENTS, shuffled, EXTENTS))
    if batches:
        assert (model.copy_calls, model.batch_calls) == (calls[0], calls[1] + 1)
    else:
        assert (model.copy_calls - calls[0], model.batch_calls) == (runs, calls[1])
    assert as_host(outs[1]).tobytes() == stored(mapping, shuffled)
    assert as_host(outs[0]).tobytes() == as_host(outs[2]).tobytes() == stored(mapping, EXTENTS)
    del outs
    gc.collect()
    model.drain()
    assert model.violations == [] and model.compute_host_waits == 0
    backend.detach(mapping)


def test_a_refused_load_in_a_step_fails_alone(mapping):
    backend = engine(mapping)
    good = backend.empty((TOTAL,), "uint8")
    errors = backend.load_all([(mapping, EXTENTS, np.empty(TOTAL, np.uint8)),
                               (mapping, EXTENTS, good), (mapping, EXTENTS[:1], good)])
    assert isinstance(errors[0], TypeError) and "host memory" in str(errors[0])
    assert errors[1] is None and isinstance(errors[2], ValueError)
    assert as_host(good).tobytes() == stored(mapping, EXTENTS)
    del good
    gc.collect()
    backend.model.drain()
    assert backend.model.violations == []
    backend.detach(mapping)


# ------------------------------------------------- the cupy runtime itself


@pytest.fixture
def cupy_backend(monkeypatch, mapping) -> Iterator[tuple[CudaBackend, Any]]:
    model = ModelRuntime()
    fake = cupy_model.install(monkeypatch, model)
    from ec_client.copy.cupy_backend import Backend as CupyBackend

    backend = CupyBackend(device=1)
    backend.chunk_bytes = CHUNK
    backend.attach(mapping)
    assert backend.pinning(mapping).done.wait(30) and backend.pinned(mapping)
    yield backend, fake
    backend.detach(mapping)
    model.drain()
    assert model.violations == []


def test_the_cupy_runtime_round_trips_cupy_arrays_under_the_model(cupy_backend, mapping):
    backend, fake = cupy_backend
    source = fake.asarray(np.arange(TOTAL, dtype=np.uint32).astype(np.uint8))
    backend.save(source, mapping, EXTENTS, backend.prepare_save(source))
    assert stored(mapping, EXTENTS) == source.get().tobytes()
    out = backend.empty((TOTAL,), "uint8")
    backend.load(mapping, EXTENTS, out)
    assert out.get().tobytes() == source.get().tobytes()


def test_the_cupy_runtime_refuses_host_memory_and_cupy_asarray_back_is_caught(
        cupy_backend, mapping, monkeypatch):
    """A host array is refused; with `cupy.asarray` put back into the
    runtime's path, the load lands in a device copy and the host array is
    returned unwritten: the test sees it."""
    backend, fake = cupy_backend
    host = np.zeros(TOTAL, np.uint8)
    with pytest.raises(TypeError, match=r"host memory is never copied through cupy\.asarray"):
        backend.load(mapping, EXTENTS, host)
    runtime = backend.runtime
    device_bytes = type(runtime).device_bytes
    copies: list[Any] = []  # the device copies cupy.asarray made, alive for the test

    def through_asarray(self: Any, array: Any) -> Any:
        copies.append(fake.asarray(array))
        return device_bytes(self, copies[-1])

    monkeypatch.setattr(type(runtime), "device_bytes", through_asarray)
    backend.load(mapping, EXTENTS, host)  # accepted now...
    assert host.tobytes() != stored(mapping, EXTENTS)  # ...and never written


def test_a_cupy_arrays_save_waits_for_cupys_stream_not_torchs(cupy_backend, mapping,
                                                             monkeypatch):
    """With torch present its current stream is the engine's compute stream;
    a CuPy array written on CuPy's current stream (another one) must be
    saved after that stream's work, not torch's."""
    backend, fake = cupy_backend
    model = fake.model
    compute = fake._wrap(model.compute)
    monkeypatch.setattr(backend.runtime, "_torch", type("T", (), {"cuda": type(
        "C", (), {"current_stream": staticmethod(lambda index: type(
            "S", (), {"cuda_stream": compute.ptr})())})}))
    final = np.full(TOTAL, 7, np.uint8)
    source = fake.asarray(np.zeros(TOTAL, np.uint8))
    producer = fake.cuda.Stream(non_blocking=True)
    with producer:
        model.launch(lambda: source.tensor.copy_(torch.from_numpy(final)), producer.stream)
        ready = backend.prepare_save(source)
    backend.save(source, mapping, EXTENTS, ready)
    assert stored(mapping, EXTENTS) == final.tobytes()


def test_a_cupy_unregistration_error_is_logged_and_the_mapping_closes(
        cupy_backend, mapping, caplog):
    backend, fake = cupy_backend
    fake.model.refuse_unregistration = lambda offset: RuntimeError("cudaErrorUnknown")
    backend.detach(mapping)  # raised before: the mapping was never closed
    assert fake.model.registered_bytes() == 0
    assert "cudaHostUnregister failed" in caplog.text
    backend.attach(mapping)  # for the fixture's own detach
    fake.model.refuse_unregistration = lambda offset: None
