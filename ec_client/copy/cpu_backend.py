"""The `cpu` backend: copies between host buffers and the region file with
pwritev/preadv, never through a mapping.

Sources and outputs are numpy arrays, bytes-likes, and CPU torch tensors
(viewed as bytes, so bfloat16 works too). One system call per contiguous
run of extents, straight between the buffer and the file's pages (the
kernel's copy, as fast as a memcpy from a mapping: docs/performance.md
section 2). Not a mapping, because any worker can truncate the file and a
mapped page past its end is a SIGBUS (`ec_client.copy.mapping`): a load the
cut made short fails (`RegionCut`), a save's write extends the file and the
canary check after it gives it up. A save stores the source's bytes in
row-major order, what a reader of its shape and dtype expects: a
non-contiguous source (transposed, strided, broadcast) is first copied into
a contiguous buffer. A load's output must be contiguous.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from ec_client.copy import Extents, Load, check_extents, empty_host, spans
from ec_client.copy.mapping import RegionMapping


def as_bytes(obj: Any, *, writable: bool = False) -> memoryview:
    """A flat byte view of `obj`'s memory (no copy). Raises TypeError for
    non-contiguous or unsupported objects."""
    if _is_torch(obj):
        _check_cpu(obj)
        if not obj.is_contiguous():
            raise TypeError(f"tensor is not contiguous (shape {tuple(obj.shape)}, "
                            f"strides {obj.stride()})")
        obj = _torch_bytes(obj)
    view = memoryview(obj)
    if not view.c_contiguous:
        raise TypeError(f"buffer is not C-contiguous (shape {view.shape}, "
                        f"strides {view.strides})")
    if writable and view.readonly:
        raise TypeError("output buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def row_major_bytes(obj: Any) -> memoryview:
    """A flat byte view of `obj` in row-major order: its own memory when it
    is contiguous, else a contiguous copy (never its storage order)."""
    if _is_torch(obj):
        _check_cpu(obj)
        return as_bytes(obj.contiguous())
    view = memoryview(obj)
    return as_bytes(view if view.c_contiguous else view.tobytes())


def _is_torch(obj: Any) -> bool:
    return hasattr(obj, "data_ptr") and hasattr(obj, "untyped_storage")


def _check_cpu(tensor: Any) -> None:
    if tensor.device.type != "cpu":
        raise TypeError("the cpu backend copies CPU tensors only")


def _torch_bytes(tensor: Any) -> Any:
    """A contiguous CPU tensor's bytes as a numpy uint8 array (no copy)."""
    import torch

    return (tensor if tensor.dim() else tensor.reshape(1)).view(torch.uint8).numpy()


class Backend:
    name = "cpu"
    device = "cpu"

    def __init__(self) -> None:
        self.stats: Counter[str] = Counter()

    def attach(self, mapping: RegionMapping) -> None:
        return None

    def detach(self, mapping: RegionMapping) -> None:
        return None

    def pinned(self, mapping: RegionMapping) -> bool:
        return False

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        return empty_host(shape, dtype)

    def prepare_save(self, source: Any) -> None:
        return None

    def save(self, source: Any, mapping: RegionMapping, extents: Extents,
             ready: Any = None) -> None:
        data = row_major_bytes(source)
        check_extents(mapping, extents, data.nbytes)
        for offset, length, done in spans(extents):
            mapping.write_from(offset, data[done:done + length])

    def load(self, mapping: RegionMapping, extents: Extents, out: Any) -> Any:
        data = as_bytes(out, writable=True)
        check_extents(mapping, extents, data.nbytes)
        for offset, length, done in spans(extents):
            mapping.read_into(offset, data[done:done + length])
        return out

    def loaded_bytes(self, out: Any) -> memoryview:
        return as_bytes(out)

    def load_all(self, loads: Sequence[Load]) -> list[Exception | None]:
        errors: list[Exception | None] = []
        for mapping, extents, out in loads:
            try:
                self.load(mapping, extents, out)
                errors.append(None)
            except (TypeError, ValueError, OSError) as exc:  # OSError: the file was cut
                errors.append(exc)
        return errors
