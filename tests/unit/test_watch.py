"""Watchers (`ec_daemon.plane.watch`): the snapshot, its marker and live events in
order; the per-watcher buffer bound, past which a watcher is dropped with its
reason and nothing else is held up; namespace filters; the cache's hook."""

from __future__ import annotations

import asyncio

import pytest

from ec_daemon.core.limits import WATCH_BUFFER_EVENTS
from ec_daemon.core.records import Entry, State
from ec_daemon.errors import InvalidArgument, ResourceExhausted, Unavailable
from ec_daemon.plane.watch import (
    ALL,
    Event,
    Feed,
    Kind,
    Watcher,
    Watchers,
    peer_of,
    validate_namespace,
)
from ec_daemon.serving import wire
from ec_protocol.protocol import pb
from tests.unit.cache_helpers import allocate, make_cache, save, worker

NS_A = "model-a|float16|image=64|"
NS_B = "model-b|float16|image=64|"


def entry(mm_hash: str, namespace: str = NS_A, entry_id: int = 1,
          state: State = State.READY) -> Entry:
    e = Entry((namespace, mm_hash), entry_id, 8, (2, 4), "uint8", [(0, 1)], None)
    e.state = state
    return e


def ticking_clock():
    now = [1_000_000_000]

    def clock() -> int:
        now[0] += 1
        return now[0]

    return clock


def drain(watcher: Watcher) -> tuple[list[tuple[str, str]], int]:
    """Everything queued as (kind, mm_hash), and where the snapshot marker was."""
    seen: list[tuple[str, str]] = []
    marker = -1
    while True:
        events, done = watcher.take()
        seen += [(e.kind.value, e.entry.mm_hash) for e in events]
        if done:
            marker = len(seen)
        if not events and not done:
            return seen, marker


def test_snapshot_then_marker_then_live_events_in_order():
    watchers = Watchers(clock=ticking_clock())
    a, b, hidden = entry("a"), entry("b", entry_id=2), entry("h", entry_id=3, state=State.HIDDEN)
    watcher = watchers.open(ALL, [a, hidden, b])
    c = entry("c", entry_id=4)
    watchers.publish(c)
    c.state = State.HIDDEN
    watchers.publish(c)
    a.state = State.HIDDEN
    watchers.publish(a)
    assert drain(watcher) == ([("stored", "a"), ("stored", "b"), ("stored", "c"),
                               ("evicted", "c"), ("evicted", "a")], 2)
    assert watchers.count == 1 and watchers.dropped == 0


def test_an_empty_snapshot_still_sends_its_marker_and_messages_are_capped():
    watcher = Watcher(1, ALL, [], 7, Feed(WATCH_BUFFER_EVENTS))
    assert watcher.take() == ([], True)
    assert watcher.take() == ([], False)
    big = Watcher(2, ALL, [entry(f"k{i}", entry_id=i + 1) for i in range(5)], 7,
                  Feed(WATCH_BUFFER_EVENTS))
    first, done = big.take(max_events=2)
    assert len(first) == 2 and not done
    assert all(e.kind is Kind.STORED and e.time_ns == 7 for e in first)
    assert big.take(max_events=2)[1] is False
    last, done = big.take(max_events=2)
    assert len(last) == 1 and done  # the marker rides on the snapshot's last message
    capped = Watcher(3, ALL, [entry("x" * 400, entry_id=i + 1) for i in range(10)], 7,
                     Feed(WATCH_BUFFER_EVENTS))
    events, _ = capped.take(max_bytes=5000)
    assert 1 < len(events) < 10


def test_the_bound_counts_live_events_past_the_snapshot_only():
    watchers = Watchers(limit=3)
    snapshot = [entry(f"s{i}", entry_id=i + 1) for i in range(10)]
    watcher = watchers.open(ALL, snapshot)
    for i in range(3):
        watchers.publish(entry(f"live{i}", entry_id=100 + i))
    assert watcher.error is None and watcher.waiting() == 3
    seen, marker = drain(watcher)  # reading makes room again
    assert marker == 10 and len(seen) == 13
    for i in range(3):
        watchers.publish(entry(f"more{i}", entry_id=200 + i))
    assert watcher.error is None
    assert watchers.dropped == 0 and watchers.count == 1


def test_a_watcher_that_does_not_read_is_dropped_with_its_reason_and_others_carry_on():
    watchers = Watchers(limit=4)
    stalled = watchers.open(ALL, [entry("old")])
    reading = watchers.open(NS_A, [])
    for i in range(5):  # one more than the stalled watcher may hold
        watchers.publish(entry(f"k{i}", entry_id=10 + i))
        drain(reading)
    assert isinstance(stalled.error, ResourceExhausted)
    assert stalled.error.code == "RESOURCE_EXHAUSTED"
    assert "read too slowly" in str(stalled.error) and "more than 4 events" in str(stalled.error)
    assert stalled.waiting() == 0 and not stalled.snapshot  # what it held is freed at once
    assert watchers.count == 1 and watchers.dropped == 1
    watchers.publish(entry("after", entry_id=99))  # a dropped watcher gets nothing more
    assert stalled.waiting() == 0 and stalled.take() == ([], False)
    assert reading.error is None and drain(reading)[0] == [("stored", "after")]
    watchers.close(stalled)  # its call ends later: nothing to undo
    assert watchers.count == 1 and watchers.dropped == 1


