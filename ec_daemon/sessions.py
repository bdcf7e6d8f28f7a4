"""Client sessions: who is attached, what each one holds, and their leases.

A session is one attached client process component: the scheduler side of an
engine, or one worker rank. It owns what it took (pins for scheduler sessions,
pending saves for worker sessions) and the acknowledgements it still owes; the
cache releases all of it when the session ends (`Cache.end_session`). The
session stream is its liveness: a broken stream ends it at once, and a lease
(renewed by any stream message) ends one whose client hangs.

Session ids are secret bearer tokens; session indexes are small numbers that
prefix the session's transfer ids and start at a random value per daemon, so
ids minted under an earlier daemon do not name a live session by accident.
"""

from __future__ import annotations

import secrets
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ec_daemon.errors import NotFound

if TYPE_CHECKING:
    from ec_daemon.cache import Entry, Transfer

ROLES = ("producer", "consumer", "both")


def _noop() -> None:
    return None


@dataclass(eq=False)
class Session:
    session_id: str
    index: int
    engine_id: str
    role: str
    rank: int | None  # None for the scheduler side
    world_size: int
    namespace: str
    client_name: str
    created: float
    lease_deadline: float
    alive: bool = True
    streaming: bool = False
    # Scheduler sessions: pins by transfer id, and the highest transfer
    # counter seen on the stream (pins arrive in order).
    pins: dict[int, Transfer] = field(default_factory=dict)
    max_transfer: int = 0
    # Transfer ids whose report gave up waiting for the pin: refuse the pin.
    abandoned: set[int] = field(default_factory=set)
    # Hidden entries this session must still acknowledge.
    awaiting: set[Entry] = field(default_factory=set)
    # Worker sessions: keys allocated and not yet reported.
    pending: set[tuple[str, str]] = field(default_factory=set)
    # Events for the stream; `wake` tells the stream writer to look.
    outbox: deque[Any] = field(default_factory=deque)
    wake: Callable[[], None] = _noop

    @property
    def is_scheduler(self) -> bool:
        return self.rank is None

    @property
    def can_save(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def can_load(self) -> bool:
        return self.role in ("consumer", "both")

    @property
    def component(self) -> str:
        return "scheduler" if self.rank is None else f"worker {self.rank}/{self.world_size}"

    def send(self, event: Any) -> None:
        self.outbox.append(event)
        self.wake()


class SessionTable:
    """Live sessions, indexed by id, index, namespace and engine rank."""

    def __init__(self, lease_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_seconds = lease_seconds
        self.clock = clock
        self._by_id: dict[str, Session] = {}
        self._by_index: dict[int, Session] = {}
        self._subscribers: dict[str, set[Session]] = defaultdict(set)
        self._ranks: dict[str, dict[int, set[Session]]] = defaultdict(lambda: defaultdict(set))
        self._next_index = secrets.randbits(31) + 1

    def create(self, *, engine_id: str, role: str, rank: int | None, world_size: int,
               namespace: str, client_name: str) -> Session:
        now = self.clock()
        session = Session(
            session_id=secrets.token_hex(16), index=self._take_index(), engine_id=engine_id,
            role=role, rank=rank, world_size=world_size, namespace=namespace,
            client_name=client_name, created=now, lease_deadline=now + self.lease_seconds,
        )
        self._by_id[session.session_id] = session
        self._by_index[session.index] = session
        if session.is_scheduler:
            self._subscribers[namespace].add(session)
        else:
            assert rank is not None
            self._ranks[engine_id][rank].add(session)
        return session

    def get(self, session_id: str) -> Session:
        """The live session; raises NotFound (the client must re-attach)."""
        session = self._by_id.get(session_id)
        if session is None:
            raise NotFound("unknown session (it ended, expired, or belongs to an earlier "
                           "daemon): attach again")
        return session

    def by_index(self, index: int) -> Session | None:
        return self._by_index.get(index)

    def remove(self, session: Session) -> None:
        session.alive = False
        self._by_id.pop(session.session_id, None)
        self._by_index.pop(session.index, None)
        if session.is_scheduler:
            self._subscribers[session.namespace].discard(session)
            if not self._subscribers[session.namespace]:
                del self._subscribers[session.namespace]
        else:
            assert session.rank is not None
            ranks = self._ranks[session.engine_id]
            ranks[session.rank].discard(session)
            if not ranks[session.rank]:
                del ranks[session.rank]
            if not ranks:
                del self._ranks[session.engine_id]

    def subscribers(self, namespace: str) -> set[Session]:
        """Live scheduler sessions of `namespace` (they hold a view of it)."""
        return self._subscribers.get(namespace, set())

    def worker_ranks(self, engine_id: str) -> set[int]:
        """Ranks of `engine_id` with at least one live worker session."""
        return set(self._ranks.get(engine_id, {}))

    def schedulers_of(self, engine_id: str) -> Iterator[Session]:
        return (s for s in self._by_id.values() if s.is_scheduler and s.engine_id == engine_id)

    def renew(self, session: Session) -> None:
        session.lease_deadline = self.clock() + self.lease_seconds

    def expired(self) -> list[Session]:
        now = self.clock()
        return [s for s in self._by_id.values() if s.lease_deadline < now]

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def _take_index(self) -> int:
        while True:
            index = self._next_index
            self._next_index = self._next_index % 0xFFFF_FFFF + 1  # 1 .. 2**32-1
            if index not in self._by_index:
                return index
