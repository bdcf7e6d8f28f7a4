"""The items being made (`Making`: who encodes a wanted item, who waits for
it, by when), as convergence (`convergence`) keeps them: indexed by session,
counted per engine instance, due by their bounds.

Why an index and a heap: a session's end must touch its own items only, and
upkeep only the items past their bound (it walked every item each second,
and every session's end did too: 65,536 claims and 299 sessions ending held
the loop for 8.5 s). What one engine instance's views take part in, and all
tokenless views' together, is counted here so that convergence can bound it
(`full`: core.limits' MAX_ITEMS_PER_INSTANCE, MAX_ITEMS_TOKENLESS).

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from ec_daemon.core.events import Verdict
from ec_daemon.core.limits import MAX_ITEMS_PER_INSTANCE, MAX_ITEMS_TOKENLESS
from ec_daemon.core.records import Key, Session
from ec_daemon.core.sessions import tokenless


@dataclass(eq=False, slots=True)
class Making:
    """An item someone is making: an engine encoding it (`holder`), a save
    landing or a promotion (`holder` None); `waiters` deferred for it."""

    kind: Verdict  # ENCODING or PROMOTING
    holder: Session | None
    deadline: float
    waiters: list[Session] = field(default_factory=list)
    # Its holder said it encodes it (`Convergence.started`).
    started: bool = False
    # Being resolved by the second tier (`Convergence.resolve`): it takes the
    # resolution's outcome, and no other (see `resolved`).
    resolving: bool = False
    # The waiter whose answer waits for the resolution, if it still wants one.
    unanswered: Session | None = None


class Makings:
    """The items in the making, by key (`making`), and their indexes."""

    def __init__(self) -> None:
        self.making: dict[Key, Making] = {}
        # The items each session holds or waits for, and how many each
        # engine instance (`Session.engine_key`) and all tokenless ones take.
        self._involved: dict[Session, set[Key]] = {}
        self._per_instance: dict[str, int] = {}
        self._tokenless = 0
        # (deadline, n, key, making): bounds come due in order; stale ones skipped
        self._due: list[tuple[float, int, Key, Making]] = []
        self._seq = itertools.count()
        # Items that wait for a save landing with no engine holding them
        # (a pending entry's): looked at by upkeep, in case it was dropped.
        self._landing: set[Key] = set()

    def full(self, session: Session) -> bool:
        """May `session` take part in no more items (its instance's, or the
        tokenless clients', share is taken)?"""
        key = session.engine_key
        if tokenless(key):
            return self._tokenless >= MAX_ITEMS_TOKENLESS
        return self._per_instance.get(key, 0) >= MAX_ITEMS_PER_INSTANCE

    def items_of(self, session: Session) -> int:
        """How many items `session` holds or waits for."""
        return len(self._involved.get(session, ()))

    def keys_of(self, session: Session) -> list[Key]:
        """The items `session` holds or waits for (a copy: they may change)."""
        return list(self._involved.get(session, ()))

    def put(self, key: Key, making: Making) -> None:
        """`making` is `key`'s from now on (none was), indexed and due."""
        self.making[key] = making
        for session in (making.holder, *making.waiters):
            if session is not None:
                self._index(session, key)
        if making.holder is None and making.kind is Verdict.ENCODING:
            self._landing.add(key)
        self.push(key, making)

    def remove(self, key: Key) -> Making | None:
        """`key`'s Making, no longer made nor indexed."""
        making = self.making.pop(key, None)
        if making is not None:
            for session in (making.holder, *making.waiters):
                if session is not None:
                    self._unindex(session, key)
            self._landing.discard(key)
        return making

    def add_waiter(self, key: Key, making: Making, session: Session) -> None:
        making.waiters.append(session)
        self._index(session, key)

    def drop_waiter(self, key: Key, making: Making, session: Session) -> None:
        making.waiters.remove(session)
        self._unindex(session, key)

    def landing_on(self, key: Key) -> None:
        """`key`'s waiters wait for a save landing that no engine holds."""
        self._landing.add(key)

    def push(self, key: Key, making: Making) -> None:
        """`making` is due at its deadline. Items made or passed on before
        theirs leave stale entries: past four per live item the heap is
        rebuilt from the live ones (a client wanting and releasing items in a
        loop must not grow it)."""
        due = self._due
        heapq.heappush(due, (making.deadline, next(self._seq), key, making))
        if len(due) > 4 * len(self.making) + 1024:
            self._due = [(m.deadline, next(self._seq), k, m) for k, m in self.making.items()]
            heapq.heapify(self._due)

    def due(self, now: float) -> Iterator[tuple[Key, Making]]:
        """The items past their deadline at `now`, each once, in order (the
        caller may hand them over as they come: the heap is read as it goes)."""
        while self._due and self._due[0][0] <= now:
            _, _, key, making = heapq.heappop(self._due)
            if self.making.get(key) is making and making.deadline <= now:
                yield key, making

    def landing(self) -> Iterator[tuple[Key, Making]]:
        """The items still waiting for a save that no engine holds (others
        found on the way are forgotten)."""
        for key in list(self._landing):
            landing = self.making.get(key)
            if landing is None or landing.holder is not None \
                    or landing.kind is not Verdict.ENCODING:
                self._landing.discard(key)
            else:
                yield key, landing

    def _index(self, session: Session, key: Key) -> None:
        keys = self._involved.setdefault(session, set())
        if key in keys:
            return
        keys.add(key)
        instance = session.engine_key
        if tokenless(instance):
            self._tokenless += 1
        self._per_instance[instance] = self._per_instance.get(instance, 0) + 1

    def _unindex(self, session: Session, key: Key) -> None:
        keys = self._involved.get(session)
        if keys is None or key not in keys:
            return
        keys.discard(key)
        if not keys:
            del self._involved[session]
        instance = session.engine_key
        if tokenless(instance):
            self._tokenless -= 1
        left = self._per_instance[instance] - 1
        if left:
            self._per_instance[instance] = left
        else:
            del self._per_instance[instance]
