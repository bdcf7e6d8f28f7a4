"""What the cache tells the scheduler views and hears from them.

A view (a scheduler session) answers hits from its own copy of its
namespace's ready entries: it is sent a snapshot when its stream opens, then
every entry that becomes ready (`ready`) or is evicted (`reclamation`), and
its engine's worker ranks that mapped the region (`tell_ranks`). It sends
back its acknowledgements of evictions, the entries its engine still loads
after a re-attach (`hold`), the loads it dispatched (`touch`) and the hits
and misses it counted (`record_lookups`).

The views change no entry's state: an acknowledgement may free an entry's
pages, which the cache does (`Acknowledgements`' reclaim).

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ec_daemon.core.entries import EntryTable
from ec_daemon.core.events import (
    Extent,
    RanksEvent,
    ReadyEvent,
    ReadySnapshot,
    SnapshotDoneEvent,
)
from ec_daemon.core.eviction import EvictionPolicy
from ec_daemon.core.limits import OUTBOX_MIN_EVENTS
from ec_daemon.core.reclamation import Acknowledgements
from ec_daemon.core.records import Entry, Session, State
from ec_daemon.core.sessions import SessionTable
from ec_daemon.durable.index import Index, NoIndex
from ec_daemon.errors import InvalidArgument


class Views:
    def __init__(self, *, sessions: SessionTable, table: EntryTable, acks: Acknowledgements,
                 policy: EvictionPolicy, index: Index | NoIndex, counters: dict[str, int],
                 extents: Callable[[Entry], tuple[Extent, ...]]) -> None:
        """The cache's parts the views read and tell: `counters` are the
        cache's, `extents(entry)` an entry's bytes in the region."""
        self.sessions = sessions
        self.table = table
        self.acks = acks
        self.policy = policy
        self.index = index
        self.counters = counters
        self.extents = extents

    def open(self, session: Session) -> None:
        """`session`'s stream opened. A scheduler session is sent a snapshot of
        the namespace's ready entries, a SnapshotDoneEvent and its engine's
        mapped ranks, then live events; evictions await it from now on. A
        worker session (its client mapped the region before opening) counts
        as one of its engine's mapped ranks."""
        self.sessions.open(session)
        if not session.is_scheduler:
            self.tell_ranks(session.engine_key)
            return
        self.index.view_on(session.engine_key, session.namespace)  # before it sees anything
        ready = [e for e in self.table.of(session.namespace).values()
                 if e.state is State.READY]
        if ready:
            session.outbox.append(ReadySnapshot(ready, self.ready_event))  # events made as sent
            session.seen_upto = max(session.seen_upto, max(e.entry_id for e in ready))
        session.outbox.append(SnapshotDoneEvent())
        session.outbox.append(RanksEvent(*self.sessions.mapped_ranks(session.engine_key)))
        session.outbox_limit = len(session.outbox) + OUTBOX_MIN_EVENTS
        session.wake()

    def ready(self, entry: Entry) -> None:
        """`entry` just became ready: its namespace's views are told."""
        views = self.sessions.subscribers(entry.key[0])
        if views:  # the event is built only for someone to hear it
            event = self.ready_event(entry)
            for view in views:
                view.send(event)
                view.seen_upto = max(view.seen_upto, entry.entry_id)

    def ready_event(self, entry: Entry) -> ReadyEvent:
        return ReadyEvent(entry.mm_hash, entry.entry_id, entry.nbytes, entry.shape,
                          entry.dtype, self.extents(entry), entry.checksum)

    def tell_ranks(self, key: str) -> None:
        """The views of engine instance `key`: how many of its ranks mapped the region."""
        event = RanksEvent(*self.sessions.mapped_ranks(key))
        for view in self.sessions.views_of(key):
            view.send(event)

    def acknowledge(self, session: Session, refs: Iterable[tuple[str, int]]) -> None:
        """`session`'s view dropped these evicted entries and loads none of
        them any more; stale refs are ignored."""
        namespace = self.table.of(session.namespace)
        for mm_hash, entry_id in refs:
            entry = namespace.get(mm_hash)
            if entry is not None and entry.entry_id == entry_id and session in entry.awaiting:
                self.acks.acknowledge(entry, session)

    def hold(self, session: Session, refs: Iterable[tuple[str, int]]) -> None:
        """`session`'s engine is still loading these entries (it re-attached
        to an adopted region): a hidden one awaits this session too and is
        announced to it as evicted; unknown or stale refs are ignored."""
        namespace = self.table.of(session.namespace)
        for mm_hash, entry_id in refs:
            entry = namespace.get(mm_hash)
            if entry is not None and entry.entry_id == entry_id \
                    and entry.state is State.HIDDEN:
                self.acks.hold(session, entry)

    def touch(self, session: Session, touches: Iterable[tuple[str, int, int]]) -> None:
        """Loads `session`'s view dispatched: recency for eviction, and the
        load counters (bytes only for entries still known)."""
        namespace = self.table.of(session.namespace)
        counters = self.table.counters[session.namespace]
        for mm_hash, entry_id, loads in touches:
            counters["loads"] += loads  # dispatched, whatever became of the entry since
            self.counters["loads"] += loads
            entry = namespace.get(mm_hash)
            if entry is None or entry.entry_id != entry_id:
                continue
            if entry.state is State.READY:
                self.policy.touch(entry.key)
            self.counters["bytes_loaded"] += loads * entry.nbytes

    def record_lookups(self, session: Session, lookups: int, hits: int) -> None:
        """Counters a scheduler's local view reports on its heartbeats."""
        if lookups < 0 or hits < 0 or hits > lookups:
            raise InvalidArgument("heartbeat counters must satisfy 0 <= hits <= lookups")
        ns = self.table.counters[session.namespace]
        ns["hits"] += hits
        ns["misses"] += lookups - hits
        self.counters["hits"] += hits
        self.counters["misses"] += lookups - hits
