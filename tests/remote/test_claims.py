"""Claims (one encode per value across hosts) and `present`, against real
servers: one node and a cluster; killed and stopped nodes."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from ec_daemon.remote.common import RemoteError
from ec_daemon.remote.redis.store import (
    MAX_TOKEN_CHARS,
    RedisStore,
    claim_key,
    open_store,
    value_key,
)
from tests import redis_servers
from tests.remote.conftest import NAMESPACE, needs_redis, wait_for
from tests.remote.test_store import put_value

_keys = itertools.count()


def fresh(prefix: str) -> str:
    """An mm_hash no other test (or run of this one) has used."""
    return f"{prefix}-{os.getpid()}-{next(_keys)}"


@pytest.fixture(params=["single", "cluster"])
def store(request: pytest.FixtureRequest) -> Iterator[RedisStore]:
    """A store on the module's single node, then on its cluster."""
    server = request.getfixturevalue("node" if request.param == "single" else "cluster")
    made = open_store(server.url, timeout_s=1.0)
    yield made
    made.close()


def test_the_claim_key_shares_the_value_keys_slot() -> None:
    from redis.crc import key_slot

    for mm_hash in ("a", "é-ü", "x" * 64):
        key, value = claim_key(NAMESPACE, mm_hash), value_key(NAMESPACE, mm_hash)
        assert key.startswith("ecd1:c:{") and key[len("ecd1:c:"):] == value[len("ecd1:v:"):]
        assert key_slot(key.encode()) == key_slot(value.encode())


def test_tokens_are_checked_before_the_network() -> None:
    store = open_store(f"redis://127.0.0.1:{redis_servers.free_port()}", timeout_s=0.5)
    for bad in ("", "t" * (MAX_TOKEN_CHARS + 1), "tökén"):
        with pytest.raises(ValueError, match="a claim token is 1 to 128 ASCII characters"):
            store.claim(NAMESPACE, "k", bad, 1.0)
        with pytest.raises(ValueError, match="a claim token is 1 to 128 ASCII characters"):
            store.release(NAMESPACE, "k", bad)
    with pytest.raises(RemoteError, match="claim ecd1:c:"):  # a good token: to the network
        store.claim(NAMESPACE, "k", "t" * MAX_TOKEN_CHARS, 1.0)
    store.close()


# ------------------------------------------------------------------ claims


@needs_redis
def test_one_claimant_wins_and_the_holder_claims_again(store: RedisStore) -> None:
    mm_hash = fresh("win")
    assert store.claim(NAMESPACE, mm_hash, "host-a", 1.0)
    assert not store.claim(NAMESPACE, mm_hash, "host-b", 30.0)
    assert not store.claim(NAMESPACE, mm_hash, "host-c", 30.0)
    # The holder's claim again: True, and its TTL starts again (here: longer).
    assert store.claim(NAMESPACE, mm_hash, "host-a", 30.0)
    assert not store.claim(NAMESPACE, mm_hash, "host-b", 30.0)
    # Another key, another claim; the value's key is untouched.
    assert store.claim(NAMESPACE, fresh("win"), "host-b", 1.0)
    assert store.present([(NAMESPACE, mm_hash)]) == [False]


@needs_redis
def test_claiming_again_restarts_the_ttl(node: redis_servers.RedisServer) -> None:
    store = open_store(node.url)
    mm_hash = fresh("refresh")
    client = node.client()
    assert store.claim(NAMESPACE, mm_hash, "host-a", 1.0)
    assert 0 < client.pttl(claim_key(NAMESPACE, mm_hash)) <= 1000
    assert store.claim(NAMESPACE, mm_hash, "host-a", 30.0)
    assert 29_000 < client.pttl(claim_key(NAMESPACE, mm_hash)) <= 30_000
    assert client.get(claim_key(NAMESPACE, mm_hash)) == b"host-a"
    assert not store.claim(NAMESPACE, mm_hash, "host-b", 60.0)  # never extends another's
    assert client.pttl(claim_key(NAMESPACE, mm_hash)) <= 30_000
    store.close()


@needs_redis
def test_racing_threads_one_claim_each_key(store: RedisStore) -> None:
    threads = 8
    for _ in range(5):
        mm_hash = fresh("race")
        start = threading.Barrier(threads)
        won: list[str] = []
        failed: list[BaseException] = []

        def take(token: str, key: str = mm_hash, barrier: threading.Barrier = start,
                 winners: list[str] = won, errors: list[BaseException] = failed) -> None:
            try:
                barrier.wait(timeout=5.0)
                if store.claim(NAMESPACE, key, token, 5.0):
                    winners.append(token)
            except BaseException as exc:
                errors.append(exc)

        running = [threading.Thread(target=take, args=(f"host-{i}",)) for i in range(threads)]
        for thread in running:
            thread.start()
        for thread in running:
            thread.join(timeout=10.0)
        assert not failed and len(won) == 1, (won, failed)
        assert store.claim(NAMESPACE, mm_hash, won[0], 5.0)


