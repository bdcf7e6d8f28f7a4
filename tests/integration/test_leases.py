"""Leases, stale views and ghosts, with a short lease (2 s).

A scheduler that is frozen past its lease must not dispatch from the view it
had: the daemon dropped its session and may have reused the pages. A
scheduler that vanishes without detaching may still have loads running, so
its owed acknowledgements stay outstanding for one more lease (a ghost); one
that closes cleanly owes nothing.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ec_client.common.contract import STAMP_MISMATCH, LoadSpec
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import pb
from tests.integration import engines
from tests.integration.daemon import Daemon
from tests.integration.engines import LAYOUT, Proc
from tests.integration.raw import UNCAPPED, Filler, MiB, RawStream, attach

pytestmark = pytest.mark.integration
LEASE = 2.0
KEY = "lease-key"
DATA = np.random.default_rng(5).integers(0, 256, (MiB // 1024, 1024), dtype=np.uint8)


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="4MiB", extra=("--lease-seconds", str(LEASE), "--quarantine-seconds",
                                         str(LEASE), "--alloc-wait-seconds", "0.2",
                                         "--ack-wait-seconds", str(LEASE), *UNCAPPED)) as d:
        yield d


class World:
    """A writer engine that saved KEY, a filler that evicts, and the
    processes of engine "S" the test starts."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.procs: list[Proc] = []
        self.writer = WorkerDelegate(daemon.socket, engine_id="writer", layout=LAYOUT,
                                     role="producer")
        assert self.writer.link.wait_attached(10)
        self.save(KEY, DATA)
        self.filler = Filler(daemon.stub, LAYOUT)

    def save(self, mm_hash: str, data: Any) -> None:
        done = self.writer.stats["saves_done"]
        assert self.writer.save(mm_hash, data) and self.writer.flush(10)
        assert self.writer.stats["saves_done"] == done + 1, dict(self.writer.stats)

    def start(self, target: Any, *args: Any) -> Proc:
        proc = Proc(target, *args)
        self.procs.append(proc)
        assert proc.recv() == "ready"
        return proc

    def dispatch(self, scheduler: Proc) -> Any:
        assert scheduler.call("wait_hit", KEY)
        hits, metadata = scheduler.call("step", ([KEY], True))
        assert hits == [True] and len(metadata.loads) == 1
        return metadata

    def state(self) -> Any:
        return self.daemon.lookup(LAYOUT, KEY)[0]

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        self.writer.close()
        self.filler.close()


@pytest.fixture
def world(daemon: Daemon) -> Iterator[World]:
    w = World(daemon)
    yield w
    w.close()


# Protects: a view answers hits only while its heartbeats are echoed (the
# client-side lease), so a scheduler frozen past its lease dispatches nothing
# from its old view; and the stamp check catches a load of reused pages.
def test_a_scheduler_frozen_past_its_lease_dispatches_nothing_stale(world):
    daemon = world.daemon
    scheduler = world.start(engines.scheduler_main, daemon.socket, "S", 1)
    worker = world.start(engines.worker_main, daemon.socket, "S", 0, 1, True)
    old = world.dispatch(scheduler)
    done, failed, loaded = worker.call("load", (old.loads, old.regions))
    assert failed == [] and loaded == {KEY: engines.describe(DATA)}
    assert scheduler.call("report", (done, [])) == 0

    scheduler.send("watch", ([KEY, "other"], 60.0))  # an engine stepping, hitting KEY
    time.sleep(0.5)
    scheduler.signal(signal.SIGSTOP)
    try:
        daemon.wait_for(lambda: daemon.components("S") == ["worker 0/1"], timeout=4 * LEASE,
                        what="the frozen scheduler's session to expire")
        assert "expired (engine 'S' scheduler)" in daemon.log()
        # Evicted after the session ended: no event reaches the frozen view,
        # which still holds KEY; only its ghost awaits it, for one lease.
        world.filler.evict_all(daemon.stats())
        daemon.wait_for(lambda: world.state().state == engines.pb.ABSENT, timeout=4 * LEASE,
                        what="KEY reclaimed once the ghost's lease ran out")
        other = np.full(4 * MiB, 0xAB, np.uint8)  # the whole cache: it reuses KEY's pages
        world.save("other", other)
        (reused,) = daemon.lookup(LAYOUT, "other")
        assert reused.entry.entry_id != old.loads[0].entry_id
        scheduler.conn.send("thawed")  # read by its first step after the freeze
    finally:
        scheduler.signal(signal.SIGCONT)

    watched = scheduler.recv()
    assert watched["frozen"] and watched["before"]["hits"][KEY] > 0
    after = watched["after"]
    # From the moment it woke up until its view refilled from a new session,
    # the stale entry of KEY was never a hit and no load of it was dispatched.
    assert after["hits"][KEY] == 0 and watched["stale_hits"] == 0
    assert [s.mm_hash for s in after["loads"]] == ["other"] * after["hits"]["other"]
    # Usually the view is still there at the first steps after the thaw (the
    # link thread has not read the stream's end yet) and only freshness keeps
    # it from answering; on a busy machine the link may clear it first. The
    # freshness rule itself is covered deterministically in
    # tests/unit/test_session_link.py.
    assert watched["state_after"]["index"] != watched["index_before"]  # re-attached
    assert after["hits"]["other"] > 0  # and serves the new view

    # A load forced onto the reused pages (the old entry's stamp and extents):
    # the copy reads the new writer's bytes, the stamp check refuses them.
    spec = old.loads[0]
    forced = LoadSpec(spec.mm_hash, spec.transfer_id + 1000, spec.entry_id, spec.generation,
                      spec.nbytes, spec.shape, spec.dtype, spec.extents)
    done, failed, loaded = worker.call("load", ([forced], old.regions))
    assert done == [] and loaded == {}
    assert failed == [(forced.transfer_id, STAMP_MISMATCH)]


