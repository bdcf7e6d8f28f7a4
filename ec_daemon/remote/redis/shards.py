"""The index of a Redis store, in shards: each daemon announces there
what it published, and every daemon reads them (`follower`) into what it
follows (`announcements`), so a want is answered from memory.

Shards ``ecd1:i:{<k>}``, k of INDEX_SHARDS, are streams of announcements
(ns, h, n, t, e), trimmed to the TTL. A publisher announces on a shard that lives on the
same node as the value (in a cluster), so the node that holds a value holds
its announcement: losing it costs exactly its keys.

Time is the server's: an announcement carries its TTL (`t`, ms) and is dated
by its stream entry ID (the milliseconds of the node's clock at the XADD), and
each XADD trims its shard by the ID the previous XADD on that shard returned,
less the TTL; no host's clock is trusted. (`e`, the expiry by the publisher's
clock, is still written for daemons that predate `t`.) Anyone who can write
to the store can write the index: an entry out of bounds is ignored.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.cluster import RedisCluster

from ec_daemon.core.limits import MAX_KEY_BYTES, MAX_NAMESPACE_BYTES
from ec_daemon.remote.breaker import CLOSED, Breakers
from ec_daemon.remote.common import RemoteError
from ec_daemon.remote.redis.announcements import Announcement
from ec_daemon.remote.redis.store import (
    ERRORS,
    INDEX_SHARDS,
    MAX_VALUE_BYTES,
    RedisStore,
    failed,
    index_key,
    shard_of,
    value_key,
)


class IndexShards:
    """The index shards of one Redis store. Thread-safe."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        # Stream key -> milliseconds of the ID our last XADD there returned
        # (the server's clock, by which the next XADD trims).
        self._added_ms: dict[str, int] = {}

    def shard_for(self, key: str) -> int:
        """The index shard for a value key: in a cluster, one on the value's
        node when there is one (so a node's loss costs exactly its keys)."""
        shard = shard_of(key)
        if self.store.cluster is None:
            return shard
        node = self.store.domain_of(key)
        local = [k for k in range(INDEX_SHARDS) if self.store.domain_of(index_key(k)) == node]
        return local[shard % len(local)] if local else shard

    def announce(self, namespace: str, mm_hash: str, nbytes: int, ttl_s: float) -> None:
        try:
            client = self.store.client()
            key = index_key(self.shard_for(value_key(namespace, mm_hash)))
            ttl_ms = max(1, int(ttl_s * 1000))
            # Trimmed by the server's clock (the ID the shard's previous XADD
            # returned): a host whose clock runs ahead must not trim the
            # others' announcements. The first XADD here trims nothing. (A Lua
            # script could trim by its own XADD's ID, in the same one round
            # trip, but would need EVAL in every daemon's ACL.)
            previous = self._added_ms.get(key)
            pipe = client.pipeline(transaction=False)
            pipe.xadd(key, {"ns": namespace, "h": mm_hash, "n": nbytes, "t": ttl_ms,
                            "e": f"{time.time() + ttl_s:.3f}"},
                      minid=None if previous is None else max(0, previous - ttl_ms),
                      approximate=True)
            # An index nobody writes to any more goes away a minute after its last entry.
            pipe.pexpire(key, ttl_ms + 60_000)
            entry_id, _ = pipe.execute()
            self._added_ms[key] = _stamp_ms(entry_id)
        except ERRORS as exc:
            raise failed(f"announce {namespace!r} {mm_hash!r}", exc) from None

    def read(self, cursor: str | None, block_s: float, count: int,
                   breakers: Breakers | None = None) -> tuple[list[Announcement], str]:
        positions = _parse_cursor(cursor)
        if self.store.single is None and self.store.cluster is None and breakers is not None:
            # No cluster client yet: connecting is the seeds' domain's call.
            seeds = breakers.get(self.store.spec.display)
            if not seeds.allow():
                self.store.pause(max(0.05, min(block_s, seeds.retry_in())))
                return [], _cursor(positions)
            try:
                self.store.client()
            except RemoteError as exc:
                seeds.failure(exc)
                self.store.pause(block_s)
                return [], _cursor(positions)
            seeds.success()
        client = self.store.client()
        # Shards by failure domain; one node answers for all of its shards.
        by_domain: dict[str, list[int]] = {}
        for shard in range(INDEX_SHARDS):
            by_domain.setdefault(self.store.domain_of(index_key(shard)), []).append(shard)
        # One node: one XREAD BLOCK over every shard. A cluster refuses
        # multi-key reads across slots: non-blocking reads, then a pause.
        blocking = self.store.single is not None
        found: list[Announcement] = []
        waited = False
        pause = block_s
        for domain, shards in by_domain.items():
            breaker = breakers.get(domain) if breakers is not None else None
            if breaker is not None and not breaker.allow():
                pause = min(pause, max(0.05, breaker.retry_in()))
                continue
            # A probe (half-open) answers at once: other calls wait for its verdict.
            block_ms = None
            if blocking and (breaker is None or breaker.state == CLOSED):
                block_ms = max(1, int(min(block_s, self.store.timeout_s / 2) * 1000))
            try:
                replies = self._read_shards(client, shards, positions, count, block_ms)
            except ERRORS as exc:
                failure = failed(f"read index on {domain}", exc)
                if breaker is None:
                    raise failure from None
                breaker.failure(failure)
                pause = min(pause, 0.1)  # count failures quickly: the breaker decides
                continue
            if breaker is not None:
                breaker.success()
            waited = waited or block_ms is not None
            for reply in replies:
                for stream, entries in reply or ():
                    shard = _shard_from_key(stream)
                    for entry_id, fields in entries:
                        positions[shard] = entry_id.decode()
                        announcement = _announcement(entry_id, fields)
                        if announcement is not None:
                            found.append(announcement)
        if not found and not waited:
            self.store.pause(pause)
        return found, _cursor(positions)

    def clock_ms(self, breakers: Breakers | None = None) -> int | None:
        if self.store.single is None and self.store.cluster is None:
            return None  # not connected yet: read_index connects
        domains = dict.fromkeys(self.store.domain_of(index_key(k)) for k in range(INDEX_SHARDS))
        for domain in domains:
            breaker = breakers.get(domain) if breakers is not None else None
            if breaker is not None and not breaker.allow():
                continue
            try:
                if self.store.single is not None:
                    seconds, micros = self.store.single.time()
                else:
                    assert self.store.cluster is not None
                    node = self.store.cluster.get_node(node_name=domain)
                    if node is None:
                        if breaker is not None:
                            breaker.success()  # (not asked: a node that left the cluster)
                        continue
                    seconds, micros = self.store.cluster.time(target_nodes=node)
            except ERRORS as exc:
                failure = failed(f"time on {domain}", exc)
                if breaker is None:
                    raise failure from None
                breaker.failure(failure)
                continue
            if breaker is not None:
                breaker.success()
            return int(seconds) * 1000 + int(micros) // 1000
        return None

    def _read_shards(self, client: redis.Redis | RedisCluster, shards: list[int],
                     positions: list[str], count: int, block_ms: int | None) -> list[Any]:
        if len(shards) > 1 and self.store.single is not None:
            streams: dict[Any, Any] = {index_key(k): positions[k] for k in shards}
            return [client.xread(streams, count=count, block=block_ms)]
        pipe = client.pipeline(transaction=False)
        for k in shards:
            pipe.xread({index_key(k): positions[k]}, count=count)
        return list(pipe.execute())


