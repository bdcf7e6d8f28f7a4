"""The entry life cycle of DESIGN.md, driven directly on the core."""

import pytest

from ec_daemon.cache import State
from ec_daemon.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)
from ec_daemon.events import (
    AllocOutcome,
    EvictedEvent,
    PinFailedEvent,
    ReadyEvent,
    ReportStatus,
    SnapshotDoneEvent,
    Verdict,
)
from tests.unit.cache_helpers import (
    PAGE,
    allocate,
    drain,
    make_cache,
    save,
    scheduler,
    tid,
    worker,
)


@pytest.fixture
def cache():
    c = make_cache(pages=8)
    yield c
    c.check_invariants()


def states(cache, *hashes, ns="ns"):
    return [None if e is None else e.state for e in cache.lookup(ns, list(hashes))]


# ------------------------------------------------------------------ pending


def test_pending_is_never_served(cache):
    view, w = scheduler(cache), worker(cache)
    drain(view)
    result = allocate(cache, w, "h")
    assert result.outcome is AllocOutcome.ALLOCATED
    assert states(cache, "h") == [None]  # invisible to lookups
    assert drain(view) == []  # no ready event before the copy landed
    late_view = scheduler(cache)
    assert all(not isinstance(e, ReadyEvent) for e in drain(late_view))  # nor in snapshots
    assert not cache.pin(view, tid(view, 1), "h", result.entry_id)
    assert isinstance(drain(view)[0], PinFailedEvent)


def test_commit_makes_ready_and_tells_every_view(cache):
    a, b, w = scheduler(cache), scheduler(cache, engine="F"), worker(cache)
    drain(a), drain(b)
    result = save(cache, w, "h", pages=2)
    for view in (a, b):
        (event,) = drain(view)
        assert isinstance(event, ReadyEvent)
        assert (event.mm_hash, event.entry_id, event.nbytes) == ("h", result.entry_id, 2 * PAGE)
        assert event.extents == result.extents
    assert states(cache, "h") == [State.READY]


def test_snapshot_holds_ready_entries_then_done(cache):
    w = worker(cache)
    save(cache, w, "a")
    allocate(cache, w, "pending")
    view = scheduler(cache)
    events = drain(view)
    assert [type(e) for e in events] == [ReadyEvent, SnapshotDoneEvent]
    assert events[0].mm_hash == "a"


def test_duplicate_alloc_is_refused_with_the_reason(cache):
    w1, w2 = worker(cache), worker(cache, engine="F")
    allocate(cache, w1, "h")
    assert allocate(cache, w2, "h").outcome is AllocOutcome.ALREADY_PENDING
    cache.commit(w1, ["h"])
    assert allocate(cache, w2, "h").outcome is AllocOutcome.ALREADY_READY
    assert cache.allocator.free_pages == 7


def test_evicting_key_is_refused_until_reclaimed(cache):
    scheduler(cache)
    w = worker(cache)
    save(cache, w, "old", pages=8)
    allocate(cache, w, "new", pages=1)  # hides "old", awaits view's ack
    assert states(cache, "old") == [State.HIDDEN]
    assert allocate(cache, w, "old").outcome is AllocOutcome.EVICTING


def test_abort_and_session_end_discard_pending(cache):
    w = worker(cache)
    allocate(cache, w, "a", pages=3)
    allocate(cache, w, "b", pages=3)
    assert cache.abort(w, ["a"]) == [ReportStatus.ACCEPTED]
    assert cache.pending_pages == 3 and cache.allocator.free_pages == 5  # an abort frees at once
    cache.end_session(w)
    assert cache.pending_pages == 0
    assert states(cache, "a", "b") == [None, None]
    # The writer may still be copying into b's pages: they wait out a lease.
    assert cache.quarantined_pages == 3 and cache.allocator.free_pages == 5
    assert cache.release_quarantine() == 0
    cache.sessions.clock.now += cache.sessions.lease_seconds
    assert cache.release_quarantine() == 3
    assert cache.allocator.free_pages == 8 and cache.quarantined_pages == 0


