"""The announcements a daemon follows (Redis): bounded in bytes, one copy of
each namespace string, and time taken from the store, never from a host's clock
(a publisher's clock that runs ahead trims nobody's announcements; a follower
whose clock is off neither drops nor keeps entries wrongly)."""

from __future__ import annotations

import gc
import hashlib
import time
import tracemalloc
from collections.abc import Callable

import pytest

from ec_daemon.remote.redis.announcements import (
    MAX_FORGOTTEN,
    Announcement,
    Announcements,
    ServerClock,
    entry_bytes,
)
from ec_daemon.remote.redis.shards import IndexShards
from ec_daemon.remote.redis.store import INDEX_SHARDS, index_key, open_store
from tests import redis_servers
from tests.remote.conftest import NAMESPACE, needs_redis, redis_tier, wait_for

HOUR_S = 3600.0


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def announcement(mm_hash: str, stamp_ms: int, *, namespace: str = NAMESPACE, nbytes: int = 10,
                 ttl_ms: int | None = 60_000) -> Announcement:
    # A fresh namespace string per announcement, as the store decodes them.
    return Announcement(namespace.encode().decode(), mm_hash, nbytes, stamp_ms, ttl_ms)


def wall_clock(monkeypatch: pytest.MonkeyPatch, skew_s: float) -> Callable[[], None]:
    """This process' wall clock runs `skew_s` off from the store's until the
    returned function is called (monotonic time is left alone)."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)
    return lambda: monkeypatch.setattr(time, "time", real)


# ------------------------------------------------------------------ memory


def test_the_index_is_bounded_in_bytes_oldest_first() -> None:
    index = Announcements(max_bytes=4 * entry_bytes("h-0"), ttl_ms=60_000)
    index.follow("a")
    index.follow("b")
    evicted = index.absorb([announcement(f"h-{i}", 1000 + i, namespace="ab"[i % 2])
                            for i in range(6)])
    assert evicted == 2 and index.entries == 4 and index.bytes == 4 * entry_bytes("h-0")
    assert [index.get("ab"[i % 2], f"h-{i}") for i in range(6)] == [None] * 2 + [10] * 4
    index.unfollow("a")
    assert index.entries == 2 and index.bytes == 2 * entry_bytes("h-0")
    index.forget("b", "h-3")
    assert index.entries == 1 and index.bytes == entry_bytes("h-0")
    assert index.absorb([announcement("x", 2000, namespace="not followed")]) == 0
    assert index.entries == 1


def test_a_forgotten_entry_stays_forgotten_when_its_announcement_is_read_again() -> None:
    """An entry forgotten because its value cannot be promoted here is not
    brought back by a rescan of the index (which reads every announcement
    again: a namespace newly followed asks for one), or every later want of
    it would fetch the value again; published anew (a later announcement),
    it is back. Forgotten keys are remembered until their entry would have
    expired, and at most MAX_FORGOTTEN of them."""
    monotonic = FakeMonotonic()
    index = Announcements(max_bytes=1 << 20, ttl_ms=60_000, clock=ServerClock(monotonic))
    index.follow(NAMESPACE)
    stamp = 1_700_000_000_000
    index.absorb([announcement("bad", stamp), announcement("good", stamp)])
    index.forget(NAMESPACE, "bad")
    index.absorb([announcement("bad", stamp), announcement("good", stamp)])  # a rescan
    assert index.get(NAMESPACE, "bad") is None and index.get(NAMESPACE, "good") == 10
    index.absorb([announcement("bad", stamp + 5_000)])  # published again
    assert index.get(NAMESPACE, "bad") == 10
    index.forget(NAMESPACE, "bad")
    monotonic.now += 70  # past the forgotten entry's expiry: nothing left to remember
    index.clock.observe(stamp + 70_000)
    index.sweep()
    assert index._forgotten == {}
    for i in range(MAX_FORGOTTEN + 10):
        index.absorb([announcement(f"h-{i}", stamp + 70_000)])
        index.forget(NAMESPACE, f"h-{i}")
    assert len(index._forgotten) == MAX_FORGOTTEN


def test_an_entry_costs_what_it_is_counted_and_namespaces_are_held_once() -> None:
    """Real memory per entry (tracemalloc) never above what is counted against
    --remote-index-bytes, with the tables just grown (as empty as they get).
    Before: 690 bytes an entry with this 250-character namespace."""
    count = 43_700  # just past a table's growth: the most per entry
    index = Announcements(max_bytes=1 << 40, ttl_ms=3_600_000)
    index.follow(NAMESPACE)
    hashes = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(count)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(0, count, 1000):
            index.absorb([announcement(hashes[i], 1_700_000_000_000 + i)
                          for i in range(start, min(count, start + 1000))])
        gc.collect()
        measured = (tracemalloc.get_traced_memory()[0] - before) / count
    finally:
        tracemalloc.stop()
    counted = index.bytes / count
    assert counted == entry_bytes(hashes[0]) == 249
    assert measured <= counted, (measured, counted)
    assert measured < 2 * len(hashes[0]) + 140  # no namespace (250 characters) in it


# ------------------------------------------------------------------ time


def test_entries_expire_by_the_stores_clock() -> None:
    monotonic = FakeMonotonic()
    index = Announcements(max_bytes=1 << 20, ttl_ms=10_000, clock=ServerClock(monotonic))
    index.follow(NAMESPACE)
    stamp = 1_700_000_000_000
    index.absorb([announcement("old", stamp - 9_000, ttl_ms=None),  # its TTL: ours
                  announcement("new", stamp, ttl_ms=10**9),  # capped at ours
                  announcement("gone", stamp - 20_000)])
    assert index.get(NAMESPACE, "gone") is None and index.entries == 2
    assert index.get(NAMESPACE, "old") == 10 and index.get(NAMESPACE, "new") == 10
    monotonic.now += 1.5  # the server's clock: the newest ID read, carried on
    assert index.get(NAMESPACE, "old") is None and index.get(NAMESPACE, "new") == 10
    index.clock.observe(stamp + 10_000)  # the store's TIME says later still
    assert index.get(NAMESPACE, "new") is None
    index.sweep()
    assert index.entries == 0 and index.bytes == 0


@needs_redis
def test_a_publisher_whose_clock_runs_ahead_trims_nobody_elses_announcements(
        own_node: redis_servers.RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    client = own_node.client()
    client.config_set("stream-node-max-entries", 4)  # approximate trims act on few entries
    honest = open_store(own_node.url)
    honest_streams = IndexShards(honest)
    for i in range(200):
        honest_streams.announce(NAMESPACE, f"honest-{i}", 10, 60.0)
    restore = wall_clock(monkeypatch, 2 * HOUR_S)  # ahead by more than the TTL
    ahead = open_store(own_node.url)
    ahead_streams = IndexShards(ahead)
    for i in range(200):
        ahead_streams.announce(NAMESPACE, f"ahead-{i}", 10, 60.0)
    restore()
    assert sum(int(client.xlen(index_key(k))) for k in range(INDEX_SHARDS)) == 400
    follower = open_store(own_node.url)
    found, _ = IndexShards(follower).read(None, 0.1, 1000)
    assert {a.mm_hash for a in found} >= {f"honest-{i}" for i in range(200)}
    for store in (honest, ahead, follower):
        store.close()


@needs_redis
@pytest.mark.parametrize(("publisher_skew", "follower_skew"),
                         [(0.0, 2 * HOUR_S), (-2 * HOUR_S, 0.0), (0.0, -2 * HOUR_S)],
                         ids=["follower-ahead", "publisher-behind", "follower-behind"])
def test_entries_live_their_ttl_whatever_the_hosts_clocks_say(
        own_node: redis_servers.RedisServer, monkeypatch: pytest.MonkeyPatch,
        publisher_skew: float, follower_skew: float) -> None:
    restore = wall_clock(monkeypatch, publisher_skew)
    publisher = open_store(own_node.url)
    IndexShards(publisher).announce(NAMESPACE, "kept", 10, 60.0)
    IndexShards(publisher).announce(NAMESPACE, "brief", 10, 1.0)
    publisher.close()
    restore()
    wall_clock(monkeypatch, follower_skew)
    tier = redis_tier(own_node.url, block_s=0.2)
    tier.follow(NAMESPACE)
    tier.start()
    try:
        assert wait_for(lambda: tier.available(NAMESPACE, "kept") == 10, 3.0)
        assert wait_for(lambda: tier.available(NAMESPACE, "brief") is None, 3.0)
        assert tier.available(NAMESPACE, "kept") == 10
    finally:
        tier.stop()
