"""The client's edge: protobuf messages to and from plain values, in one place.

As the daemon keeps protobuf in `ec_daemon.serving.wire`, the client keeps
it here: the session link converts each daemon message into `DaemonNews`
as it arrives and each `Outgoing` into a ClientMessage as it leaves, and the
saver's unary calls are built and read here too; nothing else in ec_client
imports the generated stubs (tests/unit/test_import_graph.py holds it).
The plain values keep the messages' field names (`mm_hash`, `entry_id`,
`wants`, `releases`...), so code and logs read as the protocol does.

Why convert at all: a message's fields are read on the link's thread and
the engine's, and a protobuf message is neither typed for mypy nor cheap to
read field by field; a NamedTuple is both. Unknown enum values from a newer
daemon stay ints (compared, never converted), as proto3 keeps them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ec_client.common.contract import RegionInfo
from ec_protocol.protocol import PROTOCOL_VERSION, ROLES, Layout, Role, pb


class Verdict(enum.IntEnum):
    """The daemon's answer to a want (pb.Verdict)."""

    UNANSWERED = pb.VERDICT_UNSPECIFIED
    ENCODE = pb.VERDICT_ENCODE
    READY = pb.VERDICT_READY
    PROMOTING = pb.VERDICT_PROMOTING
    ENCODING = pb.VERDICT_ENCODING


def verdict_name(verdict: int) -> str:
    """A verdict as logs name it (pb's name; a newer daemon's unknown one by number)."""
    try:
        return pb.Verdict.Name(verdict)
    except ValueError:
        return f"verdict {verdict}"


class AllocStatus(enum.IntEnum):
    """What a save's allocation got (pb.AllocStatus)."""

    UNSPECIFIED = pb.ALLOC_STATUS_UNSPECIFIED
    ALLOCATED = pb.ALLOCATED
    ALREADY_PENDING = pb.ALREADY_PENDING
    ALREADY_READY = pb.ALREADY_READY
    ALREADY_HIDDEN = pb.ALREADY_HIDDEN


class ReportStatus(enum.IntEnum):
    """What a save's report got (pb.ReportStatus)."""

    UNSPECIFIED = pb.REPORT_STATUS_UNSPECIFIED
    ACCEPTED = pb.ACCEPTED
    DUPLICATE = pb.DUPLICATE
    UNKNOWN = pb.UNKNOWN


# ------------------------------------------------------------ daemon to client

class EntryRef(NamedTuple):
    mm_hash: str
    entry_id: int


class EntryInfo(NamedTuple):
    """A ready entry: where its bytes are and what they are."""

    mm_hash: str
    entry_id: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    extents: tuple[tuple[int, int], ...]  # (offset, length)
    checksum: int


class Answer(NamedTuple):
    mm_hash: str
    verdict: int  # a Verdict (or a newer daemon's unknown one)


class NamespaceInfo(NamedTuple):
    engines: int
    remote_tier: bool


class EngineRanks(NamedTuple):
    mapped: int
    world_size: int


class SaveAllocation(NamedTuple):
    """A save's allocation: on the stream (by request id) or an Allocate reply."""

    request_id: int
    status: int  # an AllocStatus
    entry_id: int
    extents: tuple[tuple[int, int], ...]
    error_code: int = 0  # a gRPC status code: the daemon refused it
    error: str = ""


class SaveReported(NamedTuple):
    request_id: int
    status: int  # a ReportStatus


@dataclass(frozen=True)
class DaemonNews:
    """One DaemonMessage, as plain values."""

    ready: Sequence[EntryInfo] = ()
    evicted: Sequence[EntryRef] = ()
    snapshot_done: bool = False
    heartbeat_seq: int = 0
    answers: Sequence[Answer] = ()
    namespace_info: NamespaceInfo | None = None
    ranks: EngineRanks | None = None
    allocations: Sequence[SaveAllocation] = ()
    reported: Sequence[SaveReported] = ()


def _extents(extents: Any) -> tuple[tuple[int, int], ...]:
    return tuple((e.offset, e.length) for e in extents)


def _allocation(answer: Any) -> SaveAllocation:
    # (an AllocateReply has no request id nor error: a refusal is the call's status)
    return SaveAllocation(getattr(answer, "request_id", 0), answer.status, answer.entry_id,
                          _extents(answer.extents), getattr(answer, "error_code", 0),
                          getattr(answer, "error", ""))


def daemon_news(message: Any) -> DaemonNews:
    """A DaemonMessage as plain values."""
    info = message.namespace_info if message.HasField("namespace_info") else None
    ranks = message.ranks if message.HasField("ranks") else None
    return DaemonNews(
        ready=[EntryInfo(i.mm_hash, i.entry_id, i.nbytes, tuple(i.shape), i.dtype,
                         _extents(i.extents), i.checksum) for i in message.ready],
        evicted=[EntryRef(r.mm_hash, r.entry_id) for r in message.evicted],
        snapshot_done=message.snapshot_done, heartbeat_seq=message.heartbeat_seq,
        answers=[Answer(a.mm_hash, a.verdict) for a in message.answers],
        namespace_info=None if info is None else NamespaceInfo(info.engines, info.remote_tier),
        ranks=None if ranks is None else EngineRanks(ranks.mapped, ranks.world_size),
        allocations=[_allocation(a) for a in message.allocations],
        reported=[SaveReported(r.request_id, r.status) for r in message.reported])


# ------------------------------------------------------------ client to daemon

class Touch(NamedTuple):
    mm_hash: str
    entry_id: int
    loads: int


class SaveAllocate(NamedTuple):
    """A save asked for on the stream (as an Allocate call would)."""

    request_id: int
    mm_hash: str
    nbytes: int
    shape: Sequence[int]
    dtype: str