def test_reports_of_others_and_late_reports_change_nothing(cache):
    w1, w2 = worker(cache), worker(cache, engine="F")
    allocate(cache, w1, "h")
    assert cache.commit(w2, ["h"]) == [ReportStatus.UNKNOWN]  # not w2's
    assert cache.abort(w2, ["h"]) == [ReportStatus.UNKNOWN]
    assert cache.commit(w1, ["h"]) == [ReportStatus.ACCEPTED]
    assert cache.commit(w1, ["h"]) == [ReportStatus.DUPLICATE]
    assert cache.commit(w1, ["never"]) == [ReportStatus.UNKNOWN]
    assert states(cache, "h") == [State.READY]


# ------------------------------------------------------------- validation


@pytest.mark.parametrize(("mm_hash", "nbytes", "shape", "dtype", "error"), [
    ("", PAGE, (PAGE,), "uint8", InvalidArgument),
    ("x" * 600, PAGE, (PAGE,), "uint8", InvalidArgument),
    ("h", 0, (1,), "uint8", InvalidArgument),
    ("h", PAGE, (), "uint8", InvalidArgument),
    ("h", PAGE, (3,), "uint8", InvalidArgument),  # not a multiple of the shape
    ("h", PAGE, (PAGE,), "bad dtype!", InvalidArgument),
    ("h", 100 * PAGE, (100 * PAGE,), "uint8", ResourceExhausted),  # larger than the cache
])
def test_bad_saves_raise_precise_errors_and_change_nothing(cache, mm_hash, nbytes, shape,
                                                           dtype, error):
    w = worker(cache)
    with pytest.raises(error):
        cache.allocate(w, mm_hash, nbytes, shape, dtype)
    assert cache.allocator.free_pages == 8 and not w.pending


def test_only_writer_workers_allocate(cache):
    with pytest.raises(FailedPrecondition):
        allocate(cache, scheduler(cache), "h")
    with pytest.raises(FailedPrecondition):
        allocate(cache, worker(cache, role="consumer"), "h")


# --------------------------------------------------------------- eviction


def test_lru_victims_are_hidden_then_reclaimed_after_every_view_acks(cache):
    a, b, w = scheduler(cache), scheduler(cache, engine="F"), worker(cache)
    for h in "abcd":
        save(cache, w, h, pages=2)
    drain(a), drain(b)
    assert allocate(cache, w, "new", pages=2).outcome is AllocOutcome.WAIT
    assert states(cache, "a") == [State.HIDDEN]  # the least recently used
    for view in (a, b):
        assert drain(view) == [EvictedEvent("a", 1)]
    cache.acknowledge(a, [("a", 1)])
    assert allocate(cache, w, "new", pages=2).outcome is AllocOutcome.WAIT  # b still may pin
    cache.acknowledge(b, [("a", 1)])
    assert states(cache, "a") == [None]
    assert allocate(cache, w, "new", pages=2).outcome is AllocOutcome.ALLOCATED


def test_without_views_eviction_reclaims_at_once(cache):
    w = worker(cache)
    for h in "abcd":
        save(cache, w, h, pages=2)
    assert allocate(cache, w, "new", pages=3).outcome is AllocOutcome.ALLOCATED
    assert states(cache, "a", "b", "c") == [None, None, State.READY]
    assert cache.counters["evictions"] == 2


def test_pinned_entries_are_never_evicted(cache):
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "pinned", pages=4)
    save(cache, w, "free", pages=4)
    assert cache.pin(view, tid(view, 1), "pinned", 1)
    drain(view)
    assert allocate(cache, w, "new", pages=4).outcome is AllocOutcome.WAIT
    assert states(cache, "pinned", "free") == [State.READY, State.HIDDEN]
    with pytest.raises(ResourceExhausted, match="pinned"):
        allocate(cache, w, "huge", pages=8)  # only the pinned pages would remain
    assert states(cache, "pinned") == [State.READY]
    assert cache.counters["refused_saves"] == 1


