"""The daemon's records: an entry, a session, and the state of an entry.

Nearly a leaf module: it imports nothing of the daemon but its limits, so the
cache, the session table, the invariant checker and the converters all
import it without cycles.
The fields are changed only by `Cache` (entries) and `SessionTable`/`Cache`
(sessions); everyone else reads them.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ec_daemon.core.limits import OUTBOX_MIN_EVENTS
from ec_protocol.protocol import LOADING_ROLES, SAVING_ROLES, SCHEDULER, WORKER, Component, Role

Key = tuple[str, str]  # (namespace, mm_hash)
Run = tuple[int, int]  # (first payload page, pages)



class State(enum.Enum):
    """An entry's state; the one name each state has in code, stats and docs."""

    PENDING = "pending"  # being written; invisible, owned by its writer's session
    READY = "ready"  # visible to views; evictable
    HIDDEN = "hidden"  # evicted; bytes intact until every awaited view acknowledged


# Never mutated: replaced by a real set on first use.
_EMPTY: Any = frozenset()


class Entry:
    """One cached encoder output. `state` changes only inside Cache."""

    __slots__ = ("ack_by", "awaiting", "checksum", "dtype", "entry_id", "key", "nbytes", "owner",
                 "pages", "runs", "shape", "state")

    def __init__(self, key: Key, entry_id: int, nbytes: int, shape: tuple[int, ...],
                 dtype: str, runs: list[Run], owner: Session | None) -> None:
        self.key = key
        self.entry_id = entry_id  # also the stamp of its pages
        self.nbytes = nbytes
        self.shape = shape
        self.dtype = dtype
        self.runs = runs
        self.pages = runs[0][1] if len(runs) == 1 else sum(n for _, n in runs)
        self.state = State.PENDING  # restore() sets an adopted entry's
        self.owner: Session | None = owner
        # Hidden entries only: the views (live or ghost) that still owe an
        # acknowledgement. Most entries never hide: share one empty set.
        self.awaiting: set[Session] = _EMPTY
        # Hidden entries a live view awaits: by when (monotonic) it must have
        # acknowledged (`reclamation.Acknowledgements.overdue_views`); 0 otherwise.
        self.ack_by = 0.0
        # The xxh3-64 of its bytes its writer reported (0: none).
        self.checksum = 0

    @property
    def mm_hash(self) -> str:
        return self.key[1]


def _noop() -> None:
    return None


@dataclass(eq=False)
class Session:
    """One attached client component: the scheduler side of an engine (it
    holds a view) or one worker rank (it saves)."""

    session_id: str
    index: int
    engine_id: str
    role: Role
    rank: int | None  # None for the scheduler side
    world_size: int
    namespace: str
    client_name: str
    created: float
    lease_deadline: float
    alive: bool = True
    # Why it ended, when the daemon ended it (its stream's last status says so).
    ended_why: str = ""
    # The engine instance it belongs to (`sessions.engine_key`): views count
    # the worker ranks of their own instance only, and it counts under it for
    # --max-sessions-per-engine and the pending-save quota.
    engine_key: str = ""
    # Its stream opened (`views.Views.open`): a view is subscribed from then on, a
    # worker has mapped the region (it opens its stream only after that).
    streaming: bool = False
    # Scheduler sessions: the highest entry id announced ready to it. As a
    # ghost it awaits only evictions of entries up to this one.
    seen_upto: int = 0
    # A scheduler session that ended without detaching: until this time
    # evictions still await it (its engine may still be loading).
    ghost_until: float | None = None
    # Hidden entries this (scheduler) session must still acknowledge.
    awaiting: set[Entry] = field(default_factory=set)
    # Worker sessions: keys allocated and not yet reported.
    pending: set[Key] = field(default_factory=set)
    pending_pages: int = 0  # their pages (`quotas`)
    # Events for the stream; `wake` tells the stream writer to look.
    outbox: deque[object] = field(default_factory=deque)  # what `serving.wire` converts
    outbox_limit: int = OUTBOX_MIN_EVENTS
    overflowed: bool = False
    wake: Callable[[], None] = _noop

    @property
    def is_scheduler(self) -> bool:
        return self.rank is None

    @property
    def is_ghost(self) -> bool:
        return self.ghost_until is not None

    @property
    def can_save(self) -> bool:
        return self.role in SAVING_ROLES

    @property
    def can_load(self) -> bool:
        return self.role in LOADING_ROLES

    @property
    def kind(self) -> Component:
        return SCHEDULER if self.rank is None else WORKER

    @property
    def component(self) -> str:
        """For logs and stats: `scheduler`, or `worker <rank>/<world size>`."""
        return SCHEDULER if self.rank is None else f"{WORKER} {self.rank}/{self.world_size}"

    def send(self, event: object) -> None:
        """Queue an event for the stream. Past `outbox_limit` the session is
        marked overflowed (the service detaches it) and events are dropped."""
        if self.overflowed or not self.alive:
            return
        if len(self.outbox) >= self.outbox_limit:
            self.overflowed = True
        else:
            self.outbox.append(event)
        self.wake()
