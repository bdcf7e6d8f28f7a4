"""The scheduler's ReadyView: an eviction is acknowledged only when the entry
can no longer be looked up and no load of it is in flight, wherever the
eviction lands relative to the engine's hit and step boundary."""

from __future__ import annotations

import pytest

from ec_client.common.wire import DaemonNews
from ec_client.scheduler_side.view import ReadyView, Refs
from ec_protocol.protocol import pb
from tests.unit.daemon_news import news

A = ("a", 1)


def ready(mm_hash: str, entry_id: int, nbytes: int = 4096) -> DaemonNews:
    return news(ready=[pb.EntryInfo(
        mm_hash=mm_hash, entry_id=entry_id, nbytes=nbytes, shape=[nbytes // 4],
        dtype="float32", extents=[pb.Extent(offset=entry_id * 4096, length=nbytes)])])


def evicted(mm_hash: str, entry_id: int) -> DaemonNews:
    return news(evicted=[pb.EntryRef(mm_hash=mm_hash, entry_id=entry_id)])


class Link:
    """Stands in for the session link: records what the view sends."""

    def __init__(self) -> None:
        self.acks: Refs = []

    def __call__(self, acks: Refs) -> bool:
        self.acks += acks
        return True


@pytest.fixture
def view() -> ReadyView:
    v = ReadyView()
    v.apply(ready("a", 1), Link())
    return v


def test_the_snapshot_fills_the_view_and_marks_it_synced():
    view = ReadyView()
    view.apply(ready("a", 1), Link())
    assert not view.synced
    view.apply(news(ready=[], snapshot_done=True), Link())
    assert view.synced and len(view) == 1
    entry = view.get("a")
    assert entry is not None
    assert (entry.entry_id, entry.nbytes, entry.shape, entry.dtype, entry.extents) == (
        1, 4096, (1024,), "float32", ((4096, 4096),))


def test_an_eviction_before_the_claim_is_acknowledged_at_once_and_the_claim_misses(view):
    link = Link()
    view.apply(evicted("a", 1), link)
    assert link.acks == [A]
    assert view.hit("a") is None
    assert view.end_step((), view.epoch, link)
    assert link.acks == [A]  # not twice


def test_an_eviction_between_claim_and_step_end_waits_for_the_step_end(view):
    link = Link()
    assert view.hit("a") is not None
    view.apply(evicted("a", 1), link)
    assert link.acks == []  # the engine may still dispatch this hit
    assert view.hit("a") is None  # but nobody else gets it
    view.end_step((), view.epoch, link)  # it did not dispatch it after all
    assert link.acks == [A]


def test_an_eviction_between_claim_and_step_end_of_a_dispatched_load_waits_for_the_load(view):
    link = Link()
    assert view.hit("a") is not None
    view.apply(evicted("a", 1), link)
    view.end_step([A], view.epoch, link)
    assert link.acks == [] and view.inflight() == 1
    view.finish([A], view.epoch, link)
    assert link.acks == [A] and view.inflight() == 0


def test_an_eviction_after_the_step_end_waits_for_the_load_in_flight(view):
    link = Link()
    view.hit("a")
    view.end_step([A], view.epoch, link)
    view.apply(evicted("a", 1), link)
    assert link.acks == []
    assert view.hit("a") is None
    view.end_step((), view.epoch, link)  # a later step boundary releases nothing
    assert link.acks == []
    view.finish([A], view.epoch, link)
    assert link.acks == [A]


def test_an_eviction_after_the_load_finished_is_acknowledged_at_once(view):
    link = Link()
    view.hit("a")
    view.end_step([A], view.epoch, link)
    view.finish([A], view.epoch, link)
    assert link.acks == []  # nothing was evicted
    view.apply(evicted("a", 1), link)
    assert link.acks == [A]


@pytest.mark.parametrize("moment", ["before the hit", "between hit and read",
                                    "after the read"])
def test_an_eviction_racing_a_lock_free_claim_is_a_miss_or_waits(view, moment):
    """`hit` takes no lock, so the link thread's eviction can land between
    any two of its operations: either the hit misses, or the ack waits for
    the step end (and for the load, if it was dispatched)."""
    link = Link()
    pending = [evicted("a", 1)]

    def evict() -> None:
        if pending:
            view.apply(pending.pop(), link)

    class Hits(set):
        def add(self, item):
            if moment == "before the hit":
                evict()
            super().add(item)
            if moment == "between hit and read":
                evict()

    class Entries(dict):
        def get(self, key, default=None):
            value = super().get(key, default)
            if moment == "after the read":
                evict()
            return value

    view._hits, view._entries = Hits(), Entries(view._entries)
    hit = view.hit("a") is not None
    assert hit == (moment == "after the read")
    assert link.acks == ([A] if moment == "before the hit" else [])
    view.end_step([A] if hit else (), view.epoch, link)
    assert link.acks == ([] if hit else [A])
    view.finish([A] if hit else (), view.epoch, link)
    assert link.acks == [A]


def test_the_ack_waits_for_the_last_of_several_loads_in_flight(view):
    link = Link()
    view.hit("a")
    view.end_step([A, A], view.epoch, link)  # two dispatches in one step
    view.hit("a")
    view.end_step([A], view.epoch, link)  # and one more the next step
    view.apply(evicted("a", 1), link)
    assert view.inflight() == 3
    view.finish([A], view.epoch, link)
    view.finish([A], view.epoch, link)
    assert link.acks == []
    view.finish([A], view.epoch, link)
    assert link.acks == [A] and view.inflight() == 0


def test_loads_of_other_entries_do_not_hold_an_ack(view):
    link = Link()
    view.apply(ready("b", 2), link)
    view.hit("a")
    view.hit("b")
    view.end_step([A], view.epoch, link)  # only a dispatched
    view.apply(evicted("b", 2), link)
    assert link.acks == [("b", 2)]


def test_an_eviction_of_a_replaced_entry_id_leaves_the_newer_entry(view):
    link = Link()
    view.apply(ready("a", 5), link)  # the key was saved again under a new entry
    view.hit("a")
    view.apply(evicted("a", 1), link)
    # The hit is by key: the view cannot tell whether it read entry 1
    # before the replacement, so the ack waits for the step end.
    assert link.acks == []
    view.end_step([], view.lineage, link)
    assert link.acks == [A]
    entry = view.get("a")
    assert entry is not None and entry.entry_id == 5


def test_after_clear_an_older_lineages_step_end_and_finish_do_nothing(view):
    link = Link()
    old = view.lineage
    view.hit("a")
    view.end_step([A], old, link)
    view.apply(evicted("a", 1), link)
    assert link.acks == [] and view.inflight() == 1
    view.clear()  # the session is gone (its ghost protects the load)
    assert view.lineage == old + 1 and len(view) == 0 and view.inflight() == 0
    assert not view.synced
    view.finish([A], old, link)
    assert link.acks == []  # nothing for the new session's view

    view.apply(ready("a", 1), link)  # the new daemon's entry ids restart
    assert view.hit("a") is not None
    view.end_step([A], old, link)  # a load planned in the old view
    assert view.inflight() == 0 and view.take_touches() == []
    view.apply(evicted("a", 1), link)
    assert link.acks == [A]  # not withheld for the old view's load
    view.finish([A], old, link)
    assert link.acks == [A]


def test_touches_accumulate_per_dispatched_load_until_taken(view):
    link = Link()
    view.apply(ready("b", 2), link)
    view.hit("a")
    view.hit("b")
    view.end_step([A, ("b", 2), A], view.epoch, link)
    view.hit("a")
    view.end_step([A], view.epoch, link)
    assert sorted(view.take_touches()) == [(*A, 3), ("b", 2, 1)]
    assert view.take_touches() == []
    assert link.acks == []  # loads send nothing: touches ride on heartbeats


def test_counts_are_lookups_and_hits_since_the_view_was_made(view):
    assert view.counts() == (0, 0)
    for hit in (True, False, True):
        view.count(hit)
    assert view.counts() == (3, 2)
    view.clear()  # (counts outlive a session)
    view.count(False)
    assert view.counts() == (4, 2)


def test_a_claim_serves_only_a_ready_entry_of_its_epoch_while_allowed(view):
    view.apply(ready("b", 2), Link())
    assert view.hit("b", serve=False) is None  # found, not served (the ranks still map)
    assert view.hit("b", epoch=view.epoch - 1) is None  # the view moved on since
    assert view.hit("b", epoch=view.epoch) is not None
    assert view.hit("x") is None
    assert view.counts() == (0, 0)  # hits are not lookups: vLLM's are (`count`)


def test_a_failed_send_is_reported_by_the_step_end(view):
    view.hit("a")
    view.apply(evicted("a", 1), Link())
    assert view.end_step((), view.epoch, lambda acks: False) is False


def test_a_heartbeat_takes_a_bounded_batch_of_touches_and_leaves_the_rest(view):
    # A daemon refuses a message with more than MAX_BATCH touches (and would
    # end the session): an engine loading more distinct entries than that
    # between heartbeats sends them over several.
    link = Link()
    refs = [(f"k{i}", i + 1) for i in range(10)]
    for mm_hash, entry_id in refs:
        view.apply(ready(mm_hash, entry_id), link)
        view.hit(mm_hash)
    view.end_step(refs, view.epoch, link)
    first = view.take_touches(limit=4)
    second = view.take_touches(limit=4)
    rest = view.take_touches(limit=4)
    assert [len(first), len(second), len(rest)] == [4, 4, 2]
    assert sorted((h, e) for h, e, _ in first + second + rest) == sorted(refs)
    assert view.take_touches() == []


def test_touches_of_too_many_distinct_entries_are_dropped_not_grown(view, monkeypatch):
    from ec_client.scheduler_side import view as view_module

    monkeypatch.setattr(view_module, "MAX_PENDING_TOUCHES", 3)
    link = Link()
    refs = [(f"k{i}", i + 1) for i in range(5)]
    for mm_hash, entry_id in refs:
        view.apply(ready(mm_hash, entry_id), link)
        view.hit(mm_hash)
    view.end_step(refs + refs[:1], view.epoch, link)
    touches = view.take_touches()
    assert len(touches) == 3 and ("k0", 1, 2) in touches  # a known entry still counts


def test_loads_in_flight_outlive_a_reattach_to_the_same_region(view):
    """A restarted daemon adopted the region: the view is refilled, but the
    loads dispatched before still count, and a later eviction of their entry
    waits for them; the next session hears of them (`loading`)."""
    link = Link()
    view.hit("a")
    view.end_step([A], view.lineage, link)
    lineage = view.lineage
    view.clear(keep_loads=True)
    assert view.lineage == lineage and view.inflight() == 1 and view.loading() == [A]
    view.apply(ready("a", 1), link)  # the adopted entry, same id
    view.apply(evicted("a", 1), link)
    assert link.acks == []
    view.finish([A], lineage, link)
    assert link.acks == [A]


def test_a_hit_dispatched_across_a_reattach_to_the_same_region_is_counted(view):
    """The daemon restarted between a hit and the step's end: the re-attach
    dropped the step's hits, but the load is dispatched all the same, so
    it must count (else the new daemon could reuse its pages under it)."""
    link = Link()
    assert view.hit("a") is not None
    view.clear(keep_loads=True)  # the link re-attached mid-step
    view.end_step([A], view.lineage, link)
    assert view.inflight() == 1
    view.apply(ready("a", 1), link)
    view.apply(evicted("a", 1), link)
    assert link.acks == []
    view.finish([A], view.lineage, link)
    assert link.acks == [A]
