"""A stand-in `cupy` over the model of CUDA's rules (tests/cuda_model.py), so
the cupy backend's own runtime (`ec_client.copy.cupy_backend.CupyRuntime`)
runs in the CPU suite: its registrations, copies, streams and events are the
model's, and its rule breaks are the model's violations.

Only what CupyRuntime calls, with CuPy's documented behaviour where it
matters: `asarray` of host memory copies it into a new device array (a load
into that copy leaves the host array unwritten); `hostRegister`,
`hostUnregister` and `memcpyAsync` take raw addresses and raise
`CUDARuntimeError`; streams and events are per device, a stream is current
per thread (`with stream:`), and the default current stream of the engine's
thread is the compute stream.

    cupy = install(monkeypatch, model)   # sys.modules["cupy"], the runtime re-imported
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from typing import Any

import numpy as np
import torch

from tests.cuda_model import ModelRuntime, Stream


class CUDARuntimeError(RuntimeError):
    pass


class _Flags:
    c_contiguous = True


class _Device:
    def __init__(self, index: int) -> None:
        self.id = index


class _Data:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class FakeCupy(types.ModuleType):
    """The `cupy` module, over `model`."""

    def __init__(self, model: ModelRuntime) -> None:
        super().__init__("cupy")
        self.model = model
        self._streams: dict[int, FakeStream] = {}
        self._current = threading.local()
        fake = self

        class ndarray:
            def __init__(self, tensor: torch.Tensor) -> None:
                self.tensor = tensor  # the model's device memory
                self.shape = tuple(tensor.shape)
                self.dtype = np.dtype(str(tensor.dtype).removeprefix("torch."))
                self.nbytes = tensor.numel() * tensor.element_size()
                self.flags = _Flags()
                block = fake.model.allocator.block_of(tensor)
                self.device = _Device(block.device if block is not None else -1)
                self.data = _Data(tensor.data_ptr())

            def get(self) -> np.ndarray:
                return self.tensor.numpy().copy()

        self.ndarray = ndarray
        self.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(
                CUDARuntimeError=CUDARuntimeError, getDeviceCount=lambda: 2,
                getDevice=lambda: getattr(model._thread, "device", 0),
                setDevice=self._set_device, hostRegister=self._host_register,
                hostUnregister=self._host_unregister, memcpyAsync=self._memcpy_async),
            alloc_pinned_memory=self._alloc_pinned,
            Stream=lambda non_blocking=False: self._wrap(model.new_stream()),
            ExternalStream=lambda ptr, device=None: self._streams[ptr],
            Event=lambda disable_timing=False: FakeEvent(model),
            get_current_stream=self.get_current_stream)

    # ------------------------------------------------------------- arrays

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        stream = self.get_current_stream().stream
        torch_dtype = getattr(torch, np.dtype(dtype).name)
        return self.ndarray(self.model._garbage(tuple(shape), torch_dtype, stream))

    def asarray(self, obj: Any) -> Any:
        """CuPy's: a device array as it is; host memory copied to a new one."""
        if isinstance(obj, self.ndarray):
            return obj
        return self.ndarray(self.model.to_device(torch.from_numpy(np.ascontiguousarray(obj))))

    def ascontiguousarray(self, array: Any) -> Any:
        return array

    # ------------------------------------------------------------ streams

    def _wrap(self, stream: Stream) -> FakeStream:
        for wrapped in self._streams.values():
            if wrapped.stream is stream:
                return wrapped
        wrapped = FakeStream(self, stream, 0x5000 + len(self._streams))
        self._streams[wrapped.ptr] = wrapped
        return wrapped

    def get_current_stream(self) -> FakeStream:
        current = getattr(self._current, "stream", None)
        return current if current is not None else self._wrap(self.model.current_stream())

    # ------------------------------------------------------------ runtime

    def _set_device(self, index: int) -> None:
        if index == self.model.index:
            self.model.use_device()
        else:
            self.model._thread.device = index

    def _alloc_pinned(self, nbytes: int) -> Any:
        """CuPy's PinnedMemoryPointer: `ptr`, and its bytes (buffer protocol)."""
        address, _ = self.model.pinned_host(nbytes)
        buffer = self.model._page_locked[address][1]
        buffer.ptr = address
        return buffer

    def _host_register(self, pointer: int, length: int, flags: int) -> None:
        try:
            self.model.register(pointer, 0, length)
        except Exception as exc:  # the model's refusal, as CuPy raises it
            raise CUDARuntimeError(f"cudaErrorHostMemoryAlreadyRegistered: {exc}") from None

    def _host_unregister(self, pointer: int) -> None:
        try:
            self.model.unregister(pointer, 0)
        except Exception as exc:
            raise CUDARuntimeError(f"cudaErrorHostMemoryNotRegistered: {exc}") from None

    def _memcpy_async(self, dst: int, src: int, length: int, kind: int, stream: int) -> None:
        on = self._streams[stream].stream
        device = self.model.allocator.find(src if kind == 2 else dst)
        if device is None:
            raise CUDARuntimeError("cudaErrorInvalidValue: not device memory")
        tensor, offset = device
        flat = tensor.reshape(-1).view(torch.uint8)
        self.model.copy_calls += 1
        if kind == 2:  # device to host
            self.model._copy(dst, 0, flat, offset, length, on)
        else:
            self.model._copy(flat, offset, src, 0, length, on)


class FakeStream:
    def __init__(self, cupy: FakeCupy, stream: Stream, ptr: int) -> None:
        self.cupy = cupy
        self.stream = stream
        self.ptr = ptr
        self._outer: list[FakeStream | None] = []

    def __enter__(self) -> FakeStream:
        self._outer.append(getattr(self.cupy._current, "stream", None))
        self.cupy._current.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.cupy._current.stream = self._outer.pop()

    def wait_event(self, event: FakeEvent) -> None:
        self.cupy.model.wait(self.stream, event.event)

    def synchronize(self) -> None:
        self.cupy.model.synchronize_stream(self.stream)


class FakeEvent:
    def __init__(self, model: ModelRuntime) -> None:
        self.model = model
        self.event: Any = None

    def record(self, stream: FakeStream) -> None:
        self.event = self.model.record(stream.stream)

    def synchronize(self) -> None:
        self.model.synchronize(self.event)


def install(monkeypatch: Any, model: ModelRuntime) -> FakeCupy:
    """Make `cupy` the stand-in over `model` and import the cupy backend anew."""
    import ec_client.copy

    fake = FakeCupy(model)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.delitem(sys.modules, "ec_client.copy.cupy_backend", raising=False)
    module = importlib.import_module("ec_client.copy.cupy_backend")
    # Gone again after the test: no later test gets the stand-in's backend.
    monkeypatch.setitem(sys.modules, "ec_client.copy.cupy_backend", module)
    monkeypatch.setattr(ec_client.copy, "cupy_backend", module, raising=False)
    return fake
