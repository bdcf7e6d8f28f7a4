"""The entry life cycle of `ec_daemon.core.cache`, driven directly on the core.

Every cache here checks `ec_daemon.core.invariants` after each call
(`cache_helpers.make_cache`), so each step is also a bookkeeping check.
"""

from collections import deque

import pytest

from ec_daemon.core import cache as cache_module
from ec_daemon.core import stats as stats_module
from ec_daemon.core import views as views_module
from ec_daemon.core.events import (
    AllocOutcome,
    EvictedEvent,
    RanksEvent,
    ReadyEvent,
    ReportStatus,
    SnapshotDoneEvent,
)
from ec_daemon.core.records import State
from ec_daemon.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tests.unit.cache_helpers import (
    PAGE,
    FakeClock,
    allocate,
    drain,
    make_cache,
    page_numbers,
    save,
    scheduler,
    stamp_table,
    stamped,
    worker,
)

READY, HIDDEN = State.READY, State.HIDDEN


@pytest.fixture
def cache():
    return make_cache(pages=8)


def states(cache, *hashes, ns="ns"):
    return [None if e is None else e.state for e in cache.lookup(ns, list(hashes))]


# ------------------------------------------------------------- saving


def test_pending_is_invisible_until_committed(cache):
    view, w = scheduler(cache), worker(cache)
    drain(view)
    result = allocate(cache, w, "h", pages=2)
    assert result.outcome is AllocOutcome.ALLOCATED and result.entry_id > 0
    assert states(cache, "h") == [None]  # tools do not see it
    assert drain(view) == []  # no ready event before the copy landed
    assert [type(e) for e in drain(scheduler(cache, engine="late"))] == [SnapshotDoneEvent,
                                                                        RanksEvent]
    assert cache.table.pending_pages == 2 and cache.allocator.free_pages == 6


def test_commit_makes_ready_and_tells_every_view_of_the_namespace(cache):
    a, b = scheduler(cache), scheduler(cache, engine="F")
    elsewhere, w = scheduler(cache, engine="G", ns="other"), worker(cache)
    for view in (a, b, elsewhere):
        drain(view)
    result = allocate(cache, w, "h", pages=2)
    assert cache.commit(w, ["h"]) == [ReportStatus.ACCEPTED]
    for view in (a, b):
        assert drain(view) == [ReadyEvent("h", result.entry_id, 2 * PAGE, (2, PAGE), "uint8",
                                          result.extents)]
    assert drain(elsewhere) == [] and drain(w) == []  # other namespaces and writers hear nothing
    assert states(cache, "h") == [READY] and states(cache, "h", ns="other") == [None]
    assert (cache.counters["saves"], cache.counters["bytes_saved"]) == (1, 2 * PAGE)
    assert cache.table.pending_pages == 0 and cache.table.usage["ns"] == [1, 2 * PAGE]


def test_a_snapshot_holds_the_ready_entries_then_done(cache):
    w = worker(cache)
    save(cache, w, "hidden", pages=5)
    ready = save(cache, w, "ready")
    allocate(cache, w, "pending")
    scheduler(cache, engine="old")  # makes "hidden" wait for an acknowledgement
    assert allocate(cache, w, "more", pages=2).outcome is AllocOutcome.WAIT
    assert states(cache, "hidden") == [HIDDEN]
    events = drain(scheduler(cache))
    assert [type(e) for e in events] == [ReadyEvent, SnapshotDoneEvent, RanksEvent]
    assert (events[0].mm_hash, events[0].entry_id) == ("ready", ready.entry_id)
    assert events[2] == RanksEvent(1, 1)  # its engine's one worker rank mapped the region


def test_a_second_writer_is_told_the_key_is_pending_ready_or_hidden(cache):
    view, w1, w2 = scheduler(cache), worker(cache), worker(cache, engine="F")
    first = allocate(cache, w1, "h", pages=4)
    assert allocate(cache, w2, "h") == cache_module.AllocResult(AllocOutcome.ALREADY_PENDING,
                                                                first.entry_id)
    cache.commit(w1, ["h"])
    assert allocate(cache, w2, "h").outcome is AllocOutcome.ALREADY_READY
    drain(view)
    assert allocate(cache, w1, "other", pages=8).outcome is AllocOutcome.WAIT  # hides "h"
    assert allocate(cache, w2, "h").outcome is AllocOutcome.ALREADY_HIDDEN
    assert cache.allocator.free_pages == 4 and not w2.pending  # no pages taken