# Protects: an engine that cannot use its attachment (a region it cannot map)
# and tries again forever costs the other engines' saves nothing: it never
# opens its stream, so the daemon neither awaits its view nor keeps a ghost of
# it, and evictions complete at once (they waited up to --alloc-wait-seconds
# for its ghosts, and saves were refused). Sessions attached by hand and
# abandoned without a stream, one every 50 ms, cost nothing either.
def test_an_engine_that_cannot_map_the_region_never_holds_back_evictions(world):
    daemon = world.daemon
    broken = world.start(engines.unmappable_scheduler_main, daemon.socket, "broken")
    try:
        deadline = time.monotonic() + 3 * LEASE
        rounds = 0
        while time.monotonic() < deadline:
            # never streams; an engine id a round (one engine holds at most
            # --max-sessions-per-engine sessions, and each lives 60 s)
            attach(daemon.stub, LAYOUT, engine=f"abandoned-{rounds}", rank=None,
                   token=f"{rounds:032x}")  # (tokenless ones share 64 places)
            world.save(f"k{rounds}", DATA)
            assert world.filler.evict_all(daemon.stats()), f"round {rounds}: eviction held back"
            assert daemon.stats()["ghost_sessions"] == 0
            rounds += 1
            time.sleep(0.05)
        assert rounds >= 5
        assert "attach could not complete" in broken.call("stop")
    finally:
        broken.kill()


def owe_an_acknowledgement(world: World) -> Proc:
    """A scheduler of engine "S" (and its worker rank, so it hits) with a
    load of KEY in flight while KEY is evicted: KEY stays hidden, awaiting
    that view."""
    scheduler = world.start(engines.scheduler_main, world.daemon.socket, "S", 1)
    world.start(engines.worker_main, world.daemon.socket, "S", 0, 1, True)
    world.dispatch(scheduler)  # never reported: in flight
    assert not world.filler.evict_all(world.daemon.stats())
    hidden = world.state()
    assert hidden.state == engines.pb.HIDDEN and hidden.awaiting == 1
    stats = world.daemon.stats()
    assert stats["hidden_bytes"] == MiB and stats["ghost_sessions"] == 0
    return scheduler


# Protects: a scheduler session that ends without detaching stays awaited as
# a ghost for one lease (its engine may still be copying), then is released.
def test_a_killed_scheduler_is_awaited_as_a_ghost_for_one_lease(world):
    daemon = world.daemon
    scheduler = owe_an_acknowledgement(world)
    killed = time.monotonic()
    scheduler.kill()
    daemon.wait_for(lambda: daemon.components("S") == ["worker 0/1"],
                    what="the killed scheduler's session to end")
    stats = daemon.stats()
    if time.monotonic() - killed < LEASE:  # (on a machine that did not stall meanwhile)
        assert stats["ghost_sessions"] == 1 and stats["hidden_bytes"] == MiB
    daemon.wait_for(lambda: daemon.stats()["hidden_bytes"] == 0, timeout=4 * LEASE,
                    what="the ghost's acknowledgements")
    assert time.monotonic() - killed >= LEASE  # not before its lease was over
    assert daemon.stats()["ghost_sessions"] == 0
    assert world.state().state == engines.pb.ABSENT
    assert "no longer awaited" in daemon.log()


