"""A model of the CUDA rules the copy path must keep, for machines without a GPU.

`ModelRuntime` implements `ec_client.copy.cuda.CudaRuntime` on the CPU, so
`CudaBackend` (the `torch` and `cupy` backends' one copy path) runs in the
CPU test suite, and records every broken rule in `violations` (and raises
`RuleBroken`):

- every call runs with the worker's device current on its thread (threads
  start on device 0; the model's worker device is 1 by default);
- a copy range lies inside one host registration or outside all of them;
- device arrays are torch tensors the model allocated (`empty`, `to_device`,
  `place`); anything else is host memory and refused as a device array, as
  `cupy.asarray` would silently copy it (a `permissive` model, for a CPU
  vLLM engine whose outputs stand in for device tensors, takes any torch
  tensor but a view of the region); an array of another device (`place`) is
  refused too, and a stream is used only on its own device;
- the GPU is infinitely slow: work queued on a stream (a producer's kernel,
  `launch`; a pinned copy) runs only when the host synchronises, or when a
  stream that waits for it is synchronised. So a save that does not wait for
  the producer's event copies stale bytes, a load that is not synchronised
  returns garbage (`empty` fills with 0xAB), and a host wait that makes the
  compute stream's queued work run counts in `compute_host_waits`: the copy
  path must let the compute stream wait on events, never the host;
- copies from or to pageable (unregistered) memory synchronise their stream
  first, as CUDA documents for pageable cudaMemcpyAsync; one to the device
  reads the host at once and lands only when its stream runs, one to the host
  has landed on return;
- host memory is never (un)registered while a queued copy of it is pending;
- the current stream is per thread: the compute stream on the main thread
  (the engine's), a default stream of its own on every other thread;
- registration can be refused (`refuse_registration`), and `host_register_calls`
  counts the attempts.

It is a model of the documented rules, not CUDA: timing, the caching
allocator's reuse and real DMA are not modelled, and it is no substitute for
running tests/gpu on a GPU (`make gpu-test`, `make gpu-check`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ec_client.copy.cuda import CudaBackend
from ec_client.copy.mapping import RegionMapping
from ec_client.copy.pinning import PinRefused

GARBAGE = 0xAB


class RuleBroken(RuntimeError):
    """The copy path broke one of CUDA's rules."""


class Stream:
    def __init__(self, model: ModelRuntime, device: int, name: str) -> None:
        self.model = model
        self.device = device
        self.name = name
        # ("work", fn, host range or None) or ("wait", Event, None)
        self.ops: list[tuple[str, Any, tuple[int, int] | None]] = []
        self.done = 0  # ops[:done] have run

    def __repr__(self) -> str:
        return f"<stream {self.name} on device {self.device}>"


class Event:
    def __init__(self, stream: Stream, position: int) -> None:
        self.stream = stream
        self.position = position


