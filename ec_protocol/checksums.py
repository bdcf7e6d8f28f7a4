"""The checksum of an entry's bytes: what its writer reports, the daemon
records and sends with the entry, and a loader (or the daemon itself) checks.

xxh3-64 over the entry's bytes in payload order (its extents back to back),
the hash the second tier's values carry too (10-35 GB/s). 0 means "none"
(an entry whose writer computed none): a digest of 0 is reported as 1, so a
reader never mistakes a real checksum for none.

Both sides import this module: the worker's saver computes it from the
region after its copy landed, the daemon when a loader reports a mismatch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import xxhash

NONE = 0


def checksum(parts: Iterable[Any]) -> int:
    """The checksum of the concatenation of `parts` (bytes-like), never NONE."""
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest() or 1
