"""Copy backends: move payload bytes between a process's memory and the region.

A backend copies one call per contiguous run of extents (split at
pinned-memory chunks on CUDA, and batched where CUDA can) and returns only
once the bytes have landed; a step's loads go together (`load_all`: one
wait for all of them). Backends are loaded by name on first use, so
importing this package costs nothing: `cpu` (preadv/pwritev on the region
file; CI and CPU-only vLLM), and the CUDA backends (`torch`, `cupy`), which
share one copy path over a narrow seam to the CUDA runtime
(`ec_client.copy.cuda`). `auto` picks torch when CUDA is available, cpu
otherwise. No backend touches the region's pages with the CPU (a worker may
truncate the file: `mapping` says why); a custom backend that does risks
its process on every such cut.

A name of the form `package.module:ClassName` loads a custom backend: the
module is imported and the class (anything implementing `CopyBackend`) is
built without arguments, in every process that copies. For instance
`ec_daemon_copy_backend: "mycompany.ec_copy:PinnedBackend"`.

This package is the worker's data path, below `ec_client.worker_side`: the
region mapping (`mapping`) and the backends that copy through it. It never
imports the worker or scheduler side or the vLLM shell, and it keeps its
path, `ec_client.copy`, because custom backends name their interface here.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Protocol

from ec_client.common.limits import HOST_ALIGN
from ec_client.copy.mapping import RegionMapping
from ec_protocol.dtypes import ELEMENT_BYTES

Extents = Sequence[tuple[int, int]]
Load = tuple[RegionMapping, Extents, Any]  # a load: the mapping, its extents, the output
BACKENDS = ("auto", "cpu", "torch", "cupy")
# What every backend has: `CopyBackend`'s members, checked on custom ones.
INTERFACE = ("name", "device", "stats", "attach", "detach", "pinned", "empty", "prepare_save",
             "save", "load", "load_all", "loaded_bytes")


class CopyBackend(Protocol):
    name: str
    device: str  # where loaded outputs live, as torch names it: "cpu", "cuda:1"
    stats: Counter[str]  # the backend's own counters (pinning), reported with the worker's

    def attach(self, mapping: RegionMapping) -> None:
        """A new mapping (new daemon generation): register it if needed
        (CUDA backends register in the background)."""

    def detach(self, mapping: RegionMapping) -> None:
        """The mapping is going away (no copy of it runs): unregister it."""

    def pinned(self, mapping: RegionMapping) -> bool:
        """Whether all of `mapping` is registered as pinned host memory."""

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """An uninitialised output for a load, on `device`."""

    def prepare_save(self, source: Any) -> Any:
        """Called on the thread that produced `source`, before it is queued:
        whatever orders the later copy after the producing work (a CUDA event)."""

    def save(self, source: Any, mapping: RegionMapping, extents: Extents,
             ready: Any = None) -> None:
        """Copy all bytes of `source` into `extents`, in order, after `ready`;
        return when landed. The bytes are `source`'s in row-major order (what a
        reader of its shape and dtype expects): a non-contiguous source is made
        contiguous after `ready`, never copied in storage order."""

    def load(self, mapping: RegionMapping, extents: Extents, out: Any) -> Any:
        """Copy `extents` into `out` (contiguous, on `device`, whose byte size
        is their total; best made by `empty`); return `out` once the bytes
        landed. Raises TypeError for a non-contiguous `out` or one elsewhere,
        `mapping.RegionCut` (an OSError) when the file was cut short of them."""

    def load_all(self, loads: Sequence[Load]) -> list[Exception | None]:
        """Each load of a step, as `load` does it, returning once every copy
        that was made landed: per load None (its `out` holds the bytes) or
        the TypeError or ValueError that refused it, or the OSError
        (`mapping.RegionCut`) of a file another process cut under it (its
        `out` is garbage; the others go on)."""

    def loaded_bytes(self, out: Any) -> memoryview | None:
        """A loaded output's bytes as host memory, read without a copy, where
        this backend's outputs are host memory (`cpu`); None where they are
        not (CUDA): a loader that checks what it loaded reads the region's
        pages instead (`ec_client.worker_side.worker`)."""


def check_extents(mapping: RegionMapping, extents: Extents, nbytes: int) -> None:
    """Raise ValueError unless `extents` lie in the region and hold `nbytes`."""
    total = 0
    for offset, length in extents:
        mapping.check(offset, length)
        total += length
    if total != nbytes:
        raise ValueError(f"extents hold {total} bytes, the buffer {nbytes}")


def spans(extents: Extents) -> Iterator[tuple[int, int, int]]:
    """(region offset, length, offset in the buffer) of each contiguous run
    of `extents` (one that starts where the previous one ended is joined to
    it): the buffer holds the extents' bytes back to back, in order."""
    done = 0
    start = end = -1
    for offset, length in extents:
        if length <= 0:
            continue
        if offset == end:
            end += length
            continue
        if end > start >= 0:
            yield start, end - start, done
            done += end - start
        start, end = offset, offset + length
    if end > start >= 0:
        yield start, end - start, done


