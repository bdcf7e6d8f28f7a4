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
  has landed on return. A pageable copy of the region's mapping is a broken
  rule of this project: CUDA would touch its pages with the CPU, and a page a
  truncation took away is a SIGBUS (chunks not registered go through
  page-locked memory, `pinned_host`);
- registered region memory is pinned pages of the region file, which the GPU
  DMAs and which never fault: the model reads and writes the file for them
  with pread/pwrite (never the mapping, so a test process survives a cut
  too). A cut (the file found shorter than a registration, or `orphan`)
  takes the pages out of the file while the registration keeps them: from
  then on the model's GPU copies to and from those old pages (what they held,
  as far as this process moved them), and the file, regrown or not, never
  sees those copies, as on a GPU;
- host memory is never (un)registered while a queued copy of it is pending;
- the current stream is per thread: the compute stream on the main thread
  (the engine's), a default stream of its own on every other thread;
- registration can be refused (`refuse_registration`), unregistration can
  fail (`refuse_unregistration`: CUDA's error, raised), and
  `host_register_calls` counts the attempts;
- the caching allocator's per-stream rules (tests/cuda_allocator.py): memory
  allocated on one stream and written by another that did not wait for it,
  and a tensor freed while a stream it was never recorded on still has work
  on it queued, are both broken rules;
- copies are counted: `copy_calls` (one cudaMemcpyAsync each) and
  `batch_calls` (one cudaMemcpyBatchAsync each, of registered memory only;
  `batches=False`: a runtime without it).

It is a model of the documented rules, not CUDA: timing and real DMA are not
modelled, and it is no substitute for running tests/gpu on a GPU (`make
gpu-test`, `make gpu-check`).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ec_client.copy.cuda import CudaBackend
from ec_client.copy.mapping import RegionMapping
from ec_client.copy.pinning import PinRefused
from tests.cuda_allocator import Allocator
from tests.cuda_streams import Event, RuleBroken, Stream, StreamModel

__all__ = ["GARBAGE", "Backend", "EngineBackend", "Event", "ModelRuntime", "RuleBroken",
           "Stream", "as_host"]

GARBAGE = 0xAB


class Pages:
    """One registration of region memory: pinned pages of the region file, as
    the model's GPU sees them (the module docstring). Until a cut orphans
    them they are the file's; `shadow` holds what this process moved through
    them, which is what an orphaned registration keeps."""

    def __init__(self, fd: int, file_offset: int, length: int) -> None:
        self.fd = os.dup(fd)  # the mapping may close its own before a queued copy runs
        self.file_offset = file_offset
        self.length = length
        self.shadow = bytearray(length)
        self.orphaned = False

    def _check(self) -> None:
        if not self.orphaned and os.fstat(self.fd).st_size < self.file_offset + self.length:
            self.orphaned = True  # a cut took pages out of the file: ours stay pinned

    def orphan(self) -> None:
        """A cut now: the registration keeps the pages as they are."""
        if not self.orphaned:
            data = os.pread(self.fd, self.length, self.file_offset)
            self.shadow[:len(data)] = data
            self.orphaned = True

    def read(self, at: int, length: int) -> bytes:
        """What the GPU reads from the pages at `at` (a copy to the device)."""
        self._check()
        if not self.orphaned:
            data = os.pread(self.fd, length, self.file_offset + at)
            self.shadow[at:at + len(data)] = data
            if len(data) < length:
                self.orphaned = True  # cut meanwhile: the rest is the old pages'
        return bytes(self.shadow[at:at + length])

    def write(self, at: int, data: bytes) -> None:
        """What the GPU writes into the pages at `at` (a copy to the host)."""
        self.shadow[at:at + len(data)] = data
        self._check()
        if not self.orphaned:
            os.pwrite(self.fd, data, self.file_offset + at)

    def close(self) -> None:
        os.close(self.fd)


class ModelRuntime(StreamModel):
    """`CudaRuntime` over CPU memory, checking CUDA's rules."""

    name = "cuda-model"
    device = "cpu"  # where its "device" tensors really live (a CPU vLLM engine can use them)
    orders_allocations = True

    def __init__(self, device: int = 1, *, permissive: bool = False,
                 batches: bool = True) -> None:
        self.index = device
        self.permissive = permissive
        self.batches = batches
        self.violations: list[str] = []
        self.compute_host_waits = 0
        self.compute_host_waits_by_thread: dict[str, int] = {}
        self.host_register_calls = 0
        self.copy_calls = 0
        self.batch_calls = 0
        self.host_waits = 0  # synchronisations of an event or a stream by the host
        self.refuse_registration: Callable[[int, int], bool] = lambda offset, length: False
        self.refuse_unregistration: Callable[[int], Exception | None] = lambda offset: None
        self._lock = threading.RLock()
        self._thread = threading.local()
        self._registrations: dict[int, int] = {}  # address -> length
        self._pages: dict[int, Pages] = {}  # address of a registration of region memory ->
        self._hosts: dict[int, RegionMapping] = {}  # address of a host mapping -> it
        # Page-locked memory of the process's own (`pinned_host`): address -> length.
        self._page_locked: dict[int, tuple[int, Any]] = {}
        # The model's device memory, and the caching allocator's rules.
        self.allocator = Allocator(self)
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
        self.allocator.place(copy, self.index if device is None else device)
        return copy

    def place(self, tensor: torch.Tensor, device: int) -> torch.Tensor:
        """`tensor` as memory of `device` (another GPU)."""
        self.allocator.place(tensor, device)
        return tensor

    def _device_of(self, array: Any) -> int:
        if not isinstance(array, torch.Tensor):
            raise TypeError(f"{type(array).__name__} is host memory, not a device array "
                            "(cupy.asarray would copy it to the device)")
        pointer = array.data_ptr()
        for address, mapping in self._hosts.items():
            if address <= pointer < address + mapping.size:
                raise TypeError("a view of the host region is host memory, not a device array")
        block = self.allocator.block_of(array)
        if block is not None:
            return block.device
        if self.permissive:
            return self.index
        raise TypeError("a CPU tensor the model never allocated is host memory, not a device "
                        "array (cupy.asarray would copy it to the device)")

    # ------------------------------------------------------------ streams

    # ------------------------------------------------- CudaRuntime methods

    def use_device(self) -> None:
        self._thread.device = self.index

    def host_bytes(self, mapping: RegionMapping) -> int:
        self._on_device()
        anchor = ctypes.c_char.from_buffer(mapping.view)  # (maps it; touches no page)
        address = ctypes.addressof(anchor)
        del anchor
        self._hosts[address] = mapping
        return address

    def orphan(self) -> None:
        """A cut of the region file now (as `ftruncate` by another process):
        every registration of region memory keeps its pages, and the file
        gets new ones when it is regrown."""
        with self._lock:
            for pages in self._pages.values():
                pages.orphan()

    def pinned_host(self, nbytes: int) -> tuple[int, memoryview]:
        self._on_device()
        buffer = (ctypes.c_char * nbytes)()
        address = ctypes.addressof(buffer)
        with self._lock:
            self._page_locked[address] = (nbytes, buffer)
        return address, memoryview(buffer).cast("B")

    def _region_of(self, start: int) -> tuple[int, RegionMapping] | None:
        """(base address, mapping) of the region mapping holding `start`."""
        for address, mapping in self._hosts.items():
            if address <= start < address + mapping.size:
                return address, mapping
        return None

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
            region = self._region_of(start)
            if region is not None:
                if os.fstat(region[1].fd).st_size < start - region[0] + length:
                    # The driver pins the pages: those a cut removed cannot be.
                    del self._registrations[start]
                    raise PinRefused("cudaErrorInvalidValue (the model: the file is cut short)")
                self._pages[start] = Pages(region[1].fd, start - region[0], length)

    def unregister(self, host: int, offset: int) -> None:
        self._on_device()
        error = self.refuse_unregistration(offset)
        with self._lock:
            length = self._registrations.pop(host + offset, None)
            if length is None:
                raise self.broken("cudaHostUnregister of memory that is not registered")
            self._no_pending_copy(host + offset, host + offset + length, "cudaHostUnregister")
            pages = self._pages.pop(host + offset, None)
            if pages is not None:
                pages.close()
        if error is not None:  # CUDA refused, after releasing what it could
            raise error

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
        out = self._garbage(tuple(array.shape), array.dtype, stream)
        stream.ops.append(("work", lambda: out.copy_(array), None))  # reads when it runs
        self.allocator.used(array, stream)
        self.allocator.used(out, stream)
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

    def producer_stream(self, array: Any) -> Stream:
        return self.current_stream()

    def copy_batch(self, copies: Any, stream: Stream) -> bool:
        self._on_device()
        if not self.batches:
            return False
        for dst, dst_offset, src, src_offset, length in copies:
            self._copy(dst, dst_offset, src, src_offset, length, stream, batched=True)
        self.batch_calls += 1
        return True

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, length: int,
             stream: Stream) -> None:
        self._on_device()
        self.copy_calls += 1
        self._copy(dst, dst_offset, src, src_offset, length, stream)

    def _copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, length: int,
              stream: Stream, batched: bool = False) -> None:
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
        pages = self._pages_of(start) if pinned else None

        def move() -> None:
            if pages is None:
                ctypes.memmove(dst_ptr, src_ptr, length)
            elif to_host:  # the GPU writes the registered pages (the file's, or old ones)
                pages[1].write(start - pages[0], ctypes.string_at(src_ptr, length))
            else:
                ctypes.memmove(dst_ptr, pages[1].read(start - pages[0], length), length)

        if batched and not pinned:
            raise self.broken("cudaMemcpyBatchAsync of pageable memory (batches are for "
                              "registered runs, in stream order)")
        if not pinned and self._region_of(start) is not None:
            raise self.broken("a pageable copy of the region's mapping: CUDA would touch its "
                              "pages with the CPU, a SIGBUS once a truncation took one away "
                              "(chunks not registered go through page-locked memory)")
        if pinned:
            stream.ops.append(("work", move, (start, start + length)))
            self.allocator.used(device, stream)
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
        self.allocator.used(device, stream)

    def _pages_of(self, start: int) -> tuple[int, Pages] | None:
        """(its address, the registration of region memory) holding `start`."""
        with self._lock:
            for address, pages in self._pages.items():
                if address <= start < address + pages.length:
                    return address, pages
        return None

    def _pinned(self, start: int, length: int) -> bool:
        with self._lock:
            for address, (size, _) in self._page_locked.items():
                if address <= start and start + length <= address + size:
                    return True
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

    def empty(self, shape: tuple[int, ...], dtype: str, stream: Stream) -> torch.Tensor:
        self._on_device()
        self._check_stream(stream)
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        return self._garbage(shape, torch_dtype, stream)

    def used_on(self, array: Any, stream: Stream) -> None:
        self._on_device()
        self._check_stream(stream)
        self.allocator.record(array, stream)

    def _garbage(self, shape: tuple[int, ...], dtype: torch.dtype,
                 stream: Stream) -> torch.Tensor:
        """Uninitialised device memory of the worker's device, allocated on `stream`."""
        out = torch.empty(shape, dtype=dtype)
        out.reshape(-1).view(torch.uint8).fill_(GARBAGE)
        self.allocator.place(out, self.index, stream)
        return out


