"""The entry life cycle: every state change of an entry happens here.

```
absent --allocate--> PENDING (owned by the writer's session, invisible)
PENDING --commit--> READY (ready event to the namespace's views)
READY --pin--> READY with pins (per transfer id; never evicted)
pins --every expected rank reported, or owner gone--> unpinned
READY unpinned --chosen by eviction--> HIDDEN (evicted event; bytes kept)
HIDDEN --every awaited view acknowledged, no pins--> absent (pages reused)
PENDING --abort, or owner session ended--> absent
```

Why hidden entries: a scheduler answers hits from its local view and pins
without waiting, so its pin may reach the daemon after the entry was chosen
for eviction. Pages are reused only once every scheduler session that could
have seen the entry acknowledged the evicted event; its stream carries pins
before acknowledgements, so a pin sent before the acknowledgement always
lands on intact bytes (epoch-based reclamation, as in RCU).

Not thread-safe: the daemon's event loop is the only caller. Methods that
raise a `CacheError` have changed nothing.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from ec_daemon.allocator import ExtentAllocator, Run
from ec_daemon.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)
from ec_daemon.events import (
    AllocOutcome,
    AllocResult,
    EvictedEvent,
    Extent,
    PinFailedEvent,
    ReadyEvent,
    ReportStatus,
    SnapshotDoneEvent,
    Verdict,
)
from ec_daemon.eviction import EvictionPolicy, LRUPolicy
from ec_daemon.limits import MAX_KEY_BYTES, validate_mm_hash, validate_save
from ec_daemon.sessions import Session, SessionTable

Key = tuple[str, str]  # (namespace, mm_hash)

COUNTER_MASK = 0xFFFF_FFFF
# Evict at least 1/64 of the cache at a time: each eviction round costs one
# event message to every view and one acknowledgement back from each, so
# batching the victims divides that traffic (measured: benchmarks/concurrency).
EVICTION_BATCH_DIVISOR = 64


class State(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    HIDDEN = "hidden"


# Never mutated: replaced by a real set on first use.
_EMPTY: Any = frozenset()


class Entry:
    """One cached encoder output. `state` changes only inside Cache."""

    __slots__ = ("awaiting", "dtype", "entry_id", "key", "nbytes", "owner", "pages", "pins",
                 "runs", "shape", "state")

    def __init__(self, key: Key, entry_id: int, nbytes: int, shape: tuple[int, ...],
                 dtype: str, runs: list[Run], owner: Session) -> None:
        self.key = key
        self.entry_id = entry_id
        self.nbytes = nbytes
        self.shape = shape
        self.dtype = dtype
        self.runs = runs
        self.pages = sum(n for _, n in runs)
        self.state = State.PENDING
        self.owner: Session | None = owner
        # Most entries are never pinned nor hidden: share one empty set until
        # they are (a set costs ~200 bytes, a million entries add up).
        self.pins: set[int] = _EMPTY
        self.awaiting: set[Session] = _EMPTY

    @property
    def mm_hash(self) -> str:
        return self.key[1]


@dataclass(eq=False)
class Transfer:
    """A pin for one load dispatch, released when every expected rank reported."""

    transfer_id: int
    entry: Entry
    owner: Session
    expected: set[int]
    created: float
    reported: set[int] = field(default_factory=set)


class Cache:
    def __init__(self, *, capacity_bytes: int, page_bytes: int, sessions: SessionTable,
                 policy: EvictionPolicy | None = None) -> None:
        if page_bytes <= 0 or capacity_bytes < page_bytes:
            raise ValueError("the cache needs at least one page")
        self.page_bytes = page_bytes
        self.allocator = ExtentAllocator(capacity_bytes // page_bytes)
        self.capacity_bytes = self.allocator.total_pages * page_bytes
        self.sessions = sessions
        self.policy: EvictionPolicy = policy or LRUPolicy()
        self._namespaces: dict[str, dict[str, Entry]] = {}
        self._transfers: dict[int, Transfer] = {}
        self._next_entry_id = 1
        self.pending_pages = 0
        self.pinned_pages = 0
        self.hidden_pages = 0
        self.ready_entries = 0
        self.hidden_entries = 0
        # Pages of saves discarded with their session: (reusable at, runs, pages).
        self._quarantine: deque[tuple[float, list[Run], int]] = deque()
        self.quarantined_pages = 0
        # namespace -> [visible (ready or hidden) entries, their bytes]
        self.namespace_usage: dict[str, list[int]] = {}
        self.counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "evictions", "saves", "loads", "refused_saves",
             "bytes_saved", "bytes_loaded", "pins", "pin_failures"), 0)
        self.namespace_counters: dict[str, dict[str, int]] = {}
        # Hooks for the service: pages came back; a session's pins advanced.
        self.on_reclaim: Callable[[], None] = lambda: None
        self.on_pins: Callable[[Session], None] = lambda session: None

    # ----------------------------------------------------------- sessions

    def attach(self, **fields: Any) -> Session:
        """Create a session; a scheduler session is sent a snapshot of the
        namespace's ready entries, then a SnapshotDoneEvent, then live events."""
        session = self.sessions.create(**fields)
        self.namespace_counters.setdefault(session.namespace, {"hits": 0, "misses": 0})
        if session.is_scheduler:
            for entry in self._namespaces.get(session.namespace, {}).values():
                if entry.state is State.READY:
                    session.outbox.append(self._ready_event(entry))
            session.send(SnapshotDoneEvent())
        return session

    def end_session(self, session: Session) -> None:
        """Release everything `session` holds. Idempotent.

        Pending saves are discarded, pins released, owed acknowledgements
        dropped, and loads stop waiting for this rank's reports.
        """
        if not session.alive:
            return
        self.sessions.remove(session)
        for key in list(session.pending):
            entry = self._namespaces[key[0]][key[1]]
            self._discard_pending(entry, quarantine=True)
        for transfer in list(session.pins.values()):
            self._release(transfer)
        for entry in list(session.awaiting):
            self._acknowledge(entry, session)
        if session.rank is not None and session.rank not in self.sessions.worker_ranks(
                session.engine_id):
            self._forget_rank(session.engine_id, session.rank)
        session.outbox.clear()
        session.wake()

    def expire_sessions(self) -> list[Session]:
        """End every session whose lease ran out; returns them."""
        expired = self.sessions.expired()
        for session in expired:
            self.end_session(session)
        return expired

    def record_lookups(self, session: Session, lookups: int, hits: int) -> None:
        """Counters a scheduler's local view reports on its heartbeats."""
        if lookups < 0 or hits < 0 or hits > lookups:
            raise InvalidArgument("heartbeat counters must satisfy 0 <= hits <= lookups")
        ns = self.namespace_counters[session.namespace]
        ns["hits"] += hits
        ns["misses"] += lookups - hits
        self.counters["hits"] += hits
        self.counters["misses"] += lookups - hits

    # -------------------------------------------------------------- saves

    def allocate(self, session: Session, mm_hash: str, nbytes: int,
                 shape: tuple[int, ...], dtype: str) -> AllocResult:
        """Reserve extents for a save of `mm_hash` by `session` (a writer).

        On ALLOCATED the caller copies into the extents, then must `commit`
        (or `abort`); if the session ends first the entry is discarded.
        Raises ResourceExhausted when no room can be made (pinned, pending or
        awaiting acknowledgements): the caller drops the save.
        """
        validate_save(session, mm_hash, nbytes, shape, dtype)
        existing = self._namespaces.get(session.namespace, {}).get(mm_hash)
        if existing is not None:
            return AllocResult({State.PENDING: AllocOutcome.ALREADY_PENDING,
                                State.READY: AllocOutcome.ALREADY_READY,
                                State.HIDDEN: AllocOutcome.EVICTING}[existing.state],
                               existing.entry_id)
        pages = -(-nbytes // self.page_bytes)
        if pages > self.allocator.total_pages:
            self.counters["refused_saves"] += 1
            raise ResourceExhausted(
                f"an entry of {nbytes} bytes is larger than the cache "
                f"({self.capacity_bytes} bytes)")
        runs = self.allocator.allocate(pages) or self._make_room(pages)
        if runs is None:
            if self.allocator.free_pages + self.hidden_pages >= pages:
                return AllocResult(AllocOutcome.WAIT)
            self.counters["refused_saves"] += 1
            raise ResourceExhausted(self._full_message(nbytes))
        entry = Entry((session.namespace, mm_hash), self._next_entry_id, nbytes, shape, dtype,
                      runs, session)
        self._next_entry_id += 1
        self._namespaces.setdefault(session.namespace, {})[mm_hash] = entry
        session.pending.add(entry.key)
        self.pending_pages += entry.pages
        return AllocResult(AllocOutcome.ALLOCATED, entry.entry_id, self.extents(entry))

    def refuse_waited_save(self, nbytes: int) -> ResourceExhausted:
        """The error for a save that waited in vain for reclamation."""
        self.counters["refused_saves"] += 1
        return ResourceExhausted(self._full_message(nbytes) + " (evicted entries were not "
                                 "acknowledged in time)")

    def commit(self, session: Session, mm_hashes: Iterable[str]) -> list[ReportStatus]:
        """Make `session`'s pending entries ready (their copies landed)."""
        hashes = list(mm_hashes)
        for mm_hash in hashes:
            validate_mm_hash(mm_hash)
        statuses = []
        namespace = self._namespaces.get(session.namespace, {})
        for mm_hash in hashes:
            entry = namespace.get(mm_hash)
            if entry is None:
                statuses.append(ReportStatus.UNKNOWN)
            elif entry.state is not State.PENDING:
                statuses.append(ReportStatus.DUPLICATE)
            elif entry.owner is not session:
                statuses.append(ReportStatus.UNKNOWN)
            else:
                self._make_ready(entry, session)
                statuses.append(ReportStatus.ACCEPTED)
        return statuses

    def abort(self, session: Session, mm_hashes: Iterable[str]) -> list[ReportStatus]:
        """Discard `session`'s pending entries (their copies will not land)."""
        hashes = list(mm_hashes)
        for mm_hash in hashes:
            validate_mm_hash(mm_hash)
        statuses = []
        namespace = self._namespaces.get(session.namespace, {})
        for mm_hash in hashes:
            entry = namespace.get(mm_hash)
            if entry is not None and entry.state is State.PENDING and entry.owner is session:
                self._discard_pending(entry)
                statuses.append(ReportStatus.ACCEPTED)
            else:
                statuses.append(ReportStatus.UNKNOWN)
        return statuses

    # -------------------------------------------------------------- loads

    def pin(self, session: Session, transfer_id: int, mm_hash: str, entry_id: int) -> bool:
        """Pin an entry for one load dispatch, as the scheduler's stream asks.

        Failures do not raise: the session is sent a PinFailedEvent and the
        transfer's reports will be answered NOT_HELD. Pins must arrive in
        transfer-id order (they share the stream with acknowledgements).
        """
        counter = transfer_id & COUNTER_MASK
        ours = transfer_id >> 32 == session.index
        fresh = ours and counter > session.max_transfer
        if fresh:  # seen, whatever comes next: its reports stop waiting for it
            session.max_transfer = counter
        reason = self._pin_refusal(session, mm_hash, ours, fresh)
        if reason is None and transfer_id in session.abandoned:
            session.abandoned.discard(transfer_id)
            reason = "its load report timed out before the pin arrived"
        entry = self._namespaces.get(session.namespace, {}).get(mm_hash)
        if reason is None and (entry is None or entry.entry_id != entry_id
                               or entry.state is State.PENDING):
            reason = "entry is no longer cached"
        expected = self.sessions.worker_ranks(session.engine_id)
        if reason is None and not expected:
            reason = f"no worker of engine {session.engine_id!r} is attached"
        if reason is not None or entry is None:
            self.counters["pin_failures"] += 1
            session.send(PinFailedEvent(transfer_id, reason or "entry is no longer cached"))
            self.on_pins(session)
            return False
        transfer = Transfer(transfer_id, entry, session, expected, self.sessions.clock())
        self._transfers[transfer_id] = transfer
        session.pins[transfer_id] = transfer
        if not entry.pins:
            self.pinned_pages += entry.pages
            if entry.state is State.READY:
                self.policy.remove(entry.key)
            entry.pins = {transfer_id}
        else:
            entry.pins.add(transfer_id)
        self.counters["pins"] += 1
        self.on_pins(session)
        return True

    def report_loaded(self, session: Session, transfer_ids: list[int]) -> list[Verdict]:
        """A worker rank is done with these transfers; the verdict says
        whether the pin covered its copy (HELD) or the copy must be discarded.

        Raises PermissionDenied, changing nothing, if any id belongs to
        another engine. WAIT verdicts: ask again for those ids later.
        """
        if session.rank is None:
            raise FailedPrecondition("only worker sessions report loads")
        for transfer_id in transfer_ids:
            owner = self._transfer_owner(transfer_id)
            if owner is not None and owner.engine_id != session.engine_id:
                raise PermissionDenied(f"transfer {transfer_id} belongs to another engine")
        return [self._report_one(session, session.rank, t) for t in transfer_ids]

    def abandon(self, transfer_id: int) -> None:
        """A report waited in vain for this transfer's pin (the worker was told
        NOT_HELD): refuse the pin if it still comes, or it would wait forever
        for a report that was already given."""
        owner = self._transfer_owner(transfer_id)
        if owner is not None and (transfer_id & COUNTER_MASK) > owner.max_transfer:
            owner.abandoned.add(transfer_id)

    def expire_transfers(self, max_age: float) -> list[Transfer]:
        """Release pins older than `max_age` whose ranks never all reported
        (a backstop: a load takes milliseconds). Late reports get NOT_HELD."""
        oldest = self.sessions.clock() - max_age
        stale = [t for t in self._transfers.values() if t.created < oldest]
        for transfer in stale:
            self._release(transfer)
        return stale

    def release_quarantine(self) -> int:
        """Free the pages of discarded saves whose grace period is over."""
        now = self.sessions.clock()
        released = 0
        while self._quarantine and self._quarantine[0][0] <= now:
            _, runs, pages = self._quarantine.popleft()
            self.allocator.free(runs)
            self.quarantined_pages -= pages
            released += pages
        if released:
            self.on_reclaim()
        return released

    def acknowledge(self, session: Session, refs: Iterable[tuple[str, int]]) -> None:
        """`session`'s view dropped these evicted entries; stale refs are ignored."""
        namespace = self._namespaces.get(session.namespace, {})
        for mm_hash, entry_id in refs:
            entry = namespace.get(mm_hash)
            if entry is not None and entry.entry_id == entry_id and session in entry.awaiting:
                self._acknowledge(entry, session)

    # -------------------------------------------------------------- views

    def lookup(self, namespace: str, mm_hashes: list[str]) -> list[Entry | None]:
        """Entries as tools see them: pending ones are absent."""
        for mm_hash in mm_hashes:
            validate_mm_hash(mm_hash)
        entries = self._namespaces.get(namespace, {})
        found = [entries.get(h) for h in mm_hashes]
        return [e if e is not None and e.state is not State.PENDING else None for e in found]

    def extents(self, entry: Entry) -> tuple[Extent, ...]:
        """Byte extents of `entry`, in payload order; the last is trimmed."""
        out = []
        left = entry.nbytes
        for start, pages in entry.runs:
            length = min(pages * self.page_bytes, left)
            out.append((start * self.page_bytes, length))
            left -= length
        return tuple(out)

    def check_invariants(self) -> None:
        """Assert the bookkeeping adds up (tests and fuzzing call this)."""
        used = 0
        pending = pinned = hidden = 0
        for entries in self._namespaces.values():
            for entry in entries.values():
                used += entry.pages
                pending += entry.pages if entry.state is State.PENDING else 0
                pinned += entry.pages if entry.pins else 0
                hidden += entry.pages if entry.state is State.HIDDEN else 0
                assert all(s.alive for s in entry.awaiting), "dead session awaited"
                assert entry.state is State.HIDDEN or not entry.awaiting
                assert entry.state is not State.PENDING or (
                    entry.owner is not None and entry.owner.alive and not entry.pins)
                for transfer_id in entry.pins:
                    assert self._transfers[transfer_id].owner.alive, "pin of a dead session"
        used += self.quarantined_pages
        assert used + self.allocator.free_pages == self.allocator.total_pages, "pages leaked"
        assert self.quarantined_pages == sum(q[2] for q in self._quarantine)
        visible = [e for es in self._namespaces.values() for e in es.values()
                   if e.state is not State.PENDING]
        assert self.ready_entries + self.hidden_entries == len(visible)
        assert self.hidden_entries == sum(e.state is State.HIDDEN for e in visible)
        assert sum(u[1] for u in self.namespace_usage.values()) == sum(e.nbytes for e in visible)
        assert (pending, pinned, hidden) == (
            self.pending_pages, self.pinned_pages, self.hidden_pages), "byte counters drifted"
        assert len(self._transfers) == sum(len(s.pins) for s in self.sessions)

    # ------------------------------------------------------------ helpers

    def _make_room(self, pages: int) -> list[Run] | None:
        """Hide LRU victims so `pages` can come free; allocate if it already can."""
        # Hidden entries are on their way out (after acks, and loads if pinned).
        shortfall = pages - self.allocator.free_pages - self.hidden_pages
        if shortfall > 0:
            # A whole batch where there is one; never less than the shortfall.
            batch = min(self.allocator.total_pages // EVICTION_BATCH_DIVISOR,
                        self.policy.evictable_pages)
            for key in self.policy.choose(max(shortfall, batch)):
                namespace, mm_hash = cast(Key, key)
                self._hide(self._namespaces[namespace][mm_hash])
        return self.allocator.allocate(pages)

    def _make_ready(self, entry: Entry, session: Session) -> None:
        entry.state = State.READY
        entry.owner = None
        session.pending.discard(entry.key)
        self.pending_pages -= entry.pages
        self.policy.add(entry.key, entry.pages)
        self.ready_entries += 1
        usage = self.namespace_usage.setdefault(entry.key[0], [0, 0])
        usage[0] += 1
        usage[1] += entry.nbytes
        self.counters["saves"] += 1
        self.counters["bytes_saved"] += entry.nbytes
        event = self._ready_event(entry)
        for view in self.sessions.subscribers(entry.key[0]):
            view.send(event)

    def _discard_pending(self, entry: Entry, *, quarantine: bool = False) -> None:
        """Drop a pending entry. Its writer may still be copying when its
        session ended without an abort (a hung process resumed, a DMA in
        flight): those pages are reused only after a grace period."""
        assert entry.state is State.PENDING and entry.owner is not None
        entry.owner.pending.discard(entry.key)
        entry.owner = None
        self.pending_pages -= entry.pages
        if not quarantine:
            self._free(entry)
            return
        self._forget(entry)
        self._quarantine.append((self.sessions.clock() + self.sessions.lease_seconds,
                                 entry.runs, entry.pages))
        self.quarantined_pages += entry.pages

    def _hide(self, entry: Entry) -> None:
        assert entry.state is State.READY and not entry.pins
        self.policy.remove(entry.key)
        entry.state = State.HIDDEN
        self.hidden_pages += entry.pages
        self.ready_entries -= 1
        self.hidden_entries += 1
        self.counters["evictions"] += 1
        entry.awaiting = set(self.sessions.subscribers(entry.key[0]))
        event = EvictedEvent(entry.mm_hash, entry.entry_id)
        for view in entry.awaiting:
            view.awaiting.add(entry)
            view.send(event)
        if not entry.awaiting:
            self._reclaim(entry)

    def _acknowledge(self, entry: Entry, session: Session) -> None:
        entry.awaiting.discard(session)
        session.awaiting.discard(entry)
        if not entry.awaiting and not entry.pins:
            self._reclaim(entry)

    def _reclaim(self, entry: Entry) -> None:
        assert entry.state is State.HIDDEN and not entry.pins and not entry.awaiting
        self.hidden_pages -= entry.pages
        self.hidden_entries -= 1
        usage = self.namespace_usage[entry.key[0]]
        usage[0] -= 1
        usage[1] -= entry.nbytes
        self._free(entry)

    def _free(self, entry: Entry) -> None:
        self._forget(entry)
        self.allocator.free(entry.runs)
        self.on_reclaim()  # an allocation may be waiting for these pages

    def _forget(self, entry: Entry) -> None:
        namespace = self._namespaces[entry.key[0]]
        del namespace[entry.key[1]]
        if not namespace:
            del self._namespaces[entry.key[0]]

    def _release(self, transfer: Transfer) -> None:
        del self._transfers[transfer.transfer_id]
        del transfer.owner.pins[transfer.transfer_id]
        entry = transfer.entry
        entry.pins.discard(transfer.transfer_id)
        if entry.pins:
            return
        entry.pins = _EMPTY
        self.pinned_pages -= entry.pages
        if entry.state is State.READY:
            self.policy.add(entry.key, entry.pages)
        elif not entry.awaiting:
            self._reclaim(entry)

    def _forget_rank(self, engine_id: str, rank: int) -> None:
        """No live session of this rank is left: its reports will not come."""
        for scheduler in list(self.sessions.schedulers_of(engine_id)):
            for transfer in list(scheduler.pins.values()):
                transfer.expected.discard(rank)
                if transfer.expected <= transfer.reported:
                    self._release(transfer)

    def _report_one(self, session: Session, rank: int, transfer_id: int) -> Verdict:
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            owner = self._transfer_owner(transfer_id)
            if owner is not None and (transfer_id & COUNTER_MASK) > owner.max_transfer:
                return Verdict.WAIT
            return Verdict.NOT_HELD
        if rank in transfer.reported:
            return Verdict.REPORTED_ALREADY
        transfer.reported.add(rank)
        if transfer.expected <= transfer.reported:
            self.counters["loads"] += 1
            self.counters["bytes_loaded"] += transfer.entry.nbytes
            self._release(transfer)
        return Verdict.HELD

    def _transfer_owner(self, transfer_id: int) -> Session | None:
        owner = self.sessions.by_index(transfer_id >> 32)
        return owner if owner is not None and owner.is_scheduler else None

    def _pin_refusal(self, session: Session, mm_hash: str, ours: bool,
                     fresh: bool) -> str | None:
        if not session.is_scheduler or not session.can_load:
            return f"a {session.role} {session.component} session cannot pin"
        if not ours:
            return "transfer id was not minted by this session"
        if not fresh:
            return "transfer id is not greater than the previous one"
        if not mm_hash or len(mm_hash.encode()) > MAX_KEY_BYTES:
            return "invalid mm_hash"
        return None

    def _ready_event(self, entry: Entry) -> ReadyEvent:
        return ReadyEvent(entry.mm_hash, entry.entry_id, entry.nbytes, entry.shape,
                          entry.dtype, self.extents(entry))

    def _full_message(self, nbytes: int) -> str:
        pb = self.page_bytes
        return (f"cache full: cannot place {nbytes} bytes ({self.allocator.free_pages * pb} free, "
                f"{self.pinned_pages * pb} pinned, {self.pending_pages * pb} pending, "
                f"{self.hidden_pages * pb} awaiting acknowledgement)")
