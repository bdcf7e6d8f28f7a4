"""A load's bytes checked against the checksum their writer recorded.

With `verify_checksum`, `WorkerDelegate.load` calls `checksum_holds` for a
load whose entry carries its writer's checksum, after its copy landed and
its stamps held: a process that rewrote the entry's bytes in the region (any
worker of any engine maps it read-write) fails the load instead of feeding
the model.

What is hashed depends on the backend. Where its outputs are host memory
(`cpu`) that is the output itself: what the model will read, exactly. On a
CUDA device it is the region's pages, read on the host where the stamps
were: that proves the pages held the entry's bytes once the copy had
landed, so a rewrite that was there when the copy read them (the case that
lasts: a scribbled entry) is caught; it does not prove what the device holds
if another process rewrote the pages during the copy and put them back
before this read (no host-side check can without reading the device copy).
"""

from __future__ import annotations

from typing import Any

from ec_client.common.contract import LoadSpec
from ec_client.copy import CopyBackend
from ec_client.copy.mapping import RegionDamaged, RegionMapping
from ec_protocol.checksums import checksum


def checksum_holds(backend: CopyBackend, spec: LoadSpec, out: Any,
                   mapping: RegionMapping) -> bool | RegionDamaged:
    """Do the bytes `backend` loaded into `out` (from `mapping`) hash to the
    entry's checksum? The error instead when the file ended under the read
    (a cut: the load fails, not as a mismatch)."""
    loaded = backend.loaded_bytes(out)
    if loaded is not None:
        return checksum((loaded,)) == spec.checksum
    # Read with pread, never through the mapping: a page another process
    # cut would make that a SIGBUS (RegionCut here, a failed load).
    try:
        return checksum(mapping.chunks(spec.extents)) == spec.checksum
    except RegionDamaged as exc:
        return exc