class ModelRuntime:
    """`CudaRuntime` over CPU memory, checking CUDA's rules."""

    name = "cuda-model"
    device = "cpu"  # where its "device" tensors really live (a CPU vLLM engine can use them)
    orders_allocations = True

    def __init__(self, device: int = 1, *, permissive: bool = False) -> None:
        self.index = device
        self.permissive = permissive
        self.violations: list[str] = []
        self.compute_host_waits = 0
        self.compute_host_waits_by_thread: dict[str, int] = {}
        self.host_register_calls = 0
        self.refuse_registration: Callable[[int, int], bool] = lambda offset, length: False
        self._lock = threading.RLock()
        self._thread = threading.local()
        self._registrations: dict[int, int] = {}  # address -> length
        self._hosts: dict[int, int] = {}  # address of a host mapping -> its length
        # The model's device memory: storage address -> (the tensor, kept
        # alive so the address is never reused, its device).
        self._allocations: dict[int, tuple[torch.Tensor, int]] = {}
        self.compute = Stream(self, device, "compute")
        self._streams: list[Stream] = []
        self._running: set[str] | None = None

    # --------------------------------------------------------- the rules

    def broken(self, rule: str) -> RuleBroken:
        self.violations.append(rule)
        return RuleBroken(rule)

    def _on_device(self) -> None:
        current = getattr(self._thread, "device", 0)
        if current != self.index:
            raise self.broken(f"a CUDA call on thread {threading.current_thread().name} with "
                              f"device {current} current, not the worker's {self.index}")

    def to_device(self, tensor: torch.Tensor, device: int | None = None) -> torch.Tensor:
        """A copy of `tensor` in the model's device memory (of `device`,
        default the worker's)."""
        copy = tensor.clone()
        self._allocations[copy.untyped_storage().data_ptr()] = (
            copy, self.index if device is None else device)
        return copy

    def place(self, tensor: torch.Tensor, device: int) -> torch.Tensor:
        """`tensor` as memory of `device` (another GPU)."""
        self._allocations[tensor.untyped_storage().data_ptr()] = (tensor, device)
        return tensor

    def _device_of(self, array: Any) -> int:
        if not isinstance(array, torch.Tensor):
            raise TypeError(f"{type(array).__name__} is host memory, not a device array "
                            "(cupy.asarray would copy it to the device)")
        pointer = array.data_ptr()
        for address, length in self._hosts.items():
            if address <= pointer < address + length:
                raise TypeError("a view of the host region is host memory, not a device array")
        allocated = self._allocations.get(array.untyped_storage().data_ptr())
        if allocated is not None:
            return allocated[1]
        if self.permissive:
            return self.index
        raise TypeError("a CPU tensor the model never allocated is host memory, not a device "
                        "array (cupy.asarray would copy it to the device)")

    def _check_stream(self, stream: Stream) -> None:
        if stream.device != self.index:
            raise self.broken(f"{stream} used for device {self.index}'s memory: a copy runs "
                              "on the current stream of its own device")

    # ------------------------------------------------------------ streams

    def launch(self, fn: Callable[[], None], stream: Stream | None = None) -> None:
        """Queue a kernel (the test's producer or consumer) on `stream`."""
        (stream or self.compute).ops.append(("work", fn, None))

    def _run(self, stream: Stream, upto: int) -> None:
        while stream.done < upto:
            kind, what, _ = stream.ops[stream.done]
            stream.done += 1
            if self._running is not None:
                self._running.add(stream.name)
            if kind == "wait":
                self._run(what.stream, what.position)
            else:
                what()

    def _host_wait(self, stream: Stream, upto: int) -> None:
        with self._lock:
            self._running = set()
            try:
                self._run(stream, upto)
                if self.compute.name in self._running:
                    self.compute_host_waits += 1
                    thread = threading.current_thread().name
                    self.compute_host_waits_by_thread[thread] = \
                        self.compute_host_waits_by_thread.get(thread, 0) + 1
            finally:
                self._running = None

    def drain(self) -> None:
        """Run everything queued (the test's own synchronisation)."""
        with self._lock:
            for stream in [self.compute, *self._streams]:
                self._run(stream, len(stream.ops))

    # ------------------------------------------------- CudaRuntime methods

    def use_device(self) -> None:
        self._thread.device = self.index

    def host_bytes(self, mapping: RegionMapping) -> int:
        self._on_device()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping.view))
        self._hosts[address] = mapping.size
        return address

    def register(self, host: int, offset: int, length: int) -> None:
        self._on_device()
        with self._lock:
            self.host_register_calls += 1
        if self.refuse_registration(offset, length):  # (a test's hook may block)
            raise PinRefused("cudaErrorHostMemoryAlreadyRegistered (the model refused)")
        with self._lock:
            start, end = host + offset, host + offset + length
            self._no_pending_copy(start, end, "cudaHostRegister")
            for address, size in self._registrations.items():
                if address < end and start < address + size:
                    raise self.broken("cudaHostRegister of memory already registered")
            self._registrations[start] = length

    def unregister(self, host: int, offset: int) -> None:
        self._on_device()
        with self._lock:
            length = self._registrations.pop(host + offset, None)
            if length is None:
                raise self.broken("cudaHostUnregister of memory that is not registered")
            self._no_pending_copy(host + offset, host + offset + length, "cudaHostUnregister")

    def _no_pending_copy(self, start: int, end: int, call: str) -> None:
        for stream in [self.compute, *self._streams]:
            for _, _, host_range in stream.ops[stream.done:]:
                if host_range is not None and host_range[0] < end and start < host_range[1]:
                    raise self.broken(f"{call} over host memory a queued copy still uses")

    def registered_bytes(self) -> int:
        return sum(self._registrations.values())

    def check_device(self, array: Any) -> None:
        self._on_device()
        device = self._device_of(array)
        if device != self.index:
            raise TypeError(f"an array on device {device}, not the worker's {self.index}")

    def device_bytes(self, array: Any) -> torch.Tensor:
        self.check_device(array)
        if not array.is_contiguous():
            raise TypeError(f"tensor is not contiguous (shape {tuple(array.shape)})")
        return array.reshape(-1).view(torch.uint8)

    def nbytes(self, array: Any) -> int:
        return int(array.numel()) * int(array.element_size())

    def contiguous(self, array: Any, stream: Stream) -> Any:
        self._on_device()
        self._check_stream(stream)
        if array.is_contiguous():
            return array
        out = self._garbage(tuple(array.shape), array.dtype)
        stream.ops.append(("work", lambda: out.copy_(array), None))  # reads when it runs
        return out

    def new_stream(self) -> Stream:
        # Created on the calling thread's current device, right or wrong.
        stream = Stream(self, getattr(self._thread, "device", 0), f"side-{len(self._streams)}")
        self._streams.append(stream)
        return stream

    def current_stream(self) -> Stream:
        self._on_device()
        if threading.current_thread() is threading.main_thread():
            return self.compute
        stream = getattr(self._thread, "stream", None)
        if stream is None:
            stream = self._thread.stream = Stream(
                self, self.index, f"default-{threading.current_thread().name}")
            self._streams.append(stream)
        return stream

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, length: int,
             stream: Stream) -> None:
        self._on_device()
        self._check_stream(stream)
        to_host = isinstance(dst, int)
        host, host_offset = (dst, dst_offset) if to_host else (src, src_offset)
        device = src if to_host else dst
        if not isinstance(device, torch.Tensor):
            raise self.broken("a copy between two host buffers")
        if (src_offset if to_host else dst_offset) + length > device.numel():
            raise self.broken("a copy past the end of a device buffer")
        start = host + host_offset
        pinned = self._pinned(start, length)
        dst_ptr = start if to_host else device.data_ptr() + dst_offset
        src_ptr = device.data_ptr() + src_offset if to_host else start

        def move() -> None:
            ctypes.memmove(dst_ptr, src_ptr, length)

        if pinned:
            stream.ops.append(("work", move, (start, start + length)))
            return
        # Pageable: CUDA synchronises the stream, then copies through a
        # staging buffer. To the host: landed on return. To the device: the
        # host is read now, the device written when the stream runs.
        self._host_wait(stream, len(stream.ops))
        if to_host:
            move()
        else:
            staged = ctypes.string_at(src_ptr, length)
            stream.ops.append(("work", lambda: ctypes.memmove(dst_ptr, staged, length), None))

    def _pinned(self, start: int, length: int) -> bool:
        with self._lock:
            for address, size in self._registrations.items():
                inside = address <= start and start + length <= address + size
                overlaps = address < start + length and start < address + size
                if inside:
                    return True
                if overlaps:
                    raise self.broken(f"cudaMemcpyAsync range {start:x}+{length} crosses a "
                                      f"registration boundary ({address:x}+{size}): "
                                      "cudaErrorInvalidValue")
        return False

    def record(self, stream: Stream) -> Event:
        self._on_device()
        self._check_stream(stream)
        return Event(stream, len(stream.ops))

    def wait(self, stream: Stream, event: Event) -> None:
        self._on_device()
        self._check_stream(stream)
        stream.ops.append(("wait", event, None))

    def synchronize(self, event: Event) -> None:
        self._on_device()
        self._host_wait(event.stream, event.position)

    def synchronize_stream(self, stream: Stream) -> None:
        self._on_device()
        self._host_wait(stream, len(stream.ops))

    def empty(self, shape: tuple[int, ...], dtype: str, stream: Stream) -> torch.Tensor:
        self._on_device()
        self._check_stream(stream)
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        return self._garbage(shape, torch_dtype)

    def used_on(self, array: Any, stream: Stream) -> None:
        self._on_device()
        self._check_stream(stream)

    def _garbage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised device memory of the worker's device."""
        out = torch.empty(shape, dtype=dtype)
        out.reshape(-1).view(torch.uint8).fill_(GARBAGE)
        if not self.permissive:  # (a permissive model's outputs go to a real engine)
            self._allocations[out.untyped_storage().data_ptr()] = (out, self.index)
        return out


class Backend(CudaBackend):
    """The CUDA copy path over the model."""

    def __init__(self, runtime: ModelRuntime | None = None, chunk_bytes: int = 1 << 30) -> None:
        super().__init__(runtime or ModelRuntime(), chunk_bytes=chunk_bytes)
        self.model: ModelRuntime = self.runtime  # type: ignore[assignment]


class EngineBackend(Backend):
    """The CUDA copy path over a permissive model, for a CPU vLLM engine whose
    encoder outputs stand in for device tensors; selectable by name where a
    backend is (`ec_daemon_copy_backend: "tests.cuda_model:EngineBackend"`)."""

    def __init__(self) -> None:
        super().__init__(ModelRuntime(permissive=True))


def as_host(array: Any) -> np.ndarray:
    """A device array's bytes, read by the test (after `drain`)."""
    return np.asarray(array.reshape(-1).view(torch.uint8))
