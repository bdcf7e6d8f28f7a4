"""A random-operation state machine over the cache core and the clients
around it, checking the property loads depend on:

    no load that a view dispatched ever reads a page whose content or stamp
    is not its entry's, until that load finished.

The region is modelled as `content` (page -> the entry_id its last writer
copied there) next to the cache's real stamp table. Clients follow their
contract, and nothing more, with every message delayed at random:

- writers allocate, copy their entry_id into their pages, then commit or
  abort; a writer whose session ended may still copy (it was frozen) until
  its quarantine is over;
- each scheduler view shows what its delivered events say, claims only
  entries it shows and only while fresh (half a lease after its last
  renewal), dispatches or drops its claims at the step boundary, withholds
  the acknowledgement of an eviction while that entry is claimed or in
  flight, and acknowledges when the last of them finished; a load lands
  within half a lease of its claim;
- views end detached (only with nothing in flight) or not (a ghost, which
  may still finish its loads and keep dispatching while fresh); a view
  whose outbox overflowed misses events until the service ends it;
- the clock runs past leases and quarantines; the daemon's upkeep
  (expire_sessions, release_ghosts, release_quarantine) runs at random.

After every rule: `invariants.check`; every stamp (owned pages carry their
entry's, quarantined ones the dead writer's, free ones none); no page under
a writer that may still copy is reused; and the property above for every
claim, every load in flight, and every entry a fresh view shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ec_daemon.core import invariants
from ec_daemon.core.events import (
    AllocOutcome,
    EvictedEvent,
    ReadyEvent,
    ReadySnapshot,
    ReportStatus,
)
from ec_daemon.core.records import Session, State
from ec_daemon.errors import ResourceExhausted
from ec_protocol.stamps import FREE
from tests.property_budget import Budget, run_machine
from tests.unit.cache_helpers import (
    PAGE,
    FakeClock,
    make_cache,
    page_numbers,
    stamp_table,
    stamped,
)

PAGES = 6
LEASE = 10.0
QUARANTINE = 30.0
LOAD_SECONDS = LEASE / 2  # the longest a claimed load takes to land (an assumption)
NAMESPACES = ("ns", "other")
HASHES = tuple("abcdef")
BUDGET = Budget.from_env("STATE_MACHINE_EXAMPLES", 300, "STATE_MACHINE_SECONDS", 40)

Ref = tuple[str, int]
Extents = tuple[tuple[int, int], ...]


@dataclass
class Save:
    """An allocation as its writer knows it."""

    writer: Session
    mm_hash: str
    entry_id: int
    extents: Extents
    copied: bool = False
    reported: bool = False  # committed or aborted
    ended_at: float | None = None  # its writer's session ended before the report


@dataclass
class Load:
    ref: Ref
    extents: Extents
    claimed_at: float
    dispatched: bool = False


@dataclass
class View:
    """A scheduler's local view, as `ec_client.scheduler_side.view` keeps it."""

    session: Session
    renewed_at: float
    shown: dict[str, tuple[int, Extents]] = field(default_factory=dict)
    busy: list[Load] = field(default_factory=list)  # claims and loads in flight
    withheld: set[Ref] = field(default_factory=set)
    to_daemon: list[tuple[str, Ref]] = field(default_factory=list)  # ("ack"|"touch", ref)
    detached: bool = False

    def fresh(self, now: float) -> bool:
        return not self.detached and now < self.renewed_at + LEASE / 2

    def release(self, load: Load) -> None:
        """`load` finished or was dropped: acknowledge if it held an eviction."""
        self.busy.remove(load)
        if load.ref in self.withheld and all(other.ref != load.ref for other in self.busy):
            self.withheld.discard(load.ref)
            self.to_daemon.append(("ack", load.ref))


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.table = stamp_table(PAGES)
        self.cache = make_cache(PAGES, LEASE, self.clock, stamps=self.table,
                                quarantine=QUARANTINE)
        self.content: dict[int, int] = {}
        self.views: list[View] = []
        self.writers: list[Session] = []
        self.saves: list[Save] = []

    def pages(self, extents: Extents) -> list[int]:
        return page_numbers(self.cache, extents)

    def intact(self, entry_id: int, extents: Extents) -> bool:
        return (all(self.content.get(p) == entry_id for p in self.pages(extents))
                and self.table.holds(extents, entry_id))

    @initialize(slow=st.lists(st.booleans(), min_size=2, max_size=2))
    def attach_some(self, slow: list[bool]) -> None:
        """Two writers and two views in one namespace, to start with."""
        for _ in range(2):
            self.attach_writer("ns")
        for is_slow in slow:
            self.attach_view("ns", is_slow)

    # ------------------------------------------------------------ writers

    @rule(ns=st.sampled_from(NAMESPACES))
    def attach_writer(self, ns: str) -> None:
        writer = self.cache.attach(engine_id=f"W{len(self.writers)}", role="producer", rank=0,
                                   world_size=1, namespace=ns, client_name="writer")
        self.cache.views.open(writer)
        self.writers.append(writer)

    @precondition(lambda self: any(w.alive for w in self.writers))
    @rule(data=st.data(), mm_hash=st.sampled_from(HASHES), pages=st.integers(1, 2))
    def allocate(self, data: st.DataObject, mm_hash: str, pages: int) -> None:
        self.try_allocate(data, mm_hash, pages)

    def try_allocate(self, data: st.DataObject, mm_hash: str, pages: int) -> Save | None:
        writer = data.draw(st.sampled_from([w for w in self.writers if w.alive]))
        try:
            result = self.cache.allocate(writer, mm_hash, pages * PAGE, (pages, PAGE), "uint8")
        except ResourceExhausted:
            return None
        if result.outcome is not AllocOutcome.ALLOCATED:
            return None
        assert self.table.holds(result.extents, result.entry_id), "extents given unstamped"
        self.saves.append(Save(writer, mm_hash, result.entry_id, result.extents))
        return self.saves[-1]

    @precondition(lambda self: any(w.alive for w in self.writers))
    @rule(data=st.data(), mm_hash=st.sampled_from(HASHES), pages=st.integers(1, 2))
    def save(self, data: st.DataObject, mm_hash: str, pages: int) -> None:
        """A whole save at once: allocate, copy, commit."""
        save = self.try_allocate(data, mm_hash, pages)
        if save is not None:
            self.write(save)
            assert self.cache.commit(save.writer, [mm_hash]) == [ReportStatus.ACCEPTED]
            save.reported = True

    def copiable(self) -> list[Save]:
        """Saves whose writer may still be copying (alive, or frozen while quarantined)."""
        now = self.clock.now
        return [s for s in self.saves if not s.copied and not s.reported
                and (s.ended_at is None or now < s.ended_at + QUARANTINE)]

    @precondition(lambda self: self.copiable())
    @rule(data=st.data())
    def copy(self, data: st.DataObject) -> None:
        self.write(data.draw(st.sampled_from(self.copiable())))

    def write(self, save: Save) -> None:
        for page in self.pages(save.extents):
            self.content[page] = save.entry_id
        save.copied = True

    def reportable(self, copied: bool) -> list[Save]:
        return [s for s in self.saves if s.writer.alive and not s.reported
                and (s.copied or not copied)]

    @precondition(lambda self: self.reportable(copied=True))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        save = data.draw(st.sampled_from(self.reportable(copied=True)))
        assert self.cache.commit(save.writer, [save.mm_hash]) == [ReportStatus.ACCEPTED]
        save.reported = True

    @precondition(lambda self: self.reportable(copied=False))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        save = data.draw(st.sampled_from(self.reportable(copied=False)))
        assert self.cache.abort(save.writer, [save.mm_hash]) == [ReportStatus.ACCEPTED]
        save.reported = True

    @precondition(lambda self: any(w.alive for w in self.writers))
    @rule(data=st.data(), detached=st.booleans())
    def end_writer(self, data: st.DataObject, detached: bool) -> None:
        writer = data.draw(st.sampled_from([w for w in self.writers if w.alive]))
        self.cache.end_session(writer, detached=detached)
        self.writer_ended(writer)

    def writer_ended(self, writer: Session) -> None:
        for save in self.saves:
            if save.writer is writer and not save.reported:
                save.ended_at = self.clock.now

    # -------------------------------------------------------------- views

    @rule(ns=st.sampled_from(NAMESPACES), slow=st.booleans())
    def attach_view(self, ns: str, slow: bool) -> None:
        session = self.cache.attach(engine_id=f"S{len(self.views)}", role="both", rank=None,
                                    world_size=1, namespace=ns, client_name="view")
        self.cache.views.open(session)
        if slow:  # a reader that falls behind after a few events
            session.outbox_limit = len(session.outbox) + 2
        self.views.append(View(session, self.clock.now))

    @rule(silent=st.integers(0, 5))
    def heartbeats(self, silent: int) -> None:
        """Every live session renews its lease, except one that hangs."""
        sessions = [v.session for v in self.views] + self.writers
        for session in sessions:
            if session.alive and session is not sessions[silent % len(sessions)]:
                self.cache.sessions.renew(session)
        for view in self.views:
            if view.session.alive and view.session is not sessions[silent % len(sessions)]:
                view.renewed_at = self.clock.now

    def readable(self) -> list[View]:
        """Views whose stream still delivers (an overflowed one is being cut off)."""
        return [v for v in self.views if v.session.alive and not v.session.overflowed
                and v.session.outbox]

    @precondition(lambda self: self.readable())
    @rule(data=st.data())
    def deliver_events(self, data: st.DataObject) -> None:
        view = data.draw(st.sampled_from(self.readable()))
        self.deliver(view, data.draw(st.integers(1, len(view.session.outbox))))

    def deliver(self, view: View, count: int) -> None:
        outbox = view.session.outbox
        for _ in range(count):
            if not outbox:
                break
            event = outbox[0]
            if isinstance(event, ReadySnapshot):  # its ready events, made as the stream sends them
                event = event.next()
                if event is None:
                    outbox.popleft()
                    continue
            else:
                outbox.popleft()
            if isinstance(event, ReadyEvent):
                view.shown[event.mm_hash] = (event.entry_id, event.extents)
            elif isinstance(event, EvictedEvent):
                ref = (event.mm_hash, event.entry_id)
                if view.shown.get(event.mm_hash, (None,))[0] == event.entry_id:
                    del view.shown[event.mm_hash]
                if any(load.ref == ref for load in view.busy):
                    view.withheld.add(ref)
                else:
                    view.to_daemon.append(("ack", ref))

    @rule()
    def quiet(self) -> None:
        """Every stream catches up, both ways."""
        for view in self.views:
            if view.session.alive and not view.session.overflowed:
                self.deliver(view, len(view.session.outbox))
        for view in self.views:
            self.send(view, len(view.to_daemon))

    def claimers(self) -> list[View]:
        return [v for v in self.views if v.shown and v.fresh(self.clock.now)]

    @precondition(lambda self: self.claimers())
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        """A hit: only on an entry the view shows, only while it is fresh."""
        view = data.draw(st.sampled_from(self.claimers()))
        mm_hash = data.draw(st.sampled_from(sorted(view.shown)))
        entry_id, extents = view.shown[mm_hash]
        view.busy.append(Load((mm_hash, entry_id), extents, self.clock.now))

    @precondition(lambda self: any(not b.dispatched for v in self.views for b in v.busy))
    @rule(data=st.data())
    def end_step(self, data: st.DataObject) -> None:
        """The step boundary: each claim is dispatched (in flight) or dropped."""
        view = data.draw(st.sampled_from(
            [v for v in self.views if any(not b.dispatched for b in v.busy)]))
        for load in [b for b in view.busy if not b.dispatched]:
            if data.draw(st.booleans()):
                load.dispatched = True
                view.to_daemon.append(("touch", load.ref))
            else:
                view.release(load)

    @precondition(lambda self: any(b.dispatched for v in self.views for b in v.busy))
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        view = data.draw(st.sampled_from(
            [v for v in self.views if any(b.dispatched for b in v.busy)]))
        view.release(data.draw(st.sampled_from([b for b in view.busy if b.dispatched])))

    @precondition(lambda self: any(v.to_daemon for v in self.views))
    @rule(data=st.data())
    def deliver_messages(self, data: st.DataObject) -> None:
        view = data.draw(st.sampled_from([v for v in self.views if v.to_daemon]))
        self.send(view, data.draw(st.integers(1, len(view.to_daemon))))

    def send(self, view: View, count: int) -> None:
        batch, view.to_daemon = view.to_daemon[:count], view.to_daemon[count:]
        if not view.session.alive:
            return  # the stream is gone
        for kind, ref in batch:
            if kind == "ack":
                self.cache.views.acknowledge(view.session, [ref])
            else:
                self.cache.views.touch(view.session, [(*ref, 1)])

    @precondition(lambda self: any(v.session.alive for v in self.views))
    @rule(data=st.data(), detached=st.booleans())
    def end_view(self, data: st.DataObject, detached: bool) -> None:
        """Detached: the client will load nothing more (so nothing is in
        flight). Otherwise the stream was lost or cut off as too slow."""
        alive = [v for v in self.views if v.session.alive and not (detached and v.busy)]
        if not alive:
            return
        view = data.draw(st.sampled_from(alive))
        view.detached = detached
        self.cache.end_session(view.session, detached=detached)

    # -------------------------------------------------------- time, upkeep

    @rule(seconds=st.floats(0.1, LEASE))
    def advance_clock(self, seconds: float) -> None:
        now = self.clock.now + seconds
        for view in self.views:
            for load in [b for b in view.busy if b.claimed_at + LOAD_SECONDS <= now]:
                view.release(load)  # it landed by now
        self.clock.now = now

    @rule()
    def upkeep(self) -> None:
        """What the service's upkeep loop does, in its order."""
        for session in self.cache.expire_sessions():
            self.writer_ended(session)
        self.cache.release_ghosts()
        self.cache.release_quarantine()

    # ---------------------------------------------------------- properties

    @invariant()
    def bookkeeping(self) -> None:
        invariants.check(self.cache)

    @invariant()
    def stamps_name_every_owner(self) -> None:
        owned: dict[int, int] = {}
        for entry in self.cache.entries():
            owned.update(dict.fromkeys(self.pages(self.cache.extents(entry)), entry.entry_id))
            if entry.state is not State.PENDING:
                assert self.intact(entry.entry_id, self.cache.extents(entry)), (
                    f"{entry.key} is {entry.state.value} but its pages were overwritten")
        quarantined: set[int] = set()
        for _, runs, _ in self.cache.quarantine:
            pages = {p for first, count in runs for p in range(first, first + count)}
            quarantined |= pages
            # The last save into these pages is the dead writer's: its stamp stays.
            dead = max((s for s in self.saves if set(self.pages(s.extents)) == pages),
                       key=lambda s: s.entry_id)
            assert dead.ended_at is not None and not dead.reported
            assert self.table.holds(dead.extents, dead.entry_id), "quarantine lost a stamp"
        for save in self.copiable():
            assert self.table.holds(save.extents, save.entry_id), (
                f"pages of {save.mm_hash}/{save.entry_id} reused while its writer may copy")
        free = set(range(PAGES)) - owned.keys() - quarantined
        assert stamped(self.table, sorted(free), FREE), "a free page keeps a stamp"
        for page, entry_id in owned.items():
            assert stamped(self.table, [page], entry_id)

    @invariant()
    def no_load_reads_reused_pages(self) -> None:
        committed = {s.entry_id for s in self.saves if s.reported}
        now = self.clock.now
        for view in self.views:
            for load in view.busy:
                kind = "in flight" if load.dispatched else "claimed"
                assert self.intact(load.ref[1], load.extents), (
                    f"a load of {load.ref} {kind} in view {view.session.index} reads pages "
                    "that were reused")
            for mm_hash, (entry_id, extents) in view.shown.items():
                assert entry_id in committed, f"{mm_hash}/{entry_id} shown before its commit"
                if view.fresh(now):
                    assert self.intact(entry_id, extents), (
                        f"{mm_hash}/{entry_id} can still be claimed in view "
                        f"{view.session.index} but its pages were reused")


def test_no_load_reads_reused_pages(record_property) -> None:
    spent = run_machine(BUDGET, CacheMachine, stateful_step_count=100,
                        suppress_health_check=list(HealthCheck))
    spent.record(record_property)
