"""The entry life cycle: every state change of an entry happens here.

```
absent --allocate--> PENDING (owned by the writer's session, invisible; stamped)
PENDING --commit--> READY (ready event to the namespace's views)
READY --chosen by eviction--> HIDDEN (evicted event; bytes kept)
HIDDEN --every awaited view acknowledged--> absent (pages cleared, reusable)
PENDING --abort--> absent
PENDING --owner session ended--> quarantined (--quarantine-seconds) --> absent
```

Why hidden entries, and no pins: a scheduler answers hits from its local
view and dispatches loads without asking the daemon. Pages are reused only
once every scheduler view that could have seen the entry acknowledged its
eviction, and a view withholds that acknowledgement while a load of the
entry that its engine dispatched is in flight (epoch-based reclamation, as in
RCU). A view that ends without detaching stays awaited as a ghost for one
lease (`sessions`). Each allocation's entry_id is written into the region's
stamp table before its writer gets the extents, so a reader can verify.

An acknowledgement is waited for --ack-wait-seconds at most (`reclamation`):
a live view that withholds one longer is ended by the data plane, and its
ghost is awaited one lease more, so one client that never acknowledges
cannot pin the cache. Why an honest engine in a step longer than that still
reads only the saved bytes: its engine's view stops answering hits once its
session ends (the client-side lease, and the stream's end), its loads in
flight keep their pages for the bound and a lease (at least two leases, what
a frozen scheduler's loads already had), a re-attached view's `holds` cannot
extend an entry past its bound, and a load that outlasts all of it is
refused by the stamp check (docs/architecture.md, "Why the bytes cannot
change under a load").

Durability (`index`): a READY record is journaled before an entry becomes
visible, a GONE record before its pages are freed, and ids are reserved
before use, so a restarted daemon adopts the ready entries (`restore`) and
never reuses an id a reader may still hold.

Not thread-safe: the daemon's event loop is the only caller. Methods that
raise a `CacheError` have changed nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Protocol, cast

from ec_daemon.core.allocator import ExtentAllocator
from ec_daemon.core.entries import EntryTable
from ec_daemon.core.events import (
    AllocOutcome,
    AllocResult,
    Extent,
    ReportStatus,
)
from ec_daemon.core.eviction import EvictionPolicy, LRUPolicy
from ec_daemon.core.limits import (
    ACK_WAIT_LEASES,
    DEFAULT_QUARANTINE_SECONDS,
    EVICTION_BATCH_DIVISOR,
    ID_BLOCK,
    validate_mm_hash,
    validate_save,
)
from ec_daemon.core.quotas import PendingCaps, PendingQuota
from ec_daemon.core.reclamation import Acknowledgements, MakeGhost, Quarantine
from ec_daemon.core.records import Entry, Key, Run, Session, State
from ec_daemon.core.sessions import SessionTable
from ec_daemon.core.views import Views
from ec_daemon.durable.index import Index, NoIndex
from ec_daemon.durable.journal import Record
from ec_daemon.durable.stamp_file import LOST
from ec_daemon.errors import FailedPrecondition, ResourceExhausted
from ec_protocol.protocol import Role

COUNTERS = ("hits", "misses", "evictions", "saves", "loads", "refused_saves", "bytes_saved",
            "bytes_loaded", "capped_saves", "refused_attaches", "preempted_sessions",
            "ack_timeouts", "stalled_streams", "mismatch_reports", "checksum_mismatches",
            "region_truncations")


class Stamps(Protocol):
    """Where the cache writes allocation stamps: the region's stamp table
    (`durable.stamp_file.StampFile`; `ec_protocol.stamps.StampTable` over
    memory in tests)."""

    def write(self, runs: Iterable[Run], stamp: int) -> None: ...

    def clear(self, runs: Iterable[Run]) -> None: ...

    def holds(self, extents: Iterable[Extent], stamp: int) -> bool: ...


class NoStamps:
    """The stamps of a cache without a region (unit tests): none kept."""

    def write(self, runs: Iterable[Run], stamp: int) -> None:
        return None

    def clear(self, runs: Iterable[Run]) -> None:
        return None

    def holds(self, extents: Iterable[Extent], stamp: int) -> bool:
        return True  # no table, no region: nothing was read from pages


class CacheListener(Protocol):
    """Who hears what the cache announces beyond its views: the data plane
    (`plane.dataplane`), passed to the cache when it is made."""

    def entry_changed(self, entry: Entry) -> None:
        """`entry` just became READY (its views were told first) or HIDDEN:
        the one announcement watchers, convergence and the second tier hear."""

    def pages_reclaimed(self) -> None:
        """Pages came back to the allocator: a save may be waiting for them."""


class Unheard:
    """The listener of a cache nobody listens to (unit tests, tools)."""

    def entry_changed(self, entry: Entry) -> None:
        return None

    def pages_reclaimed(self) -> None:
        return None


class Cache:
    def __init__(self, *, capacity_bytes: int, page_bytes: int, sessions: SessionTable,
                 policy: EvictionPolicy | None = None, data_offset: int = 0,
                 stamps: Stamps | None = None, index: Index | NoIndex | None = None,
                 quarantine_seconds: float = DEFAULT_QUARANTINE_SECONDS,
                 pending_caps: PendingCaps | None = None,
                 ack_wait_seconds: float | None = None,
                 listener: CacheListener | None = None) -> None:
        """`capacity_bytes` of payload pages starting at byte `data_offset` of
        the region; `stamps` is the region's stamp table (None: none kept),
        `index` its journal (None: a `NoIndex`); `pending_caps` bound each
        session's pending saves (`quotas`; None: unbounded);
        `ack_wait_seconds` bounds how long an eviction waits on a live view
        (`reclamation`; None: three leases, the daemon's default);
        `listener` hears entries change and pages come back (None: nobody)."""
        if page_bytes <= 0 or capacity_bytes < page_bytes:
            raise ValueError("the cache needs at least one page")
        self.page_bytes = page_bytes
        self.data_offset = data_offset
        self.allocator = ExtentAllocator(capacity_bytes // page_bytes)
        self.capacity_bytes = self.allocator.total_pages * page_bytes
        self.sessions = sessions
        self.policy: EvictionPolicy = policy or LRUPolicy()
        self.stamps: Stamps = stamps if stamps is not None else NoStamps()
        self.index: Index | NoIndex = index if index is not None else NoIndex()
        self.listener: CacheListener = listener if listener is not None else Unheard()
        self.quarantine_seconds = quarantine_seconds
        self.acks = Acknowledgements(sessions, ACK_WAIT_LEASES * sessions.lease_seconds
                                     if ack_wait_seconds is None else ack_wait_seconds,
                                     self._reclaim)
        # Ids of hidden entries whose pages were cut off the region file
        # (`cut_off`): stamped LOST until they are reclaimed.
        self.lost: set[int] = set()
        self.quota = PendingQuota(pending_caps, self.page_bytes)
        self.table = EntryTable()
        self._next_entry_id = 1
        self.quarantine = Quarantine()  # saves discarded with their session
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.views = Views(sessions=sessions, table=self.table, acks=self.acks,
                           policy=self.policy, index=self.index, counters=self.counters,
                           extents=self.extents)

    # ----------------------------------------------------------- sessions

    def attach(self, *, engine_id: str, role: Role, rank: int | None, world_size: int,
               namespace: str, client_name: str, engine_token: str = "",
               in_place_of: Session | None = None) -> Session:
        """Create a session (`SessionTable.create`); it takes part once its
        stream opens (`Views.open`). Raises ResourceExhausted past the session
        caps (counted)."""
        try:
            session = self.sessions.create(
                engine_id=engine_id, role=role, rank=rank, world_size=world_size,
                namespace=namespace, client_name=client_name, engine_token=engine_token,
                in_place_of=in_place_of)
        except ResourceExhausted:
            self.counters["refused_attaches"] += 1
            raise
        self.table.counted(session.namespace)
        return session

    def end_session(self, session: Session, *, detached: bool = False) -> None:
        """Release everything `session` holds. Idempotent.

        Pending saves are quarantined. A scheduler session that `detached`
        (its client said it will load nothing more) acknowledges everything
        it owed; one that did not becomes a ghost for one lease.
        """
        if not session.alive:
            return
        # A view whose stream never opened was told nothing: no ghost.
        ghost = session.is_scheduler and session.streaming and not detached
        self.sessions.remove(session, ghost=ghost)
        for key in list(session.pending):
            self._discard_pending(self.table.of(key[0])[key[1]], quarantine=True)
        if not ghost:
            self.acks.acknowledge_all(session)
            if session.is_scheduler and session.streaming:
                self.index.view_off(session.engine_key, session.namespace)
        if not session.is_scheduler and session.streaming:
            self.views.tell_ranks(session.engine_key)
        session.outbox.clear()
        session.wake()
        self._prune_namespace(session.namespace)

    def expire_sessions(self) -> list[Session]:
        """End every session whose lease ran out; returns them."""
        expired = self.sessions.expired()
        for session in expired:
            session.ended_why = f"no message for {self.sessions.lease_seconds:.1f}s (its lease)"
            self.end_session(session)
        return expired

    def release_ghosts(self) -> list[Session]:
        """Acknowledge for ghosts whose lease is over; returns them."""
        ghosts = self.sessions.expired_ghosts()
        for ghost in ghosts:
            self._ghost_gone(ghost)
        return ghosts

    def reattached(self, session: Session) -> None:
        """`session`'s engine declared its loads in flight (`Views.hold`) on the
        session's first message: the ghost standing for that engine's view of
        the previous daemon (`restore`) awaits nothing any more."""
        ghost = self.acks.reattached(session)
        if ghost is not None:
            self._ghost_gone(ghost)

    def _ghost_gone(self, ghost: Session) -> None:
        self.acks.ghost_gone(ghost)
        self.index.view_off(ghost.engine_key, ghost.namespace)
        self._prune_namespace(ghost.namespace)

    # -------------------------------------------------------------- saves

    def allocate(self, session: Session, mm_hash: str, nbytes: int,
                 shape: tuple[int, ...], dtype: str, *, count_hidden: bool = True) -> AllocResult:
        """Reserve and stamp extents for a save of `mm_hash` by `session`.

        On ALLOCATED the caller copies into the extents, then must `commit`
        (or `abort`); if the session ends first the pages are quarantined.
        WAIT: victims were hidden, ask again once pages came back
        (`CacheListener.pages_reclaimed`). Raises
        ResourceExhausted when no room can be made, or past the session's cap
        of pending saves (`quotas`, nothing evicted): the caller drops the save.
        `count_hidden`: hidden pages count as coming back (acknowledgements
        usually arrive within milliseconds); a caller that waited in vain asks
        again without, and more ready entries are hidden if need be.
        """
        if session.rank is None or not session.can_save:
            raise FailedPrecondition(
                f"a {session.role} {session.component} session cannot save: only worker "
                "sessions of producer or both engines allocate")
        validate_save(mm_hash, nbytes, shape, dtype)
        existing = self.table.get(session.namespace, mm_hash)
        if existing is not None:
            return AllocResult({State.PENDING: AllocOutcome.ALREADY_PENDING,
                                State.READY: AllocOutcome.ALREADY_READY,
                                State.HIDDEN: AllocOutcome.ALREADY_HIDDEN}[existing.state],
                               existing.entry_id)
        pages = -(-nbytes // self.page_bytes)
        if pages > self.allocator.total_pages:
            self.counters["refused_saves"] += 1
            raise ResourceExhausted(
                f"an entry of {nbytes} bytes is larger than the cache "
                f"({self.capacity_bytes} bytes)")
        try:
            self.quota.check(session, pages)  # before anything is evicted for it
        except ResourceExhausted:
            self.counters["capped_saves"] += 1
            raise
        runs = self.allocator.allocate(pages) or self._make_room(pages, count_hidden)
        if runs is None:
            if self.allocator.free_pages + self.table.hidden_pages >= pages:
                return AllocResult(AllocOutcome.WAIT)
            self.counters["refused_saves"] += 1
            raise ResourceExhausted(self._full_message(nbytes))
        if self._next_entry_id >= self.index.ids_reserved:  # said before it is used
            self.index.reserve_ids(self._next_entry_id + ID_BLOCK)
        entry = Entry((session.namespace, mm_hash), self._next_entry_id, nbytes, shape, dtype,
                      runs, session)
        self._next_entry_id += 1
        self.stamps.write(runs, entry.entry_id)  # before anyone learns the extents
        self.table.pending(entry)
        session.pending.add(entry.key)
        session.pending_pages += entry.pages
        if session.session_id:  # (the daemon's own writer is bounded by its budget)
            self.quota.take(session.engine_key, entry.pages)
        return AllocResult(AllocOutcome.ALLOCATED, entry.entry_id, self.extents(entry))

    def refuse_waited_save(self, nbytes: int) -> ResourceExhausted:
        """The error for a save that waited in vain for reclamation."""
        self.counters["refused_saves"] += 1
        return ResourceExhausted(self._full_message(nbytes) + " (evicted entries were not "
                                 "acknowledged in time)")

    def commit(self, session: Session, mm_hashes: Iterable[str],
               checksums: Iterable[int] = ()) -> list[ReportStatus]:
        """Make `session`'s pending entries ready (their copies landed), each
        with the checksum of its bytes its writer reported (`checksums`, in
        order; missing or 0: none)."""
        hashes = _valid(mm_hashes)
        sums = list(checksums)
        return [self._commit_one(session, h, sums[i] if i < len(sums) else 0)
                for i, h in enumerate(hashes)]

    def abort(self, session: Session, mm_hashes: Iterable[str]) -> list[ReportStatus]:
        """Discard `session`'s pending entries (their copies will not land)."""
        statuses = []
        namespace = self.table.of(session.namespace)
        for mm_hash in _valid(mm_hashes):
            entry = namespace.get(mm_hash)
            if entry is not None and entry.state is State.PENDING and entry.owner is session:
                self._discard_pending(entry)
                statuses.append(ReportStatus.ACCEPTED)
            else:
                statuses.append(ReportStatus.UNKNOWN)
        return statuses

    def release_quarantine(self) -> int:
        """Free the pages of discarded saves whose quarantine is over."""
        now = self.sessions.clock()
        self.quota.release(now)
        released = 0
        for runs, pages in self.quarantine.over(now):
            self._free_runs(runs)
            released += pages
        return released

    # ------------------------------------------------------------ entries

    def withdraw(self, entry: Entry) -> None:
        """Ready `entry`'s pages no longer hold what its writer saved (another
        process wrote them: `plane.verify`): stamped LOST, so no load of it
        passes its stamp check any more, and hidden as eviction would (its
        views told; its pages reclaimed once they acknowledge)."""
        assert entry.state is State.READY
        self.stamps.write(entry.runs, LOST)
        self.lost.add(entry.entry_id)
        self._hide(entry)

    def lookup(self, namespace: str, mm_hashes: list[str]) -> list[Entry | None]:
        """Entries as tools see them: pending ones are absent."""
        entries = self.table.of(namespace)
        found = [entries.get(h) for h in _valid(mm_hashes)]
        return [e if e is not None and e.state is not State.PENDING else None for e in found]

    def state_of(self, namespace: str, mm_hash: str) -> State | None:
        """The state of a key's entry; None when there is none."""
        entry = self.get(namespace, mm_hash)
        return None if entry is None else entry.state

    def get(self, namespace: str, mm_hash: str) -> Entry | None:
        """A key's entry in any state (the service's second tier)."""
        return self.table.get(namespace, mm_hash)

    def extents(self, entry: Entry) -> tuple[Extent, ...]:
        """Byte extents of `entry` in the region file, in payload order; the
        last is trimmed to the entry's size."""
        out = []
        left = entry.nbytes
        for start, pages in entry.runs:
            length = min(pages * self.page_bytes, left)
            out.append((self.data_offset + start * self.page_bytes, length))
            left -= length
        return tuple(out)

    def entries(self) -> Iterable[Entry]:
        """Every entry, any state (the invariant checker and tools)."""
        return iter(self.table)

    # ---------------------------------------------------- warm restart

    def restore(self, records: Iterable[Record], free: list[Run], quarantined: list[Run],
                next_entry_id: int, views: Iterable[tuple[str, str]], ghost: MakeGhost) -> None:
        """Rebuild an empty cache from an adopted region (`adoption`): the
        verified `records` (least recently used first) become ready or hidden
        entries, `quarantined` runs (stamped, owned by no adopted entry: a
        writer of the previous daemon may still be copying) stay out of use
        for the quarantine, and ids continue from `next_entry_id`. Each engine
        instance whose view was attached (`views`: engine key, namespace) may
        still be loading: a ghost of it, `ghost(namespace, key, seen_upto)`, is
        awaited by the hidden entries of its namespace and by every eviction
        there of an adopted entry, until the engine re-attaches (`reattached`)
        or a lease passes."""
        assert self._next_entry_id == 1 and not self.table, "restore into an empty cache"
        self.allocator = ExtentAllocator(self.allocator.total_pages, free)
        self._next_entry_id = next_entry_id
        awaited = self.acks.previous_views(views, ghost, next_entry_id - 1)
        hidden = []
        for record in records:
            key = (record.namespace, record.mm_hash)
            entry = Entry(key, record.entry_id, record.nbytes, record.shape, record.dtype,
                          record.runs, None)
            entry.checksum = record.checksum
            if record.hidden:
                entry.state = State.HIDDEN
                entry.awaiting = set(awaited.get(key[0], ()))
                for view in entry.awaiting:
                    view.awaiting.add(entry)
                hidden.append(entry)
            else:
                entry.state = State.READY
                self.policy.add(key, entry.pages)
            self.table.adopted(entry)
        if quarantined:
            self.quarantine.hold(self.sessions.clock() + self.quarantine_seconds, quarantined,
                                 sum(n for _, n in quarantined))
        for entry in hidden:
            if not entry.awaiting:  # no view was attached: nobody can be loading it
                self._reclaim(entry)

    def cut_off(self, first: int) -> list[Entry]:
        """The region file lost every payload page from `first` on (a client
        truncated it; the file was given its size back, zeros there). Every
        entry with a page there is lost, and none may be read or completed:
        its pages, and quarantined ones there, are stamped LOST (no reader's
        or writer's check passes on it); a ready one is hidden (its views
        told; reclaimed once they acknowledge), a hidden one goes as it would,
        a pending one is dropped into quarantine (its writer may still be
        copying). Returns the entries lost."""
        lost = [e for e in self.entries() if any(p + n > first for p, n in e.runs)]
        for entry in lost:
            self.stamps.write(entry.runs, LOST)
            if entry.state is State.PENDING:
                self._discard_pending(entry, quarantine=True)
                continue
            self.lost.add(entry.entry_id)
            if entry.state is State.READY:
                self._hide(entry)  # (reclaimed at once when nobody awaits it)
        for _, runs, _ in self.quarantine:
            cut = [(p, n) for p, n in runs if p + n > first]
            if cut:
                self.stamps.write(cut, LOST)
        return lost

    def compact_index(self) -> bool:
        """Rewrite the journal when it holds mostly dead records, live entries
        in eviction order (a later adoption keeps it). True if it did."""
        if not self.index.needs_compaction():
            return False
        ready = (self.table.of(ns)[h].entry_id for ns, h in
                 cast(Iterable[Key], self.policy.order()))
        hidden = (e.entry_id for e in self.entries() if e.state is State.HIDDEN)
        self.index.compact(itertools.chain(ready, hidden))
        return True

    # ------------------------------------------------------------ helpers

    def _make_room(self, pages: int, count_hidden: bool) -> list[Run] | None:
        """Hide LRU victims so `pages` can come free; allocate if it already can."""
        # Hidden entries are on their way out (after the acknowledgements).
        coming = self.table.hidden_pages if count_hidden else 0
        shortfall = pages - self.allocator.free_pages - coming
        if shortfall > 0:
            # A whole batch where there is one; never less than the shortfall.
            batch = min(self.allocator.total_pages // EVICTION_BATCH_DIVISOR,
                        self.policy.evictable_pages)
            for key in self.policy.choose(max(shortfall, batch)):
                namespace, mm_hash = cast(Key, key)
                self._hide(self.table.of(namespace)[mm_hash])
        return self.allocator.allocate(pages)

    def _commit_one(self, session: Session, mm_hash: str, checksum: int = 0) -> ReportStatus:
        entry = self.table.get(session.namespace, mm_hash)
        if entry is None or (entry.state is State.PENDING and entry.owner is not session):
            return ReportStatus.UNKNOWN
        if entry.state is not State.PENDING:
            return ReportStatus.DUPLICATE
        entry.checksum = checksum
        self.index.ready(entry.entry_id, entry.key[0], entry.key[1], entry.nbytes, entry.shape,
                         entry.dtype, entry.runs, checksum)  # durable before it is visible
        entry.state = State.READY
        entry.owner = None
        session.pending.discard(entry.key)
        session.pending_pages -= entry.pages
        self.table.ready(entry)
        if session.session_id:
            self.quota.settle(session.engine_key, entry.pages)
        self.policy.add(entry.key, entry.pages)
        self.counters["saves"] += 1
        self.counters["bytes_saved"] += entry.nbytes
        self.views.ready(entry)
        self.listener.entry_changed(entry)  # after the views: a waiter's answer follows its event
        return ReportStatus.ACCEPTED

    def _discard_pending(self, entry: Entry, *, quarantine: bool = False) -> None:
        """Drop a pending entry; with `quarantine` its pages stay out of use
        (and stamped) for `quarantine_seconds`."""
        owner = entry.owner
        assert entry.state is State.PENDING and owner is not None
        owner.pending.discard(entry.key)
        owner.pending_pages -= entry.pages
        entry.owner = None
        if owner.session_id:
            self.quota.settle(owner.engine_key, entry.pages)
        if self.table.discarded(entry):
            self._prune_namespace(entry.key[0])
        if not quarantine:
            self._free_runs(entry.runs)
            return
        until = self.sessions.clock() + self.quarantine_seconds
        if owner.session_id:
            self.quota.charge(owner.engine_key, entry.pages, until)  # its instance holds them
        self.quarantine.hold(until, entry.runs, entry.pages)

    def _hide(self, entry: Entry) -> None:
        assert entry.state is State.READY
        self.policy.remove(entry.key)
        awaiting = self.acks.awaited(entry)
        if awaiting:  # else reclaimed at once: its GONE record says it all
            self.index.hidden(entry.entry_id)
        entry.state = State.HIDDEN
        self.table.hidden(entry)
        self.counters["evictions"] += 1
        self.listener.entry_changed(entry)
        if awaiting:
            self.acks.hidden(entry, awaiting)
        else:
            self._reclaim(entry)

    def _reclaim(self, entry: Entry) -> None:
        assert entry.state is State.HIDDEN and not entry.awaiting
        entry.ack_by = 0.0
        self.lost.discard(entry.entry_id)
        self.index.gone(entry.entry_id)  # before any page can be reused
        if self.table.reclaimed(entry):
            self._prune_namespace(entry.key[0])
        self._free_runs(entry.runs)

    def _free_runs(self, runs: list[Run]) -> None:
        self.stamps.clear(runs)
        self.allocator.free(runs)
        self.listener.pages_reclaimed()  # an allocation may be waiting for these pages

    def _prune_namespace(self, namespace: str) -> None:
        """Forget the counters of a namespace nobody uses and nothing is in."""
        if not self.sessions.in_use(namespace):
            self.table.prune(namespace)

    def join(self, worker: Session, key: str) -> None:
        """Worker `worker` presented the token of engine instance `key`: it
        counts toward that instance's views only (both instances' views are
        told their count)."""
        before = self.sessions.join(worker, key)
        self.quota.move(before, key, worker.pending_pages)  # its saves are the instance's
        if before != key and worker.streaming:
            self.views.tell_ranks(before)
            self.views.tell_ranks(key)

    def _full_message(self, nbytes: int) -> str:
        pb = self.page_bytes
        return (f"cache full: cannot place {nbytes} bytes ({self.allocator.free_pages * pb} free, "
                f"{self.table.pending_pages * pb} pending, {self.table.hidden_pages * pb} hidden "
                f"awaiting acknowledgement, {self.quarantine.pages * pb} quarantined)")


def _valid(mm_hashes: Iterable[str]) -> list[str]:
    """All of `mm_hashes`, checked before any is used (raises InvalidArgument)."""
    hashes = list(mm_hashes)
    for mm_hash in hashes:
        validate_mm_hash(mm_hash)
    return hashes
