"""Converters between protobuf messages and the core's plain values.

Protobuf stays at this edge: the core takes and returns Python values, the
service calls these to translate. Validation of request shape (lengths,
ranges) happens here too, before the core is asked anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict

import grpc

from ec_daemon.core.cache import Cache
from ec_daemon.core.events import (
    AllocationAnswer,
    AllocOutcome,
    AllocResult,
    AnswerEvent,
    ClientMessage,
    EvictedEvent,
    Heartbeat,
    HeartbeatEcho,
    NamespaceInfoEvent,
    RanksEvent,
    ReadyEvent,
    ReportAnswer,
    ReportStatus,
    SaveAllocate,
    SaveReport,
    SnapshotDoneEvent,
    Verdict,
)
from ec_daemon.core.limits import (
    DTYPE_RE,
    MAX_ID_CHARS,
    MAX_MODALITIES,
    MAX_MODALITY_CHARS,
    MAX_MODEL_CHARS,
    MAX_ROW_BYTES,
    MAX_WORLD_SIZE,
    validate_layout_namespace,
)
from ec_daemon.core.records import Entry, State
from ec_daemon.core.stats import Snapshot
from ec_daemon.errors import CacheError, InvalidArgument
from ec_daemon.plane.watch import Event, Kind
from ec_protocol.protocol import (
    MAX_BATCH,
    ROLE_NAMES,
    ROLES,
    WORKER,
    Role,
    engine_token_problem,
    pb,
    store_namespace_problem,
)

U64_MAX = 2**64 - 1

ALLOC_STATUS = {
    AllocOutcome.ALLOCATED: pb.ALLOCATED,
    AllocOutcome.ALREADY_PENDING: pb.ALREADY_PENDING,
    AllocOutcome.ALREADY_READY: pb.ALREADY_READY,
    AllocOutcome.ALREADY_HIDDEN: pb.ALREADY_HIDDEN,
}
REPORT_STATUS = {
    ReportStatus.ACCEPTED: pb.ACCEPTED,
    ReportStatus.DUPLICATE: pb.DUPLICATE,
    ReportStatus.UNKNOWN: pb.UNKNOWN,
}
ENTRY_STATE = {State.READY: pb.READY, State.HIDDEN: pb.HIDDEN}
VERDICT = {Verdict.ENCODE: pb.VERDICT_ENCODE, Verdict.READY: pb.VERDICT_READY,
           Verdict.PROMOTING: pb.VERDICT_PROMOTING, Verdict.ENCODING: pb.VERDICT_ENCODING}


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
    if len(layout.row_bytes) > MAX_MODALITIES:
        raise InvalidArgument(f"layout.row_bytes has more than {MAX_MODALITIES} modalities")
    widths = []
    for modality, width in sorted(layout.row_bytes.items()):
        _text(modality, "layout.row_bytes modality", MAX_MODALITY_CHARS)
        if not 0 < width <= MAX_ROW_BYTES:
            raise InvalidArgument(f"layout.row_bytes[{modality!r}] must be in 1..{MAX_ROW_BYTES}")
        widths.append(f"{modality}={width}")
    variant = _text(layout.variant, "layout.variant", MAX_ID_CHARS, required=False)
    return validate_layout_namespace("|".join((model, layout.dtype, ",".join(widths), variant)))


class AttachFields(TypedDict):
    """What an AttachRequest asks, checked: `DataPlane.attach`'s arguments."""

    engine_id: str
    role: Role
    rank: int | None
    world_size: int
    engine_token: str
    namespace: str
    client_name: str
    store_namespace: str