@needs_redis
def test_a_claim_expires_by_itself(store: RedisStore) -> None:
    mm_hash = fresh("expire")
    started = time.monotonic()
    assert store.claim(NAMESPACE, mm_hash, "host-a", 0.3)
    assert not store.claim(NAMESPACE, mm_hash, "host-b", 5.0)
    assert wait_for(lambda: store.claim(NAMESPACE, mm_hash, "host-b", 5.0), 3.0)
    assert time.monotonic() - started > 0.25
    assert not store.claim(NAMESPACE, mm_hash, "host-a", 5.0)  # host-b's now


@needs_redis
def test_release_drops_only_the_holders_claim(store: RedisStore) -> None:
    mm_hash = fresh("release")
    store.release(NAMESPACE, mm_hash, "host-a")  # nothing held: not an error
    assert store.claim(NAMESPACE, mm_hash, "host-a", 30.0)
    store.release(NAMESPACE, mm_hash, "host-b")  # not the holder: nothing happens
    assert not store.claim(NAMESPACE, mm_hash, "host-b", 30.0)
    store.release(NAMESPACE, mm_hash, "host-a")
    assert store.claim(NAMESPACE, mm_hash, "host-b", 30.0)
    assert not store.claim(NAMESPACE, mm_hash, "host-a", 30.0)
    store.release(NAMESPACE, mm_hash, "host-b")
    store.release(NAMESPACE, mm_hash, "host-b")  # twice: not an error


@needs_redis
def test_a_claim_lives_on_its_values_node(cluster: redis_servers.Cluster) -> None:
    store = open_store(cluster.url)
    owners = set()
    for i in range(12):
        mm_hash = fresh(f"beside-{i}")
        owner = cluster.node_of(value_key(NAMESPACE, mm_hash))
        owners.add(owner.port)
        assert cluster.node_of(claim_key(NAMESPACE, mm_hash)) is owner
        assert store.claim(NAMESPACE, mm_hash, "host-a", 30.0)
        assert owner.client().get(claim_key(NAMESPACE, mm_hash)) == b"host-a"
        assert store.domain(NAMESPACE, mm_hash) == owner.address
    assert len(owners) > 1
    store.close()


@needs_redis
def test_a_node_without_the_scripts_gets_them(own_node: redis_servers.RedisServer) -> None:
    """EVALSHA, then EVAL when the node does not know the script (a restart,
    SCRIPT FLUSH); the node caches it for the next EVALSHA."""
    from ec_daemon.remote.redis.store import _CLAIM, _RELEASE

    store = open_store(own_node.url)
    client = own_node.client()
    assert client.script_exists(_CLAIM.sha, _RELEASE.sha) == [False, False]
    assert store.claim(NAMESPACE, "scripts", "host-a", 30.0)
    store.release(NAMESPACE, "scripts", "host-a")
    assert client.script_exists(_CLAIM.sha, _RELEASE.sha) == [True, True]
    client.script_flush()
    assert store.claim(NAMESPACE, "scripts", "host-b", 30.0)
    assert not store.claim(NAMESPACE, "scripts", "host-a", 30.0)
    store.close()


@needs_redis
def test_claims_and_present_follow_a_key_that_moved(cluster: redis_servers.Cluster) -> None:
    """A stale slot table (a resharding) sends the call to the wrong node:
    it goes again through redis-py, which follows MOVED."""
    store = open_store(cluster.url)
    assert isinstance(store, RedisStore)
    store.ping()
    assert store.cluster is not None
    manager = store.cluster.nodes_manager
    mm_hash = fresh("moved")
    key = claim_key(NAMESPACE, mm_hash)
    owner = cluster.node_of(key)
    wrong = next(n for n in store.cluster.get_nodes() if n.port != owner.port)

    def mislead() -> None:
        manager.slots_cache[cluster.slot_of(key)] = [wrong]

    mislead()
    assert store.claim(NAMESPACE, mm_hash, "host-a", 30.0)
    assert owner.client().get(key) == b"host-a"
    mislead()
    assert not store.claim(NAMESPACE, mm_hash, "host-b", 30.0)
    mislead()
    store.release(NAMESPACE, mm_hash, "host-a")
    assert not owner.client().exists(key)
    put_value(store, mm_hash, b"v")
    mislead()
    assert store.present([(NAMESPACE, mm_hash), (NAMESPACE, fresh("moved"))]) == [True, False]
    store.close()