def test_everything_pinned_or_pending_refuses_without_evicting(cache):
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "p", pages=4)
    cache.pin(view, tid(view, 1), "p", 1)
    allocate(cache, w, "pending", pages=4)
    with pytest.raises(ResourceExhausted):
        allocate(cache, w, "x", pages=1)
    assert states(cache, "p") == [State.READY] and cache.counters["evictions"] == 0


def test_a_pin_sent_before_the_ack_lands_and_keeps_the_bytes(cache):
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "a", pages=8)
    drain(view)
    # The view saw "a" as ready and pins it; eviction happens concurrently.
    assert allocate(cache, w, "b", pages=8).outcome is AllocOutcome.WAIT
    entry = cache.lookup("ns", ["a"])[0]
    runs = list(entry.runs)
    assert cache.pin(view, tid(view, 1), "a", 1)  # pin arrives first on the stream ...
    cache.acknowledge(view, [("a", 1)])  # ... then the ack
    assert states(cache, "a") == [State.HIDDEN]
    assert allocate(cache, w, "b", pages=8).outcome is AllocOutcome.WAIT  # pages still held
    assert cache.report_loaded(worker(cache, rank=0), [tid(view, 1)]) == [Verdict.HELD]
    assert states(cache, "a") == [None]
    result = allocate(cache, w, "b", pages=8)
    assert result.outcome is AllocOutcome.ALLOCATED
    assert [(o // PAGE, n // PAGE) for o, n in result.extents] == runs


def test_a_dead_view_stops_blocking_reclamation(cache):
    alive, dead, w = scheduler(cache), scheduler(cache, engine="F"), worker(cache)
    save(cache, w, "a", pages=8)
    allocate(cache, w, "b", pages=8)
    cache.acknowledge(alive, [("a", 1)])
    assert states(cache, "a") == [State.HIDDEN]
    cache.end_session(dead)
    assert states(cache, "a") == [None]


def test_stale_and_foreign_acks_are_ignored(cache):
    view, other, w = scheduler(cache), scheduler(cache, ns="other"), worker(cache)
    save(cache, w, "a", pages=8)
    allocate(cache, w, "b", pages=8)
    cache.acknowledge(view, [("a", 999)])  # wrong entry id
    cache.acknowledge(other, [("a", 1)])  # another namespace's view
    assert states(cache, "a") == [State.HIDDEN]


# ------------------------------------------------------------ pins, loads


def test_transfer_ids_must_be_this_sessions_and_increasing(cache):
    view, other, w = scheduler(cache), scheduler(cache, engine="F"), worker(cache)
    worker(cache, engine="F")
    save(cache, w, "a")
    assert not cache.pin(view, tid(other, 1), "a", 1)  # minted by another session
    assert cache.pin(view, tid(view, 5), "a", 1)
    assert not cache.pin(view, tid(view, 5), "a", 1)  # reused
    assert not cache.pin(view, tid(view, 3), "a", 1)  # went backwards
    assert cache.pin(view, tid(view, 6), "a", 1)  # a second dispatch of the same entry
    reasons = [e.reason for e in drain(view) if isinstance(e, PinFailedEvent)]
    assert reasons == ["transfer id was not minted by this session",
                       "transfer id is not greater than the previous one",
                       "transfer id is not greater than the previous one"]
    assert len(cache.lookup("ns", ["a"])[0].pins) == 2


def test_load_unpins_only_after_every_rank_reported():
    cache = make_cache(pages=8)
    view = scheduler(cache)
    r0, r1 = worker(cache, rank=0, world=2), worker(cache, rank=1, world=2)
    save(cache, r0, "a")
    t = tid(view, 1)
    assert cache.pin(view, t, "a", 1)
    assert cache.report_loaded(r0, [t]) == [Verdict.HELD]
    assert cache.report_loaded(r0, [t]) == [Verdict.REPORTED_ALREADY]  # duplicate ignored
    assert len(cache.lookup("ns", ["a"])[0].pins) == 1
    assert cache.report_loaded(r1, [t]) == [Verdict.HELD]
    assert not cache.lookup("ns", ["a"])[0].pins
    assert cache.report_loaded(r1, [t]) == [Verdict.NOT_HELD]  # late: the pin is gone
    assert cache.counters["loads"] == 1
    cache.check_invariants()


def test_a_report_that_overtook_its_pin_waits_for_it(cache):
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "a")
    assert cache.report_loaded(w, [tid(view, 1)]) == [Verdict.WAIT]
    cache.pin(view, tid(view, 1), "a", 1)
    assert cache.report_loaded(w, [tid(view, 1)]) == [Verdict.HELD]
    # A counter the stream already passed was refused or released: not held.
    assert cache.report_loaded(w, [tid(view, 1)]) == [Verdict.NOT_HELD]


def test_a_failed_pin_answers_not_held(cache):
    view, w = scheduler(cache), worker(cache)
    cache.pin(view, tid(view, 1), "missing", 1)
    assert cache.report_loaded(w, [tid(view, 1)]) == [Verdict.NOT_HELD]


def test_reports_for_another_engine_are_denied_and_change_nothing(cache):
    view, w = scheduler(cache), worker(cache)
    intruder = worker(cache, engine="X")
    save(cache, w, "a")
    cache.pin(view, tid(view, 1), "a", 1)
    with pytest.raises(PermissionDenied):
        cache.report_loaded(intruder, [tid(view, 1)])
    assert len(cache.lookup("ns", ["a"])[0].pins) == 1
    with pytest.raises(FailedPrecondition):
        cache.report_loaded(view, [tid(view, 1)])  # schedulers do not report loads


def test_pins_need_an_attached_worker_and_a_consumer_role():
    cache = make_cache()
    view = scheduler(cache)
    producer = scheduler(cache, engine="P", role="producer")
    w = worker(cache, engine="W")
    save(cache, w, "a")
    assert not cache.pin(view, tid(view, 1), "a", 1)  # engine E has no worker
    worker(cache, engine="P")
    assert not cache.pin(producer, tid(producer, 1), "a", 1)
    cache.check_invariants()


# ---------------------------------------------------------- session ends


def test_scheduler_death_releases_its_pins(cache):
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "a")
    cache.pin(view, tid(view, 1), "a", 1)
    cache.pin(view, tid(view, 2), "a", 1)
    assert cache.pinned_pages == 1
    cache.end_session(view)
    assert cache.pinned_pages == 0
    assert cache.report_loaded(w, [tid(view, 1)]) == [Verdict.NOT_HELD]