def attach_fields(request: Any) -> AttachFields:
    """`DataPlane.attach`'s arguments from an AttachRequest."""
    role = ROLE_NAMES.get(request.role)
    if role is None:
        raise InvalidArgument("role must be PRODUCER, CONSUMER or BOTH")
    which = request.WhichOneof("component")
    if which is None:
        raise InvalidArgument("component must be scheduler or worker")
    rank: int | None = None
    world_size = 1
    component = request.worker if which == WORKER else request.scheduler
    token = _engine_token(component.engine_token, f"{which}.engine_token")
    if which == WORKER:
        world_size = request.worker.world_size
        rank = request.worker.rank
        if not 0 < world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"worker.world_size must be in 1..{MAX_WORLD_SIZE}")
        if rank >= world_size:
            raise InvalidArgument(f"worker.rank {rank} is not below world_size {world_size}")
    if not request.HasField("layout"):
        raise InvalidArgument("layout is missing")
    return AttachFields(
        engine_id=_text(request.engine_id, "engine_id", MAX_ID_CHARS),
        role=role,
        rank=rank,
        world_size=world_size,
        engine_token=token,
        namespace=namespace_of(request.layout),
        client_name=_text(request.client_name, "client_name", MAX_ID_CHARS, required=False),
        store_namespace=_store_namespace(request.store_namespace),
    )


def watch_engine(request: Any) -> tuple[str, str]:
    """The engine id and token a WatchRequest presents (both or none)."""
    engine_id = _text(request.engine_id, "engine_id", MAX_ID_CHARS, required=False)
    token = _engine_token(request.engine_token, "engine_token")
    if bool(engine_id) != bool(token):
        raise InvalidArgument("a watch presents an engine's id and token together, or neither")
    return engine_id, token


def _engine_token(token: str, what: str) -> str:
    problem = engine_token_problem(token)
    if problem is not None:
        raise InvalidArgument(f"{what}: {problem}")
    return token


def _store_namespace(value: str) -> str:
    problem = store_namespace_problem(value)
    if problem is not None:
        raise InvalidArgument(problem)
    return value


def saved_checksums(request: Any) -> list[int]:
    """A Report call's checksums of its saved entries: none, or one each."""
    sums = list(request.saved_checksums)
    if sums and len(sums) != len(request.saved):
        raise InvalidArgument(f"saved_checksums has {len(sums)} values for {len(request.saved)} "
                              "saved entries: give one each, or none")
    return sums


def batch(values: Any, what: str) -> list[Any]:
    if len(values) > MAX_BATCH:
        raise InvalidArgument(f"{what} has more than {MAX_BATCH} items")
    return list(values)


def refs(values: Any, what: str) -> list[tuple[str, int]]:
    """(mm_hash, entry_id) pairs of repeated EntryRef, bounded."""
    return [(r.mm_hash, r.entry_id) for r in batch(values, what)]


def touches(values: Any) -> list[tuple[str, int, int]]:
    """(mm_hash, entry_id, loads) of repeated Touch, bounded (0 loads is 1)."""
    return [(t.mm_hash, t.entry_id, max(1, t.loads)) for t in batch(values, "touches")]


def client_message(message: Any) -> ClientMessage:
    """A ClientMessage of the session stream, bounded (raises InvalidArgument)."""
    beat = message.heartbeat if message.HasField("heartbeat") else None
    if beat is not None and beat.hits > beat.lookups:
        raise InvalidArgument("heartbeat counters must satisfy hits <= lookups")
    return ClientMessage(
        acks=refs(message.acks, "acks"), holds=refs(message.holds, "holds"),
        touches=touches(message.touches), wants=batch(message.wants, "wants"),
        releases=batch(message.releases, "releases"), yields=batch(message.yields, "yields"),
        heartbeat=None if beat is None else Heartbeat(beat.seq, beat.lookups, beat.hits),
        allocations=save_allocations(message.allocations),
        reports=[SaveReport(r.request_id, r.mm_hash, r.saved, r.checksum)
                 for r in batch(message.reports, "reports")],
        engine_token=_engine_token(message.engine_token, "engine_token"),
        mismatches=refs(message.mismatches, "mismatches"),
        encoding=batch(message.encoding, "encoding"))


