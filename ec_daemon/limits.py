"""Limits on what a request may ask, checked before anything is allocated.

Every key, size and shape a client sends is bounded here, so no request can
make the daemon allocate memory it did not mean to (a huge key, a negative
size, a shape that does not match its bytes). Raising means nothing changed.
"""

from __future__ import annotations

import re

from ec_daemon.errors import InvalidArgument

MAX_KEY_BYTES = 512
MAX_DIMS = 8
MAX_ELEMENT_BYTES = 16
DTYPE_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")


def validate_mm_hash(mm_hash: str) -> None:
    if not mm_hash:
        raise InvalidArgument("mm_hash is empty")
    if len(mm_hash.encode()) > MAX_KEY_BYTES:
        raise InvalidArgument(f"mm_hash is longer than {MAX_KEY_BYTES} bytes")


def validate_save(mm_hash: str, nbytes: int, shape: tuple[int, ...], dtype: str) -> None:
    """Raise unless an entry described so may be saved."""
    validate_mm_hash(mm_hash)
    if nbytes <= 0:
        raise InvalidArgument(f"nbytes must be positive, got {nbytes}")
    if not shape or len(shape) > MAX_DIMS or any(d <= 0 for d in shape):
        raise InvalidArgument(f"shape must have 1..{MAX_DIMS} positive dims, got {shape}")
    elements = 1
    for d in shape:
        elements *= d
    if nbytes % elements or nbytes // elements > MAX_ELEMENT_BYTES:
        raise InvalidArgument(
            f"nbytes {nbytes} does not match shape {shape} (1..16 bytes per element)")
    if not DTYPE_RE.match(dtype):
        raise InvalidArgument(f"dtype must be 1..32 letters, digits or _, got {dtype!r}")
