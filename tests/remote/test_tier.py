"""The tier's threads against real servers: publication and the index between
two tiers, expiry, bounds, verification, and a store (or a cluster node) that
dies and comes back."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from functools import partial

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ec_daemon.remote.redis.announcements import entry_bytes
from ec_daemon.remote.redis.shards import IndexShards
from ec_daemon.remote.redis.store import INDEX_SHARDS, index_key, open_store, value_key
from ec_daemon.remote.tier import RemoteTier
from ec_daemon.remote.values import encode, size_bounds
from tests import redis_servers
from tests.remote.conftest import (
    NAMESPACE,
    Pages,
    fetched,
    needs_redis,
    payload,
    publish,
    redis_tier,
    wait_for,
)

pytestmark = needs_redis
OTHER = "another-model|float16|image=1024|"


@pytest.fixture()
def tiers() -> Iterator[list[RemoteTier]]:
    """Tiers a test made; each stopped at the end."""
    made: list[RemoteTier] = []
    yield made
    for tier in made:
        tier.stop()


def tier_for(made: list[RemoteTier], url: str, *, start: bool = True, **kwargs: object
             ) -> RemoteTier:
    options: dict[str, object] = {"timeout_s": 1.0, "block_s": 0.2, "breaker_base_s": 0.2,
                                  "breaker_max_s": 1.0}
    options.update(kwargs)
    tier = redis_tier(url, **options)  # type: ignore[arg-type]
    made.append(tier)
    if start:
        tier.start()
    return tier


def flush_index(server: redis_servers.RedisServer) -> None:
    server.client().delete(*[index_key(k) for k in range(INDEX_SHARDS)])


# ------------------------------------------------------------------ publish and index


def test_a_second_tier_sees_a_publication(node: redis_servers.RedisServer,
                                          tiers: list[RemoteTier], pages: Pages) -> None:
    host1, host2 = tier_for(tiers, node.url), tier_for(tiers, node.url)
    host2.follow(NAMESPACE)
    data = payload(300_000)
    started = time.monotonic()
    assert publish(host1, pages, "seen", data)
    assert wait_for(lambda: host2.available(NAMESPACE, "seen") == len(data), 3.0)
    seen_after = time.monotonic() - started
    assert seen_after < 2.0
    found = host2.fetch(NAMESPACE, "seen", len(data))
    assert found is not None and found.shape == (len(data),) and found.dtype == "uint8"
    extents = pages.extents(found.nbytes)
    assert host2.fetch_into(NAMESPACE, "seen", found, pages.region, extents)
    assert pages.read(extents) == data
    s1, s2 = host1.snapshot(), host2.snapshot()
    assert s1["publishes"] == 1 and s1["publish_bytes"] == len(data)
    assert s2["remote_hits"] == 1 and s2["fetch_bytes"] == len(data)
    assert s2["index_entries"] >= 1 and s2["reachable"] is True
    assert host2.fetch(NAMESPACE, "never-published", 10) is None
    assert host2.snapshot()["remote_misses"] == 1


def test_namespaces_not_followed_are_ignored_until_followed(
        node: redis_servers.RedisServer, tiers: list[RemoteTier], pages: Pages) -> None:
    host1, host2 = tier_for(tiers, node.url), tier_for(tiers, node.url)
    host2.follow(NAMESPACE)
    assert publish(host1, pages, "theirs", b"x" * 100, namespace=OTHER)
    assert publish(host1, pages, "ours", b"y" * 100)
    assert wait_for(lambda: host2.available(NAMESPACE, "ours"), 3.0)
    assert host2.available(OTHER, "theirs") is None
    # Following later reads the index again: earlier announcements count.
    host2.follow(OTHER)
    assert wait_for(lambda: host2.available(OTHER, "theirs") == 100, 3.0)


def test_entries_age_out_with_the_ttl(node: redis_servers.RedisServer,
                                      tiers: list[RemoteTier], pages: Pages) -> None:
    host1 = tier_for(tiers, node.url, ttl_s=1.0)
    host2 = tier_for(tiers, node.url)
    host2.follow(NAMESPACE)
    assert publish(host1, pages, "brief", b"z" * 1000)
    assert wait_for(lambda: host2.available(NAMESPACE, "brief") == 1000, 3.0)
    assert fetched(host2, pages, "brief") == b"z" * 1000
    assert wait_for(lambda: host2.available(NAMESPACE, "brief") is None, 3.0)
    # The value expires with it (its TTL started a little later: never earlier).
    assert wait_for(lambda: host2.fetch(NAMESPACE, "brief", 1000) is None, 1.0)
    # A follower that starts later does not take expired announcements.
    late = tier_for(tiers, node.url)
    late.follow(NAMESPACE)
    time.sleep(0.5)
    assert late.available(NAMESPACE, "brief") is None


def test_the_index_is_bounded_in_bytes(node: redis_servers.RedisServer,
                                       tiers: list[RemoteTier], pages: Pages) -> None:
    flush_index(node)
    host1 = tier_for(tiers, node.url)
    host2 = tier_for(tiers, node.url, index_bytes=5 * entry_bytes("bounded-10"))
    host2.follow(NAMESPACE)
    for i in range(12):
        mm_hash = f"bounded-{i}"
        assert publish(host1, pages, mm_hash, b"b" * 10)
        assert wait_for(partial(host2.available, NAMESPACE, mm_hash), 3.0)
    snap = host2.snapshot()
    assert snap["index_entries"] == 5 and snap["index_evictions"] >= 7
    assert snap["index_bytes"] == sum(entry_bytes(f"bounded-{i}") for i in range(7, 12))
    assert [host2.available(NAMESPACE, f"bounded-{i}") for i in range(12)] == \
        [None] * 7 + [10] * 5


def test_the_publish_queue_is_bounded_in_bytes_and_never_blocks(
        node: redis_servers.RedisServer, tiers: list[RemoteTier], pages: Pages) -> None:
    tier = tier_for(tiers, node.url, publish_queue_bytes=10_000)
    gate = threading.Event()

    def slowly() -> bool:  # (the publisher holds the first entry until the gate opens)
        gate.wait(10)
        return True

    assert publish(tier, pages, "first", b"s" * 4000, current=slowly)
    results = []
    started = time.monotonic()
    for i in range(5):
        results.append(publish(tier, pages, f"more-{i}", b"m" * 4000))
    assert time.monotonic() - started < 0.1  # the caller is never held
    assert results == [True, False, False, False, False]  # 4000 + 4000 fit in 10,000
    assert not publish(tier, pages, "huge", b"h" * 20_000)
    snap = tier.snapshot()
    assert snap["publish_drops"] == 5 and snap["publish_queue_bytes"] == 8000
    gate.set()
    assert wait_for(lambda: tier.snapshot()["publishes"] == 2, 3.0)
    store = open_store(node.url)
    assert {h for h in ("first", "more-0", "more-1") if store.get(NAMESPACE, h)} == \
        {"first", "more-0"}  # the queued ones, once each; dropped ones never
    store.close()
    assert tier.snapshot()["publish_queue_bytes"] == 0


def test_pages_rewritten_while_published_are_not_announced(
        node: redis_servers.RedisServer, tiers: list[RemoteTier], pages: Pages) -> None:
    """Pages read for a publication are checked again once checksummed
    (reused: nothing sent) and once sent (reused: stored, never announced)."""
    tier = tier_for(tiers, node.url)
    store = open_store(node.url)
    for mm_hash, answers in (("rewritten-early", [False]), ("rewritten-late", [True, False])):
        asked = iter(answers)
        assert publish(tier, pages, mm_hash, b"0123456789",
                       current=lambda asked=asked: next(asked))
    assert wait_for(lambda: tier.snapshot()["publish_skips"] == 2, 3.0)
    assert store.get(NAMESPACE, "rewritten-early") is None
    assert store.get(NAMESPACE, "rewritten-late") is not None
    found, _ = IndexShards(store).read(None, 0.1, 1000)
    assert not {a.mm_hash for a in found} & {"rewritten-early", "rewritten-late"}
    assert tier.snapshot()["publishes"] == 0
    assert publish(tier, pages, "in-place", b"0123456789")
    assert wait_for(lambda: tier.snapshot()["publishes"] == 1, 3.0)
    store.close()


# ------------------------------------------------------------------ verification


def test_values_that_fail_verification_are_never_served(
        node: redis_servers.RedisServer, tiers: list[RemoteTier],
        caplog: pytest.LogCaptureFixture, pages: Pages) -> None:
    tier = tier_for(tiers, node.url)
    tier.follow(NAMESPACE)
    client = node.client()
    assert publish(tier, pages, "corrupt", payload(50_000))
    assert wait_for(lambda: tier.available(NAMESPACE, "corrupt"), 3.0)
    client.setrange(value_key(NAMESPACE, "corrupt"), 30_000, b"\xff\xfe")
    # A value another model stored under our key (or a stale format), each
    # announced at a size its bytes could have: read and verified.
    foreign = b"".join(bytes(p) for p in encode(OTHER, "foreign", (4000,), "uint8", b"a" * 4000))
    client.set(value_key(NAMESPACE, "foreign"), foreign)
    client.set(value_key(NAMESPACE, "garbage"), b"\x00" * 1000)

    def announced(stored: int, mm_hash: str) -> int:
        """A payload size whose values may take `stored` bytes."""
        return stored - size_bounds(NAMESPACE, mm_hash, 0)[0] - 13

    with caplog.at_level(logging.WARNING, logger="ec_daemon.remote"):
        for _ in range(3):
            assert tier.fetch(NAMESPACE, "corrupt", 50_000) is None
        assert tier.fetch(NAMESPACE, "foreign", announced(len(foreign), "foreign")) is None
        assert tier.fetch(NAMESPACE, "garbage", announced(1000, "garbage")) is None
    messages = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(messages) == 3  # at most once per key a minute
    assert "checksum mismatch" in messages[0]
    assert "stored for namespace 'another-model" in messages[1]
    assert "not an ec-daemon value" in messages[2]
    assert tier.snapshot()["bad_values"] == 5
    assert tier.available(NAMESPACE, "corrupt") is None  # no longer promised


# ------------------------------------------------------------------ failures


def test_the_store_killed_mid_run(own_node: redis_servers.RedisServer,
                                  tiers: list[RemoteTier],
                                  caplog: pytest.LogCaptureFixture, pages: Pages) -> None:
    caplog.set_level(logging.INFO, logger="ec_daemon.remote")
    host1, host2 = tier_for(tiers, own_node.url), tier_for(tiers, own_node.url)
    host2.follow(NAMESPACE)
    assert publish(host1, pages, "before", b"1" * 1000)
    assert wait_for(lambda: host2.available(NAMESPACE, "before"), 3.0)
    own_node.kill()
    # The followers notice by themselves; once open, calls fail fast.
    assert wait_for(lambda: not host2.snapshot()["reachable"], 5.0)
    assert wait_for(lambda: not host1.snapshot()["reachable"], 5.0)
    started = time.monotonic()
    for _ in range(20):
        assert host2.fetch(NAMESPACE, "before", 1000) is None
        assert not publish(host1, pages, "during", b"2" * 1000)
    assert time.monotonic() - started < 0.5
    assert host2.snapshot()["fetch_refused"] >= 1
    assert host1.snapshot()["publish_drops"] >= 20
    time.sleep(1.5)  # a few probes fail meanwhile: still one warning
    own_node.restart()
    assert wait_for(lambda: host1.snapshot()["reachable"] and host2.snapshot()["reachable"],
                    10.0)
    # Back without anyone's help (the data is gone: no persistence here).
    assert publish(host1, pages, "after", b"3" * 1000)
    assert wait_for(lambda: host2.available(NAMESPACE, "after"), 5.0)
    assert fetched(host2, pages, "after") == b"3" * 1000
    records = [r for r in caplog.records if r.name == "ec_daemon.remote"]
    down = [r for r in records if "unreachable" in r.getMessage()]
    up = [r for r in records if "reachable again" in r.getMessage()]
    assert len(down) == 2 and len(up) == 2  # once each way, for each of the two tiers
    assert all(r.levelno == logging.WARNING and own_node.address in r.getMessage()
               for r in down)


def test_a_cluster_node_killed_costs_only_its_keys(
        tiers: list[RemoteTier], caplog: pytest.LogCaptureFixture, pages: Pages) -> None:
    caplog.set_level(logging.INFO, logger="ec_daemon.remote")
    with redis_servers.cluster(3) as group:
        host1, host2 = tier_for(tiers, group.url), tier_for(tiers, group.url)
        host2.follow(NAMESPACE)
        keys = {f"spread-{i}": payload(20_000 + i) for i in range(24)}
        for mm_hash, data in keys.items():
            assert publish(host1, pages, mm_hash, data)
        assert wait_for(lambda: all(host2.available(NAMESPACE, k) for k in keys), 5.0)
        victim = group.nodes[1]
        lost = {k for k in keys if group.node_of(value_key(NAMESPACE, k)) is victim}
        assert 0 < len(lost) < len(keys)
        victim.kill()
        for _ in range(3):  # enough failures to open the victim's breaker
            for mm_hash in lost:
                host2.fetch(NAMESPACE, mm_hash, len(keys[mm_hash]))
        started = time.monotonic()
        for mm_hash, data in keys.items():
            value = fetched(host2, pages, mm_hash)
            if mm_hash in lost:
                assert value is None
            else:
                assert value == data
        assert time.monotonic() - started < 2.0
        states = host2.states()
        assert states[victim.address] in ("open", "half_open")
        assert sum(1 for s in states.values() if s == "closed") >= 2
        # Publishing to the live nodes goes on; their announcements still arrive.
        fresh = next(f"fresh-{i}" for i in range(100)
                     if group.node_of(value_key(NAMESPACE, f"fresh-{i}")) is not victim)
        assert publish(host1, pages, fresh, b"f" * 100)
        assert wait_for(lambda: host2.available(NAMESPACE, fresh) == 100, 5.0)
        victim.restart()
        assert wait_for(lambda: all(t.states().get(victim.address, "closed") == "closed"
                                    for t in (host1, host2)), 10.0)
        back = next(k for k in lost)
        assert publish(host1, pages, back, keys[back])
        assert wait_for(lambda: fetched(host2, pages, back) == keys[back], 10.0)
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert down and all(victim.address in r.getMessage() for r in down)


def test_stop_is_prompt(node: redis_servers.RedisServer, pages: Pages) -> None:
    tier = redis_tier(node.url, publish_queue_bytes=1 << 20, block_s=0.5)
    tier.follow(NAMESPACE)
    tier.start()
    time.sleep(0.3)  # the follower sits in a blocking read

    def slowly() -> bool:
        time.sleep(0.2)
        return True

    assert publish(tier, pages, "late", b"x", current=slowly)
    started = time.monotonic()
    tier.stop()
    assert time.monotonic() - started < 1.5
    assert not any(t.is_alive() for t in tier._threads)
    assert tier.snapshot()["publish_queue_bytes"] == 0


def test_prometheus_families(node: redis_servers.RedisServer, tiers: list[RemoteTier],
                             pages: Pages) -> None:
    tier = tier_for(tiers, node.url)
    tier.follow(NAMESPACE)
    assert publish(tier, pages, "metrics", b"m" * 10)
    assert wait_for(lambda: tier.available(NAMESPACE, "metrics") == 10, 3.0)
    assert fetched(tier, pages, "metrics") == b"m" * 10
    registry = CollectorRegistry()
    registry.register(tier)
    text = generate_latest(registry).decode()
    for name in ("ec_daemon_remote_publishes_total 1.0", "ec_daemon_remote_remote_hits_total",
                 "ec_daemon_remote_reachable 1.0", "ec_daemon_remote_index_entries",
                 'ec_daemon_remote_op_duration_seconds_bucket{le="0.1",op="put"}',
                 'ec_daemon_remote_op_duration_seconds_count{op="get"}'):
        assert name in text, name


@pytest.mark.parametrize("kind", ["single", "cluster"])
def test_a_tier_started_while_the_store_is_down_connects_later(
        kind: str, tiers: list[RemoteTier], caplog: pytest.LogCaptureFixture,
        pages: Pages) -> None:
    caplog.set_level(logging.INFO, logger="ec_daemon.remote")
    with redis_servers.single_node() if kind == "single" else redis_servers.cluster(3) as up:
        nodes = [up] if isinstance(up, redis_servers.RedisServer) else up.nodes
        for n in nodes:
            n.kill()
        tier = tier_for(tiers, up.url)
        tier.follow(NAMESPACE)
        assert wait_for(lambda: not tier.snapshot()["reachable"], 5.0)
        assert tier.fetch(NAMESPACE, "later", 10) is None
        assert not publish(tier, pages, "later", b"l" * 10)
        for n in nodes:
            n.restart()
        if isinstance(up, redis_servers.Cluster):
            up.wait_ok()
        assert wait_for(lambda: tier.snapshot()["reachable"], 10.0)
        assert wait_for(lambda: publish(tier, pages, "later", b"l" * 10), 5.0)
        assert wait_for(lambda: tier.available(NAMESPACE, "later") == 10, 5.0)
        assert fetched(tier, pages, "later") == b"l" * 10
        assert any("reachable again" in r.getMessage() for r in caplog.records)