def test_a_dead_rank_stops_holding_loads():
    cache = make_cache()
    view = scheduler(cache)
    r0, r1 = worker(cache, rank=0, world=2), worker(cache, rank=1, world=2)
    save(cache, r0, "a")
    cache.pin(view, tid(view, 1), "a", 1)
    cache.report_loaded(r0, [tid(view, 1)])
    cache.end_session(r1)
    assert not cache.lookup("ns", ["a"])[0].pins
    cache.check_invariants()


def test_a_rank_with_another_live_session_is_still_awaited():
    cache = make_cache()
    view = scheduler(cache)
    r0 = worker(cache, rank=0)
    r0_again = worker(cache, rank=0)  # reconnected before the old session ended
    save(cache, r0, "a")
    cache.pin(view, tid(view, 1), "a", 1)
    cache.end_session(r0)
    assert cache.lookup("ns", ["a"])[0].pins
    assert cache.report_loaded(r0_again, [tid(view, 1)]) == [Verdict.HELD]
    cache.check_invariants()


def test_expired_leases_end_sessions_and_release_everything():
    from tests.unit.cache_helpers import FakeClock

    clock = FakeClock()
    cache = make_cache(lease=5, clock=clock)
    view, rank0, writer = scheduler(cache), worker(cache), worker(cache, engine="S")
    save(cache, writer, "a")
    cache.pin(view, tid(view, 1), "a", 1)
    allocate(cache, writer, "b")
    clock.now += 3
    cache.sessions.renew(view)
    cache.sessions.renew(rank0)
    clock.now += 3
    assert cache.expire_sessions() == [writer]
    assert cache.pending_pages == 0 and cache.pinned_pages == 1  # view and rank0 renewed
    clock.now += 6
    assert set(cache.expire_sessions()) == {view, rank0}
    assert cache.pinned_pages == 0 and len(cache.sessions) == 0
    cache.check_invariants()