class SaveReport(NamedTuple):
    """A save reported on the stream: landed (`saved`, with its checksum) or given up."""

    mm_hash: str
    saved: bool
    request_id: int = 0
    checksum: int = 0


@dataclass
class Heartbeat:
    lookups: int = 0
    hits: int = 0
    seq: int = 0  # set by the link as it sends it


@dataclass
class Outgoing:
    """One ClientMessage, as plain values (its fields' names)."""

    open_session_id: str = ""
    acks: list[EntryRef] = field(default_factory=list)
    touches: list[Touch] = field(default_factory=list)
    heartbeat: Heartbeat | None = None
    wants: list[str] = field(default_factory=list)
    holds: list[EntryRef] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    yields: list[str] = field(default_factory=list)
    allocations: list[SaveAllocate] = field(default_factory=list)
    reports: list[SaveReport] = field(default_factory=list)
    engine_token: str = ""
    mismatches: list[EntryRef] = field(default_factory=list)
    encoding: list[str] = field(default_factory=list)

    def merge(self, other: Outgoing) -> None:
        """`other`'s items added to these (its strings and heartbeat where set)."""
        for name in ("acks", "touches", "wants", "holds", "releases", "yields", "allocations",
                     "reports", "mismatches", "encoding"):
            getattr(self, name).extend(getattr(other, name))
        self.open_session_id = other.open_session_id or self.open_session_id
        self.engine_token = other.engine_token or self.engine_token
        self.heartbeat = other.heartbeat or self.heartbeat


def client_message(out: Outgoing) -> Any:
    """An Outgoing as the ClientMessage it stands for."""
    message = pb.ClientMessage(
        open_session_id=out.open_session_id, wants=out.wants, releases=out.releases,
        yields=out.yields, engine_token=out.engine_token, encoding=out.encoding,
        acks=[pb.EntryRef(mm_hash=h, entry_id=e) for h, e in out.acks],
        holds=[pb.EntryRef(mm_hash=h, entry_id=e) for h, e in out.holds],
        mismatches=[pb.EntryRef(mm_hash=h, entry_id=e) for h, e in out.mismatches],
        touches=[pb.Touch(mm_hash=h, entry_id=e, loads=n) for h, e, n in out.touches],
        allocations=[pb.SaveAllocate(request_id=a.request_id, mm_hash=a.mm_hash,
                                     nbytes=a.nbytes, shape=a.shape, dtype=a.dtype)
                     for a in out.allocations],
        reports=[pb.SaveReport(request_id=r.request_id, mm_hash=r.mm_hash, saved=r.saved,
                               checksum=r.checksum) for r in out.reports])
    if out.heartbeat is not None:
        beat = out.heartbeat
        message.heartbeat.CopyFrom(pb.Heartbeat(lookups=beat.lookups, hits=beat.hits,
                                                seq=beat.seq))
    return message


# ------------------------------------------------------------ the unary calls

@dataclass(frozen=True)
class Attachment:
    session_id: str
    index: int
    namespace: str
    region: RegionInfo
    lease_ms: int
    heartbeat_ms: int
    # the daemon takes saves on the stream (`ec_client.worker_side.stream_saves`)
    stream_saves: bool = False
    # the daemon takes a producer's wants and releases (its claims)
    producer_claims: bool = False


def attach_request(*, engine_id: str, role: Role, layout: Layout, client_name: str,
                   rank: int | None, world_size: int, engine_token: str) -> Any:
    """An AttachRequest: a scheduler's (`rank` None) or a worker rank's."""
    request = pb.AttachRequest(protocol_version=PROTOCOL_VERSION, engine_id=engine_id,
                               role=ROLES[role], layout=layout.to_pb(),
                               client_name=client_name, store_namespace=layout.store_namespace)
    if rank is None:
        request.scheduler.engine_token = engine_token
    else:
        request.worker.rank = rank
        request.worker.world_size = world_size
        request.worker.engine_token = engine_token
    return request


def with_engine_token(request: Any, token: str) -> Any:
    """A copy of a worker's AttachRequest presenting `token` (never changed in place)."""
    copy = pb.AttachRequest()
    copy.CopyFrom(request)
    copy.worker.engine_token = token
    return copy


def attachment_of(reply: Any) -> Attachment:
    """An AttachReply as the attachment it grants."""
    region = reply.region
    return Attachment(
        session_id=reply.session_id, index=reply.session_index, namespace=reply.namespace,
        region=RegionInfo(region.path, region.size_bytes, region.generation,
                          region.page_bytes, region.data_offset, region.canary),
        lease_ms=reply.lease_ms, heartbeat_ms=reply.heartbeat_ms,
        stream_saves=reply.stream_saves, producer_claims=reply.producer_claims)


def detach_request(session_id: str) -> Any:
    return pb.DetachRequest(session_id=session_id)


def allocate_request(session_id: str, mm_hash: str, nbytes: int, shape: Sequence[int],
                     dtype: str) -> Any:
    return pb.AllocateRequest(session_id=session_id, mm_hash=mm_hash, nbytes=nbytes,
                              shape=shape, dtype=dtype)


def allocated(reply: Any) -> SaveAllocation:
    """An AllocateReply as plain values."""
    return _allocation(reply)


def report_request(session_id: str, *, saved: Sequence[str] = (), aborted: Sequence[str] = (),
                   saved_checksums: Sequence[int] = ()) -> Any:
    return pb.ReportRequest(session_id=session_id, saved=saved, aborted=aborted,
                            saved_checksums=saved_checksums)


def report_statuses(reply: Any) -> list[int]:
    """A ReportReply's status of each `saved` key (ReportStatus values)."""
    return list(reply.saved)
