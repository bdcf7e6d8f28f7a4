"""Random-operation state machine over ec_daemon.cache.Cache.

Models the real asynchrony: each scheduler client has a local view fed by
its outbox (delivered at random times), a client->daemon message queue
(pins then deferred acks, delivered at random times), and worker ranks that
copy dispatched loads at random times (possibly before the pin lands) and
report at random times.

Safety properties checked, beyond Cache.check_invariants():
  S1  a worker's copy that gets a HELD verdict read pages that were owned by
      the spec's entry at copy time (no reuse before the copy);
  S2  an entry that is in a live scheduler's client view (not yet acked) is
      never reclaimed (pages not reused);
  S3  a pin sent for an entry that was in the view when sent succeeds
      (unless no worker is attached / role forbids);
  plus bookkeeping: policy holds exactly the ready unpinned entries;
  entry.awaiting and session.awaiting are symmetric; every transfer's entry
  is still in the map.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ec_daemon.cache import State
from ec_daemon.errors import CacheError
from ec_daemon.events import (
    AllocOutcome,
    EvictedEvent,
    ReadyEvent,
    Verdict,
)
from tests.unit.cache_helpers import PAGE, FakeClock, make_cache

ENGINES = ("E", "F")
NS = ("ns", "other")
HASHES = tuple("abcdef")


class Client:
    """A scheduler client: local view, claims, pending messages to the daemon."""

    def __init__(self, session):
        self.session = session
        self.view: dict[str, tuple[int, tuple]] = {}
        self.claimed: set[str] = set()
        self.deferred: list[tuple[str, int]] = []
        self.to_daemon: list[tuple[str, object]] = []  # ("pin", (tid, h, eid)) / ("ack", ref)
        self.counter = 0
        self.sent_pins: dict[int, bool] = {}  # tid -> was in view when sent


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.cache = make_cache(pages=8, lease=10.0, clock=self.clock)
        self.clients: list[Client] = []
        self.workers: list = []
        self.page_owner: dict[int, int] = {}
        self.tasks: list[dict] = []  # loads dispatched to worker ranks
        self.pin_results: dict[int, bool] = {}

    # ------------------------------------------------------------ sessions
    @rule(engine=st.sampled_from(ENGINES), ns=st.sampled_from(NS),
          role=st.sampled_from(["both", "consumer", "producer"]))
    def attach_scheduler(self, engine, ns, role):
        s = self.cache.attach(engine_id=engine, role=role, rank=None, world_size=1,
                              namespace=ns, client_name="t")
        self.clients.append(Client(s))

    @rule(engine=st.sampled_from(ENGINES), ns=st.sampled_from(NS), rank=st.integers(0, 1),
          role=st.sampled_from(["both", "producer"]))
    def attach_worker(self, engine, ns, rank, role):
        w = self.cache.attach(engine_id=engine, role=role, rank=rank, world_size=2,
                              namespace=ns, client_name="t")
        self.workers.append(w)

    @precondition(lambda self: self.clients or self.workers)
    @rule(data=st.data())
    def end_session(self, data):
        everyone = [c.session for c in self.clients] + self.workers
        s = data.draw(st.sampled_from(everyone))
        self.cache.end_session(s)

    @rule(dt=st.floats(0, 6))
    def tick_and_expire(self, dt):
        self.clock.now += dt
        self.cache.expire_sessions()

    # --------------------------------------------------------------- saves
    @precondition(lambda self: any(w.alive for w in self.workers))
    @rule(data=st.data(), h=st.sampled_from(HASHES), pages=st.integers(1, 4))
    def allocate(self, data, h, pages):
        w = data.draw(st.sampled_from([w for w in self.workers if w.alive]))
        try:
            r = self.cache.allocate(w, h, pages * PAGE, (pages, PAGE), "uint8")
        except CacheError:
            return
        if r.outcome is AllocOutcome.ALLOCATED:
            for off, ln in r.extents:
                for p in range(off // PAGE, (off + ln + PAGE - 1) // PAGE):
                    self.page_owner[p] = r.entry_id

    @precondition(lambda self: any(w.pending for w in self.workers if w.alive))
    @rule(data=st.data(), commit=st.booleans())
    def finish_save(self, data, commit):
        w = data.draw(st.sampled_from([w for w in self.workers if w.alive and w.pending]))
        key = data.draw(st.sampled_from(sorted(w.pending)))
        (self.cache.commit if commit else self.cache.abort)(w, [key[1]])

    # ------------------------------------------------------- scheduler side
    @precondition(lambda self: any(c.session.outbox for c in self.clients))
    @rule(data=st.data())
    def deliver_events(self, data):
        c = data.draw(st.sampled_from([c for c in self.clients if c.session.outbox]))
        n = data.draw(st.integers(1, len(c.session.outbox)))
        for _ in range(n):
            ev = c.session.outbox.popleft()
            if isinstance(ev, ReadyEvent):
                c.view[ev.mm_hash] = (ev.entry_id, ev.extents)
            elif isinstance(ev, EvictedEvent):
                if ev.mm_hash in c.claimed:
                    c.deferred.append((ev.mm_hash, ev.entry_id))
                else:
                    if c.view.get(ev.mm_hash, (None,))[0] == ev.entry_id:
                        del c.view[ev.mm_hash]
                    c.to_daemon.append(("ack", (ev.mm_hash, ev.entry_id)))

    @precondition(lambda self: any(c.view and c.session.alive for c in self.clients))
    @rule(data=st.data())
    def plan_and_step(self, data):
        """has_item + after_alloc for some view entries, then the step boundary:
        pins queued, then deferred acks."""
        c = data.draw(st.sampled_from([c for c in self.clients if c.view and c.session.alive]))
        hs = data.draw(st.lists(st.sampled_from(sorted(c.view)), min_size=1, max_size=3,
                                unique=True))
        for h in hs:
            c.claimed.add(h)
            eid, extents = c.view[h]
            c.counter += 1
            tid = (c.session.index << 32) | c.counter
            c.to_daemon.append(("pin", (tid, h, eid)))
            c.sent_pins[tid] = True
            for rank in (0, 1):  # every TP rank process gets the step's loads
                self.tasks.append(dict(engine=c.session.engine_id, rank=rank, tid=tid,
                                       eid=eid, extents=extents, copied=None))
        c.claimed.clear()
        for h, eid in c.deferred:
            if c.view.get(h, (None,))[0] == eid:
                del c.view[h]
            c.to_daemon.append(("ack", (h, eid)))
        c.deferred.clear()

    @precondition(lambda self: any(c.to_daemon for c in self.clients))
    @rule(data=st.data())
    def deliver_client_messages(self, data):
        c = data.draw(st.sampled_from([c for c in self.clients if c.to_daemon]))
        n = data.draw(st.integers(1, len(c.to_daemon)))
        batch, c.to_daemon = c.to_daemon[:n], c.to_daemon[n:]
        if not c.session.alive:
            return
        for kind, payload in batch:
            if kind == "pin":
                tid, h, eid = payload
                ok = self.cache.pin(c.session, tid, h, eid)
                self.pin_results[tid] = ok
                if not ok and c.session.can_load and self.cache.sessions.worker_ranks(
                        c.session.engine_id):
                    raise AssertionError(f"S3: pin of {h}/{eid} sent from the view failed")
            else:
                self.cache.acknowledge(c.session, [payload])

    # -------------------------------------------------------------- workers
    @precondition(lambda self: any(t["copied"] is None for t in self.tasks))
    @rule(data=st.data())
    def worker_copies(self, data):
        t = data.draw(st.sampled_from([t for t in self.tasks if t["copied"] is None]))
        intact = all(self.page_owner.get(p) == t["eid"]
                     for off, ln in t["extents"]
                     for p in range(off // PAGE, (off + ln + PAGE - 1) // PAGE))
        t["copied"] = intact

    @precondition(lambda self: any(t["copied"] is not None for t in self.tasks))
    @rule(data=st.data())
    def worker_reports(self, data):
        t = data.draw(st.sampled_from([t for t in self.tasks if t["copied"] is not None]))
        live = [o for o in self.workers if o.alive and o.engine_id == t["engine"]
                and o.rank == t["rank"]]
        if not live:
            return  # detached rank process: it reports once it re-attaches
        w = data.draw(st.sampled_from(live))
        (v,) = self.cache.report_loaded(w, [t["tid"]])
        if v is Verdict.WAIT:
            return
        if data.draw(st.booleans()):
            self.tasks.remove(t)
        if v is Verdict.HELD:
            assert t["copied"], f"S1: HELD for transfer {t['tid']:x} whose copy read reused pages"
            assert self.pin_results.get(t["tid"]), "HELD without a successful pin"

    # ----------------------------------------------------------- invariants
    @invariant()
    def core_invariants(self):
        self.cache.check_invariants()

    @invariant()
    def extra_invariants(self):
        cache = self.cache
        live = {}
        for entries in cache._namespaces.values():
            for e in entries.values():
                live[e.entry_id] = e
                evictable = e.state is State.READY and not e.pins
                assert (e.key in cache.policy._order) == evictable, (e.key, e.state, e.pins)
                for s in e.awaiting:
                    assert e in s.awaiting
        assert len(cache.policy._order) == sum(
            1 for es in cache._namespaces.values() for e in es.values()
            if e.state is State.READY and not e.pins)
        for s in cache.sessions:
            for e in s.awaiting:
                assert s in e.awaiting and live.get(e.entry_id) is e
        for t in cache._transfers.values():
            assert live.get(t.entry.entry_id) is t.entry, "transfer of a freed entry"
        # S2: an entry in a live client's view whose eviction it has not acked
        # must still own its pages.
        for c in self.clients:
            if not c.session.alive:
                continue
            for h, (eid, extents) in c.view.items():
                pages = {p for off, ln in extents
                         for p in range(off // PAGE, (off + ln + PAGE - 1) // PAGE)}
                assert all(self.page_owner.get(p) == eid for p in pages), (
                    f"S2: pages of {h}/{eid} reused while a live view shows it")


CacheMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("STATE_MACHINE_EXAMPLES", "300")),
    stateful_step_count=60, deadline=None,
    suppress_health_check=list(HealthCheck))
TestCacheMachine = CacheMachine.TestCase
