"""Second tier: a verified fetch (RemoteTier.fetch: chunked read + header
checks + xxh3 over the payload) against a raw redis-py GET of the same key's
same bytes, in the same run, against a local redis-server; with redis-py's
hiredis parser and with its pure-Python one (a child process that cannot
import hiredis). `promote` adds the write into a region's pages (fetch_into:
pwritev into a file in /dev/shm, as a promotion writes the daemon's region)
to the fetch; `get_crc32` is a GET followed by zlib.crc32 over the value
(the checksum this format did not take), as a ratio to the plain GET.

    python -m benchmarks.remote [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "bench/model|bfloat16|image=2304|" + "v" * 64


def _best_of(fns: list[Callable[[], Any]], repeat: int) -> list[float]:
    """Interleaved, so each sees the same cache and frequency state."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            started = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - started)
    return best


def measure(sizes: tuple[int, ...] = (MiB, 8 * MiB, 32 * MiB), quick: bool = False
            ) -> list[dict[str, Any]]:
    """Rows of GET vs fetch throughput (GB/s) per payload size, for the
    parser redis-py uses in this process."""
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    from ec_daemon.durable.region import Region
    from ec_daemon.remote.redis.store import value_key
    from ec_daemon.remote.tier import open_tier
    from ec_daemon.remote.values import encode
    from tests.redis_servers import single_node

    rows = []
    with single_node() as server, tempfile.TemporaryDirectory(
            prefix="ecd-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
        tier = open_tier(server.url, ttl_s=600, publish_queue_bytes=1 << 30,
                         index_bytes=1 << 20, promotion_bytes=1 << 30, claim_s=0)
        store = tier.backend.store
        raw = redis.Redis(host="127.0.0.1", port=server.port, protocol=2, socket_timeout=10)
        region = Region.create(shm, max(sizes))
        try:
            for size in sizes:
                mm_hash = f"bench-{size}"
                payload = os.urandom(size)
                store.put(NAMESPACE, mm_hash, encode(NAMESPACE, mm_hash, (size,), "uint8",
                                                     payload), 600)
                key = value_key(NAMESPACE, mm_hash)

                def fetch(mm_hash: str = mm_hash, size: int = size) -> None:
                    assert tier.fetch(NAMESPACE, mm_hash, size) is not None

                def promote(mm_hash: str = mm_hash, size: int = size) -> None:
                    found = tier.fetch(NAMESPACE, mm_hash, size)
                    assert found is not None
                    assert tier.fetch_into(NAMESPACE, mm_hash, found, region, [(0, size)])

                def get(key: str = key) -> None:
                    raw.get(key)

                def get_crc32(key: str = key) -> None:  # the checksum not taken
                    value = raw.get(key)
                    assert isinstance(value, bytes)
                    zlib.crc32(value)

                repeat = max(3, (64 if quick else 384) * MiB // size)
                t_get, t_fetch, t_promote, t_crc = _best_of([get, fetch, promote, get_crc32],
                                                            repeat)
                rows.append({"parser": "hiredis" if HIREDIS_AVAILABLE else "python",
                             "MiB": size // MiB, "get_gbps": size / t_get / 1e9,
                             "fetch_gbps": size / t_fetch / 1e9,
                             "promote_gbps": size / t_promote / 1e9,
                             "fetch_ratio": t_get / t_fetch, "promote_ratio": t_get / t_promote,
                             "get_crc32_ratio": t_get / t_crc,
                             "get_ms": t_get * 1e3, "fetch_ms": t_fetch * 1e3})
            assert region.read([(0, sizes[-1])])[0] == payload  # (the last one promoted)
        finally:
            region.close()
            raw.close()
            tier.stop()
    return rows


def _child(quick: bool) -> list[dict[str, Any]]:
    """measure() in a process where `import hiredis` fails."""
    code = ("import sys, json; sys.modules['hiredis'] = None; "
            "from benchmarks.remote import measure; "
            f"print(json.dumps(measure(quick={quick})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=True)
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def table(rows: list[dict[str, Any]]) -> str:
    columns = ["parser", "MiB", "get_gbps", "fetch_gbps", "fetch_ratio", "promote_gbps",
               "promote_ratio", "get_crc32_ratio", "get_ms", "fetch_ms"]
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in columns]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    from redis.utils import HIREDIS_AVAILABLE

    rows = measure(quick=args.quick)
    if HIREDIS_AVAILABLE:
        rows += _child(args.quick)
    print("second tier: raw redis-py GET vs RemoteTier.fetch (verified) of the same bytes, "
          "GB/s, best of N interleaved")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
