"""The `cupy` backend: the same data path as `torch`, through CuPy.

The mapping is registered with cupy.cuda.runtime.hostRegister (in chunks);
copies are cudaMemcpyAsync per extent on a non-blocking CuPy stream, ordered
after the producing stream by an event and awaited before returning.
Sources and outputs may be CuPy arrays or CUDA torch tensors (anything with
a `data_ptr()` or `__cuda_array_interface__`). A non-contiguous source is
made contiguous on the copy stream after the producer's event (so the region
holds its bytes in row-major order, never its storage order); an output must
be contiguous.
"""

from __future__ import annotations

from typing import Any

import cupy

from ec_client.copy import Extents, check_extents, spans
from ec_client.mapping import RegionMapping

REGISTER_CHUNK_BYTES = 1 << 30
_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2  # cudaMemcpyDeviceToHost


def _nbytes(obj: Any) -> int:
    if _is_torch(obj):
        return int(obj.numel()) * int(obj.element_size())
    return int(cupy.asarray(obj).nbytes)


def _device_pointer(obj: Any) -> int:
    """The device pointer of a contiguous tensor or CUDA array. Raises
    TypeError for a non-contiguous one: from its pointer lie its bytes in
    storage order, or past its end for a broadcast view."""
    if not _is_contiguous(obj):
        raise TypeError(f"array is not contiguous (shape {tuple(obj.shape)})")
    if _is_torch(obj):
        return int(obj.data_ptr())
    return int(cupy.asarray(obj).data.ptr)


def _is_torch(obj: Any) -> bool:
    return hasattr(obj, "data_ptr")


def _is_contiguous(obj: Any) -> bool:
    if _is_torch(obj):
        return bool(obj.is_contiguous())
    # cupy.asarray views any __cuda_array_interface__ object without a copy.
    return bool(cupy.asarray(obj).flags.c_contiguous)


class Backend:
    name = "cupy"

    def __init__(self) -> None:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("the cupy copy backend needs a CUDA device")
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._bases: dict[int, int] = {}
        self._registered: dict[int, list[int]] = {}

    def attach(self, mapping: RegionMapping) -> None:
        import ctypes

        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping.view))
        chunks: list[int] = []
        try:
            for start in range(0, mapping.size, REGISTER_CHUNK_BYTES):
                length = min(REGISTER_CHUNK_BYTES, mapping.size - start)
                cupy.cuda.runtime.hostRegister(base + start, length, 0)
                chunks.append(base + start)
        except Exception:
            for pointer in chunks:
                cupy.cuda.runtime.hostUnregister(pointer)
            raise
        self._bases[id(mapping)] = base
        self._registered[id(mapping)] = chunks

    def detach(self, mapping: RegionMapping) -> None:
        cupy.cuda.runtime.deviceSynchronize()
        for pointer in self._registered.pop(id(mapping), []):
            cupy.cuda.runtime.hostUnregister(pointer)
        self._bases.pop(id(mapping), None)

    def prepare_save(self, source: Any) -> Any:
        if hasattr(source, "data_ptr"):  # torch: its current stream produced it
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(source.device))
            return event
        event = cupy.cuda.Event()
        event.record(cupy.cuda.get_current_stream())
        return event

    def save(self, source: Any, mapping: RegionMapping, extents: Extents,
             ready: Any = None) -> None:
        check_extents(mapping, extents, _nbytes(source))
        base = self._bases[id(mapping)]
        if ready is not None:
            ready.synchronize()
        try:
            data = self._contiguous(source)  # only now: the producer has written it
            pointer = _device_pointer(data)
            for offset, length, done in spans(extents):
                cupy.cuda.runtime.memcpyAsync(base + offset, pointer + done, length, _D2H,
                                              self._stream.ptr)
        finally:  # what was queued lands before a caller may abort the save
            self._stream.synchronize()

    def load(self, mapping: RegionMapping, extents: Extents, out: Any) -> Any:
        pointer = _device_pointer(out)
        check_extents(mapping, extents, _nbytes(out))
        base = self._bases[id(mapping)]
        _consumer_synchronize(out)  # `out` may reuse memory still read there
        for offset, length, done in spans(extents):
            cupy.cuda.runtime.memcpyAsync(pointer + done, base + offset, length, _H2D,
                                          self._stream.ptr)
        self._stream.synchronize()
        return out

    def _contiguous(self, source: Any) -> Any:
        """`source`, or a row-major copy of it made on the copy stream (so the
        memcpys that read the copy are ordered after it)."""
        if _is_contiguous(source):
            return source
        if _is_torch(source):
            import torch

            stream = torch.cuda.ExternalStream(self._stream.ptr, device=source.device)
            with torch.cuda.stream(stream):
                return source.contiguous()
        with self._stream:
            return cupy.ascontiguousarray(cupy.asarray(source))


def _consumer_synchronize(out: Any) -> None:
    if hasattr(out, "data_ptr"):
        import torch

        torch.cuda.current_stream(out.device).synchronize()
    else:
        cupy.cuda.get_current_stream().synchronize()