def test_the_same_key_in_another_namespace_is_another_entry(cache):
    save(cache, worker(cache), "h")
    assert allocate(cache, worker(cache, ns="other"), "h").outcome is AllocOutcome.ALLOCATED


def test_abort_frees_at_once_and_commit_and_abort_answer_per_key(cache):
    w1, w2 = worker(cache), worker(cache, engine="F")
    allocate(cache, w1, "a", pages=3)
    allocate(cache, w1, "b", pages=3)
    assert cache.commit(w2, ["a"]) == [ReportStatus.UNKNOWN]  # not w2's save
    assert cache.abort(w2, ["a"]) == [ReportStatus.UNKNOWN]
    assert cache.abort(w1, ["a", "never"]) == [ReportStatus.ACCEPTED, ReportStatus.UNKNOWN]
    assert cache.table.pending_pages == 3 and cache.allocator.free_pages == 5
    assert states(cache, "a") == [None]
    assert cache.commit(w1, ["a", "b"]) == [ReportStatus.UNKNOWN, ReportStatus.ACCEPTED]
    assert cache.commit(w1, ["b"]) == [ReportStatus.DUPLICATE]
    assert cache.abort(w1, ["b"]) == [ReportStatus.UNKNOWN]  # ready: no longer the writer's
    assert states(cache, "b") == [READY]


def test_a_report_with_one_bad_key_changes_nothing(cache):
    w = worker(cache)
    allocate(cache, w, "h")
    with pytest.raises(InvalidArgument):
        cache.commit(w, ["h", ""])
    with pytest.raises(InvalidArgument):
        cache.abort(w, ["h", "x" * 600])
    assert w.pending == {("ns", "h")}
    assert cache.commit(w, ["h"]) == [ReportStatus.ACCEPTED]


@pytest.mark.parametrize(("mm_hash", "nbytes", "shape", "dtype", "error"), [
    ("", PAGE, (PAGE,), "uint8", InvalidArgument),
    ("x" * 600, PAGE, (PAGE,), "uint8", InvalidArgument),
    ("h", 0, (1,), "uint8", InvalidArgument),
    ("h", -PAGE, (PAGE,), "uint8", InvalidArgument),
    ("h", PAGE, (), "uint8", InvalidArgument),
    ("h", PAGE, (0, PAGE), "uint8", InvalidArgument),
    ("h", PAGE, (3,), "uint8", InvalidArgument),  # not a multiple of the shape
    ("h", 32 * PAGE, (PAGE,), "uint8", InvalidArgument),  # 32 bytes per element
    ("h", PAGE, (PAGE,), "bad dtype!", InvalidArgument),
    ("h", PAGE, (PAGE,), "notadtype", InvalidArgument),  # no loader makes it
    ("h", PAGE, (PAGE,), "float32", InvalidArgument),  # 4 bytes an element: 4x too few
    ("h", 2 * PAGE, (PAGE,), "float16", None),  # exactly right: allocated
    ("h", 100 * PAGE, (100 * PAGE,), "uint8", ResourceExhausted),  # larger than the cache
])
def test_bad_saves_raise_precise_errors_and_change_nothing(cache, mm_hash, nbytes, shape,
                                                           dtype, error):
    w = worker(cache)
    if error is None:
        assert cache.allocate(w, mm_hash, nbytes, shape, dtype).outcome \
            is AllocOutcome.ALLOCATED
        return
    with pytest.raises(error):
        cache.allocate(w, mm_hash, nbytes, shape, dtype)
    assert cache.allocator.free_pages == 8 and not w.pending and not list(cache.entries())


def test_only_workers_of_saving_engines_allocate(cache):
    with pytest.raises(FailedPrecondition):
        allocate(cache, scheduler(cache), "h")
    with pytest.raises(FailedPrecondition):
        allocate(cache, worker(cache, role="consumer"), "h")
    assert allocate(cache, worker(cache, role="producer"), "h").outcome is AllocOutcome.ALLOCATED


def test_extents_lie_after_the_stamp_table_and_the_last_is_trimmed():
    table = stamp_table(8)
    cache = make_cache(pages=8, stamps=table)
    w = worker(cache)
    for h in "pqrs":
        allocate(cache, w, h, pages=2)
    cache.abort(w, ["p", "r"])  # free: pages 0-1 and 4-5
    result = cache.allocate(w, "x", 3 * PAGE + 512, (7, 512), "uint8")
    (entry,) = [e for e in cache.entries() if e.mm_hash == "x"]
    assert sorted(entry.runs) == [(0, 2), (4, 2)]
    first, second = entry.runs  # payload order; only the last extent is trimmed
    assert result.extents == ((table.data_offset + first[0] * PAGE, 2 * PAGE),
                              (table.data_offset + second[0] * PAGE, PAGE + 512))


