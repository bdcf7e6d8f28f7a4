"""The `cupy` backend: the CUDA copy path (`ec_client.copy.cuda`) through CuPy.

Copies are `cupy.cuda.runtime.memcpyAsync` between the mapping's address and
a device pointer, on a non-blocking CuPy stream of the worker's device. CuPy
clears the CUDA error of a call it raises for (so a refused registration
leaves none pending).

Arrays may be CUDA torch tensors (what vLLM hands over) or CuPy arrays;
nothing else, and never host memory: `cupy.asarray` of host memory would
copy it to a temporary device array and the copy would land there. With
torch present, load outputs are torch tensors allocated for the copy stream
and recorded on the compute stream (torch's current stream), as the torch
backend does. Without torch they are CuPy arrays; CuPy's pool has no
record_stream, so a CuPy output is allocated on the compute stream and its
load waits for that stream's queued work (on the device; the host then
waits for the copy). A save waits for the stream its source's own library
wrote it on: torch's current stream for a tensor, CuPy's for a CuPy array.

CuPy has no binding of cudaMemcpyBatchAsync, and the process's libcudart
need not be the runtime CuPy uses (its current device and errors are
per runtime), so copies are one memcpyAsync per run. An unregistration CuPy
refuses is logged (`pinning` goes on), as the torch backend does.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Sequence
from typing import Any

import cupy

from ec_client.copy.cuda import Copy, CudaBackend
from ec_client.copy.mapping import RegionMapping
from ec_client.copy.pinning import PinRefused

log = logging.getLogger(__name__)

_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2  # cudaMemcpyDeviceToHost


def _torch() -> Any:
    """torch, if it is installed with CUDA (vLLM's workers have it)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _is_torch(array: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(array, torch.Tensor)


class CupyRuntime:
    """`CudaRuntime` through CuPy, for the current device at construction."""

    name = "cupy"

    def __init__(self, device: int | None = None) -> None:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("the cupy copy backend needs a CUDA device")
        self.index = cupy.cuda.runtime.getDevice() if device is None else device
        self.device = f"cuda:{self.index}"
        self._torch = _torch()
        # torch's allocator orders an output for the copy stream; CuPy's pool cannot.
        self.orders_allocations = self._torch is not None
        self._pinned: list[Any] = []  # the bounce buffers' page-locked memory

    def use_device(self) -> None:
        cupy.cuda.runtime.setDevice(self.index)

    def host_bytes(self, mapping: RegionMapping) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(mapping.view))

    def register(self, host: int, offset: int, length: int) -> None:
        try:
            cupy.cuda.runtime.hostRegister(host + offset, length, 0)
        except cupy.cuda.runtime.CUDARuntimeError as exc:  # CuPy cleared the error
            raise PinRefused(f"cudaHostRegister: {exc}") from None

    def unregister(self, host: int, offset: int) -> None:
        try:
            cupy.cuda.runtime.hostUnregister(host + offset)
        except cupy.cuda.runtime.CUDARuntimeError as exc:  # CuPy cleared the error
            log.warning("ec-daemon: cudaHostUnregister failed (%s)", exc)

    def check_device(self, array: Any) -> None:
        if _is_torch(array):
            where = array.device
            if array.is_cuda and array.device.index == self.index:
                return
        elif isinstance(array, cupy.ndarray):
            where = f"cuda:{array.device.id}"
            if array.device.id == self.index:
                return
        else:
            raise TypeError(f"the cupy backend copies CUDA torch tensors and CuPy arrays, not "
                            f"{type(array).__name__} (host memory is never copied through "
                            "cupy.asarray)")
        raise TypeError(f"the cupy backend copies arrays on {self.device}, not {where}")

    def device_bytes(self, array: Any) -> tuple[int, int]:
        """(device pointer, bytes) of a contiguous array on this device."""
        self.check_device(array)
        if _is_torch(array):
            if not array.is_contiguous():
                raise TypeError(f"tensor is not contiguous (shape {tuple(array.shape)}, "
                                f"strides {array.stride()})")
            return int(array.data_ptr()), self.nbytes(array)
        if not array.flags.c_contiguous:
            raise TypeError(f"array is not contiguous (shape {tuple(array.shape)})")
        return int(array.data.ptr), int(array.nbytes)

    def nbytes(self, array: Any) -> int:
        if _is_torch(array):
            return int(array.numel()) * int(array.element_size())
        return int(array.nbytes)

    def contiguous(self, array: Any, stream: cupy.cuda.Stream) -> Any:
        if _is_torch(array):
            if array.is_contiguous():
                return array
            torch = self._torch
            with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=array.device)):
                return array.contiguous()
        if array.flags.c_contiguous:
            return array
        with stream:
            return cupy.ascontiguousarray(array)

    def new_stream(self) -> cupy.cuda.Stream:
        return cupy.cuda.Stream(non_blocking=True)

    def current_stream(self) -> Any:
        if self._torch is not None:
            return cupy.cuda.ExternalStream(
                self._torch.cuda.current_stream(self.index).cuda_stream, self.index)
        return cupy.cuda.get_current_stream()

    def producer_stream(self, array: Any) -> Any:
        if _is_torch(array):
            return self.current_stream()
        return cupy.cuda.get_current_stream()

    def copy_batch(self, copies: Sequence[Copy], stream: cupy.cuda.Stream) -> bool:
        return False

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, length: int,
             stream: cupy.cuda.Stream) -> None:
        if isinstance(dst, int):  # the host mapping: device to host
            cupy.cuda.runtime.memcpyAsync(dst + dst_offset, src[0] + src_offset, length, _D2H,
                                          stream.ptr)
        else:
            cupy.cuda.runtime.memcpyAsync(dst[0] + dst_offset, src + src_offset, length, _H2D,
                                          stream.ptr)

    def record(self, stream: Any) -> cupy.cuda.Event:
        event = cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def synchronize_stream(self, stream: Any) -> None:
        stream.synchronize()

    def pinned_host(self, nbytes: int) -> tuple[int, memoryview]:
        import numpy

        memory = cupy.cuda.alloc_pinned_memory(nbytes)
        self._pinned.append(memory)  # freed with the runtime: the copies name its address
        return int(memory.ptr), memoryview(numpy.frombuffer(memory, numpy.uint8, nbytes))

    def empty(self, shape: tuple[int, ...], dtype: str, stream: cupy.cuda.Stream) -> Any:
        torch = self._torch
        if torch is not None:
            with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=self.device)):
                dtype_obj = getattr(torch, dtype, None)
                if not isinstance(dtype_obj, torch.dtype):
                    raise ValueError(f"unknown dtype {dtype!r}")
                return torch.empty(shape, dtype=dtype_obj, device=self.device)
        with self.current_stream():  # see the module docstring
            return cupy.empty(shape, dtype=dtype)

    def used_on(self, array: Any, stream: Any) -> None:
        if _is_torch(array):
            torch = self._torch
            array.record_stream(torch.cuda.ExternalStream(stream.ptr, device=array.device))


class Backend(CudaBackend):
    def __init__(self, device: int | None = None) -> None:
        super().__init__(CupyRuntime(device))
