"""The element types an entry may have, and the bytes of one element.

One table for both packages: the daemon refuses a save whose dtype is not
here, or whose bytes are not its shape's elements times this size
(INVALID_ARGUMENT), and never adopts such a record from an index; the
worker's loaders make their outputs only of these types. So an entry the
daemon accepted is one every loader can read back: a bogus dtype or size
can no longer be saved for another engine to fail on.

Names are torch's without the `torch.` prefix (numpy names the types both
share alike): what `ec_client.copy.describe` reports for a tensor or array.
"""

from __future__ import annotations

from collections.abc import Sequence

ELEMENT_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


def entry_problem(nbytes: int, shape: Sequence[int], dtype: str) -> str | None:
    """Why an entry of `nbytes` bytes of `shape` and `dtype` cannot be read
    back by a loader, or None. Checks the type and the size only (the shape's
    own bounds are the daemon's: `ec_daemon.core.limits`)."""
    size = ELEMENT_BYTES.get(dtype)
    if size is None:
        return (f"dtype {dtype[:40]!r} is not one loaders make (one of "
                f"{', '.join(ELEMENT_BYTES)})")
    elements = 1
    for d in shape:
        elements *= d
    if nbytes != elements * size:
        return (f"nbytes {nbytes} is not shape {tuple(shape)} x {size} bytes of {dtype} "
                f"({elements * size})")
    return None
