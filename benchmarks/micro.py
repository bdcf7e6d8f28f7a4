"""Data-plane and bookkeeping benchmarks, each against a baseline measured
in the same process: copy throughput, the stamp check every load pays,
allocator quality, start-up, memory."""

from __future__ import annotations

import gc
import mmap
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ec_client.copy import get_backend
from ec_client.copy.mapping import RegionMapping
from ec_daemon.core.allocator import ExtentAllocator
from ec_daemon.durable.region import Region
from ec_protocol.stamps import StampReader, StampTable, table_bytes

MiB = 1 << 20


def _best_of(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def _best_of_pair(ours: Callable[[], Any], baseline: Callable[[], Any],
                  repeat: int) -> tuple[float, float]:
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for i, fn in enumerate((ours, baseline)):
            started = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - started)
    return best[0], best[1]


def copy_throughput(sizes: tuple[int, ...] = (64 << 10, MiB, 16 * MiB, 64 * MiB, 256 * MiB)
                    ) -> list[dict[str, Any]]:
    """cpu backend save/load of a real /dev/shm region file (pwritev and
    preadv: it maps nothing, docs/security.md) against the same system calls
    made bare on the same buffers (its own overhead: `*_ratio`), and against
    np.copyto of the same bytes through a mapping of the file (the memcpy the
    backend did before, which a worker that truncates the file turns into a
    SIGBUS: `*_vs_mapped`). Buffers as loads get them (`backend.empty`)."""
    backend = get_backend("cpu")
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="bench-") as f:
        os.posix_fallocate(f.fileno(), 0, max(sizes))
        mapping = RegionMapping(f.name, max(sizes), generation=1)
        try:
            return [_copy_row(backend, mapping, size) for size in sizes]
        finally:
            gc.collect()
            mapping.close()


