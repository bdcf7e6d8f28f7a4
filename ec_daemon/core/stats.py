"""One snapshot of the daemon's state, read by the Stats RPC and by the
Prometheus collector alike, so each figure is computed in one place (page
counts become bytes here and nowhere else).

Sessions are listed up to LISTED_SESSIONS (the oldest first) and counted in
full: the list must never outgrow a gRPC reply (4 MiB by default), whatever
the session caps allow. Namespaces likewise, up to LISTED_NAMESPACES, the
largest first: any client can save under as many namespaces as the region
has pages, each name up to 4 KiB, and each listed one is also a label set
of the Prometheus families per namespace."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from ec_daemon.core.cache import Cache
from ec_daemon.core.limits import LISTED_NAMESPACES, LISTED_SESSIONS
from ec_protocol.protocol import Component, Role

NO_LOOKUPS = {"hits": 0, "misses": 0, "loads": 0}


@dataclass(frozen=True)
class SessionSnapshot:
    index: int
    engine_id: str
    role: Role
    component: str
    namespace: str
    awaiting: int
    pending: int
    client_name: str
    age_s: float


@dataclass(frozen=True)
class NamespaceSnapshot:
    name: str
    entries: int
    bytes: int
    hits: int
    misses: int
    loads: int


@dataclass(frozen=True)
class Snapshot:
    capacity_bytes: int
    bytes_by_state: dict[str, int]  # free, pending, ready, hidden, quarantined
    ready_entries: int
    hidden_entries: int
    largest_free_bytes: int
    page_bytes: int
    counters: dict[str, int]
    namespaces: list[NamespaceSnapshot]  # the LISTED_NAMESPACES holding the most bytes
    sessions: list[SessionSnapshot]  # the first LISTED_SESSIONS
    ghost_sessions: int
    generation: int
    region_path: str
    uptime_s: float
    sessions_by_kind: dict[tuple[Role, Component], int] = field(default_factory=dict)
    # Open Watch calls (`watch`), and those dropped for reading too slowly.
    watchers: int = 0
    dropped_watchers: int = 0
    # One encode per item, promotions (`convergence`); the second tier (`remote`).
    convergence: dict[str, int] = field(default_factory=dict)
    remote_tier: dict[str, float] = field(default_factory=dict)
    sessions_total: int = 0  # live sessions, listed or not
    namespaces_total: int = 0  # namespaces in use or holding entries, listed or not
    # What this start found of the previous daemon's region (`adoption.Found`).
    adoption: dict[str, int] = field(default_factory=dict)

    @property
    def sessions_not_listed(self) -> int:
        return self.sessions_total - len(self.sessions)

    @property
    def namespaces_not_listed(self) -> int:
        return max(0, self.namespaces_total - len(self.namespaces))

    @property
    def used_bytes(self) -> int:
        return self.capacity_bytes - self.bytes_by_state["free"]


def take(cache: Cache, *, generation: int, region_path: str, started: float,
         convergence: dict[str, int] | None = None,
         remote_tier: dict[str, float] | None = None) -> Snapshot:
    """Read everything at once (on the daemon's event loop)."""
    page = cache.page_bytes
    free = cache.allocator.free_pages * page
    pending = cache.table.pending_pages * page
    hidden = cache.table.hidden_pages * page
    quarantined = cache.quarantine.pages * page
    now = time.monotonic()
    sessions = [SessionSnapshot(s.index, s.engine_id, s.role, s.component, s.namespace,
                                len(s.awaiting), len(s.pending), s.client_name, now - s.created)
                for s in itertools.islice(cache.sessions, LISTED_SESSIONS)]
    usage, counters = cache.table.usage, cache.table.counters
    # in use (counters from Attach) or holding entries (adopted ones too)
    names = counters.keys() | usage.keys()
    listed = heapq.nsmallest(  # the most bytes first, then by name: a stable order
        LISTED_NAMESPACES, names, key=lambda name: (-usage.get(name, (0, 0))[1], name))
    namespaces = []
    for name in listed:
        counts = counters.get(name, NO_LOOKUPS)
        entries, nbytes = usage.get(name, (0, 0))
        namespaces.append(NamespaceSnapshot(name, entries, nbytes, counts["hits"],
                                            counts["misses"], counts["loads"]))
    return Snapshot(
        capacity_bytes=cache.capacity_bytes,
        bytes_by_state={"free": free, "pending": pending, "hidden": hidden,
                        "quarantined": quarantined,
                        "ready": cache.capacity_bytes - free - pending - hidden - quarantined},
        ready_entries=cache.table.ready_entries, hidden_entries=cache.table.hidden_entries,
        largest_free_bytes=cache.allocator.largest_free_run * page, page_bytes=page,
        counters=dict(cache.counters), namespaces=namespaces, sessions=sessions,
        ghost_sessions=sum(1 for _ in cache.sessions.ghosts()), generation=generation,
        region_path=region_path, uptime_s=now - started,
        sessions_by_kind=dict(Counter((s.role, s.kind) for s in cache.sessions)),
        sessions_total=len(cache.sessions), namespaces_total=len(names),
        convergence=dict(convergence or {}), remote_tier=dict(remote_tier or {}))
