"""Warm restart, measured (`make bench`, section 9).

- adoption: a crashed daemon's region of N entries (1k, 100k, 1M; one page
  each, in a region of as many pages or of a 64 GiB region's 1M pages, the
  file sparse) written by the real cache and index, then adopted by the
  real code path (`adoption.find`, then `Cache.restore`), next to the time
  to read and decode the index file alone, in the same run;
- the index's cost: saves (allocate + commit) with evictions and their
  acknowledgements on the cache core, journaling on and off, alternating
  rounds in one process; and saves through two real daemons, --warm-restart
  on and off, alternating rounds (ratio = on / off: the target is >= 0.95);
- engines back: a real daemon started on a crashed region of 100k entries,
  while a scheduler waits for it (attached to the dead one before): seconds
  from the daemon's start to its first hit;
- hit rate around a kill -9: an engine looks up its 1,000 saved keys at 100
  lookups/s; the daemon is killed and started again, adopting its region
  (the first minute after, second by second) or with --fresh-start (the
  baseline, ten seconds), and the hit rate before is set against after.

    python -m benchmarks.warm_restart [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PAGE = 64 << 10
NAMESPACE_OF = "bench-model|float32|image=4096|"


def _crashed_region(folder: Path, socket: str, entries: int, pages: int,
                    namespace: str = NAMESPACE_OF) -> Path:
    """A dead daemon's region of `pages` pages (sparse) holding `entries`
    ready one-page entries, written by the real cache and index."""
    from ec_daemon.core.cache import Cache
    from ec_daemon.core.sessions import SessionTable
    from ec_daemon.durable.index import Index, index_path
    from ec_daemon.durable.region import PREFIX, SUFFIX, new_generation
    from ec_daemon.serving.adoption import RegionSpec
    from ec_protocol.stamps import StampTable, table_bytes

    offset = table_bytes(pages, PAGE)
    layout = RegionSpec(socket, offset + pages * PAGE, PAGE, offset)
    generation = new_generation()
    path = folder / f"{PREFIX}{generation:016x}{SUFFIX}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, layout.region_size)
    table = mmap.mmap(fd, offset)
    stamps = StampTable(memoryview(table), PAGE, offset)
    index = Index.create(index_path(path), layout.header(generation))
    cache = Cache(capacity_bytes=pages * PAGE, page_bytes=PAGE,
                  sessions=SessionTable(10.0), data_offset=offset, stamps=stamps, index=index)
    writer = cache.attach(engine_id="w", role="producer", rank=0, world_size=1,
                          namespace=namespace, client_name="bench")
    for i in range(entries):
        key = f"{i:064x}"
        cache.allocate(writer, key, PAGE, (16, 1024), "float32")
        cache.commit(writer, [key])
    stamps.release()
    table.close()
    index.close()
    os.close(fd)  # the "crash": files as they are, the lock gone
    return path


def adoption(counts: tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    """(entries, region pages) -> adoption time against reading the index."""
    from ec_daemon.core.cache import Cache
    from ec_daemon.core.sessions import SessionTable
    from ec_daemon.durable.index import index_path, read_index
    from ec_daemon.serving.adoption import RegionSpec, find
    from ec_protocol.stamps import table_bytes

    rows = []
    socket = "unix:///bench/ec.sock"
    for entries, pages in counts:
        folder = Path(tempfile.mkdtemp(prefix="ecd-bench-", dir="/dev/shm"))
        try:
            path = _crashed_region(folder, socket, entries, pages)
            index_bytes = index_path(path).stat().st_size
            gc.collect()
            started = time.perf_counter()
            read_index(index_path(path))
            read_s = time.perf_counter() - started
            offset = table_bytes(pages, PAGE)
            layout = RegionSpec(socket, offset + pages * PAGE, PAGE, offset)
            started = time.perf_counter()
            adopted, why = find(str(folder), layout)
            assert adopted is not None, why
            found_s = time.perf_counter() - started
            cache = Cache(capacity_bytes=pages * PAGE, page_bytes=PAGE,
                          sessions=SessionTable(10.0), data_offset=offset)
            v = adopted.verified
            cache.restore(v.records, v.free, v.quarantined, v.next_entry_id, v.views,
                          cache.sessions.previous_daemon)
            total_s = time.perf_counter() - started
            assert cache.table.ready_entries == entries
            adopted.region.close(remove=True)
            rows.append({"entries": entries, "region_GiB": pages * PAGE / (1 << 30),
                         "index_MiB": index_bytes / (1 << 20), "read_index_ms": read_s * 1e3,
                         "adopt_ms": found_s * 1e3, "restore_ms": (total_s - found_s) * 1e3,
                         "total_ms": total_s * 1e3, "ratio_to_read": total_s / read_s})
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return rows


def index_cost(rounds: int, saves: int) -> dict[str, Any]:
    """Saves with evictions on the cache core: journaling on / off."""
    from ec_daemon.core.cache import Cache
    from ec_daemon.core.events import EvictedEvent
    from ec_daemon.core.sessions import SessionTable
    from ec_daemon.durable.index import Index
    from ec_daemon.durable.journal import Header
    from ec_protocol.stamps import StampTable, table_bytes

    pages = 4096
    offset = table_bytes(pages, PAGE)
    folder = Path(tempfile.mkdtemp(prefix="ecd-bench-", dir="/dev/shm"))
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for round_ in range(rounds):
            for mode in ("off", "on"):
                index = Index.create(folder / f"{mode}-{round_}.index",
                                     Header(1, offset + pages * PAGE, PAGE, offset, "bench")) \
                    if mode == "on" else None
                if index is not None:  # as in the daemon: one write per loop turn (call)
                    index.flush_with(lambda flush: None)
                stamps = StampTable(memoryview(bytearray(offset)), PAGE, offset)
                cache = Cache(capacity_bytes=pages * PAGE, page_bytes=PAGE,
                              sessions=SessionTable(10.0), data_offset=offset, stamps=stamps,
                              index=index)
                view = cache.attach(engine_id="v", role="both", rank=None, world_size=1,
                                    namespace="ns", client_name="bench")
                writer = cache.attach(engine_id="w", role="both", rank=0, world_size=1,
                                      namespace="ns", client_name="bench")
                rng = random.Random(round_)
                sizes = [rng.randint(1, 8) for _ in range(saves)]
                started = time.perf_counter()
                for i, size in enumerate(sizes):
                    key = f"{round_}-{i}"
                    while cache.allocate(writer, key, size * PAGE, (size, PAGE),
                                         "uint8").outcome.name == "WAIT":
                        refs = [(e.mm_hash, e.entry_id) for e in view.outbox
                                if isinstance(e, EvictedEvent)]
                        view.outbox.clear()
                        cache.views.acknowledge(view, refs)
                        if index is not None:
                            index.flush()
                    cache.commit(writer, [key])
                    if index is not None:
                        index.flush()
                    if i % 256 == 0:
                        cache.compact_index()
                times[mode].append(time.perf_counter() - started)
                if index is not None:
                    index.close(remove=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    best = {mode: min(t) for mode, t in times.items()}
    return {"saves_per_round": saves, "rounds": rounds,
            "off_saves_per_s": saves / best["off"], "on_saves_per_s": saves / best["on"],
            "ratio": best["off"] / best["on"],
            "median_ratio": statistics.median(times["off"]) / statistics.median(times["on"])}


def daemon_saves(rounds: int, saves: int) -> dict[str, Any]:
    """Saves through the daemon (Allocate, copy, Report; a cache small
    enough that every save evicts), --warm-restart on vs off, alternating
    rounds; each figure is the best round."""
    import numpy as np

    from ec_client.worker_side.worker import WorkerDelegate
    from tests.integration.daemon import Daemon
    from tests.integration.engines import LAYOUT

    hosts = {}
    best: dict[str, float] = {}
    data = np.ones((64, 1024), np.float32)  # 256 KiB: 4 pages
    try:
        for mode in ("off", "on"):
            daemon = Daemon(cpu_bytes="16MiB", check_invariants=False,
                            extra=("--warm-restart", "true" if mode == "on" else "false")).start()
            worker = WorkerDelegate(daemon.socket, engine_id=f"bench-{mode}", layout=LAYOUT)
            assert worker.link.wait_attached(30)
            hosts[mode] = (daemon, worker)
        for round_ in range(rounds):
            for mode, (_, worker) in hosts.items():
                started = time.perf_counter()
                for i in range(saves):
                    while not worker.save(f"{round_}-{i}", data):
                        worker.flush(30)
                worker.flush(120)
                rate = saves / (time.perf_counter() - started)
                best[mode] = max(best.get(mode, 0.0), rate)
    finally:
        for daemon, worker in hosts.values():
            worker.close()
            daemon.cleanup()
    return {"what": "saves/s (every save evicts)", "off": best["off"], "on": best["on"],
            "ratio": best["on"] / best["off"]}


def engines_back(entries: int) -> dict[str, Any]:
    """Seconds from a real daemon's start on a crashed region of `entries`
    entries to the first hit of a scheduler that waited for it."""
    from ec_client.scheduler_side.scheduler import SchedulerDelegate
    from ec_client.worker_side.worker import WorkerDelegate
    from ec_daemon.serving.wire import namespace_of
    from ec_protocol.protocol import RegionSpec
    from tests.integration.daemon import Daemon, short_tmpdir

    layout = RegionSpec("bench-model", "float32", {"image": 4096})
    shm = Path(tempfile.mkdtemp(prefix="ecd-bench-", dir="/dev/shm"))
    folder = short_tmpdir()
    pages = max(entries, 1024)
    daemon = Daemon(folder=folder, shm_dir=str(shm), cpu_bytes=str(pages * PAGE),
                    check_invariants=False)
    _crashed_region(shm, f"unix://{os.path.abspath(daemon.socket_path)}", entries, pages,
                    namespace=namespace_of(layout.to_pb()))
    scheduler = SchedulerDelegate(daemon.socket, engine_id="bench", layout=layout)
    worker = WorkerDelegate(daemon.socket, engine_id="bench", layout=layout)  # hits need it
    time.sleep(3)  # the engine tries the dead socket, backing off as it does
    last = f"{entries - 1:064x}"
    marks: dict[str, float] = {}
    try:
        started, wall = time.monotonic(), time.time()
        daemon.start(wait=False)
        while not (scheduler.serving() and scheduler.view.get(last)):  # the snapshot's last
            scheduler.build_step_metadata()
            now = time.monotonic() - started
            if scheduler.link.attachment is not None:
                marks.setdefault("attached_s", now)
            if scheduler.view.synced:
                marks.setdefault("synced_s", now)
            time.sleep(0.001)
            if now > 120:
                raise RuntimeError("no hit within 120 s:\n" + daemon.log())
        first_hit = time.monotonic() - started
        scheduler.build_step_metadata()
        log = daemon.log()
        adopted_ms = float(log.split(" in ")[1].split(" ms")[0]) if "adopted" in log else None
        serving = next(line for line in log.splitlines() if "serving on" in line)
        serving_s = time.mktime(time.strptime(serving[:19], "%Y-%m-%d %H:%M:%S")) \
            + int(serving[20:23]) / 1000 - wall
        return {"entries": entries, "first_hit_s": first_hit, "adoption_ms": adopted_ms,
                "serving_s": serving_s, **marks}
    finally:
        scheduler.close()
        worker.close()
        daemon.cleanup()
        shutil.rmtree(shm, ignore_errors=True)


def hit_rate_around_a_kill(fresh: bool, seconds_after: float) -> dict[str, Any]:
    """An engine's hit rate over its saved keys before and after kill -9."""
    import numpy as np

    from ec_client.scheduler_side.scheduler import SchedulerDelegate
    from ec_client.worker_side.worker import WorkerDelegate
    from tests.integration.daemon import Daemon, short_tmpdir
    from tests.integration.engines import LAYOUT

    folder = short_tmpdir()
    daemon = Daemon(folder=folder, cpu_bytes="256MiB", check_invariants=False).start()
    scheduler = SchedulerDelegate(daemon.socket, engine_id="bench", layout=LAYOUT)
    worker = WorkerDelegate(daemon.socket, engine_id="bench", layout=LAYOUT)
    keys = [f"k{i}" for i in range(1000)]
    data = np.zeros((16, 1024), np.float32)
    try:
        for d in (scheduler, worker):
            assert d.link.wait_attached(30)
        for key in keys:
            assert worker.save(key, data)
        assert worker.flush(120)
        while len(scheduler.view) < len(keys):
            time.sleep(0.01)
        rng = random.Random(0)

        def rate(seconds: float) -> list[tuple[float, bool]]:
            out = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                key = rng.choice(keys)  # (its load would be staged: a hit a step later)
                hit = scheduler.serving() and scheduler.view.get(key) is not None
                out.append((time.monotonic(), hit))
                scheduler.build_step_metadata()
                time.sleep(0.01)
            return out

        before = rate(5.0)
        daemon.kill()
        started = time.monotonic()
        daemon = Daemon(folder=folder, cpu_bytes="256MiB", check_invariants=False,
                        extra=("--fresh-start",) if fresh else ()).start(wait=False)
        after = rate(seconds_after)
        hits_after = [t for t, hit in after if hit]
        buckets = [sum(hit for t, hit in after if lo <= t - started < lo + 1) /
                   max(1, sum(1 for t, _ in after if lo <= t - started < lo + 1))
                   for lo in range(int(seconds_after))]
        return {"start": "fresh" if fresh else "adopting",
                "hit_rate_before": sum(h for _, h in before) / len(before),
                "hit_rate_first_s": buckets[0] if buckets else 0.0,
                "hit_rate_after": sum(h for _, h in after) / max(1, len(after)),
                "first_hit_s": (hits_after[0] - started) if hits_after else None,
                "curve": [round(b, 2) for b in buckets],
                "curve_first_5s": " ".join(f"{b:.2f}" for b in buckets[:5])}
    finally:
        scheduler.close()
        worker.close()
        daemon.cleanup()


def measure(quick: bool) -> dict[str, Any]:
    counts = ((1000, 1000), (10_000, 10_000)) if quick else (
        (1000, 1000), (100_000, 100_000), (100_000, 1 << 20), (1_000_000, 1 << 20))
    return {
        "adoption": adoption(counts),
        "index_cost": index_cost(rounds=3 if quick else 7, saves=2000 if quick else 20_000),
        "daemon_saves": daemon_saves(rounds=2 if quick else 5, saves=200 if quick else 1000),
        "engines_back": engines_back(10_000 if quick else 100_000),
        "hit_rate": [hit_rate_around_a_kill(False, 3.0 if quick else 60.0),
                     hit_rate_around_a_kill(True, 3.0 if quick else 10.0)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(json.dumps(measure(args.quick), indent=2))


if __name__ == "__main__":
    main()
