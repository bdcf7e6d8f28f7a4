"""The Redis store against real servers: values, TTLs, the index, AUTH, TLS,
a cluster; and the URL forms."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ec_daemon.remote.common import RemoteAuthError, RemoteError
from ec_daemon.remote.redis.shards import IndexShards
from ec_daemon.remote.redis.store import (
    CHUNK_BYTES,
    FIRST_READ_BYTES,
    INDEX_SHARDS,
    RedisStore,
    index_key,
    open_store,
    value_key,
)
from ec_daemon.remote.redis.url import parse_url
from ec_daemon.remote.values import decode, encode
from tests import redis_servers
from tests.remote.conftest import NAMESPACE, needs_redis, payload, wait_for

# ------------------------------------------------------------------ URLs


@pytest.mark.parametrize(("url", "cluster", "tls", "nodes"), [
    ("redis://127.0.0.1:7000", False, False, (("127.0.0.1", 7000),)),
    ("redis://cache.internal", False, False, (("cache.internal", 6379),)),
    ("redis://[::1]:7000/", False, False, (("::1", 7000),)),
    ("rediss://cache:6380", False, True, (("cache", 6380),)),
    ("redis+cluster://a:7000,b:7001,c", True, False, (("a", 7000), ("b", 7001), ("c", 6379))),
    ("REDISS+CLUSTER://a:7000", True, True, (("a", 7000),)),
])
def test_urls(url: str, cluster: bool, tls: bool, nodes: tuple[tuple[str, int], ...]) -> None:
    spec = parse_url(url)
    assert (spec.cluster, spec.tls, spec.nodes) == (cluster, tls, nodes)


def test_tls_options() -> None:
    spec = parse_url("rediss://h:1?ca_certs=/ca.pem&certfile=/c.pem&keyfile=/k.pem"
                     "&check_hostname=false")
    assert spec.tls_options == {"ca_certs": "/ca.pem", "certfile": "/c.pem",
                                "keyfile": "/k.pem", "check_hostname": "false"}


@pytest.mark.parametrize(("url", "reason"), [
    ("", "no scheme"),
    ("127.0.0.1:6379", "no scheme"),
    ("http://h:1", "unknown scheme 'http'"),
    ("redis://", "no host"),
    ("redis://user:secret@h:1", "credentials do not go in the URL"),
    ("redis://h:1/2", "no path or database number"),
    ("redis://h:99999", "bad address"),
    ("redis://h:port", "bad address"),
    ("redis://a:1,b:2", "several addresses need redis\\+cluster"),
    ("redis+cluster://a:1,", "bad address"),
    ("redis://h:1?ca_certs=/x", "needs TLS"),
    ("rediss://h:1?password=x", "unknown option 'password'"),
    ("rediss://h:1?check_hostname=maybe", "check_hostname must be true or false"),
])
def test_bad_urls_name_the_accepted_forms(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as caught:
        parse_url(url)
    assert "accepted: redis://HOST:PORT, rediss://HOST:PORT" in str(caught.value)
    assert "redis+cluster://HOST:PORT[,HOST:PORT...]" in str(caught.value)


def test_token_files(token_file: Callable[[str], str], tmp_path: Path) -> None:
    from ec_daemon.remote.redis.url import read_credentials

    assert read_credentials(token_file("s3cret:with:colons\n")) == (None, "s3cret:with:colons")
    assert read_credentials(token_file("\nalice\n  pw  \n")) == ("alice", "pw")
    with pytest.raises(ValueError, match="must hold a password"):
        read_credentials(token_file(""))
    with pytest.raises(ValueError, match="must hold a password"):
        read_credentials(token_file("a\nb\nc\n"))
    with pytest.raises(ValueError, match="cannot read remote token file"):
        open_store("redis://127.0.0.1:1", token_file=str(tmp_path / "missing"))


def test_a_store_that_is_down_is_not_an_error_until_used() -> None:
    store = open_store(f"redis://127.0.0.1:{redis_servers.free_port()}", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(RemoteError, match="ConnectionError"):
        store.ping()
    with pytest.raises(RemoteError, match="get ecd1:v:"):
        store.get(NAMESPACE, "x")
    assert time.monotonic() - started < 2.0
    store.close()
    with pytest.raises(RemoteError, match="store closed"):
        store.get(NAMESPACE, "x")


# ------------------------------------------------------------------ one node

def put_value(store: RedisStore, mm_hash: str, data: bytes, ttl_s: float = 60.0,
              namespace: str = NAMESPACE) -> None:
    store.put(namespace, mm_hash, encode(namespace, mm_hash, (len(data),), "uint8", data),
              ttl_s)


@needs_redis
@pytest.mark.parametrize("size", [0, 1, 1000, FIRST_READ_BYTES - 200, FIRST_READ_BYTES,
                                  FIRST_READ_BYTES + 1, 3 * CHUNK_BYTES + 17])
def test_put_get_round_trip(node: redis_servers.RedisServer, size: int) -> None:
    store = open_store(node.url)
    data = payload(size)
    put_value(store, f"rt-{size}", data)
    parts = store.get(NAMESPACE, f"rt-{size}")
    assert parts is not None
    got = decode(parts, namespace=NAMESPACE, mm_hash=f"rt-{size}")
    assert bytes(got.payload) == data and got.shape == (size,)
    store.close()


def test_a_put_is_one_set_of_the_parts_as_they_are() -> None:
    """SET key value PX ttl in RESP: the payload goes out as the caller's own
    buffer; small parts ride with the command's text (fewer sends)."""
    from ec_daemon.remote.redis.resp import SMALL_PART_BYTES, set_command

    big = bytearray(SMALL_PART_BYTES * 2)
    pieces = set_command("ecd1:v:{é}", [b"head", memoryview(big), b"x"], 1500)
    assert pieces[0] == b"*5\r\n$3\r\nSET\r\n$11\r\necd1:v:{\xc3\xa9}\r\n$%d\r\nhead" % (
        len(big) + 5)
    assert isinstance(pieces[1], memoryview) and pieces[1].obj is big
    assert pieces[2:] == [b"x\r\n$2\r\nPX\r\n$4\r\n1500\r\n"]
    assert set_command("k", [b""], 1) == [b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n"
                                           b"\r\n$2\r\nPX\r\n$1\r\n1\r\n"]