class Backend(CudaBackend):
    """The CUDA copy path over the model. `busy_compute`: as in an engine,
    the compute stream always has work queued when the worker allocates and
    loads (the previous step's kernels), and the forward pass reads each
    loaded output there afterwards (checked against the bytes the load
    returned when it runs). `wait_pinned`: `attach` returns once the mapping
    is registered, so copies run pinned and the chunk rules apply."""

    def __init__(self, runtime: ModelRuntime | None = None, chunk_bytes: int = 1 << 30, *,
                 busy_compute: bool = False, wait_pinned: bool = False) -> None:
        super().__init__(runtime or ModelRuntime(), chunk_bytes=chunk_bytes)
        self.model: ModelRuntime = self.runtime  # type: ignore[assignment]
        self.busy_compute = busy_compute
        self.wait_pinned = wait_pinned
        self.consumed = 0  # loaded outputs the forward pass read, as loaded

    def attach(self, mapping: RegionMapping) -> None:
        super().attach(mapping)
        if self.wait_pinned:
            assert self.pinning(mapping).done.wait(30)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        if self.busy_compute:
            self.model.launch(lambda: None)  # the previous step, still running
        return super().empty(shape, dtype)

    def load_all(self, loads: Any) -> list[Exception | None]:
        if self.busy_compute:
            self.model.launch(lambda: None)
        errors = super().load_all(loads)
        if self.busy_compute:
            for (_, _, out), error in zip(loads, errors, strict=True):
                if error is None:
                    self._consume(out)
        return errors

    def _consume(self, out: torch.Tensor) -> None:
        """Queue the forward pass's read of `out` on the compute stream."""
        returned = as_host(out).tobytes()
        model = self.model
        # Not held by the kernel: an output freed while it is queued is the
        # allocator's business (tests/cuda_allocator.py), as on a GPU.
        ref = weakref.ref(out)

        def forward() -> None:
            tensor = ref()
            if tensor is not None and as_host(tensor).tobytes() != returned:
                model.broken("the compute stream read a loaded output that differs from the "
                             "bytes its load returned")
            self.consumed += 1

        model.launch(forward, uses=(out,))


class EngineBackend(Backend):
    """The CUDA copy path over a permissive model, for a CPU vLLM engine whose
    encoder outputs stand in for device tensors; selectable by name where a
    backend is (`ec_daemon_copy_backend: "tests.cuda_model:EngineBackend"`):
    its compute stream is busy, as an engine's is."""

    def __init__(self) -> None:
        super().__init__(ModelRuntime(permissive=True), busy_compute=True)


def as_host(array: Any) -> np.ndarray:
    """A device array's bytes, read by the test (after `drain`)."""
    return np.asarray(array.reshape(-1).view(torch.uint8))
