"""The `torch` backend: the CUDA copy path (`ec_client.copy.cuda`) through torch.

Copies are `Tensor.copy_(non_blocking=True)` between slices of a uint8 view
of the mapping and of the device tensor, on a stream of the worker's device
(torch runs a tensor's copy on the current stream of the tensor's own
device, so tensors of another device are refused, never copied there). The
mapping is registered with `torch.cuda.cudart().cudaHostRegister`, whose
binding returns the error instead of clearing it: a refusal is cleared with
cudaGetLastError from the CUDA runtime torch loaded, or it would surface at
the next unrelated kernel launch on that thread. Runs of registered memory go
in one cudaMemcpyBatchAsync (`ec_client.copy.batch`) where the runtime has it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ec_client.copy.batch import BatchCopy, loaded_cudart
from ec_client.copy.cuda import Copy, CudaBackend
from ec_client.copy.mapping import RegionMapping
from ec_client.copy.pinning import PinRefused

log = logging.getLogger(__name__)

_HOST_REGISTER_DEFAULT = 0


class TorchRuntime:
    """`CudaRuntime` through torch, for the current device at construction."""

    name = "torch"
    orders_allocations = True

    def __init__(self, device: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the torch copy backend needs CUDA; use the cpu backend")
        self.index = torch.cuda.current_device() if device is None else device
        self.device = f"cuda:{self.index}"
        self._device = torch.device("cuda", self.index)
        self.batch = BatchCopy(_loaded_cudart())

    def use_device(self) -> None:
        torch.cuda.set_device(self.index)

    def host_bytes(self, mapping: RegionMapping) -> torch.Tensor:
        return torch.frombuffer(mapping.view, dtype=torch.uint8)

    def register(self, host: torch.Tensor, offset: int, length: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr() + offset, length,
                                                       _HOST_REGISTER_DEFAULT))
        if err != 0:
            _clear_error()
            raise PinRefused(f"cudaHostRegister: CUDA error {err}")

    def unregister(self, host: torch.Tensor, offset: int) -> None:
        err = int(torch.cuda.cudart().cudaHostUnregister(host.data_ptr() + offset))
        if err != 0:
            _clear_error()
            log.warning("ec-daemon: cudaHostUnregister failed (CUDA error %d)", err)

    def check_device(self, array: Any) -> None:
        if not isinstance(array, torch.Tensor) or array.device != self._device:
            where = array.device if isinstance(array, torch.Tensor) else type(array).__name__
            raise TypeError(f"the torch backend copies tensors on {self.device}, not {where}")

    def device_bytes(self, array: Any) -> torch.Tensor:
        self.check_device(array)
        if not array.is_contiguous():
            raise TypeError(f"tensor is not contiguous (shape {tuple(array.shape)}, "
                            f"strides {array.stride()})")
        return array.reshape(-1).view(torch.uint8)

    def nbytes(self, array: Any) -> int:
        return int(array.numel()) * int(array.element_size())

    def contiguous(self, array: Any, stream: torch.cuda.Stream) -> Any:
        with torch.cuda.stream(stream):
            return array.contiguous()

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self._device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self._device)

    def producer_stream(self, array: Any) -> torch.cuda.Stream:
        return self.current_stream()

    def copy(self, dst: torch.Tensor, dst_offset: int, src: torch.Tensor, src_offset: int,
             length: int, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            dst[dst_offset:dst_offset + length].copy_(src[src_offset:src_offset + length],
                                                      non_blocking=True)

    def copy_batch(self, copies: Sequence[Copy], stream: torch.cuda.Stream) -> bool:
        dsts = [dst.data_ptr() + offset for dst, offset, _, _, _ in copies]
        srcs = [src.data_ptr() + offset for _, _, src, offset, _ in copies]
        return self.batch(dsts, srcs, [copy[4] for copy in copies], stream.cuda_stream)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def synchronize_stream(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()

    def pinned_host(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buffer, memoryview(buffer.numpy())

    def empty(self, shape: tuple[int, ...], dtype: str, stream: torch.cuda.Stream) -> Any:
        with torch.cuda.stream(stream):
            return torch.empty(shape, dtype=_torch_dtype(dtype), device=self._device)

    def used_on(self, array: Any, stream: torch.cuda.Stream) -> None:
        array.record_stream(stream)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _clear_error() -> None:
    """cudaGetLastError on this thread, in the CUDA runtime torch uses (torch's
    cudart binding has no such call)."""
    runtime = _loaded_cudart()
    if runtime is None:
        log.warning("ec-daemon: no CUDA runtime library found to clear a CUDA error with")
        return
    runtime.cudaGetLastError()


_cudart: Any = None


def _loaded_cudart() -> Any:
    """The libcudart torch loaded (`batch.loaded_cudart`), looked up once."""
    global _cudart
    if _cudart is None:
        _cudart = loaded_cudart()
    return _cudart


class Backend(CudaBackend):
    def __init__(self, device: int | None = None) -> None:
        super().__init__(TorchRuntime(device))
