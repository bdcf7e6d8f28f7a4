"""Converters between protobuf messages and the core's plain values.

Protobuf stays at this edge: the core takes and returns Python values, the
service calls these to translate. Validation of request shape (lengths,
ranges) happens here too, before the core is asked anything.
"""

from __future__ import annotations

from typing import Any

from ec_daemon.cache import Cache, Entry
from ec_daemon.errors import InvalidArgument
from ec_daemon.events import (
    AllocOutcome,
    AllocResult,
    EvictedEvent,
    PinFailedEvent,
    ReadyEvent,
    ReportStatus,
    SnapshotDoneEvent,
    Verdict,
)
from ec_daemon.limits import DTYPE_RE
from ec_protocol.protocol import ROLE_NAMES, pb

MAX_ID_CHARS = 256
MAX_MODEL_CHARS = 512
MAX_BATCH = 4096
MAX_WORLD_SIZE = 4096

ALLOC_STATUS = {
    AllocOutcome.ALLOCATED: pb.ALLOCATED,
    AllocOutcome.ALREADY_PENDING: pb.ALREADY_PENDING,
    AllocOutcome.ALREADY_READY: pb.ALREADY_READY,
    AllocOutcome.EVICTING: pb.EVICTING,
}
REPORT_STATUS = {
    ReportStatus.ACCEPTED: pb.ACCEPTED,
    ReportStatus.DUPLICATE: pb.DUPLICATE,
    ReportStatus.UNKNOWN: pb.UNKNOWN,
}
VERDICT = {
    Verdict.HELD: pb.HELD,
    Verdict.NOT_HELD: pb.NOT_HELD,
    Verdict.REPORTED_ALREADY: pb.REPORTED_ALREADY,
}


def _text(value: str, what: str, limit: int, *, required: bool = True) -> str:
    if required and not value:
        raise InvalidArgument(f"{what} is empty")
    if len(value) > limit:
        raise InvalidArgument(f"{what} is longer than {limit} characters")
    return value


def namespace_of(layout: Any) -> str:
    """The namespace name of a layout fingerprint (canonical, readable)."""
    model = _text(layout.model, "layout.model", MAX_MODEL_CHARS)
    if not DTYPE_RE.match(layout.dtype):
        raise InvalidArgument(f"layout.dtype must be 1..32 letters, digits or _, "
                              f"got {layout.dtype!r}")
    if len(layout.row_bytes) > 64:
        raise InvalidArgument("layout.row_bytes has more than 64 modalities")
    widths = []
    for modality, width in sorted(layout.row_bytes.items()):
        _text(modality, "layout.row_bytes modality", 64)
        if not 0 < width <= 1 << 32:
            raise InvalidArgument(f"layout.row_bytes[{modality!r}] must be in 1..2**32")
        widths.append(f"{modality}={width}")
    variant = _text(layout.variant, "layout.variant", MAX_ID_CHARS, required=False)
    return "|".join((model, layout.dtype, ",".join(widths), variant))


def attach_fields(request: Any) -> dict[str, Any]:
    """Keyword arguments of Cache.attach from an AttachRequest."""
    role = ROLE_NAMES.get(request.role)
    if role is None:
        raise InvalidArgument("role must be PRODUCER, CONSUMER or BOTH")
    which = request.WhichOneof("component")
    if which is None:
        raise InvalidArgument("component must be scheduler or worker")
    rank: int | None = None
    world_size = 1
    if which == "worker":
        world_size = request.worker.world_size
        rank = request.worker.rank
        if not 0 < world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"worker.world_size must be in 1..{MAX_WORLD_SIZE}")
        if rank >= world_size:
            raise InvalidArgument(f"worker.rank {rank} is not below world_size {world_size}")
    if not request.HasField("layout"):
        raise InvalidArgument("layout is missing")
    return {
        "engine_id": _text(request.engine_id, "engine_id", MAX_ID_CHARS),
        "role": role,
        "rank": rank,
        "world_size": world_size,
        "namespace": namespace_of(request.layout),
        "client_name": _text(request.client_name, "client_name", MAX_ID_CHARS, required=False),
    }


def batch(values: Any, what: str) -> list[Any]:
    if len(values) > MAX_BATCH:
        raise InvalidArgument(f"{what} has more than {MAX_BATCH} items")
    return list(values)


def extents(values: tuple[tuple[int, int], ...]) -> list[Any]:
    return [pb.Extent(offset=o, length=n) for o, n in values]


def entry_info(cache: Cache, entry: Entry) -> Any:
    return pb.EntryInfo(mm_hash=entry.mm_hash, entry_id=entry.entry_id, nbytes=entry.nbytes,
                        shape=entry.shape, dtype=entry.dtype, extents=extents(cache.extents(entry)))


def alloc_reply(result: AllocResult) -> Any:
    return pb.AllocateReply(status=ALLOC_STATUS[result.outcome], entry_id=result.entry_id,
                            extents=extents(result.extents))


def daemon_message(events: list[Any]) -> Any:
    """One stream message carrying `events`, in order of kind (never reordered
    within a kind: a view applies ready, then evicted)."""
    message = pb.DaemonMessage()
    for event in events:
        if isinstance(event, ReadyEvent):
            message.ready.append(pb.EntryInfo(
                mm_hash=event.mm_hash, entry_id=event.entry_id, nbytes=event.nbytes,
                shape=event.shape, dtype=event.dtype, extents=extents(event.extents)))
        elif isinstance(event, EvictedEvent):
            message.evicted.append(pb.EntryRef(mm_hash=event.mm_hash, entry_id=event.entry_id))
        elif isinstance(event, PinFailedEvent):
            message.pin_failures.append(
                pb.PinFailure(transfer_id=event.transfer_id, reason=event.reason))
        elif isinstance(event, SnapshotDoneEvent):
            message.snapshot_done = True
    return message


def event_size(event: Any) -> int:
    """An upper estimate of an event's encoded size, to cap messages."""
    if isinstance(event, ReadyEvent):
        return 64 + len(event.mm_hash) + len(event.dtype) + 11 * len(event.shape) \
            + 24 * len(event.extents)
    if isinstance(event, EvictedEvent):
        return 24 + len(event.mm_hash)
    if isinstance(event, PinFailedEvent):
        return 24 + len(event.reason)
    return 8
