"""Byte sizes as people write and read them: `parse_size` for flags and
settings, `format_size` for logs and errors.

A leaf module of the protocol: the daemon's settings, region files, adoption
and CLI, and the connector's extra-config keys all speak sizes, and none of
them should import another's concern to do so (one size syntax for both).
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2,
    "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """`64GiB` -> 68719476736. Raises ValueError with the accepted forms."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: use a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB), e.g. 512MiB or 64GiB"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value != int(value):
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """68719476736 -> '64 GiB' (exact when a unit divides evenly)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if n % scale == 0 else f"{value:.2f} {unit}"
    return f"{n} B"
