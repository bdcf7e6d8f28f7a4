"""The scheduler delegate's hot path, without a daemon: the session stream
is replaced by a list, so every message it would send is visible."""

import pytest

from ec_client.scheduler import SchedulerDelegate
from ec_client.session import Attachment
from ec_protocol.protocol import Layout, pb

ATTACHMENT = Attachment(session_id="s", index=7, namespace="ns", region_path="/dev/null",
                        region_size=1 << 20, page_bytes=4096, generation=42, lease_ms=10000,
                        heartbeat_ms=2000)


def ready(mm_hash, entry_id, nbytes=4096):
    return pb.DaemonMessage(ready=[pb.EntryInfo(
        mm_hash=mm_hash, entry_id=entry_id, nbytes=nbytes, shape=[nbytes // 2], dtype="float16",
        extents=[pb.Extent(offset=entry_id * 4096, length=nbytes)])], snapshot_done=True)


@pytest.fixture
def delegate():
    d = SchedulerDelegate("unix:///nonexistent/ec.sock", engine_id="E",
                          layout=Layout("m", "float16", {"image": 2}), start=False)
    sent = []
    # What would go on the stream, as the link thread builds it.
    d.link.send = lambda message: sent.append(
        message.to_message() if hasattr(message, "to_message") else message) or True
    d.sent = sent
    d._on_attached(ATTACHMENT)
    yield d
    d.transport.close()


def test_misses_and_hits_come_from_the_view_without_rpcs(delegate):
    assert not delegate.has_item("a")
    delegate._on_message(ready("a", 1))
    assert delegate.has_item("a")
    assert delegate.after_alloc("req-1", "a")
    assert not delegate.after_alloc("req-2", "b")  # a miss: computed and saved by the worker
    meta = delegate.build_step_metadata()
    assert [s.mm_hash for s in meta.loads] == ["a"]
    spec = meta.loads[0]
    assert spec.transfer_id >> 32 == 7 and spec.generation == 42
    assert spec.extents == ((4096, 4096),) and spec.shape == (2048,)
    assert sum(delegate.transport.calls.values()) == 0


def test_transfer_ids_are_unique_per_dispatch_and_session(delegate):
    delegate._on_message(ready("a", 1))
    ids = []
    for step in range(3):
        delegate.has_item("a")
        delegate.after_alloc(f"req-{step}", "a")
        ids += [s.transfer_id for s in delegate.build_step_metadata().loads]
    assert len(set(ids)) == 3
    delegate._on_attached(Attachment(**{**ATTACHMENT.__dict__, "index": 8}))
    delegate._on_message(ready("a", 1))
    delegate.has_item("a")
    delegate.after_alloc("req-x", "a")
    (spec,) = delegate.build_step_metadata().loads
    assert spec.transfer_id >> 32 == 8 and spec.transfer_id not in ids


def test_same_item_twice_in_a_step_is_one_load(delegate):
    delegate._on_message(ready("a", 1))
    delegate.has_item("a")
    assert delegate.after_alloc("r1", "a") and delegate.after_alloc("r2", "a")
    meta = delegate.build_step_metadata()
    assert len(meta.loads) == 1
    delegate.apply_worker_output(failed=[meta.loads[0].transfer_id])
    assert delegate.take_unavailable_requests() == {"r1", "r2"}
    assert delegate.take_unavailable_requests() == set()


def test_an_eviction_during_the_step_waits_until_the_pin_is_queued(delegate):
    delegate._on_message(ready("a", 1))
    delegate.sent.clear()
    assert delegate.has_item("a")
    # The eviction arrives between has_item and after_alloc.
    delegate._on_message(pb.DaemonMessage(evicted=[pb.EntryRef(mm_hash="a", entry_id=1)]))
    assert delegate.sent == []  # not acknowledged yet
    assert delegate.after_alloc("r", "a")  # still loadable
    delegate.build_step_metadata()
    (message,) = delegate.sent
    assert [p.mm_hash for p in message.pins] == ["a"]
    assert [a.mm_hash for a in message.acks] == ["a"]  # same message: pins are applied first
    assert not delegate.has_item("a")


def test_evictions_of_unclaimed_entries_are_acknowledged_at_once(delegate):
    delegate._on_message(ready("a", 1))
    delegate.sent.clear()
    delegate._on_message(pb.DaemonMessage(evicted=[pb.EntryRef(mm_hash="a", entry_id=1)]))
    assert [a.mm_hash for m in delegate.sent for a in m.acks] == ["a"]
    assert not delegate.has_item("a")


def test_detach_empties_the_view_and_fails_planned_loads(delegate):
    delegate._on_message(ready("a", 1))
    delegate.has_item("a")
    delegate.after_alloc("r", "a")
    delegate._on_detached()
    delegate.link.send = lambda message: False
    assert not delegate.has_item("a")
    delegate.build_step_metadata()
    assert delegate.take_unavailable_requests() == {"r"}


def test_pin_failures_make_their_requests_unavailable(delegate):
    delegate._on_message(ready("a", 1))
    delegate.has_item("a")
    delegate.after_alloc("r", "a")
    (spec,) = delegate.build_step_metadata().loads
    delegate._on_message(pb.DaemonMessage(pin_failures=[
        pb.PinFailure(transfer_id=spec.transfer_id, reason="entry is no longer cached")]))
    assert delegate.take_unavailable_requests() == {"r"}


def test_heartbeats_carry_lookup_counters_as_deltas(delegate):
    delegate._on_message(ready("a", 1))
    for h in ("a", "b", "c"):
        delegate.has_item(h)
    beat = delegate._heartbeat()
    assert (beat.lookups, beat.hits) == (3, 1)
    beat = delegate._heartbeat()
    assert (beat.lookups, beat.hits) == (0, 0)


def test_producers_never_hit():
    d = SchedulerDelegate("unix:///nonexistent/ec.sock", engine_id="E", role="producer",
                          layout=Layout("m", "float16", {"image": 2}), start=False)
    d._on_attached(ATTACHMENT)
    d._on_message(ready("a", 1))
    assert not d.has_item("a")
    d.transport.close()


def test_a_hit_lost_to_a_detach_before_after_alloc_fails_its_request(delegate):
    delegate._on_message(ready("a", 1))
    assert delegate.has_item("a")
    delegate._on_detached()  # the link drops between has_item and after_alloc
    assert delegate.after_alloc("r", "a")  # the engine will expect a load ...
    delegate.link.send = lambda message: False
    delegate.build_step_metadata()
    assert delegate.take_unavailable_requests() == {"r"}  # ... so the request fails


def test_an_eviction_racing_the_step_end_is_acknowledged_after_the_pin(delegate):
    import threading

    delegate._on_message(ready("a", 1))
    delegate.sent.clear()
    assert delegate.has_item("a")
    delegate.after_alloc("r", "a")
    racer = threading.Thread(target=delegate._on_message, args=(pb.DaemonMessage(
        evicted=[pb.EntryRef(mm_hash="a", entry_id=1)]),))
    send = delegate.link.send

    def send_with_a_racing_eviction(message):
        if not racer.is_alive() and racer.ident is None:
            racer.start()  # the link thread delivers the eviction right now
            racer.join(0.2)
        return send(message)

    delegate.link.send = send_with_a_racing_eviction
    delegate.build_step_metadata()
    racer.join(5)
    kinds = [("pin" if m.pins else "") + ("ack" if m.acks else "") for m in delegate.sent]
    assert kinds == ["pin", "ack"]


@pytest.mark.parametrize("moment", ["before the claim", "between claim and read",
                                    "after the read"])
def test_an_eviction_racing_a_lookup_is_either_a_miss_or_deferred(delegate, moment):
    """Lookups take no lock: the link thread's eviction can land between any
    two of their operations. Whichever it is, a hit's pin must be queued
    before the eviction is acknowledged."""
    view = delegate.view
    delegate._on_message(ready("a", 1))
    delegate.sent.clear()

    pending = [pb.DaemonMessage(evicted=[pb.EntryRef(mm_hash="a", entry_id=1)])]

    def evict():
        if pending:
            delegate._on_message(pending.pop())

    class Claims(set):
        def add(self, item):
            if moment == "before the claim":
                evict()
            super().add(item)
            if moment == "between claim and read":
                evict()

    class Entries(dict):
        def get(self, key, default=None):
            value = super().get(key, default)
            if moment == "after the read" and key == "a" and value is not None:
                evict()
            return value

    view._claimed, view._entries = Claims(), Entries(view._entries)
    hit = delegate.has_item("a")
    if hit:
        delegate.after_alloc("r", "a")
    delegate.build_step_metadata()
    order = [("pin" if m.pins else "") + ("ack" if m.acks else "") for m in delegate.sent]
    assert order == (["pinack"] if hit else ["ack"])
    assert hit == (moment == "after the read")
    assert not delegate.has_item("a")


def test_heartbeat_counts_are_consistent_under_concurrent_lookups(delegate):
    import threading

    delegate._on_message(ready("a", 1))
    stop = threading.Event()
    beats = []

    def beat():
        while not stop.is_set():
            beats.append(delegate._heartbeat())

    thread = threading.Thread(target=beat)
    thread.start()
    for i in range(20000):
        delegate.has_item("a" if i % 2 else "b")
    stop.set()
    thread.join()
    beats.append(delegate._heartbeat())
    assert all(b.hits <= b.lookups for b in beats)
    assert sum(b.lookups for b in beats) == 20000 and sum(b.hits for b in beats) == 10000


def test_a_reattach_during_a_lookup_never_pairs_an_old_entry_with_the_new_session(delegate):
    """The view's entry and the transfer id must come from one session: an
    old entry's extents under a new session's transfer id could be pinned
    there (entry ids restart with the daemon) and load the wrong bytes."""
    delegate._on_message(ready("a", 1))

    class Entries(dict):
        def get(self, key, default=None):
            value = super().get(key, default)
            if key == "a" and value is not None and value.entry_id == 1:
                # The link detaches and re-attaches to a restarted daemon
                # right after the lookup read the old entry.
                delegate._on_detached()
                delegate._on_attached(Attachment(**{**ATTACHMENT.__dict__, "index": 8}))
                delegate._on_message(ready("a", 1))
            return value

    delegate.view._entries = Entries(delegate.view._entries)
    assert delegate.has_item("a")
    delegate.after_alloc("r", "a")
    (spec,) = delegate.build_step_metadata().loads
    assert spec.transfer_id >> 32 == 7  # the old session's: the new daemon refuses the pin