def _copy_row(backend: Any, mapping: RegionMapping, size: int) -> dict[str, Any]:
    source = backend.empty((size,), "uint8")
    source[:] = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    out = backend.empty((size,), "uint8")
    target = np.frombuffer(mapping.view, dtype=np.uint8)[:size]
    extents = [(0, size)]  # what the allocator gives at p50: one extent
    repeat = max(5, min(200, (256 * MiB) // size))
    fd, src, dst = mapping.fd, memoryview(source), memoryview(out)
    # Interleaved, so all see the same cache and frequency state.
    save, raw_in = _best_of_pair(lambda: backend.save(source, mapping, extents),
                                 lambda: os.pwritev(fd, [src], 0), repeat)
    mapped_in = _best_of(lambda: np.copyto(target, source), repeat)
    load, raw_out = _best_of_pair(lambda: backend.load(mapping, extents, out),
                                  lambda: os.preadv(fd, [dst], 0), repeat)
    mapped_out = _best_of(lambda: np.copyto(out, target), repeat)
    return {"bytes": size, "save_gbps": size / save / 1e9, "load_gbps": size / load / 1e9,
            "pwrite_gbps": size / raw_in / 1e9, "pread_gbps": size / raw_out / 1e9,
            "save_ratio": raw_in / save, "load_ratio": raw_out / load,
            "mapped_in_gbps": size / mapped_in / 1e9, "mapped_out_gbps": size / mapped_out / 1e9,
            "save_vs_mapped": mapped_in / save, "load_vs_mapped": mapped_out / load}


def stamp_check(rows: int = 1024, row_bytes: tuple[int, ...] = (256, 2048, 8192),
                page_bytes: int = 64 << 10, repeat: int = 200) -> list[dict[str, Any]]:
    """`StampReader.holds` over a `rows`-row entry's extents (what every load
    checks after its copy: pread, one call per group of nearby runs) against
    the copy itself (the cpu backend's load from a real /dev/shm region), and
    the same check through a mapping of the table (`StampTable`, what
    workers did before: a SIGBUS once the file is cut), for rows of
    `row_bytes` (256 B: the bench model's bfloat16 x 128; 8 KiB: bfloat16 x
    4096), with the entry in one extent (the allocator's p50) and in one
    extent per page (the worst case)."""
    backend = get_backend("cpu")
    largest = rows * max(row_bytes)
    pages = -(-largest // page_bytes)
    data_offset = table_bytes(pages, page_bytes)
    size = data_offset + pages * page_bytes
    out = []
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="bench-") as f:
        os.posix_fallocate(f.fileno(), 0, size)
        mapping = RegionMapping(f.name, size, generation=1)
        mapped = StampTable(mapping.view[:data_offset], page_bytes, data_offset)
        stamps = StampReader(mapping.fd, page_bytes, data_offset, pages)
        try:
            for width in row_bytes:
                nbytes = rows * width
                used = -(-nbytes // page_bytes)
                mapped.write([(0, used)], 7)
                whole = [(data_offset, nbytes)]
                per_page = [(data_offset + p * page_bytes, min(page_bytes, nbytes - p * page_bytes))
                            for p in range(used)]
                target = backend.empty((nbytes,), "uint8")
                for extents in (whole, per_page):
                    assert stamps.holds(extents, 7) and not stamps.holds(extents, 8)
                    check, copy = _best_of_pair(
                        lambda e=extents: stamps.holds(e, 7),
                        lambda e=extents, t=target: backend.load(mapping, e, t), repeat)
                    before = _best_of(lambda e=extents: mapped.holds(e, 7), repeat)
                    out.append({"entry_bytes": nbytes, "pages": used, "extents": len(extents),
                                "check_us": check * 1e6, "copy_us": copy * 1e6,
                                "ratio": check / copy, "mapped_check_us": before * 1e6})
        finally:
            gc.collect()
            mapped.release()
            mapping.close()
    return out


def allocator_quality(pages: int = 1 << 16, occupancy: float = 0.9,
                      operations: int = 200_000) -> dict[str, Any]:
    """Extents per entry under random churn at `occupancy`, entry sizes of
    1..64 pages (64 KiB .. 4 MiB with the default page)."""
    rng = random.Random(0)
    allocator = ExtentAllocator(pages)
    held: list[list[tuple[int, int]]] = []
    extents: list[int] = []
    for _ in range(operations):
        used = pages - allocator.free_pages
        if used < occupancy * pages:
            runs = allocator.allocate(rng.randint(1, 64))
            if runs is not None:
                held.append(runs)
                extents.append(len(runs))
        else:
            allocator.free(held.pop(rng.randrange(len(held))))
    tail = sorted(extents[len(extents) // 5:])  # after the fill phase
    return {"entries": len(tail), "extents_p50": tail[len(tail) // 2],
            "extents_p99": tail[int(len(tail) * 0.99)], "extents_max": tail[-1],
            "free_runs": allocator.free_runs, "occupancy": occupancy}


def startup(size: int = 2 << 30, repeat: int = 3) -> dict[str, Any]:
    """Region.create (posix_fallocate, locked, renamed) against creating a
    tmpfs file of the same size and mapping it with MAP_POPULATE."""
    folder = tempfile.mkdtemp(prefix="bench-", dir="/dev/shm")
    try:
        ours, populate = [], []
        for _ in range(repeat):
            started = time.perf_counter()
            region = Region.create(folder, size)
            ours.append(time.perf_counter() - started)
            region.close()
            path = os.path.join(folder, "populate")
            started = time.perf_counter()
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE)
            populate.append(time.perf_counter() - started)
            mapped.close()
            os.close(fd)
            os.unlink(path)
    finally:
        os.rmdir(folder)
    return {"bytes": size, "ours_s": statistics.median(ours),
            "map_populate_s": statistics.median(populate),
            "ratio": statistics.median(ours) / statistics.median(populate)}


_MEMORY_SCRIPT = """
import os, sys
from ec_daemon.core.cache import Cache
from ec_daemon.core.sessions import SessionTable

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

n = int(sys.argv[1])
before = rss()
cache = Cache(capacity_bytes=n * 4096, page_bytes=4096, sessions=SessionTable(10))
view = cache.attach(engine_id="e", role="both", rank=None, world_size=1, namespace="ns",
                    client_name="bench")
worker = cache.attach(engine_id="e", role="both", rank=0, world_size=1, namespace="ns",
                      client_name="bench")
for i in range(n):
    key = f"{i:064x}"  # a sha256-sized mm_hash
    cache.allocate(worker, key, 4096, (2, 1024), "float16")
    cache.commit(worker, [key])
    view.outbox.clear()
after = rss()
print(before, after, cache.table.ready_entries)
"""


def memory(entries: int = 1_000_000) -> dict[str, Any]:
    """Bookkeeping memory of the daemon's core with `entries` ready entries
    (the region is shared memory, not counted): RSS growth of a process
    holding the core alone."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(entries)], check=True,
                         capture_output=True, text=True).stdout.split()
    before, after, ready = (int(x) for x in out)
    return {"entries": ready, "rss_mib": after / MiB, "growth_mib": (after - before) / MiB,
            "bytes_per_entry": (after - before) / ready,
            "build_s": time.perf_counter() - started}




def watcher_fanout(entries: int = 16384, watchers: tuple[int, ...] = (1, 200),
                   repeat: int = 5) -> list[dict[str, Any]]:
    """One eviction round of `entries` published on the daemon's loop with
    1 (the baseline) and many watchers of every namespace that read nothing
    meanwhile: the loop's stall (best of `repeat`), and after the round, the
    time for every watcher to take its events (their stream writers' share)."""
    from ec_daemon.core.records import Entry, State
    from ec_daemon.plane.watch import ALL, Watchers

    evicted = []
    for i in range(entries):
        entry = Entry(("bench|float16|image=64|", f"{i:064x}"), i + 1, 4096, (64, 32), "float16",
                      [(i, 1)], None)
        entry.state = State.HIDDEN
        evicted.append(entry)
    rows = []
    for count in watchers:
        best_publish = best_take = float("inf")
        for _ in range(repeat):
            hub = Watchers(max_watchers=count, max_per_peer=count)
            open_ = [hub.open(ALL, []) for _ in range(count)]
            started = time.perf_counter()
            for entry in evicted:
                hub.publish(entry)
            best_publish = min(best_publish, time.perf_counter() - started)
            started = time.perf_counter()
            for w in open_:
                w.take()  # the (empty) snapshot and its marker
                while w.take()[0]:
                    pass
            best_take = min(best_take, time.perf_counter() - started)
        rows.append({"watchers": count, "entries": entries, "publish_ms": best_publish * 1e3,
                     "take_all_ms": best_take * 1e3})
    for row in rows:
        row["publish_ratio"] = row["publish_ms"] / rows[0]["publish_ms"]
    return rows