@needs_redis
def test_put_round_trip_of_parts_and_a_non_ascii_key(node: redis_servers.RedisServer) -> None:
    store = open_store(node.url)
    data = payload(300_000)
    header = encode(NAMESPACE, "é-ü", (len(data),), "uint8", data)[0]
    parts = [header, b"", data[:7], memoryview(data)[7:200_000], bytearray(data[200_000:])]
    store.put(NAMESPACE, "é-ü", parts, 60.0)
    got = store.get(NAMESPACE, "é-ü")
    assert got is not None
    assert bytes(decode(got, namespace=NAMESPACE, mm_hash="é-ü").payload) == data
    assert node.client().pttl(value_key(NAMESPACE, "é-ü")) > 50_000
    store.close()


class _Socket:
    """Hands out `data` in pieces of at most `step` bytes, as a socket may."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.step = data, step

    def recv_into(self, into: memoryview) -> int:
        count = min(len(into), self.step, len(self.data))
        into[:count] = self.data[:count]
        self.data = self.data[count:]
        return count


@pytest.mark.parametrize("step", [1, 3, 1 << 20])
def test_a_bulk_reply_is_read_into_a_buffer_and_nothing_past_it(step: int) -> None:
    from types import SimpleNamespace

    from redis.exceptions import InvalidResponse, MovedError, ResponseError

    from ec_daemon.remote.redis.resp import read_bulk

    # (A reply's first line is read with room to spare; nothing follows a
    # reply on a connection, except in this test, read a byte at a time.)
    after = b"+NEXT\r\n" if step == 1 else b""

    def read(reply: bytes, most: int = 100) -> tuple[object, bytes]:
        sock = _Socket(reply + after, step)
        got = read_bulk(SimpleNamespace(_sock=sock), most)
        return (bytes(got) if got is not None else None), sock.data

    assert read(b"$12\r\nhello\r\nworld\r\n") == (b"hello\r\nworld", after)
    assert read(b"$0\r\n\r\n") == (b"", after)
    assert read(b"$-1\r\n") == (None, after)
    assert read(b"$5\r\nhello\r\n", most=5) == (b"hello", after)
    with pytest.raises(MovedError):
        read(b"-MOVED 3999 127.0.0.1:6381\r\n")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        read(b"-WRONGTYPE Operation against a key\r\n")
    for bad in (b"+OK\r\n", b":5\r\n", b"$--1\r\n", b"$5\r\nhelloXY", b"$6\r\nhello\r\n"):
        with pytest.raises(InvalidResponse):
            read(bad, most=5)
    with pytest.raises(ConnectionError):
        read_bulk(SimpleNamespace(_sock=_Socket(b"$5\r\nhel", step)), 5)


@needs_redis
def test_an_error_reply_to_a_get_is_a_remote_error_and_the_store_goes_on(
        node: redis_servers.RedisServer) -> None:
    store = open_store(node.url)
    node.client().rpush(value_key(NAMESPACE, "a-list"), b"x")
    with pytest.raises(RemoteError, match=r"get ecd1:v:.*WRONGTYPE"):
        store.get(NAMESPACE, "a-list")
    put_value(store, "after-a-list", b"fine")
    parts = store.get(NAMESPACE, "after-a-list")
    assert parts is not None
    assert bytes(decode(parts, namespace=NAMESPACE, mm_hash="after-a-list").payload) == b"fine"
    store.close()


@needs_redis
def test_a_refused_put_is_a_remote_error_and_the_store_goes_on(
        own_node: redis_servers.RedisServer) -> None:
    store = open_store(own_node.url)
    client = own_node.client()
    client.config_set("maxmemory", 1)
    with pytest.raises(RemoteError, match=r"put ecd1:v:.*OutOfMemoryError"):
        put_value(store, "refused", payload(100_000))
    client.config_set("maxmemory", 0)
    put_value(store, "refused", payload(100_000))
    assert store.get(NAMESPACE, "refused") is not None
    store.close()


@needs_redis
def test_absent_is_none_and_keys_carry_the_namespace(node: redis_servers.RedisServer) -> None:
    store = open_store(node.url)
    assert store.get(NAMESPACE, "never-put") is None
    put_value(store, "k", b"abc")
    assert store.get(NAMESPACE + "-other", "k") is None  # another namespace, another key
    client = node.client()
    key = value_key(NAMESPACE, "k")
    assert key.startswith("ecd1:v:{") and len(key) < 100 and client.exists(key)
    assert 59_000 < client.pttl(key) <= 60_000
    store.close()


@needs_redis
def test_ttl_expiry(node: redis_servers.RedisServer) -> None:
    store = open_store(node.url)
    put_value(store, "short", b"x" * 100, ttl_s=0.3)
    assert store.get(NAMESPACE, "short") is not None
    assert wait_for(lambda: store.get(NAMESPACE, "short") is None, 3.0)
    store.close()


@needs_redis
def test_the_index(node: redis_servers.RedisServer) -> None:
    store = open_store(node.url)
    streams = IndexShards(store)
    node.client().delete(*[index_key(k) for k in range(INDEX_SHARDS)])
    before_ms = int(node.client().time()[0]) * 1000
    for i in range(30):
        streams.announce(NAMESPACE, f"idx-{i}", 1000 + i, 60.0)
    found, cursor = streams.read(None, 0.1, 1000)
    assert sorted(a.mm_hash for a in found) == sorted(f"idx-{i}" for i in range(30))
    a = next(a for a in found if a.mm_hash == "idx-7")
    assert a.namespace == NAMESPACE and a.nbytes == 1007 and a.ttl_ms == 60_000
    assert before_ms <= a.stamp_ms <= before_ms + 60_000  # the server's clock, in ms
    # Sharded: the announcements spread over several streams.
    assert sum(1 for k in range(INDEX_SHARDS) if node.client().exists(index_key(k))) > 5
    # The cursor moves on; a blocking read returns what comes next.
    started = time.monotonic()
    assert streams.read(cursor, 0.2, 1000)[0] == []
    assert 0.15 < time.monotonic() - started < 1.5
    streams.announce(NAMESPACE, "idx-late", 5, 60.0)
    found, cursor = streams.read(cursor, 0.2, 1000)
    assert [a.mm_hash for a in found] == ["idx-late"]
    # count bounds each shard's batch.
    found, _ = streams.read(None, 0.1, 1)
    assert len(found) <= INDEX_SHARDS
    # The store's clock (what a follower dates entries by).
    clock_ms = streams.clock_ms()
    assert clock_ms is not None and abs(clock_ms - time.time() * 1000) < 5000
    store.close()


@needs_redis
def test_the_index_is_trimmed_to_the_ttl(node: redis_servers.RedisServer) -> None:
    store = open_store(node.url)
    streams = IndexShards(store)
    node.client().delete(*[index_key(k) for k in range(INDEX_SHARDS)])
    for i in range(200):
        streams.announce(NAMESPACE, f"old-{i}", 1, 0.2)
    time.sleep(0.3)
    for i in range(200):
        streams.announce(NAMESPACE, f"new-{i}", 1, 0.2)
    client = node.client()
    lengths = sum(int(client.xlen(index_key(k))) for k in range(INDEX_SHARDS))
    assert lengths < 400  # MINID ~ trims whole nodes of old entries
    assert all(client.pttl(index_key(k)) <= 60_200 for k in range(INDEX_SHARDS))
    store.close()


# ------------------------------------------------------------------ AUTH


@needs_redis
def test_auth_with_a_token_file(token_file: Callable[[str], str]) -> None:
    with redis_servers.single_node(password="correct horse battery") as server:
        store = open_store(server.url, token_file=token_file("correct horse battery\n"))
        store.ping()
        put_value(store, "auth", b"secret bytes")
        assert store.get(NAMESPACE, "auth") is not None
        store.close()
        # An ACL user: user name and password on two lines.
        server.client().execute_command("ACL", "SETUSER", "ecd", "on", ">ecd-password-123",
                                        "~ecd1:*", "+@all")
        store = open_store(server.url, token_file=token_file("ecd\necd-password-123\n"))
        store.ping()
        assert store.get(NAMESPACE, "auth") is not None
        store.close()
        wrong = open_store(server.url, token_file=token_file("wrong horse\n"))
        with pytest.raises(RemoteAuthError, match=r"WRONGPASS|invalid username-password"):
            wrong.ping()
        with pytest.raises(RemoteAuthError):
            wrong.get(NAMESPACE, "auth")
        wrong.close()
        missing = open_store(server.url)
        with pytest.raises(RemoteAuthError, match=r"NOAUTH|Authentication required"):
            missing.ping()
        missing.close()


# ------------------------------------------------------------------ TLS


@needs_redis
@pytest.mark.skipif(redis_servers.OPENSSL is None, reason="openssl is not installed")
def test_tls(tmp_path: Path) -> None:
    tls = redis_servers.make_tls_files(tmp_path)
    assert tls is not None
    with redis_servers.single_node(tls=tls) as server:
        store = open_store(server.url)  # rediss://...?ca_certs=...
        put_value(store, "tls", b"over tls" * 1000)
        parts = store.get(NAMESPACE, "tls")
        assert parts is not None
        assert bytes(decode(parts, namespace=NAMESPACE, mm_hash="tls").payload) == \
            b"over tls" * 1000
        store.close()
        untrusted = open_store(f"rediss://{server.address}", timeout_s=1.0)
        with pytest.raises(RemoteError, match=r"(?i)certificate"):
            untrusted.ping()
        untrusted.close()
        plain = open_store(f"redis://{server.address}", timeout_s=1.0)
        with pytest.raises(RemoteError):
            plain.ping()
        plain.close()
    with redis_servers.cluster(3, tls=tls) as group:
        assert group.url.startswith("rediss+cluster://")
        store = open_store(group.url)
        for i in range(6):
            put_value(store, f"tls-{i}", b"cluster over tls")
            assert store.get(NAMESPACE, f"tls-{i}") is not None
        assert len({store.domain(NAMESPACE, f"tls-{i}") for i in range(6)}) > 1
        store.close()
    with redis_servers.single_node(tls=tls, tls_auth_clients=True) as server:
        mutual = open_store(f"{server.url}&certfile={tls.cert}&keyfile={tls.key}")
        mutual.ping()
        mutual.close()
        anonymous = open_store(server.url, timeout_s=1.0)
        with pytest.raises(RemoteError):
            anonymous.ping()
        anonymous.close()


# ------------------------------------------------------------------ cluster


@needs_redis
def test_cluster_spreads_values_over_the_nodes(cluster: redis_servers.Cluster) -> None:
    store = open_store(cluster.url)
    data = {f"c-{i}": payload(1000 + i) for i in range(30)}
    for mm_hash, value in data.items():
        put_value(store, mm_hash, value)
    for mm_hash, value in data.items():
        parts = store.get(NAMESPACE, mm_hash)
        assert parts is not None
        assert bytes(decode(parts, namespace=NAMESPACE, mm_hash=mm_hash).payload) == value
        assert store.domain(NAMESPACE, mm_hash) == cluster.node_of(
            value_key(NAMESPACE, mm_hash)).address
    per_node = [len(n.client().keys("ecd1:v:*")) for n in cluster.nodes]
    assert sum(per_node) >= 30 and all(count > 0 for count in per_node), per_node
    big = payload(3 * CHUNK_BYTES + 5)
    put_value(store, "c-big", big)
    parts = store.get(NAMESPACE, "c-big")
    assert parts is not None and len(parts) > 1
    assert bytes(decode(parts, namespace=NAMESPACE, mm_hash="c-big").payload) == big
    store.close()


@needs_redis
def test_a_put_to_a_key_that_moved_follows_the_redirection(
        cluster: redis_servers.Cluster) -> None:
    """A stale slot table (a resharding) sends the SET or the GETRANGE to the
    wrong node: the call goes through redis-py, which follows MOVED."""

    store = open_store(cluster.url)
    assert isinstance(store, RedisStore)
    store.ping()
    key = value_key(NAMESPACE, "moved")
    owner = cluster.node_of(key)
    assert store.cluster is not None
    manager = store.cluster.nodes_manager
    wrong = next(n for n in store.cluster.get_nodes() if n.port != owner.port)
    manager.slots_cache[cluster.slot_of(key)] = [wrong]
    data = payload(50_000)
    put_value(store, "moved", data)
    assert owner.client().exists(key)
    manager.slots_cache[cluster.slot_of(key)] = [wrong]  # (redis-py learnt the owner)
    parts = store.get(NAMESPACE, "moved")
    assert parts is not None
    assert bytes(decode(parts, namespace=NAMESPACE, mm_hash="moved").payload) == data
    store.close()


@needs_redis
def test_cluster_announcements_live_beside_their_values(cluster: redis_servers.Cluster) -> None:
    """A value's announcement goes to an index shard on the value's node."""
    store = open_store(cluster.url)
    streams = IndexShards(store)
    store.ping()
    for n in cluster.nodes:
        keys = [k for k in range(INDEX_SHARDS) if cluster.node_of(index_key(k)) is n]
        assert keys, "every node holds some index shard (16 shards, 3 nodes)"
    for i in range(20):
        mm_hash = f"beside-{i}"
        node = cluster.node_of(value_key(NAMESPACE, mm_hash))
        client = node.client()
        before = sum(int(client.xlen(index_key(k))) for k in range(INDEX_SHARDS)
                     if cluster.node_of(index_key(k)) is node)
        streams.announce(NAMESPACE, mm_hash, 1, 60.0)
        after = sum(int(client.xlen(index_key(k))) for k in range(INDEX_SHARDS)
                    if cluster.node_of(index_key(k)) is node)
        assert after == before + 1
    found, _ = streams.read(None, 0.1, 10_000)
    assert {f"beside-{i}" for i in range(20)} <= {a.mm_hash for a in found}
    clock_ms = streams.clock_ms()
    assert clock_ms is not None and abs(clock_ms - time.time() * 1000) < 5000
    store.close()


@needs_redis
def test_payloads_go_out_without_copies(node: redis_servers.RedisServer,
                                        cluster: redis_servers.Cluster) -> None:
    """Every connection (one node, each cluster node) packs commands in Python,
    which sends a large payload as it is; the hiredis packer copies it twice."""
    from redis.connection import PythonRespSerializer


    for url in (node.url, cluster.url):
        store = open_store(url)
        assert isinstance(store, RedisStore)
        put_value(store, "no-copies", b"p" * 100_000)
        assert store.get(NAMESPACE, "no-copies") is not None
        if store.single is not None:
            pools = [store.single.connection_pool]
        else:
            assert store.cluster is not None
            pools = [n.redis_connection.connection_pool for n in store.cluster.get_nodes()]
        for pool in pools:
            connection = pool.get_connection()
            try:
                assert isinstance(connection._command_packer, PythonRespSerializer)
            finally:
                pool.release(connection)
        store.close()


def test_a_password_in_a_bad_url_is_never_echoed() -> None:
    with pytest.raises(ValueError) as refused:
        parse_url("redis://default:hunter2-SECRET@127.0.0.1:6399")
    assert "hunter2" not in str(refused.value) and "***" in str(refused.value)


def test_index_entries_out_of_bounds_are_ignored() -> None:
    from ec_daemon.remote.redis.announcements import Announcement
    from ec_daemon.remote.redis.shards import _announcement

    good = {b"ns": b"m|f16|image=8|", b"h": b"abc", b"n": b"4096", b"t": b"60000",
            b"e": b"1e15"}
    announcement = _announcement(b"1700000000123-4", good)
    assert announcement is not None
    assert announcement.stamp_ms == 1_700_000_000_123 and announcement.ttl_ms == 60_000
    for field, value in ((b"h", b"x" * 20_000), (b"ns", b"n" * 10_000), (b"n", b"0"),
                         (b"n", str(1 << 50).encode()), (b"t", b"0"), (b"t", b"nan"),
                         (b"h", b"")):
        assert _announcement(b"1-0", {**good, field: value}) is None, field
    # A daemon that predates `t`: its entry counts, with the reader's own TTL.
    older = {k: v for k, v in good.items() if k != b"t"}
    assert _announcement(b"1-0", older) == Announcement("m|f16|image=8|", "abc", 4096, 1, None)