# ----------------------------------------------------------- eviction


def test_lru_victims_are_hidden_and_every_view_of_the_namespace_is_told(cache):
    a, b = scheduler(cache), scheduler(cache, engine="F")
    elsewhere, w = scheduler(cache, engine="G", ns="other"), worker(cache)
    ids = {h: save(cache, w, h, pages=2).entry_id for h in "abcd"}
    for view in (a, b, elsewhere):
        drain(view)
    assert allocate(cache, w, "new", pages=2).outcome is AllocOutcome.WAIT
    assert states(cache, *"abcd") == [HIDDEN, READY, READY, READY]  # the least recent
    for view in (a, b):
        assert drain(view) == [EvictedEvent("a", ids["a"])]
    assert drain(elsewhere) == []
    (entry,) = cache.lookup("ns", ["a"])
    assert entry.awaiting == {a, b} and a.awaiting == {entry}
    assert cache.table.hidden_pages == 2 and cache.counters["evictions"] == 1


def test_pages_are_reused_only_after_every_awaited_view_acknowledged(cache):
    a, b, w = scheduler(cache), scheduler(cache, engine="F"), worker(cache)
    old = save(cache, w, "old", pages=8)
    assert allocate(cache, w, "new", pages=8).outcome is AllocOutcome.WAIT
    cache.views.acknowledge(a, [("old", old.entry_id)])
    assert states(cache, "old") == [HIDDEN]
    assert allocate(cache, w, "new", pages=8).outcome is AllocOutcome.WAIT  # b may still load
    late = scheduler(cache, engine="late")  # attached after the eviction: never saw "old"
    cache.views.acknowledge(late, [("old", old.entry_id)])
    assert states(cache, "old") == [HIDDEN] and cache.allocator.free_pages == 0
    cache.views.acknowledge(b, [("old", old.entry_id)])
    assert states(cache, "old") == [None] and cache.allocator.free_pages == 8
    new = allocate(cache, w, "new", pages=8)
    assert new.outcome is AllocOutcome.ALLOCATED and new.extents == old.extents


def test_stale_and_foreign_acknowledgements_are_ignored(cache):
    view, w = scheduler(cache), worker(cache)
    other_ns_view = scheduler(cache, engine="G", ns="other")
    first = save(cache, w, "k", pages=8)
    assert allocate(cache, w, "x", pages=8).outcome is AllocOutcome.WAIT
    cache.views.acknowledge(view, [("k", first.entry_id)])  # reclaimed
    again = save(cache, w, "k", pages=4)
    save(cache, w, "filler", pages=4)
    assert allocate(cache, w, "x", pages=8).outcome is AllocOutcome.WAIT  # hides both
    cache.views.acknowledge(view, [("k", first.entry_id)])  # a late duplicate of the old ack
    cache.views.acknowledge(view, [("k", 999), ("missing", again.entry_id)])
    cache.views.acknowledge(other_ns_view, [("k", again.entry_id)])  # another namespace's view
    assert states(cache, "k") == [HIDDEN]
    cache.views.acknowledge(view, [("k", again.entry_id)])
    assert states(cache, "k", "filler") == [None, HIDDEN]


def test_without_views_eviction_reclaims_at_once(cache):
    w = worker(cache)
    for h in "abcd":
        save(cache, w, h, pages=2)
    assert allocate(cache, w, "new", pages=3).outcome is AllocOutcome.ALLOCATED
    assert states(cache, *"abcd") == [None, None, READY, READY]
    assert cache.counters["evictions"] == 2 and cache.table.hidden_pages == 0


def test_while_victims_await_acknowledgements_saves_wait_and_nothing_more_is_hidden(cache):
    scheduler(cache)  # a view the victims wait for
    w = worker(cache)
    for h in "abcd":
        save(cache, w, h, pages=2)
    assert allocate(cache, w, "new", pages=2).outcome is AllocOutcome.WAIT
    assert allocate(cache, w, "new", pages=2).outcome is AllocOutcome.WAIT
    assert states(cache, *"abcd") == [HIDDEN, READY, READY, READY]
    assert cache.counters["evictions"] == 1 and not w.pending