def save_allocations(values: Any) -> list[SaveAllocate]:
    """A stream's allocations, bounded; each must carry a request id."""
    allocations = []
    for a in batch(values, "allocations"):
        if not a.request_id:
            raise InvalidArgument("an allocation on the stream needs a request_id (not 0)")
        allocations.append(SaveAllocate(a.request_id, a.mm_hash, a.nbytes, tuple(a.shape),
                                        a.dtype))
    return allocations


def extents(values: tuple[tuple[int, int], ...]) -> list[Any]:
    return [pb.Extent(offset=o, length=n) for o, n in values]


def lookup_result(cache: Cache, entry: Entry | None) -> Any:
    if entry is None:
        return pb.LookupResult(state=pb.ABSENT)
    info = pb.EntryInfo(mm_hash=entry.mm_hash, entry_id=entry.entry_id, nbytes=entry.nbytes,
                        shape=entry.shape, dtype=entry.dtype, extents=extents(cache.extents(entry)),
                        checksum=entry.checksum)
    return pb.LookupResult(state=ENTRY_STATE[entry.state], entry=info,
                           awaiting=len(entry.awaiting))


def alloc_reply(result: AllocResult) -> Any:
    return pb.AllocateReply(status=ALLOC_STATUS[result.outcome], entry_id=result.entry_id,
                            extents=extents(result.extents))


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The status a call failing with `exc` ends with: a CacheError's own,
    INTERNAL for anything else."""
    return getattr(grpc.StatusCode, exc.code) if isinstance(exc, CacheError) \
        else grpc.StatusCode.INTERNAL


def _add_ready(message: Any, event: ReadyEvent) -> None:
    message.ready.append(pb.EntryInfo(
        mm_hash=event.mm_hash, entry_id=event.entry_id, nbytes=event.nbytes, shape=event.shape,
        dtype=event.dtype, extents=extents(event.extents), checksum=event.checksum))


def _add_evicted(message: Any, event: EvictedEvent) -> None:
    message.evicted.append(pb.EntryRef(mm_hash=event.mm_hash, entry_id=event.entry_id))


def _add_echo(message: Any, event: HeartbeatEcho) -> None:
    message.heartbeat_seq = max(message.heartbeat_seq, event.seq)


def _add_snapshot_done(message: Any, event: SnapshotDoneEvent) -> None:
    message.snapshot_done = True


def _add_answer(message: Any, event: AnswerEvent) -> None:
    message.answers.add(mm_hash=event.mm_hash, verdict=VERDICT[event.verdict])


def _add_namespace_info(message: Any, event: NamespaceInfoEvent) -> None:  # the latest wins
    message.namespace_info.engines = event.engines
    message.namespace_info.remote_tier = event.remote_tier


def _add_ranks(message: Any, event: RanksEvent) -> None:  # the latest wins
    message.ranks.mapped = event.mapped
    message.ranks.world_size = event.world_size


def _add_allocation(message: Any, answer: AllocationAnswer) -> None:
    result, error = answer.result, answer.error
    if result is not None:
        added = message.allocations.add(request_id=answer.request_id,
                                        status=ALLOC_STATUS[result.outcome],
                                        entry_id=result.entry_id)
        add_extent = added.extents.add  # in place: no pb.Extent built to be copied
        for offset, length in result.extents:
            add_extent(offset=offset, length=length)
    elif error is not None:
        message.allocations.add(request_id=answer.request_id,
                                error_code=status_code(error).value[0], error=str(error))


def _add_reported(message: Any, answer: ReportAnswer) -> None:
    message.reported.add(request_id=answer.request_id, status=REPORT_STATUS[answer.status])


# How each event goes into a DaemonMessage, by its exact type (a dict
# lookup: a save's answers are most of the events and were last in an
# isinstance chain).
_ADD: dict[type, Callable[[Any, Any], None]] = {
    ReadyEvent: _add_ready, EvictedEvent: _add_evicted, HeartbeatEcho: _add_echo,
    SnapshotDoneEvent: _add_snapshot_done, AnswerEvent: _add_answer,
    NamespaceInfoEvent: _add_namespace_info, RanksEvent: _add_ranks,
    AllocationAnswer: _add_allocation, ReportAnswer: _add_reported,
}


def daemon_message(events: list[Any]) -> Any:
    """One stream message carrying `events`, in order of kind (never reordered
    within a kind: a view applies ready, then evicted)."""
    message = pb.DaemonMessage()
    for event in events:
        _ADD[type(event)](message, event)
    return message


def _ready_size(event: ReadyEvent) -> int:
    return 74 + len(event.mm_hash) + len(event.dtype) + 11 * len(event.shape) \
        + 24 * len(event.extents)


def _allocation_size(event: AllocationAnswer) -> int:
    return 32 + (24 * len(event.result.extents) if event.result is not None
                 else len(str(event.error)))


_SIZE: dict[type, Callable[[Any], int]] = {
    ReadyEvent: _ready_size, AllocationAnswer: _allocation_size,
    EvictedEvent: lambda event: 24 + len(event.mm_hash),
    AnswerEvent: lambda event: 24 + len(event.mm_hash),
}


def event_size(event: Any) -> int:
    """An upper estimate of an event's encoded size, to cap messages."""
    size = _SIZE.get(type(event))
    return 12 if size is None else size(event)


