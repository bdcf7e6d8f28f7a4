"""The scheduler's ReadyView applies a large daemon message in slices: the
engine's step boundary waits for one slice of the view's lock, never for a
whole snapshot, and no slice boundary exposes a state that could dispatch a
load of pages already acknowledged."""

from __future__ import annotations

import random
import threading
import time

from ec_client.scheduler_side.view import APPLY_SLICE, ReadyView, Refs
from ec_protocol.protocol import pb
from tests.unit.daemon_news import news

ENTRIES = 4096


def info(mm_hash: str, entry_id: int) -> pb.EntryInfo:
    return pb.EntryInfo(mm_hash=mm_hash, entry_id=entry_id, nbytes=4096, shape=[1024],
                        dtype="float32", extents=[pb.Extent(offset=entry_id * 4096, length=4096)])


class HoldRecorder:
    """The view's lock, recording per hold how far the view's entry count
    moved and whether the snapshot was marked done: the work one hold did."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.view: ReadyView | None = None
        self.holds: list[tuple[int, bool]] = []  # (entries added or removed, synced after)
        self._before = 0

    def __enter__(self) -> HoldRecorder:
        self._lock.acquire()
        assert self.view is not None
        self._before = len(self.view)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.view is not None
        self.holds.append((abs(len(self.view) - self._before), self.view.synced))
        self._lock.release()


def recorded_view() -> tuple[ReadyView, HoldRecorder]:
    recorder = HoldRecorder()
    view = ReadyView(lock=recorder)
    recorder.view = view
    return view, recorder


def test_a_snapshot_of_4096_entries_holds_the_lock_for_at_most_one_slice_at_a_time():
    view, recorder = recorded_view()
    sent: list[tuple[int, Refs]] = []
    view.apply(news(ready=[info(f"h{i}", i + 1) for i in range(ENTRIES)],
                                snapshot_done=True), lambda acks: sent.append((0, acks)) or True)
    assert len(view) == ENTRIES and view.synced
    assert max(work for work, _ in recorder.holds) <= APPLY_SLICE
    assert len(recorder.holds) >= ENTRIES // APPLY_SLICE
    # Synced only once the whole snapshot is in: never on an earlier hold.
    assert [synced for _, synced in recorder.holds] == [False] * (len(recorder.holds) - 1) + [True]


def test_evicting_4096_entries_holds_the_lock_per_slice_and_acknowledges_once_all_are_out():
    view, recorder = recorded_view()
    view.apply(news(ready=[info(f"h{i}", i + 1) for i in range(ENTRIES)]),
               lambda acks: True)
    recorder.holds.clear()
    left_at_send: list[int] = []
    acked: Refs = []

    def send(acks: Refs) -> bool:
        left_at_send.append(len(view))
        acked.extend(acks)
        return True

    view.apply(news(evicted=[pb.EntryRef(mm_hash=f"h{i}", entry_id=i + 1)
                                         for i in range(ENTRIES)]), send)
    assert max(work for work, _ in recorder.holds) <= APPLY_SLICE
    assert len(recorder.holds) >= ENTRIES // APPLY_SLICE
    # The acknowledgements go out once, after the last entry left the view.
    assert left_at_send == [0]
    assert sorted(acked) == sorted((f"h{i}", i + 1) for i in range(ENTRIES))


def test_an_eviction_that_follows_a_ready_of_the_same_key_in_one_message_waits_for_the_hit():
    """The daemon evicted entry 1 of `k`, then saved `k` again as entry 2; one
    message carries both (ready events are applied first). A hit of this
    step read entry 1 before the message: its eviction waits for the step
    end, and then for the load dispatched from it."""
    view = ReadyView()
    acked: Refs = []

    def send(acks: Refs) -> bool:
        acked.extend(acks)
        return True

    view.apply(news(ready=[info("k", 1)]), send)
    hit = view.hit("k")
    assert hit is not None and hit.entry_id == 1
    view.apply(news(ready=[info("k", 2)],
                                evicted=[pb.EntryRef(mm_hash="k", entry_id=1)]), send)
    assert acked == []  # entry 1 may be dispatched at this step's end
    view.end_step([("k", 1)], view.lineage, send)
    assert acked == []  # and now it is in flight
    view.finish([("k", 1)], view.lineage, send)
    assert acked == [("k", 1)]
    assert view.get("k") is not None and view.get("k").entry_id == 2  # type: ignore[union-attr]


def test_an_engine_thread_stepping_while_large_messages_apply_never_loads_acknowledged_pages():
    """The link thread applies large messages (a new entry id of every key,
    evicting the previous one, in the same message) while the engine's thread
    looks up, dispatches and finishes loads. No load is ever dispatched or
    still running once its entry's eviction was acknowledged."""
    keys = [f"h{i}" for i in range(ENTRIES)]
    view = ReadyView()
    acked: set[tuple[str, int]] = set()
    acked_lock = threading.Lock()
    violations: list[str] = []

    def send(acks: Refs) -> bool:
        with acked_lock:
            acked.update(acks)
        return True

    rounds = 12
    view.apply(news(ready=[info(k, 1) for k in keys], snapshot_done=True), send)
    done = threading.Event()

    def link_thread() -> None:
        for generation in range(2, rounds + 2):
            message = news(
                ready=[info(k, generation) for k in keys],
                evicted=[pb.EntryRef(mm_hash=k, entry_id=generation - 1) for k in keys])
            view.apply(message, send)
        done.set()

    def engine_thread() -> None:
        rng = random.Random(7)
        in_flight: list[tuple[str, int]] = []
        while not done.is_set():
            dispatched = []
            for k in rng.sample(keys, 8):
                entry = view.hit(k)
                if entry is not None:
                    dispatched.append((k, entry.entry_id))
            with acked_lock:
                already = [r for r in dispatched if r in acked]
            view.end_step(dispatched, view.lineage, send)
            with acked_lock:
                # Acknowledged before it was dispatched: its pages may be reused.
                violations.extend(f"dispatched acked {r}" for r in already)
            in_flight.extend(dispatched)
            if len(in_flight) > 32:
                finishing, in_flight[:] = in_flight[:16], in_flight[16:]
                with acked_lock:
                    violations.extend(f"acked in flight {r}" for r in finishing if r in acked)
                view.finish(finishing, view.lineage, send)
            time.sleep(0)
        with acked_lock:
            violations.extend(f"acked in flight {r}" for r in in_flight if r in acked)
        view.finish(in_flight, view.lineage, send)
        view.end_step((), view.lineage, send)

    threads = [threading.Thread(target=link_thread), threading.Thread(target=engine_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert violations == []
    # Every replaced entry id was acknowledged in the end, the newest ones kept.
    assert acked == {(k, g) for k in keys for g in range(1, rounds + 1)}
    assert {k: view.get(k).entry_id for k in keys} == {k: rounds + 1 for k in keys}  # type: ignore[union-attr]
    assert view.inflight() == 0
