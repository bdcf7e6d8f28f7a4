"""Views whose storage order is not their row-major order, for the copy
backends' tests (numpy arrays and torch tensors on the cpu backend; torch
tensors and CuPy arrays on the GPU ones)."""

from __future__ import annotations

import importlib
from typing import Any

VIEWS = ["transposed", "strided", "offset", "expanded"]


def non_contiguous(kind: str, array: Any) -> Any:
    """A view of a (rows, cols) array of `kind`: its storage order is not
    its row-major order (or, for `offset`, it starts mid-storage)."""
    if kind == "transposed":
        return array.T
    if kind == "strided":
        return array[:, ::2]
    if kind == "offset":
        return array[1:]
    if hasattr(array, "expand"):  # a torch tensor: one row broadcast to all
        return array[:1].expand(array.shape[0], -1)
    module = importlib.import_module(type(array).__module__.split(".")[0])  # numpy or cupy
    return module.broadcast_to(array[:1], array.shape)