def test_a_save_that_stops_counting_hidden_pages_hides_one_more_round(cache):
    scheduler(cache)  # a view that never acknowledges (a load in flight, a ghost)
    w = worker(cache)
    for h in "abcd":
        save(cache, w, h, pages=2)
    assert allocate(cache, w, "new", pages=2).outcome is AllocOutcome.WAIT
    assert states(cache, *"abcd") == [HIDDEN, READY, READY, READY]
    impatient = allocate(cache, w, "new", pages=2, count_hidden=False)
    assert impatient.outcome is AllocOutcome.WAIT  # "b" is hidden too, awaiting the view
    assert states(cache, *"abcd") == [HIDDEN, HIDDEN, READY, READY]
    assert allocate(cache, w, "new", pages=2).outcome is AllocOutcome.WAIT
    assert cache.counters["evictions"] == 2


def test_a_full_cache_with_nothing_evictable_refuses_and_hides_nothing(cache):
    scheduler(cache)
    w = worker(cache)
    allocate(cache, w, "pending", pages=6)
    save(cache, w, "ready", pages=2)
    with pytest.raises(ResourceExhausted, match=r"cache full.*6144 pending"):
        allocate(cache, w, "x", pages=4)  # even hiding "ready" would not make room
    assert states(cache, "ready") == [READY]
    assert cache.counters["evictions"] == 0 and cache.counters["refused_saves"] == 1
    cache.abort(w, ["pending"])
    with pytest.raises(ResourceExhausted, match="larger than the cache"):
        allocate(cache, w, "huge", pages=9)
    assert cache.counters["refused_saves"] == 2


def test_a_save_that_waited_in_vain_is_refused_and_counted(cache):
    error = cache.refuse_waited_save(4 * PAGE)
    assert isinstance(error, ResourceExhausted) and "not acknowledged in time" in str(error)
    assert cache.counters["refused_saves"] == 1


def test_evictions_come_in_batches_of_a_sixty_fourth_of_the_cache():
    """Each eviction round costs every view an event message and an
    acknowledgement: one round makes room for several saves, not one."""
    cache = make_cache(pages=256)
    view, w = scheduler(cache), worker(cache)
    for i in range(256):
        save(cache, w, f"k{i}")
    drain(view)
    assert allocate(cache, w, "new0").outcome is AllocOutcome.WAIT  # the view must ack
    evicted = drain(view)
    assert [e.mm_hash for e in evicted] == ["k0", "k1", "k2", "k3"]  # 256 // 64, oldest first
    cache.views.acknowledge(view, [(e.mm_hash, e.entry_id) for e in evicted])
    for n in range(4):  # room for the next saves without another round
        assert allocate(cache, w, f"new{n}").outcome is AllocOutcome.ALLOCATED
    assert drain(view) == [] and cache.counters["evictions"] == 4


def test_a_small_shortfall_is_met_when_less_than_a_batch_is_evictable():
    cache = make_cache(pages=128)  # a batch is 2 pages
    view, w = scheduler(cache), worker(cache)
    allocate(cache, w, "pending", pages=127)
    save(cache, w, "cold", pages=1)
    drain(view)
    assert allocate(cache, w, "new", pages=1).outcome is AllocOutcome.WAIT
    assert states(cache, "cold") == [HIDDEN]


# ------------------------------------------------------------ touches


def test_a_touch_makes_an_entry_recent_and_counts_the_load(cache):
    view, w = scheduler(cache), worker(cache)
    ids = {h: save(cache, w, h, pages=2).entry_id for h in "abcd"}
    cache.views.touch(view, [("a", ids["a"], 2)])  # two loads of one entry
    assert allocate(cache, w, "new", pages=2).outcome is AllocOutcome.WAIT
    assert states(cache, "a", "b") == [READY, HIDDEN]
    assert cache.counters["loads"] == 2 and cache.counters["bytes_loaded"] == 4 * PAGE
    assert cache.table.counters["ns"]["loads"] == 2


