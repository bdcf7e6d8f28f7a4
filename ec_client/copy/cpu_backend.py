"""The `cpu` backend: plain memcpy between host buffers and the region.

Sources and outputs are anything exposing a C-contiguous buffer: numpy
arrays, bytes-likes, and CPU torch tensors (viewed as bytes, so bfloat16
works too). One slice assignment (a memcpy) per extent.
"""

from __future__ import annotations

from typing import Any

from ec_client.copy import Extents, check_extents, spans
from ec_client.mapping import RegionMapping


def as_bytes(obj: Any, *, writable: bool = False) -> memoryview:
    """A flat byte view of `obj`'s memory (no copy). Raises TypeError for
    non-contiguous or unsupported objects."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "untyped_storage"):  # a torch tensor
        if obj.device.type != "cpu":
            raise TypeError("the cpu backend copies CPU tensors only")
        if not obj.is_contiguous():
            raise TypeError("tensor is not contiguous")
        import torch

        obj = obj.view(torch.uint8).numpy() if obj.dim() else obj.reshape(1).view(
            torch.uint8).numpy()
    view = memoryview(obj)
    if not view.c_contiguous:
        raise TypeError("buffer is not C-contiguous")
    if writable and view.readonly:
        raise TypeError("output buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Backend:
    name = "cpu"

    def attach(self, mapping: RegionMapping) -> None:
        return None

    def detach(self, mapping: RegionMapping) -> None:
        return None

    def prepare_save(self, source: Any) -> None:
        return None

    def save(self, source: Any, mapping: RegionMapping, extents: Extents,
             ready: Any = None) -> None:
        data = as_bytes(source)
        check_extents(mapping, extents, data.nbytes)
        region = mapping.view
        for offset, length, done in spans(extents):
            region[offset:offset + length] = data[done:done + length]

    def load(self, mapping: RegionMapping, extents: Extents, out: Any) -> Any:
        data = as_bytes(out, writable=True)
        check_extents(mapping, extents, data.nbytes)
        region = mapping.view
        for offset, length, done in spans(extents):
            data[done:done + length] = region[offset:offset + length]
        return out