def test_heartbeat_counters_feed_hit_and_miss_stats(cache):
    view = scheduler(cache)
    cache.record_lookups(view, 10, 4)
    assert (cache.counters["hits"], cache.counters["misses"]) == (4, 6)
    assert cache.namespace_counters["ns"] == {"hits": 4, "misses": 6}
    with pytest.raises(InvalidArgument):
        cache.record_lookups(view, 1, 2)


# ------------------------------------------------------- review regressions


def test_a_pin_arriving_after_its_report_gave_up_is_refused(cache):
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "a")
    assert cache.report_loaded(w, [tid(view, 1)]) == [Verdict.WAIT]
    cache.abandon(tid(view, 1))  # the service answered NOT_HELD after waiting
    drain(view)
    assert not cache.pin(view, tid(view, 1), "a", 1)
    (event,) = drain(view)
    assert isinstance(event, PinFailedEvent) and "timed out" in event.reason
    assert cache.pinned_pages == 0  # nothing waits for a report that was given


def test_a_refused_pin_does_not_make_reports_wait():
    cache = make_cache()
    producer = scheduler(cache, role="producer")
    w = worker(cache)
    save(cache, w, "a")
    assert not cache.pin(producer, tid(producer, 1), "a", 1)  # producers cannot pin
    assert cache.report_loaded(w, [tid(producer, 1)]) == [Verdict.NOT_HELD]


def test_pins_whose_reports_never_come_expire():
    from tests.unit.cache_helpers import FakeClock

    clock = FakeClock()
    cache = make_cache(clock=clock)
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "a")
    cache.pin(view, tid(view, 1), "a", 1)
    assert cache.expire_transfers(60) == []
    clock.now += 61
    (stale,) = cache.expire_transfers(60)
    assert stale.transfer_id == tid(view, 1) and cache.pinned_pages == 0
    assert cache.report_loaded(w, [tid(view, 1)]) == [Verdict.NOT_HELD]
    cache.check_invariants()


def test_evictions_come_in_batches_of_a_sixty_fourth_of_the_cache():
    """Every eviction round costs each view an event message and an
    acknowledgement: one round makes room for several saves, not one."""
    cache = make_cache(pages=256)
    view, w = scheduler(cache), worker(cache)
    for i in range(256):
        save(cache, w, f"k{i}")
    drain(view)
    assert allocate(cache, w, "new0").outcome is AllocOutcome.WAIT  # the view must ack
    evicted = [e for e in drain(view) if isinstance(e, EvictedEvent)]
    assert [e.mm_hash for e in evicted] == ["k0", "k1", "k2", "k3"]  # 256 // 64, oldest first
    cache.acknowledge(view, [(e.mm_hash, e.entry_id) for e in evicted])
    for n in range(4):  # room for the next saves without another round
        assert allocate(cache, w, f"new{n}").outcome is AllocOutcome.ALLOCATED
    assert drain(view) == [] and cache.counters["evictions"] == 4


def test_a_small_shortfall_is_met_even_when_less_than_a_batch_is_evictable():
    cache = make_cache(pages=128)  # a batch is 2 pages
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "pinned", pages=127)
    save(cache, w, "cold", pages=1)
    assert cache.pin(view, tid(view, 1), "pinned", cache.lookup("ns", ["pinned"])[0].entry_id)
    drain(view)
    assert allocate(cache, w, "new", pages=1).outcome is AllocOutcome.WAIT  # "cold" hidden
    assert states(cache, "cold") == [State.HIDDEN]