# Protects: a scheduler that detaches (closes its stream cleanly) releases
# what it owed at once and leaves no ghost.
def test_a_scheduler_that_closes_cleanly_releases_at_once(world):
    daemon = world.daemon
    scheduler = owe_an_acknowledgement(world)
    assert scheduler.call("close") == "closed"
    daemon.wait_for(lambda: daemon.components("S") == ["worker 0/1"],
                    what="the scheduler's session to end")
    # Released by the session's end itself: no lease to wait out.
    stats = daemon.stats()
    assert stats["ghost_sessions"] == 0 and stats["hidden_bytes"] == 0
    assert world.state().state == engines.pb.ABSENT


# ------------------------------------- issue 40: a view that withholds acks


def test_a_view_that_never_acknowledges_cannot_pin_the_cache(world):
    """Finding 1: a client attached a view to a victim's namespace, read its
    events and heartbeated, and never acknowledged: every later save was
    refused, the whole cache hidden, until the view left. The eviction now
    waits --ack-wait-seconds (three leases by default, one here) for it; then
    its session is ended, awaited as a ghost for one lease, and the pages
    come back."""
    daemon = world.daemon
    session = attach(daemon.stub, LAYOUT, engine="withholder", rank=None)
    view = RawStream(daemon.stub, session.session_id)  # reads; never acknowledges
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.2):
            view.send(heartbeat=pb.Heartbeat())

    threading.Thread(target=beat, daemon=True).start()
    try:
        assert view.next() is not None  # its snapshot: KEY's eviction awaits it
        assert not world.filler.evict_all(daemon.stats())  # held back by the view
        assert world.state().state == engines.pb.HIDDEN
        started = time.monotonic()
        daemon.wait_for(lambda: daemon.stats()["hidden_bytes"] == 0, timeout=6 * LEASE,
                        what="the withheld pages to come back")
        assert time.monotonic() - started <= 2 * LEASE + 2  # --ack-wait-seconds + a lease
        stats = daemon.stats()
        assert stats["ack_timeouts"] == 1 and stats["ghost_sessions"] == 0
        assert "did not acknowledge an eviction within 2s (--ack-wait-seconds)" \
            in daemon.log()
        assert world.filler.evict_all(daemon.stats())  # nothing pins the cache any more
        world.save("after", DATA)
    finally:
        stop.set()
        view.close()


def test_an_engine_in_a_step_longer_than_the_bound_reads_the_saved_bytes(world):
    """The acknowledgement is the pin of a load in flight, so a view ended for
    withholding it (an honest engine in a step longer than --ack-wait-seconds)
    must not have its load read reused pages: its ghost keeps them a lease
    more, its re-attached view answers from a fresh snapshot, and a load within
    the bound and that lease reads exactly the saved bytes. Past them the pages
    may be reused, and the stamp check refuses them (never wrong bytes)."""
    daemon = world.daemon
    scheduler = world.start(engines.scheduler_main, daemon.socket, "S", 1)
    worker = world.start(engines.worker_main, daemon.socket, "S", 0, 1, True)
    step = world.dispatch(scheduler)  # a step that does not end: its load in flight
    assert not world.filler.evict_all(daemon.stats())
    daemon.wait_for(lambda: daemon.stats()["ack_timeouts"] == 1, timeout=4 * LEASE,
                    what="the view to be ended for withholding past the bound")
    assert world.state().state == engines.pb.HIDDEN  # its ghost still awaits it
    assert not world.filler.take(daemon.stats()["capacity_bytes"])  # KEY's pages stay
    _, failed, loaded = worker.call("load", (step.loads, step.regions))
    assert failed == [] and loaded == {KEY: engines.describe(DATA)}
    daemon.wait_for(lambda: world.state().state == engines.pb.ABSENT, timeout=4 * LEASE,
                    what="KEY reclaimed once the ghost's lease ran out")
    other = np.full(4 * MiB, 0xCD, np.uint8)  # the whole cache: it reuses KEY's pages
    world.save("other", other)
    _, failed, loaded = worker.call("load", (step.loads, step.regions))
    assert loaded == {} and failed == [(step.loads[0].transfer_id, STAMP_MISMATCH)]