def _parse_cursor(cursor: str | None) -> list[str]:
    if cursor:
        positions = cursor.split(",")
        if len(positions) == INDEX_SHARDS:
            return positions
    return ["0-0"] * INDEX_SHARDS


def _cursor(positions: list[str]) -> str:
    return ",".join(positions)


def _shard_from_key(stream: bytes | str) -> int:
    name = stream.decode() if isinstance(stream, bytes) else stream
    return int(name.rsplit("{", 1)[1].rstrip("}"))


def _stamp_ms(entry_id: bytes | str) -> int:
    """The milliseconds part of a stream entry ID (the server's clock)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0])


def _announcement(entry_id: bytes | str, fields: dict[bytes, bytes]) -> Announcement | None:
    """An index entry, or None when it is malformed or out of bounds: the
    daemon's bounds on a key and a namespace (anyone who can write to the
    store can write the index; a daemon must not hold what it says)."""
    try:
        namespace, mm_hash = fields[b"ns"], fields[b"h"]
        if len(namespace) > MAX_NAMESPACE_BYTES or not 0 < len(mm_hash) <= MAX_KEY_BYTES:
            return None
        nbytes = int(fields[b"n"])
        ttl_ms = int(fields[b"t"]) if b"t" in fields else None
        if not 0 < nbytes <= MAX_VALUE_BYTES or (ttl_ms is not None and ttl_ms <= 0):
            return None
        return Announcement(namespace=namespace.decode(), mm_hash=mm_hash.decode(),
                            nbytes=nbytes, stamp_ms=_stamp_ms(entry_id), ttl_ms=ttl_ms)
    except (KeyError, ValueError):
        return None