def _saturated(counter: int) -> int:
    """A counter as a uint64 field: clients report lookups on their heartbeats,
    and a bogus report must not make every later Stats fail."""
    return min(counter, U64_MAX)


def stats_reply(snapshot: Snapshot, region: Any) -> Any:
    s = snapshot
    by_state = s.bytes_by_state
    reply = pb.StatsReply(
        capacity_bytes=s.capacity_bytes, used_bytes=s.used_bytes, free_bytes=by_state["free"],
        pending_bytes=by_state["pending"], hidden_bytes=by_state["hidden"],
        quarantined_bytes=by_state["quarantined"], entries=s.ready_entries,
        hidden_entries=s.hidden_entries, sessions=s.sessions_total,
        sessions_not_listed=s.sessions_not_listed, namespaces_not_listed=s.namespaces_not_listed,
        ghost_sessions=s.ghost_sessions, page_bytes=s.page_bytes, generation=region.generation,
        region_path=region.path, uptime_s=s.uptime_s, largest_free_bytes=s.largest_free_bytes)
    for name, value in s.counters.items():
        setattr(reply, name, _saturated(value))
    reply.watchers, reply.dropped_watchers = s.watchers, s.dropped_watchers
    for name, value in s.convergence.items():
        reply.convergence[name] = _saturated(value)
    for name, number in s.remote_tier.items():
        reply.remote_tier[name] = float(number)
    for name, value in s.adoption.items():
        reply.adoption[name] = value
    for ns in s.namespaces:
        reply.namespaces.add(namespace=ns.name, entries=ns.entries, bytes=ns.bytes,
                             hits=_saturated(ns.hits), misses=_saturated(ns.misses),
                             loads=_saturated(ns.loads))
    for x in s.sessions:
        reply.session_list.add(
            session_index=x.index, engine_id=x.engine_id, role=ROLES[x.role],
            component=x.component, namespace=x.namespace, awaiting=x.awaiting,
            pending=x.pending, client_name=x.client_name, age_s=x.age_s)
    return reply


WATCH_KIND = {Kind.STORED: pb.WatchEvent.STORED, Kind.EVICTED: pb.WatchEvent.EVICTED}


def watch_message(generation: int, events: list[Event], snapshot_done: bool) -> Any:
    """One Watch message: `events` in order, and whether it completes the snapshot."""
    message = pb.WatchMessage(generation=generation, snapshot_done=snapshot_done)
    add = message.events.add
    for kind, entry, time_ns in events:
        add(kind=WATCH_KIND[kind], namespace=entry.key[0], mm_hash=entry.key[1],
            entry_id=entry.entry_id, nbytes=entry.nbytes, shape=entry.shape, dtype=entry.dtype,
            time_unix_ns=time_ns)
    return message
