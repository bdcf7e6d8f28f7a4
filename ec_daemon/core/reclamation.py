"""Pages on their way back to the allocator, and what they wait for: a
hidden entry's, for every view that could load it to acknowledge its
eviction, within --ack-wait-seconds for a live one (`Acknowledgements`); a
discarded save's, for its quarantine to pass (`Quarantine`). Why views
acknowledge and why the wait is bounded: `cache`'s docstring, and
docs/architecture.md, "Why the bytes cannot change under a load".

The cache decides when an entry hides and frees its pages (`cache`); these
keep whom and what that waits for, and the ghosts of the views of the daemon
whose region was adopted.

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator

from ec_daemon.core.events import EvictedEvent
from ec_daemon.core.records import Entry, Run, Session, State
from ec_daemon.core.sessions import SessionTable

# Makes the ghost of one view of the previous daemon: (namespace, engine
# instance, the highest entry id it may have seen).
MakeGhost = Callable[[str, str, int], Session]


class Acknowledgements:
    def __init__(self, sessions: SessionTable, ack_wait_seconds: float,
                 reclaim: Callable[[Entry], None]) -> None:
        """`reclaim(entry)` is called when a hidden entry awaits nobody more
        (the cache frees its pages)."""
        self.sessions = sessions
        self.ack_wait_seconds = ack_wait_seconds
        self._reclaim = reclaim
        # (ack_by, entry) of hidden entries live views await, in order of ack_by
        self._due: deque[tuple[float, Entry]] = deque()
        # Ghosts of the views of the daemon whose region was adopted, by
        # (engine, namespace): each until its engine re-attaches.
        self._previous: dict[tuple[str, str], Session] = {}

    def awaited(self, entry: Entry) -> set[Session]:
        """Whom hiding `entry` now would await (`SessionTable.awaited`)."""
        return self.sessions.awaited(entry.key[0], entry.entry_id)

    def hidden(self, entry: Entry, awaiting: set[Session]) -> None:
        """`entry` was hidden and awaits `awaiting` (not empty): they are
        told, and the live ones must acknowledge within the bound."""
        entry.awaiting = awaiting
        event = EvictedEvent(entry.mm_hash, entry.entry_id)
        for view in awaiting:
            view.awaiting.add(entry)
            view.send(event)  # ghosts send nothing
        if any(view.alive for view in awaiting):
            self._due_by(entry, self.sessions.clock())

    def acknowledge(self, entry: Entry, session: Session) -> None:
        """`session` no longer loads hidden `entry`; the last one reclaims it."""
        entry.awaiting.discard(session)
        session.awaiting.discard(entry)
        if not entry.awaiting:
            self._reclaim(entry)

    def acknowledge_all(self, session: Session) -> None:
        """`session` loads nothing any more (it detached, or its ghost's lease ended)."""
        for entry in list(session.awaiting):
            self.acknowledge(entry, session)

    def hold(self, session: Session, entry: Entry) -> None:
        """`session`'s engine is still loading hidden `entry` (it re-attached
        to an adopted region): it awaits this session too, which is told it
        was evicted; not past its bound (the ghost of the view ended for it
        covers the rest)."""
        assert entry.state is State.HIDDEN
        now = self.sessions.clock()
        if session in entry.awaiting or (entry.ack_by and entry.ack_by <= now):
            return
        entry.awaiting.add(session)
        session.awaiting.add(entry)
        session.send(EvictedEvent(entry.mm_hash, entry.entry_id))
        if not entry.ack_by:  # (an adopted hidden entry: awaited by ghosts until now)
            self._due_by(entry, now)

    def overdue_views(self) -> list[Session]:
        """Live scheduler sessions that have not acknowledged an eviction
        within --ack-wait-seconds: the caller ends them (each then a ghost for
        one lease, whose clock acknowledges for it). Why that is safe for an
        honest engine in a long step: docs/architecture.md, "Why the bytes
        cannot change under a load"."""
        now = self.sessions.clock()
        due = self._due
        overdue: dict[Session, None] = {}
        while due and due[0][0] <= now:
            _, entry = due.popleft()
            if entry.state is State.HIDDEN:
                overdue.update((view, None) for view in entry.awaiting if view.alive)
        return list(overdue)

    def _due_by(self, entry: Entry, now: float) -> None:
        """Live views must acknowledge `entry`'s eviction by `now` + the bound."""
        entry.ack_by = now + self.ack_wait_seconds
        self._due.append((entry.ack_by, entry))

    # ------------------------------------------------ the previous daemon

    def previous_views(self, views: Iterable[tuple[str, str]], ghost: MakeGhost,
                       seen_upto: int) -> dict[str, set[Session]]:
        """The views of the daemon whose region was adopted (`views`: engine
        instance, namespace) may still be loading: a ghost of each, made by
        `ghost(namespace, instance, seen_upto)`, until its engine re-attaches
        (`reattached`) or a lease passes. Returns them by namespace."""
        for instance, namespace in views:  # (`sessions.engine_key`, namespace)
            self._previous[(instance, namespace)] = ghost(namespace, instance, seen_upto)
        awaited: dict[str, set[Session]] = {}
        for g in self._previous.values():
            awaited.setdefault(g.namespace, set()).add(g)
        return awaited

    def reattached(self, session: Session) -> Session | None:
        """The ghost standing for `session`'s engine's view of the previous
        daemon, if any: it awaits nothing any more (the caller lets it go)."""
        ghost = self._previous.pop((session.engine_key, session.namespace), None)
        if ghost is not None:
            self.sessions.drop_ghost(ghost)
        return ghost

    def serving(self) -> None:
        """The daemon serves now: the previous daemon's views get their whole
        lease from here (adopting a large region takes seconds)."""
        until = self.sessions.clock() + self.sessions.lease_seconds
        for ghost in self._previous.values():
            ghost.ghost_until = until

    def ghost_gone(self, ghost: Session) -> None:
        """`ghost` loads nothing any more (its lease ran out, or its engine
        came back): it acknowledges everything it owed."""
        key = (ghost.engine_key, ghost.namespace)
        if self._previous.get(key) is ghost:  # its lease ran out before its engine came back
            del self._previous[key]
        self.acknowledge_all(ghost)


class Quarantine:
    """Pages of saves discarded with their session (their writer may still
    be copying): out of use, and stamped, until a time."""

    def __init__(self) -> None:
        self._held: deque[tuple[float, list[Run], int]] = deque()  # (until, runs, pages)
        self.pages = 0

    def __iter__(self) -> Iterator[tuple[float, list[Run], int]]:
        return iter(self._held)

    def hold(self, until: float, runs: list[Run], pages: int) -> None:
        """`runs` (`pages` pages) stay out of use until `until` (later than any held)."""
        self._held.append((until, runs, pages))
        self.pages += pages

    def over(self, now: float) -> list[tuple[list[Run], int]]:
        """The runs, and their pages, whose quarantine is over at `now`: no
        longer held."""
        held, over = self._held, []
        while held and held[0][0] <= now:
            _, runs, pages = held.popleft()
            self.pages -= pages
            over.append((runs, pages))
        return over