def test_publishing_stores_each_event_once_however_many_watch():
    """Publishing runs inside eviction on the daemon's loop: 200 watchers and
    a 16,384-entry eviction round cost one append per event and filter, not
    one per watcher (each reads the shared feed from its own cursor)."""
    watchers = Watchers(max_watchers=300, max_per_peer=300)
    every = [watchers.open(ALL, []) for _ in range(100)]
    of_a = [watchers.open(NS_A, []) for _ in range(100)]
    evicted = [entry(f"k{i}", entry_id=i + 1, state=State.HIDDEN) for i in range(16384)]
    for e in evicted:
        watchers.publish(e)
    assert watchers.buffered() == 2 * 16384  # one feed of all namespaces, one of NS_A
    assert all(w.waiting() == 16384 for w in every + of_a)
    assert every[0].take() == ([], True) == of_a[-1].take()  # their (empty) snapshots
    first, _ = every[0].take()
    other, _ = of_a[-1].take()
    assert first[0] is other[0]  # the same event, stored once


def test_a_feed_holds_at_most_a_bound_and_a_ninth_of_it_behind_its_readers():
    watchers = Watchers(limit=64)
    reader, idle = watchers.open(ALL, []), watchers.open(ALL, [])
    most = 0
    for i in range(1000):
        watchers.publish(entry(f"k{i}", entry_id=i + 1))
        drain(reader)
        most = max(most, watchers.buffered())
    assert isinstance(idle.error, ResourceExhausted)  # dropped once 64 behind
    assert most <= 64 + 64 // 8 and reader.error is None


def test_watchers_are_capped_in_all_and_per_peer_and_a_stuck_dropped_one_keeps_its_place():
    watchers = Watchers(limit=2, max_watchers=3, max_per_peer=2)
    a1 = watchers.open(ALL, [], "ipv4:10.0.0.1")
    watchers.open(ALL, [], "ipv4:10.0.0.1")
    per_peer = r"from ipv4:10.0.0.1: 2 watch calls are open \(at most 2 per peer, --max-watch"
    with pytest.raises(ResourceExhausted, match=per_peer):
        watchers.open(ALL, [], "ipv4:10.0.0.1")
    b = watchers.open(ALL, [], "unix")
    in_all = r"3 watch calls are open \(at most 3, --max-watchers"
    with pytest.raises(ResourceExhausted, match=in_all):
        watchers.open(NS_A, [], "ipv4:10.0.0.2")
    for i in range(3):  # a1 reads nothing: dropped
        watchers.publish(entry(f"k{i}", entry_id=i + 1))
        drain(b)
    assert isinstance(a1.error, ResourceExhausted) and watchers.dropped >= 1
    # Its call has not ended (its last write may be stuck): it still counts.
    with pytest.raises(ResourceExhausted):
        watchers.open(ALL, [], "ipv4:10.0.0.2")
    watchers.close(a1)  # the call ended
    assert watchers.open(ALL, [], "ipv4:10.0.0.2").error is None


@pytest.mark.parametrize(("peer", "key"), [
    ("ipv4:10.0.0.5:41234", "ipv4:10.0.0.5"),
    ("ipv6:[::1]:5000", "ipv6:[::1]"),
    ("unix:/run/ec-daemon/ec.sock", "unix"),
    ("unix:", "unix"),
    ("unix-abstract:ec", "unix"),
    ("ipv6:[::ffff:10.0.0.5]:41234", "ipv4:10.0.0.5"),  # the same client as over IPv4
])
def test_a_peer_is_an_address_without_its_port_and_local_clients_are_one(peer, key):
    assert peer_of(peer) == key


def test_the_default_bound_is_65536_events():
    watchers = Watchers()
    watcher = watchers.open(ALL, [])
    e = entry("k")
    for _ in range(WATCH_BUFFER_EVENTS):
        watchers.publish(e)
    assert WATCH_BUFFER_EVENTS == 65536 and watcher.error is None
    watchers.publish(e)
    assert isinstance(watcher.error, ResourceExhausted) and watchers.dropped == 1


def test_namespace_filters():
    watchers = Watchers()
    only_a, only_b, every = watchers.open(NS_A, []), watchers.open(NS_B, []), watchers.open(ALL, [])
    watchers.publish(entry("in-a", NS_A))
    watchers.publish(entry("in-b", NS_B, entry_id=2))
    assert drain(only_a)[0] == [("stored", "in-a")]
    assert drain(only_b)[0] == [("stored", "in-b")]
    assert drain(every)[0] == [("stored", "in-a"), ("stored", "in-b")]
    late = watchers.open(NS_B, [entry("a1", NS_A), entry("b1", NS_B, entry_id=3)])
    assert drain(late) == ([("stored", "b1")], 1)


