"""What the cache announces to session streams and answers to its callers,
and what a session stream brings in (`ClientMessage`).

Plain values: the service turns them into protobuf (`wire`), tests read them
directly. Those made for every save or entry are named tuples, the rest
frozen dataclasses: several are built per save, and a frozen dataclass's
`__init__` costs three times a tuple's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ec_daemon.core.records import Entry

Extent = tuple[int, int]  # (byte offset, byte length)


class ReadyEvent(NamedTuple):
    mm_hash: str
    entry_id: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    extents: tuple[Extent, ...]
    checksum: int = 0  # its writer's xxh3-64 of the bytes (0: none)


class EvictedEvent(NamedTuple):
    mm_hash: str
    entry_id: int


class ReadySnapshot:
    """A view's snapshot of ready entries in its outbox, made into ready
    events only as its stream sends them (`make`): a stream that is never
    read holds one reference per entry, not the events (16,384 entries x 100
    unread views took 464 MiB). The entries' key, id, size, shape, dtype and
    pages never change, so an event made later is the one made at open; one
    evicted meanwhile is followed by its evicted event, as at open."""

    __slots__ = ("_at", "_entries", "_make")

    def __init__(self, entries: list[Entry], make: Callable[[Entry], ReadyEvent]) -> None:
        self._entries = entries
        self._make = make
        self._at = 0

    def next(self) -> ReadyEvent | None:
        """The next ready event, None once all were made."""
        if self._at >= len(self._entries):
            return None
        self._at += 1
        return self._make(self._entries[self._at - 1])

    def __len__(self) -> int:
        """Events still to make."""
        return len(self._entries) - self._at


@dataclass(frozen=True)
class HeartbeatEcho:
    """The lease was renewed after the client sent heartbeat `seq`."""

    seq: int


@dataclass(frozen=True)
class SnapshotDoneEvent:
    pass


class Verdict(enum.Enum):
    """The answer to a wanted item (`convergence`)."""

    ENCODE = "encode"  # nobody has it or makes it: encode it (others may wait for you)
    READY = "ready"  # a ready event preceded the answer
    PROMOTING = "promoting"  # being fetched from the second tier: defer
    ENCODING = "encoding"  # another engine of this host encodes or saves it: defer


@dataclass(frozen=True)
class AnswerEvent:
    mm_hash: str
    verdict: Verdict


@dataclass(frozen=True)
class NamespaceInfoEvent:
    """Whether wanting items helps: another engine shares the namespace, or
    a second tier may hold what this host misses."""

    engines: int
    remote_tier: bool


@dataclass(frozen=True)
class RanksEvent:
    """To an engine's view: how many of its worker ranks mapped the region
    (hits are answered only once every loading rank has)."""

    mapped: int
    world_size: int  # the largest its worker sessions attached with; 0 with none


class AllocOutcome(enum.Enum):
    ALLOCATED = "allocated"
    ALREADY_PENDING = "already_pending"
    ALREADY_READY = "already_ready"
    ALREADY_HIDDEN = "already_hidden"
    # Victims are hidden and their pages come back once the views acknowledge:
    # ask again once pages came back (`CacheListener.pages_reclaimed`).
    WAIT = "wait"


class AllocResult(NamedTuple):
    outcome: AllocOutcome
    entry_id: int = 0
    extents: tuple[Extent, ...] = ()


@dataclass(frozen=True)
class Heartbeat:
    """`seq` to echo, and the lookups a view answered (and the hits among
    them) since its previous heartbeat."""

    seq: int
    lookups: int
    hits: int


class SaveAllocate(NamedTuple):
    """A worker's save asked for on its stream (as an Allocate call)."""

    request_id: int
    mm_hash: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


class SaveReport(NamedTuple):
    """A save that landed (`saved`) or was given up, on the stream;
    `request_id` 0 is not answered."""

    request_id: int
    mm_hash: str
    saved: bool
    checksum: int = 0  # with saved: the bytes' xxh3-64 its writer read back (0: none)


@dataclass(frozen=True)
class ClientMessage:
    """One message of a session stream (`wire.client_message`): entries
    acknowledged, held and touched (mm_hash, entry_id[, loads]), items
    wanted, released, yielded and being encoded, the heartbeat if it carries
    one, and a worker's saves (allocations asked for, reports), the engine
    token a worker presents."""

    acks: list[tuple[str, int]]
    holds: list[tuple[str, int]]
    touches: list[tuple[str, int, int]]
    wants: list[str]
    releases: list[str]
    yields: list[str]
    heartbeat: Heartbeat | None = None
    allocations: list[SaveAllocate] = field(default_factory=list)
    reports: list[SaveReport] = field(default_factory=list)
    engine_token: str = ""  # a worker joins its engine instance (`Cache.join`)
    # A view's report: these entries' bytes did not match their checksum
    # when its engine loaded them (`plane.verify`).
    mismatches: list[tuple[str, int]] = field(default_factory=list)
    # A view's engine encodes these items it was told to (`Convergence.started`).
    encoding: list[str] = field(default_factory=list)


class ReportStatus(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    UNKNOWN = "unknown"


class AllocationAnswer(NamedTuple):
    """To a worker's stream: the answer to its allocation `request_id`, the
    result or the error an Allocate call would have raised."""

    request_id: int
    result: AllocResult | None
    error: Exception | None = None


class ReportAnswer(NamedTuple):
    """To a worker's stream: the status of its report `request_id`."""

    request_id: int
    status: ReportStatus


class Resolution(enum.Enum):
    """How the second tier's resolution of a wanted key ended
    (`plane.second_tier.SecondTier.resolve`). The data plane and the tier
    (`remote`) both name it and neither imports the other: it sits below both."""

    FOUND = "found"  # the store holds it: promote (its size is `available`'s now)
    CLAIMED = "claimed"  # nobody holds it and this host claimed it: encode here
    ELSEWHERE = "elsewhere"  # another host claimed it: waiting for its value
    ABSENT = "absent"  # not held, not claimable (claims off, or waited past the claim)
    FAILED = "failed"  # the store could not say (down, slow): encode here


@dataclass(frozen=True)
class Fetched:
    """A value the second tier found (`plane.second_tier.SecondTier.fetch`):
    the tensor it holds, which pages are allocated for, and what its store's
    backend needs to write them (`fetch_into`): the payload, read and
    verified whole (Redis), or the header it is verified against on its way
    into the pages (Mooncake: ec-daemon's, beside the value; None for a
    value vLLM wrote, checked for its format only)."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    payload: tuple[memoryview, ...] = ()
    header: bytes | None = None