# ------------------------------------------------------------------ present


@needs_redis
def test_present(store: RedisStore) -> None:
    stored = [fresh("there") for _ in range(10)]
    absent = [fresh("absent") for _ in range(10)]
    for mm_hash in stored:
        put_value(store, mm_hash, b"v")
    store.claim(NAMESPACE, absent[0], "host-a", 30.0)  # a claim is not a value
    keys = [(NAMESPACE, h) for pair in zip(stored, absent, strict=True) for h in pair]
    keys.append((NAMESPACE + "-other", stored[0]))  # another namespace, another key
    assert store.present(keys) == [True, False] * 10 + [False]
    assert store.present([]) == []
    assert store.present([(NAMESPACE, stored[3])] * 3) == [True] * 3
    if "cluster" in repr(store):  # the keys were spread over the nodes
        assert len({store.domain(NAMESPACE, h) for h in stored + absent}) > 1


# ------------------------------------------------------------------ failures


@needs_redis
def test_a_killed_node_fails_fast(own_node: redis_servers.RedisServer) -> None:
    store = open_store(own_node.url, timeout_s=1.0)
    assert store.claim(NAMESPACE, "killed", "host-a", 30.0)
    own_node.kill()
    started = time.monotonic()
    with pytest.raises(RemoteError, match="claim ecd1:c:"):
        store.claim(NAMESPACE, "killed", "host-a", 30.0)
    with pytest.raises(RemoteError, match="release ecd1:c:"):
        store.release(NAMESPACE, "killed", "host-a")
    with pytest.raises(RemoteError, match=f"present \\(1 keys\\) on {own_node.address}"):
        store.present([(NAMESPACE, "killed")])
    assert time.monotonic() - started < 1.0
    own_node.restart()  # (no data kept: the claim went with the node)
    assert store.claim(NAMESPACE, "killed", "host-b", 30.0)
    store.close()


@needs_redis
def test_a_stopped_node_costs_the_timeout_not_a_hang(
        own_node: redis_servers.RedisServer) -> None:
    store = open_store(own_node.url, timeout_s=0.3)
    store.ping()
    assert own_node.pid is not None
    os.kill(own_node.pid, signal.SIGSTOP)
    try:
        for call in (lambda: store.claim(NAMESPACE, "stopped", "host-a", 30.0),
                     lambda: store.release(NAMESPACE, "stopped", "host-a"),
                     lambda: store.present([(NAMESPACE, "stopped")])):
            started = time.monotonic()
            with pytest.raises(RemoteError, match="Timeout"):
                call()
            assert time.monotonic() - started < 1.0
    finally:
        os.kill(own_node.pid, signal.SIGCONT)
    assert wait_for(lambda: _answers(store), 5.0)
    assert store.claim(NAMESPACE, "stopped", "host-a", 30.0)
    store.close()


def _answers(store: RedisStore) -> bool:
    with contextlib.suppress(RemoteError):
        store.ping()
        return True
    return False


@needs_redis
def test_a_killed_cluster_node_fails_only_its_keys() -> None:
    with redis_servers.cluster(3) as group:
        store = open_store(group.url, timeout_s=1.0)
        victim = group.nodes[1]
        hashes = [f"spread-{i}" for i in range(24)]
        for mm_hash in hashes:
            put_value(store, mm_hash, b"v")
        lost = [h for h in hashes if group.node_of(value_key(NAMESPACE, h)) is victim]
        kept = [h for h in hashes if h not in lost]
        assert lost and kept
        victim.kill()
        started = time.monotonic()
        assert store.present([(NAMESPACE, h) for h in kept]) == [True] * len(kept)
        with pytest.raises(RemoteError, match=f"present \\(24 keys\\) on {victim.address}"):
            store.present([(NAMESPACE, h) for h in hashes])
        with pytest.raises(RemoteError, match="claim ecd1:c:"):
            store.claim(NAMESPACE, lost[0], "host-a", 30.0)
        with pytest.raises(RemoteError, match="release ecd1:c:"):
            store.release(NAMESPACE, lost[0], "host-a")
        assert store.claim(NAMESPACE, kept[0], "host-a", 30.0)
        store.release(NAMESPACE, kept[0], "host-a")
        assert time.monotonic() - started < 3.0
        store.close()