def test_touches_of_stale_unknown_or_foreign_refs_count_the_load_but_no_bytes(cache):
    # A view dispatched those loads; the entry may be gone by the time its
    # heartbeat lands. They count as loads, their bytes are unknown.
    view, w = scheduler(cache), worker(cache)
    other = scheduler(cache, engine="G", ns="other")
    a = save(cache, w, "a")
    before = list(cache.policy._order)
    cache.views.touch(view, [("a", a.entry_id + 100, 1), ("missing", a.entry_id, 1)])
    cache.views.touch(other, [("a", a.entry_id, 1)])  # another namespace has no "a"
    assert cache.counters["loads"] == 3 and cache.counters["bytes_loaded"] == 0
    assert cache.table.counters["ns"]["loads"] == 2
    assert cache.table.counters["other"]["loads"] == 1
    assert list(cache.policy._order) == before  # recency untouched


def test_a_touch_of_a_hidden_entry_counts_the_load_but_does_not_revive_it(cache):
    view, w = scheduler(cache), worker(cache)
    a = save(cache, w, "a", pages=4)
    save(cache, w, "b", pages=4)
    assert allocate(cache, w, "new", pages=4).outcome is AllocOutcome.WAIT
    cache.views.touch(view, [("a", a.entry_id, 1)])  # dispatched before the view saw the eviction
    assert states(cache, "a") == [HIDDEN] and cache.policy.evictable_pages == 4
    assert cache.counters["loads"] == 1


# ------------------------------------------------ session ends, ghosts


def test_a_view_that_ends_without_detaching_is_awaited_as_a_ghost_for_one_lease():
    clock = FakeClock()
    cache = make_cache(pages=8, lease=10, clock=clock)
    view, w = scheduler(cache), worker(cache)
    for h in "abcd":
        save(cache, w, h, pages=2)
    assert allocate(cache, w, "new", pages=2).outcome is AllocOutcome.WAIT  # hides "a"
    cache.end_session(view)  # the stream was lost: its engine may still be loading "a"
    assert view.is_ghost and not view.alive and view.awaiting
    assert states(cache, "a") == [HIDDEN]
    assert allocate(cache, w, "more", pages=4).outcome is AllocOutcome.WAIT  # hides "b"
    (b,) = cache.lookup("ns", ["b"])
    assert b.state is HIDDEN and b.awaiting == {view}  # evictions while a ghost await it
    assert not view.outbox  # a ghost is sent nothing
    clock.now += 9.9
    assert cache.release_ghosts() == []
    assert states(cache, "a", "b") == [HIDDEN, HIDDEN]
    clock.now += 0.1
    assert cache.release_ghosts() == [view]
    assert states(cache, "a", "b") == [None, None] and not view.awaiting
    assert cache.sessions.awaited("ns", 1) == set()
    assert allocate(cache, w, "more", pages=4).outcome is AllocOutcome.ALLOCATED


def test_a_ghost_awaits_only_evictions_of_entries_announced_to_it():
    clock = FakeClock()
    cache = make_cache(pages=8, lease=10, clock=clock)
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "seen", pages=2)
    cache.end_session(view)  # a ghost: it may be loading "seen"
    for h in "abc":  # saved after it ended: it never heard of them
        save(cache, w, h, pages=2)
    assert allocate(cache, w, "new", pages=4).outcome is AllocOutcome.WAIT  # hides seen, a
    assert states(cache, "seen", "a") == [HIDDEN, None]  # "a" came back at once
    clock.now += 9
    cache.release_ghosts()
    assert states(cache, "seen") == [HIDDEN]  # until its lease is over
    clock.now += 1
    cache.release_ghosts()
    assert states(cache, "seen") == [None]
    assert allocate(cache, w, "new", pages=4).outcome is AllocOutcome.ALLOCATED


def test_a_view_whose_stream_never_opened_is_not_awaited_and_leaves_no_ghost():
    cache = make_cache(pages=8)
    w = worker(cache)
    save(cache, w, "a", pages=8)
    never = scheduler(cache, engine="broken", stream=False)  # it could not map the region
    assert never.outbox == deque()  # told nothing before its stream opens
    # "a" is reclaimed as it is hidden: nobody could be loading it.
    assert allocate(cache, w, "new", pages=8).outcome is AllocOutcome.ALLOCATED
    assert states(cache, "a") == [None]
    cache.end_session(never)  # its lease ran out, without Detach
    assert not never.is_ghost and list(cache.sessions.ghosts()) == []


