"""The second tier on Mooncake Store (section 11 of `make bench`), each part
against its baseline in the same run: a local mooncake_master, and a store
node (another process lending the store its memory: in a fleet a value sits
in one of many hosts' memory, seldom the reader's own).

- promotion: what a daemon's promotion does to a value another daemon
  published (`MooncakeStore.put_entry`: vLLM's header and the entry, the
  checksum beside it): `RemoteTier.fetch` (the value's head: its checksum)
  then `RemoteTier.fetch_into` the region's pages (the value read into the
  thread's registered buffer, copied into a private chunk, verified there
  with xxh3, written into the pages with pwrite), against a raw `get_into`
  of the same bytes into a registered buffer by a bare
  MooncakeDistributedStore; and the same promotion through the Redis tier
  (a verified fetch, then pwritev into the region) against a local
  redis-server, with its raw GET. Best of N,
  interleaved; every client here lends no memory, so every read crosses
  loopback TCP to the store node;
- saves and hits on a host with `--remote mooncake://...` against one with
  no remote (benchmarks/tier.py's two daemons and rounds);
- the daemon's CPU per published 1 MiB (tier.py's method; publications
  counted on the store: the checksums beside the values);
- promotion end to end through two daemons, on Mooncake and on Redis.

The daemons lend the store 16 MiB each (the least it takes), filled before
measuring, so that what they publish lands in the store node's memory: a
host's own segment would make its puts and gets local copies.

    python -m benchmarks.mooncake_tier [--quick] [--part promotion|saves|cpu|end-to-end]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import tier
from ec_protocol.protocol import Layout

# Mooncake's log: warnings and errors only (read when the library loads).
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
# The engine's name for its namespace in the store (vLLM's key scheme v3).
STORE_NAMESPACE = ("embedding@model:bench-model#weights=bench@revision:default"
                   "@encoder:bench@dtype:torch.float16@protocol:v3")
LAYOUT = Layout("bench-model", "float16", {"image": 2048}, store_namespace=STORE_NAMESPACE)
NAMESPACE = "bench/model|float16|image=2048|" + "v" * 64  # (in-process: ec-daemon's name)
DAEMON_SEGMENT = "16MiB"  # what each daemon lends the store (the least mooncake takes)
NODE_SEGMENT = 2 << 30  # the store node's: no eviction within a part
HEADER_BYTES = 24  # vLLM's header before the payload


def tensor(size: int, seed: int = 0) -> Any:
    """An encoder output of `size` bytes as vLLM makes one: 2-D float16, 2 KiB rows."""
    return np.random.default_rng(seed + size).standard_normal(
        (size // 2048, 1024)).astype(np.float16)


# ------------------------------------------------------------ the store

_NODE = """
import sys
from mooncake.store import MooncakeDistributedStore
metadata, master, segment = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = MooncakeDistributedStore()
code = store.setup("127.0.0.1", metadata, segment, 16 << 20, "tcp", "", master)
print(code, store.get_hostname() if code == 0 else "-", flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
store.close()
"""


@contextlib.contextmanager
def store_node(server: Any, segment_bytes: int = NODE_SEGMENT, nice: int = 0) -> Iterator[str]:
    """A process that lends the store `segment_bytes` of its memory, at
    `nice`; yields its segment's name. Ended by its pid."""
    proc = subprocess.Popen([sys.executable, "-c", _NODE, server.metadata_url,
                             server.rpc_address, str(segment_bytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                            env=dict(os.environ, MC_LOG_LEVEL="ERROR"))
    try:
        if nice:
            os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
        assert proc.stdout is not None
        code, _, name = proc.stdout.readline().strip().partition(" ")
        if code != "0":
            raise RuntimeError(f"the store node's setup returned {code or proc.poll()!r}; "
                               f"master log:\n{server.log_tail()}")
        yield name
    finally:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _admin(server: Any, path: str) -> str:
    base = server.metrics_url.rsplit("/", 1)[0]
    with urllib.request.urlopen(base + path, timeout=5) as reply:
        return str(reply.read().decode())


def segments(server: Any) -> list[str]:
    """The segments mounted in the store now (the master's admin page)."""
    return [line.strip() for line in _admin(server, "/get_all_segments").splitlines()
            if line.strip()]


def free_bytes(server: Any, segment: str) -> int:
    fields = dict(line.split(":", 1) for line in
                  _admin(server, f"/query_segment?segment={segment}").splitlines()[1:]
                  if ":" in line)
    values = {k.strip(): int(v) for k, v in fields.items()}
    return values["Capacity(bytes)"] - values["Used(bytes)"]


def fill(server: Any, client: Any, full: list[str]) -> None:
    """Fill the segments `full` (the daemons') with junk, so that what the
    daemons publish lands in the store node's memory."""
    from mooncake.store import ReplicateConfig

    for n, segment in enumerate(full):
        config = ReplicateConfig()
        config.preferred_segments = [segment]
        size, i = 4 * MiB, 0
        while size >= 64:
            key = f"ecd-bench-junk-{n}-{i}"
            i += 1
            code = client.put(key, b"\0" * size, config)
            if code == 0:
                replicas = client.batch_get_replica_desc([key]).get(key) or []
                where = [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                         for r in replicas if r.is_memory_replica()]
                if where == [segment]:
                    continue
                client.remove(key, True)
            size //= 2
        left = free_bytes(server, segment)
        assert left < MiB, f"segment {segment} still has {left} bytes free"


@contextlib.contextmanager
def fleet(hosts: int) -> Iterator[tuple[Any, list[tier._Host], Any]]:
    """A master, a store node at nice 19 (in a fleet it is other machines'
    work), `hosts` daemons with --remote mooncake:// whose segments are
    full; yields the master, the hosts and a raw client (lending nothing)."""
    from tests.mooncake_servers import master, raw_client

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(master())
        node = stack.enter_context(store_node(server, nice=19))
        client = stack.enter_context(raw_client(server, global_segment_bytes=0))
        made: list[tier._Host] = []
        for _ in range(hosts):
            host = tier._Host(server.url_with(segment=DAEMON_SEGMENT), LAYOUT)
            stack.callback(host.close)
            made.append(host)
        deadline = time.monotonic() + 60
        while len(segments(server)) < hosts + 1 or not all(h.scheduler.wanting for h in made):
            assert time.monotonic() < deadline, "the daemons never joined the store"
            time.sleep(0.05)
        fill(server, client, [s for s in segments(server) if s != node])
        yield server, made, client


# ------------------------------------------------------------ the parts

def promotion(quick: bool = False) -> list[dict[str, Any]]:
    """Promotion through the tier vs a raw get_into, and through the Redis tier."""
    import redis

    from ec_daemon.durable.region import Region
    from ec_daemon.remote.common import Common
    from ec_daemon.remote.mooncake.backend import MooncakeBackend
    from ec_daemon.remote.mooncake.codec import value_key
    from ec_daemon.remote.mooncake.store import MooncakeStore
    from ec_daemon.remote.mooncake.url import parse_url
    from ec_daemon.remote.redis.store import value_key as redis_key
    from ec_daemon.remote.tier import RemoteTier, open_tier
    from ec_daemon.remote.values import encode
    from tests.mooncake_servers import master, raw_client
    from tests.redis_servers import single_node

    sizes = (MiB, 8 * MiB) if quick else (MiB, 8 * MiB, 32 * MiB)
    rows = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(master())
        stack.enter_context(store_node(server, segment_bytes=4 * sum(sizes) + 64 * MiB))
        redis_server = stack.enter_context(single_node())
        shm = stack.enter_context(tempfile.TemporaryDirectory(prefix="ecd-bench-",
                                                              dir="/dev/shm"))
        # Host 1's region (published from) and host 2's (promoted into).
        source = Region.create(shm, max(sizes))
        stack.callback(source.close)
        region = Region.create(shm, max(sizes))
        stack.callback(region.close)
        spec = replace(parse_url(server.url), segment_bytes=0)  # (lending nothing)
        publisher = MooncakeStore(spec)
        stack.callback(publisher.close)
        common = Common(promotion_bytes=1 << 30)
        store = MooncakeStore(spec, budget=common.budget)
        mooncake = RemoteTier(MooncakeBackend(common, store, index_bytes=1 << 20),
                              publish_queue_bytes=1 << 30)
        stack.callback(mooncake.stop)
        mooncake.follow(NAMESPACE, STORE_NAMESPACE)
        redis_tier = open_tier(redis_server.url, ttl_s=600, publish_queue_bytes=1 << 30,
                               index_bytes=1 << 20, promotion_bytes=1 << 30, claim_s=0)
        stack.callback(redis_tier.stop)
        raw = stack.enter_context(raw_client(server, global_segment_bytes=0))
        redis_raw = redis.Redis(host="127.0.0.1", port=redis_server.port, protocol=2,
                                socket_timeout=10)
        stack.callback(redis_raw.close)
        deadline = time.monotonic() + 60
        while not (_connected(publisher) and _connected(store)):
            assert time.monotonic() < deadline, "never connected to the master"
            time.sleep(0.05)
        for size in sizes:
            array = tensor(size)
            mm_hash = f"bench-{size}"
            extents = [(0, size)]
            source.write(extents, [array])
            assert publisher.put_entry(STORE_NAMESPACE, mm_hash, array.shape, "float16",
                                       source, extents) == "stored"
            redis_tier.backend.store.put(NAMESPACE, mm_hash, encode(
                NAMESPACE, mm_hash, array.shape, "float16", array), 600)
            key = value_key(STORE_NAMESPACE, mm_hash)
            capacity = size + HEADER_BYTES
            buffer = ctypes.create_string_buffer(capacity)
            assert raw.register_buffer(ctypes.addressof(buffer), capacity) == 0

            def get_into(key: str = key, buffer: Any = buffer, capacity: int = capacity) -> None:
                assert raw.get_into(key, ctypes.addressof(buffer), capacity) == capacity

            def promote(mm_hash: str = mm_hash, extents: list[tuple[int, int]] = extents,
                        size: int = size) -> None:
                found = mooncake.fetch(NAMESPACE, mm_hash, size)
                assert found is not None
                assert mooncake.fetch_into(NAMESPACE, mm_hash, found, region, extents)

            def promote_resolved(mm_hash: str = mm_hash,
                                 extents: list[tuple[int, int]] = extents) -> float:
                """The value alone, its head read before (untimed): a wanted
                key the resolver found, whose head it remembered."""
                found = store.head(STORE_NAMESPACE, mm_hash)
                assert found is not None
                started = time.perf_counter()
                assert mooncake.fetch_into(NAMESPACE, mm_hash, found, region, extents)
                return time.perf_counter() - started

            def head(mm_hash: str = mm_hash) -> None:
                assert store.head(STORE_NAMESPACE, mm_hash) is not None

            def redis_promote(mm_hash: str = mm_hash, extents: list[tuple[int, int]] = extents,
                              size: int = size) -> None:
                found = redis_tier.fetch(NAMESPACE, mm_hash, size)
                assert found is not None
                assert redis_tier.fetch_into(NAMESPACE, mm_hash, found, region, extents)

            def redis_get(key: str = redis_key(NAMESPACE, mm_hash)) -> None:
                redis_raw.get(key)

            repeat = max(5, (48 if quick else 640) * MiB // size)
            t_get, t_promote, t_resolved, t_head, t_redis, t_redis_get = _best_of(
                [get_into, promote, promote_resolved, head, redis_promote, redis_get], repeat)
            assert region.read(extents)[0] == memoryview(array).cast("B").tobytes()
            raw.unregister_buffer(ctypes.addressof(buffer))
            rows.append({"MiB": size // MiB, "get_into_gbps": size / t_get / 1e9,
                         "promote_gbps": size / t_promote / 1e9,
                         "promote_ratio": t_get / t_promote, "get_into_ms": t_get * 1e3,
                         "promote_ms": t_promote * 1e3, "head_ms": t_head * 1e3,
                         "resolved_ratio": t_get / t_resolved, "resolved_ms": t_resolved * 1e3,
                         "redis_get_gbps": size / t_redis_get / 1e9,
                         "redis_promote_gbps": size / t_redis / 1e9,
                         "vs_redis": t_redis / t_promote,
                         "remote_hits": mooncake.snapshot()["remote_hits"]})
    return rows


def _best_of(fns: list[Callable[[], float | None]], repeat: int) -> list[float]:
    """benchmarks.remote._best_of, where a function may time itself (it
    returns the seconds that count)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            started = time.perf_counter()
            spent = fn()
            best[i] = min(best[i], spent if spent is not None else
                          time.perf_counter() - started)
    return best


def _connected(store: Any) -> bool:
    try:
        store.ping()
    except Exception:
        return False
    return True


def saves(quick: bool = False) -> list[dict[str, Any]]:
    """Saves and hits, the Mooncake tier on vs off (tier.saves_and_hits)."""
    with fleet(1) as (_server, (on,), _client):
        hosts = {"off": tier._Host("", LAYOUT), "on": on}
        try:
            return tier.saves_and_hits(hosts, tensor(MiB), quick)
        finally:
            hosts["off"].close()


def publish_cpu(quick: bool = False) -> list[dict[str, Any]]:
    """The daemon's CPU per published 1 MiB (tier.cpu_rounds); a publication
    counts once the store holds its checksum (asked of the store)."""
    from ec_daemon.remote.mooncake.codec import SIDECAR, value_key

    with fleet(1) as (_server, (on,), client):
        hosts = {"off": tier._Host("", LAYOUT), "on": on}
        seen: set[int] = set()

        def announced() -> int:
            asked = [n for n in range(1, on.saved + 1) if n not in seen]
            if asked:
                states = client.batch_is_exist(
                    [value_key(STORE_NAMESPACE, f"save-{n}") + SIDECAR for n in asked])
                seen.update(n for n, state in zip(asked, states, strict=True) if state == 1)
            return len(seen)

        try:
            return tier.cpu_rounds(hosts, tensor(MiB, seed=1), quick, announced)
        finally:
            hosts["off"].close()


def end_to_end(quick: bool = False) -> list[dict[str, Any]]:
    """tier.promotions through two daemons on Mooncake, then on Redis."""
    from tests.redis_servers import single_node

    rows = []
    with fleet(2) as (_server, (one, two), _client):
        rows += [{"store": "mooncake", **row} for row in tier.promotions(
            one, two, quick, tensor,
            lambda count: one.daemon.stats()["remote_tier"]["publishes"] >= count)]
    with single_node() as server:
        assert server.pid is not None
        os.setpriority(os.PRIO_PROCESS, server.pid, 19)
        one, two = tier._Host(server.url, LAYOUT), tier._Host(server.url, LAYOUT)
        try:
            rows += [{"store": "redis", **row} for row in tier.promotions(
                one, two, quick, tensor,
                lambda count: two.daemon.stats()["remote_tier"]["index_entries"] >= count)]
        finally:
            one.close()
            two.close()
    return rows


PARTS: dict[str, Callable[[bool], list[dict[str, Any]]]] = {
    "promotion": promotion, "saves": saves, "cpu": publish_cpu, "end-to-end": end_to_end}
COLUMNS = {
    "promotion": ["MiB", "get_into_gbps", "promote_gbps", "promote_ratio", "get_into_ms",
                  "promote_ms", "head_ms", "resolved_ms", "resolved_ratio", "redis_get_gbps",
                  "redis_promote_gbps", "vs_redis"],
    "saves": ["what", "off", "on", "ratio", "published"],
    "cpu": ["off_ms_per_save", "on_ms_per_save", "daemon_cpu_ms_per_mib",
            "publisher_cpu_ms_per_mib", "published"],
    "end-to-end": ["store", "MiB", "promote_ms", "promote_gbps"],
}
TITLES = {
    "promotion": "11a. promotion through the Mooncake tier (the head, then the value read, "
                 "verified and written into the region) vs a raw get_into of the same bytes "
                 "(GB/s; ratio = get_into time / ours; resolved: the value alone, its head "
                 "read when the key was resolved); the Redis tier's promotion and raw GET "
                 "beside it (vs_redis = Redis promotion time / Mooncake's)",
    "saves": "11b. the Mooncake tier on vs off, same host (ratio = on / off)",
    "cpu": "11b. the daemon's CPU per published 1 MiB on Mooncake (ms; on / off: per save, "
           "with the tier / without; daemon: the difference; publisher: its thread alone)",
    "end-to-end": "11c. promotion end to end through two daemons: a miss deferred until the "
                  "entry is ready (best)",
}


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    from benchmarks.tables import table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", choices=tuple(PARTS), action="append",
                        help="only this part (repeatable)")
    args = parser.parse_args(argv)
    results = {name: part(args.quick) for name, part in PARTS.items()
               if not args.part or name in args.part}
    for name, rows in results.items():
        print(table(TITLES[name], rows, COLUMNS[name]))
        print()
    return results


if __name__ == "__main__":
    main()