def get_backend(name: str) -> CopyBackend:
    """The backend called `name`: one of `BACKENDS`, or a custom class named
    `package.module:ClassName`. Raises ValueError for unknown or malformed
    names and ImportError when the backend's module (or library) is not
    installed or lacks the class."""
    if ":" in name:
        return _custom_backend(name)
    if name not in BACKENDS:
        raise ValueError(f"unknown copy backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "torch" if _cuda_available() else "cpu"
    module = importlib.import_module(f"ec_client.copy.{name}_backend")
    backend: CopyBackend = module.Backend()
    return backend


def _custom_backend(name: str) -> CopyBackend:
    module_name, _, class_name = name.partition(":")
    if not (class_name.isidentifier()
            and all(part.isidentifier() for part in module_name.split("."))):
        raise ValueError(f"malformed copy backend {name!r}: expected package.module:ClassName")
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ImportError(f"copy backend {name!r}: module {module_name} has no {class_name}")
    backend: CopyBackend = cls()
    # Checked once, here: a backend missing a part of the interface would
    # otherwise fail at an engine's first step, save or load.
    missing = [part for part in INTERFACE if not hasattr(backend, part)]
    if missing:
        raise TypeError(f"copy backend {name!r} lacks {', '.join(missing)} of the CopyBackend "
                        "interface (ec_client.copy.CopyBackend; a cpu_backend.Backend or "
                        "cuda.CudaBackend subclass has them all)")
    return backend


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def storage_of(obj: Any) -> tuple[Hashable, int]:
    """What keeping `obj` alive holds: a key naming its memory (a torch
    storage, numpy's base buffer) and that memory's bytes. A slice of a larger
    tensor keeps all of it; several slices of one output (vLLM splits a
    batch's encoder output per item) hold it once."""
    nbytes = describe(obj)[0]
    storage = getattr(obj, "untyped_storage", None)
    if storage is not None:  # torch
        whole = storage()
        return ("torch", str(obj.device), whole.data_ptr()), max(int(whole.nbytes()), nbytes)
    base = obj
    while getattr(base, "base", None) is not None:  # numpy views
        base = base.base
    held = getattr(base, "nbytes", None)
    return ("buffer", id(base)), max(int(held) if held is not None else 0, nbytes)


def describe(obj: Any) -> tuple[int, tuple[int, ...], str]:
    """(nbytes, shape, dtype name) of a numpy array or torch tensor.
    dtype names are torch's without the prefix: float16, bfloat16, uint8..."""
    shape = tuple(int(d) for d in obj.shape)
    dtype = str(obj.dtype).removeprefix("torch.")
    if hasattr(obj, "element_size"):
        nbytes = int(obj.numel()) * int(obj.element_size())
    else:
        nbytes = int(obj.nbytes)
    return nbytes, shape, dtype




def empty_host(shape: tuple[int, ...], dtype: str) -> Any:
    """An uninitialised host array, its first byte `HOST_ALIGN`-aligned:
    numpy where numpy knows the dtype, otherwise a CPU torch tensor
    (bfloat16, float8...; torch aligns its own). Only the types of
    `ec_protocol.dtypes` (the daemon accepts no others): ValueError else."""
    import numpy as np

    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")

    try:
        numpy_dtype = np.dtype(dtype)
    except TypeError:
        import torch

        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}") from None
        return torch.empty(shape, dtype=torch_dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * numpy_dtype.itemsize
    raw: Any = np.empty(nbytes + HOST_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % HOST_ALIGN
    return raw[start:start + nbytes].view(numpy_dtype).reshape(shape)