def test_an_engines_views_hear_how_many_of_its_ranks_mapped_the_region():
    cache = make_cache()
    view, other = scheduler(cache), scheduler(cache, engine="F")
    assert drain(view)[-1] == RanksEvent(0, 0)  # no worker yet
    drain(other)
    r0 = worker(cache, rank=0, world=2)
    r1 = worker(cache, rank=1, world=2, stream=False)  # attached, not mapped yet
    assert drain(view) == [RanksEvent(1, 2)] and drain(other) == []
    cache.views.open(r1)
    assert drain(view) == [RanksEvent(2, 2)]
    late = scheduler(cache)  # a re-attached view learns it with its snapshot
    assert drain(late)[-1] == RanksEvent(2, 2)
    cache.end_session(r0)  # a rank died
    assert drain(view) == [RanksEvent(1, 2)] == drain(late)
    assert drain(other) == []


def test_a_hidden_entry_awaiting_a_live_view_and_a_ghost_needs_both():
    clock = FakeClock()
    cache = make_cache(pages=8, lease=10, clock=clock)
    live, lost, w = scheduler(cache), scheduler(cache, engine="F"), worker(cache)
    a = save(cache, w, "a", pages=8)
    assert allocate(cache, w, "new", pages=8).outcome is AllocOutcome.WAIT
    cache.end_session(lost)
    clock.now += 10
    assert cache.release_ghosts() == [lost]
    assert states(cache, "a") == [HIDDEN]  # the live view still owes its ack
    cache.views.acknowledge(live, [("a", a.entry_id)])
    assert states(cache, "a") == [None]


def test_a_detached_view_acknowledges_at_once(cache):
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "a", pages=8)
    assert allocate(cache, w, "new", pages=8).outcome is AllocOutcome.WAIT
    cache.end_session(view, detached=True)
    assert not view.is_ghost and list(cache.sessions.ghosts()) == []
    assert states(cache, "a") == [None]
    assert allocate(cache, w, "new", pages=8).outcome is AllocOutcome.ALLOCATED


def test_ending_a_session_twice_changes_nothing(cache):
    view = scheduler(cache)
    cache.end_session(view)
    ghost_until = view.ghost_until
    cache.sessions.clock.now += 5
    cache.end_session(view, detached=True)
    assert view.is_ghost and view.ghost_until == ghost_until


def test_expired_leases_end_sessions_views_become_ghosts():
    clock = FakeClock()
    cache = make_cache(pages=8, lease=5, clock=clock, quarantine=30)
    view, writer = scheduler(cache), worker(cache)
    save(cache, writer, "a", pages=4)
    allocate(cache, writer, "b", pages=2)
    clock.now += 3
    cache.sessions.renew(view)
    clock.now += 3
    assert cache.expire_sessions() == [writer]
    assert cache.table.pending_pages == 0 and cache.quarantine.pages == 2
    clock.now += 3
    assert cache.expire_sessions() == [view]
    assert view.is_ghost and view.ghost_until == clock.now + 5 and len(cache.sessions) == 0
    assert cache.expire_sessions() == []


# --------------------------------------------------------- quarantine


def test_pending_saves_of_an_ended_writer_are_quarantined_then_freed():
    clock = FakeClock()
    table = stamp_table(8)
    cache = make_cache(pages=8, lease=10, clock=clock, stamps=table, quarantine=30)
    w = worker(cache)
    allocate(cache, w, "a", pages=3)
    b = allocate(cache, w, "b", pages=3)
    cache.end_session(w, detached=True)  # detached or not: it may still be copying
    assert cache.table.pending_pages == 0 and states(cache, "a", "b") == [None, None]
    assert cache.quarantine.pages == 6 and cache.allocator.free_pages == 2
    # The key is free again, but not the pages a frozen writer may still write.
    retry = allocate(cache, worker(cache, engine="F"), "b", pages=2)
    assert retry.outcome is AllocOutcome.ALLOCATED
    assert set(page_numbers(cache, retry.extents)).isdisjoint(page_numbers(cache, b.extents))
    with pytest.raises(ResourceExhausted, match="6144 quarantined"):
        allocate(cache, worker(cache, engine="G"), "c")
    clock.now += 29.9
    assert cache.release_quarantine() == 0
    assert table.holds(b.extents, b.entry_id)  # the dead writer's stamp stays meanwhile
    clock.now += 0.1
    assert cache.release_quarantine() == 6
    assert cache.quarantine.pages == 0 and cache.allocator.free_pages == 6
    assert table.holds(b.extents, 0)


# ------------------------------------------------------------- stamps