@pytest.mark.parametrize(("namespace", "message"), [
    ("no-separators", "is not a namespace"),
    ("x" * 9000, "longer than 4096 bytes"),
])
def test_bad_namespace_filters_are_refused(namespace, message):
    with pytest.raises(InvalidArgument, match=message):
        validate_namespace(namespace)
    watchers = Watchers()
    with pytest.raises(InvalidArgument):
        watchers.open(namespace, [])
    assert watchers.count == 0
    assert validate_namespace(ALL) == ALL and validate_namespace(NS_A) == NS_A


def test_shutdown_ends_every_watch_and_refuses_new_ones():
    watchers = Watchers()
    watcher = watchers.open(ALL, [])
    watchers.close_all()
    assert isinstance(watcher.error, Unavailable) and watcher.error.code == "UNAVAILABLE"
    assert watchers.count == 0 and watchers.dropped == 0
    with pytest.raises(Unavailable, match="shutting down"):
        watchers.open(ALL, [])


def test_batches_wait_for_events_and_stop_when_the_watch_ends():
    async def scenario():
        watchers = Watchers()
        watcher = watchers.open(ALL, [entry("a")])
        got: list[tuple[list[str], bool]] = []

        async def read():
            async for events, done in watcher.batches():
                got.append(([e.entry.mm_hash for e in events], done))

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.01)
        assert got == [(["a"], True)]  # then it waits
        watchers.publish(entry("b", entry_id=2))
        await asyncio.sleep(0.01)
        assert got[-1] == (["b"], False)
        watchers.close_all()
        await asyncio.wait_for(reader, 1)
        assert isinstance(watcher.error, Unavailable)

    asyncio.run(scenario())


class Publishing:
    """A cache listener that tells the watchers, as the data plane does."""

    def __init__(self, watchers: Watchers) -> None:
        self.watchers = watchers

    def entry_changed(self, entry) -> None:
        self.watchers.publish(entry)

    def pages_reclaimed(self) -> None:
        pass


def test_the_caches_announcements_reach_watchers_in_order():
    watchers = Watchers()
    cache = make_cache(pages=4, listener=Publishing(watchers))
    w = worker(cache)
    save(cache, w, "first", pages=2)
    watcher = watchers.open(ALL, cache.entries())
    allocate(cache, w, "pending", pages=2)  # pending entries are invisible
    cache.abort(w, ["pending"])
    save(cache, w, "second", pages=2)
    save(cache, w, "third", pages=2)  # evicts "first" (LRU), no view awaits it
    assert drain(watcher) == ([("stored", "first"), ("stored", "second"),
                               ("evicted", "first"), ("stored", "third")], 1)


def test_wire_message_carries_every_field():
    e = entry("k", entry_id=5)
    message = wire.watch_message(0xABCDEF0123456789, [Event(Kind.STORED, e, 123),
                                                      Event(Kind.EVICTED, e, 456)], True)
    assert message.generation == 0xABCDEF0123456789 and message.snapshot_done
    stored, evicted = message.events
    assert stored.kind == pb.WatchEvent.STORED and evicted.kind == pb.WatchEvent.EVICTED
    assert (stored.namespace, stored.mm_hash, stored.entry_id, stored.nbytes, list(stored.shape),
            stored.dtype, stored.time_unix_ns) == (NS_A, "k", 5, 8, [2, 4], "uint8", 123)
    assert evicted.time_unix_ns == 456


def test_a_running_engines_watch_has_its_own_bucket_and_the_kept_slots():
    """Issue 40, finding 12: every client of the Unix socket is one peer, so
    one local client's 16 unread calls took every local slot. A watch of a
    running engine instance (its id and token) counts in its own bucket, and
    the last quarter of the slots is kept for such watches."""
    watchers = Watchers(max_watchers=8, max_per_peer=2)
    watchers.open(ALL, [], "unix")
    watchers.open(ALL, [], "unix")
    with pytest.raises(ResourceExhausted, match="from unix: 2 watch calls"):
        watchers.open(ALL, [], "unix")
    engine = "0123/engine-a"
    watchers.open(ALL, [], "unix", engine=engine)
    for peer in ("ipv4:10.0.0.1", "ipv4:10.0.0.2"):
        watchers.open(ALL, [], peer)
    watchers.open(ALL, [], "ipv4:10.0.0.3")
    with pytest.raises(ResourceExhausted, match="the last 2 are kept for running engines"):
        watchers.open(ALL, [], "ipv4:10.0.0.3")
    watchers.open(ALL, [], "unix", engine=engine)  # the kept slots
    with pytest.raises(ResourceExhausted, match="per engine instance"):
        watchers.open(ALL, [], "unix", engine=engine)
    watchers.open(ALL, [], "unix", engine="4567/engine-b")
    with pytest.raises(ResourceExhausted, match=r"8 watch calls are open \(at most 8, "):
        watchers.open(ALL, [], "unix", engine="89ab/engine-c")