def test_allocate_stamps_every_page_of_every_run_before_returning():
    table = stamp_table(8)
    cache = make_cache(pages=8, stamps=table)
    w = worker(cache)
    held = {h: allocate(cache, w, h, pages=2) for h in "pqrs"}
    cache.abort(w, ["p", "r"])  # free: pages 0-1 and 4-5
    result = allocate(cache, w, "x", pages=4)
    assert len(result.extents) == 2  # two runs
    assert stamped(table, [0, 1, 4, 5], result.entry_id)
    assert table.holds(result.extents, result.entry_id)
    assert stamped(table, [2, 3], held["q"].entry_id) and stamped(table, [6, 7],
                                                                  held["s"].entry_id)


def test_stamps_are_written_before_the_writer_learns_the_extents():
    class Recording(cache_module.Stamps):
        def __init__(self):
            self.calls = []

        def write(self, runs, stamp):
            self.calls.append(("write", list(runs), stamp))

        def clear(self, runs):
            self.calls.append(("clear", list(runs)))

    stamps = Recording()
    cache = make_cache(pages=8)
    cache.stamps = stamps
    w = worker(cache)
    result = allocate(cache, w, "h", pages=3)
    assert stamps.calls == [("write", [(0, 3)], result.entry_id)]
    cache.abort(w, ["h"])
    assert stamps.calls[1:] == [("clear", [(0, 3)])]


def test_stamps_are_cleared_when_pages_come_back_and_rewritten_on_reuse():
    table = stamp_table(8)
    cache = make_cache(pages=8, stamps=table)
    view, w = scheduler(cache), worker(cache)
    a = save(cache, w, "a", pages=8)
    assert allocate(cache, w, "b", pages=8).outcome is AllocOutcome.WAIT
    assert table.holds(a.extents, a.entry_id)  # hidden: the bytes are intact
    cache.views.acknowledge(view, [("a", a.entry_id)])
    assert stamped(table, range(8), 0)
    b = allocate(cache, w, "b", pages=8)
    assert b.entry_id != a.entry_id and table.holds(b.extents, b.entry_id)
    assert not table.holds(a.extents, a.entry_id)  # a load of "a" now would be caught
    cache.abort(w, ["b"])
    assert stamped(table, range(8), 0)


# ------------------------------------------------------ namespaces, counters


def test_namespace_counters_are_forgotten_once_nothing_uses_the_namespace():
    clock = FakeClock()
    cache = make_cache(pages=8, lease=10, clock=clock)
    view, w = scheduler(cache, ns="x"), worker(cache, ns="x")
    save(cache, w, "a")
    cache.views.record_lookups(view, 3, 1)
    cache.end_session(view, detached=True)
    cache.end_session(w)
    assert cache.table.counters["x"]["hits"] == 1  # "a" is still cached
    assert allocate(cache, worker(cache, ns="y"), "big", pages=8).outcome is (
        AllocOutcome.ALLOCATED)  # "a" evicted and reclaimed: nobody awaited it
    assert "x" not in cache.table.counters and "x" not in cache.table.usage
    ghost = scheduler(cache, ns="g")
    cache.end_session(ghost)  # not detached: a ghost still uses its namespace
    assert "g" in cache.table.counters
    clock.now += 10
    assert cache.release_ghosts() == [ghost]
    assert "g" not in cache.table.counters


def test_stats_list_the_namespaces_holding_the_most_bytes_and_count_the_rest(monkeypatch):
    """Any client can save under as many namespaces as the region has pages:
    the snapshot (the Stats reply, /metrics' label sets) lists a bounded
    number, the largest first, and counts the others."""
    monkeypatch.setattr(stats_module, "LISTED_NAMESPACES", 3)
    cache = make_cache(pages=16)
    for i, pages in enumerate([1, 3, 0, 2, 4]):
        w = worker(cache, ns=f"ns{i}")
        if pages:
            save(cache, w, f"key{i}", pages=pages)
    snapshot = stats_module.take(cache, generation=1, region_path="r", started=0.0)
    assert [(n.name, n.bytes) for n in snapshot.namespaces] == [
        ("ns4", 4 * cache.page_bytes), ("ns1", 3 * cache.page_bytes),
        ("ns3", 2 * cache.page_bytes)]
    assert snapshot.namespaces_total == 5 and snapshot.namespaces_not_listed == 2
    monkeypatch.setattr(stats_module, "LISTED_NAMESPACES", 64)
    assert stats_module.take(cache, generation=1, region_path="r",
                             started=0.0).namespaces_not_listed == 0


def test_stats_list_a_namespace_that_only_holds_adopted_entries():
    """After a warm restart, before any engine attaches, the region's bytes
    are in namespaces nobody uses yet: they are listed (no lookups yet)."""
    from ec_daemon.durable.journal import Record

    cache = make_cache(pages=8)
    cache.restore([Record(6, "adopted", "a", 1024, (1, 1024), "uint8", [(1, 2)])],
                  [(0, 1), (3, 5)], [], 7, (), cache.sessions.previous_daemon)
    snapshot = stats_module.take(cache, generation=1, region_path="r", started=0.0)
    assert [(n.name, n.entries, n.bytes, n.hits) for n in snapshot.namespaces] == [
        ("adopted", 1, 1024, 0)]  # the entry's bytes
    assert snapshot.namespaces_total == 1 and snapshot.namespaces_not_listed == 0


def test_heartbeat_lookup_counters_feed_hits_and_misses(cache):
    view = scheduler(cache)
    cache.views.record_lookups(view, 10, 4)
    cache.views.record_lookups(view, 0, 0)
    assert (cache.counters["hits"], cache.counters["misses"]) == (4, 6)
    assert cache.table.counters["ns"] == {"hits": 4, "misses": 6, "loads": 0}


@pytest.mark.parametrize(("lookups", "hits"), [(1, 2), (-1, 0), (3, -1)])
def test_impossible_lookup_counters_are_refused_and_change_nothing(cache, lookups, hits):
    view = scheduler(cache)
    with pytest.raises(InvalidArgument):
        cache.views.record_lookups(view, lookups, hits)
    assert cache.counters["hits"] == cache.counters["misses"] == 0
    assert cache.table.counters["ns"] == {"hits": 0, "misses": 0, "loads": 0}


# ------------------------------------------------------------- outbox


def test_a_view_whose_outbox_passes_its_limit_is_marked_overflowed(cache, monkeypatch):
    monkeypatch.setattr(views_module, "OUTBOX_MIN_EVENTS", 2)
    w = worker(cache)
    for h in "abc":
        save(cache, w, h)
    view = scheduler(cache)  # a snapshot (of 3, one item) + done + ranks: the limit counts them
    wakes = []
    view.wake = lambda: wakes.append(1)
    assert not view.overflowed and len(view.outbox) == 3
    save(cache, w, "d")
    assert not view.overflowed and len(view.outbox) == 4
    save(cache, w, "e")
    assert not view.overflowed and len(view.outbox) == 5
    save(cache, w, "f")  # past the snapshot's 3 + 2
    assert view.overflowed and wakes == [1, 1, 1]  # the stream writer is told to look
    save(cache, w, "g")
    events = drain(view)
    assert [getattr(e, "mm_hash", None) for e in events] == ["a", "b", "c", None, None, "d",
                                                             "e"]
    # Still awaited: it missed events, so it is ended as a ghost, never trusted to ack.
    assert view in cache.sessions.awaited("ns", 1)


def test_an_ended_session_is_sent_nothing(cache):
    view, w = scheduler(cache), worker(cache)
    drain(view)
    cache.end_session(view, detached=True)
    save(cache, w, "a")
    assert not view.outbox and not view.overflowed


def test_an_eviction_waits_on_a_live_view_for_the_bound_only():
    """Issue 40, finding 1, on the core: an eviction awaits a live view for
    --ack-wait-seconds (3 leases by default); then the view is overdue (the
    data plane ends it: a ghost for a lease), and a view re-attaching with the
    entry in its loads cannot make it await it again."""
    clock = FakeClock()
    cache = make_cache(pages=4, clock=clock)
    view, w = scheduler(cache), worker(cache)
    save(cache, w, "a", pages=4)
    drain(view)
    assert allocate(cache, w, "b", pages=4).outcome is AllocOutcome.WAIT  # "a" hidden
    entry = cache.get("ns", "a")
    assert entry.state is State.HIDDEN and entry.awaiting == {view}
    clock.now += 29.9
    assert cache.acks.overdue_views() == []
    clock.now += 0.1
    assert cache.acks.overdue_views() == [view]
    cache.end_session(view)  # a ghost: it still awaits "a" for a lease
    again = scheduler(cache, engine="E")
    cache.views.hold(again, [("a", entry.entry_id)])
    assert again not in entry.awaiting and entry.awaiting == {view}
    clock.now += 10
    cache.release_ghosts()
    assert cache.get("ns", "a") is None  # the pages came back
