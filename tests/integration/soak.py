"""Soak: engine processes stepping concurrently against one small daemon.

Each engine process has a scheduler side and a worker side (the delegates
vLLM's connector uses) and steps in a loop: looks items up, dispatches the
hits, loads them and checks every loaded byte against the bytes the key
stands for, computes and saves the misses. The cache is small, so entries
are evicted all the time, often under loads in flight. The summary counts
steps, loads verified, corrupt and failed loads (both must be 0: a failed
load is one the stamp check caught), and what the daemon holds once every
engine detached (pending, hidden, quarantined bytes and ghosts: all 0).

    python -m tests.integration.soak --seconds 600 --processes 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time
import zlib
from typing import Any

import numpy as np
import psutil

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout
from tests import staged
from tests.integration.daemon import Daemon

LAYOUT = Layout("soak-model", "uint8", {"image": 1024})
KEYS = 400
# What the daemon must no longer hold once every engine detached.
LEFT = ("pending_bytes_left", "hidden_bytes_left", "quarantined_bytes_left",
        "ghost_sessions_left")


def payload(key: int) -> np.ndarray:
    """The bytes `key` stands for: 16 KiB .. ~1 MiB, content from the key."""
    rows = 16 + (key * 7919) % 1000
    rng = np.random.default_rng(key)
    return rng.integers(0, 256, (rows, 1024), dtype=np.uint8)


def crc(array: Any) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(array)).cast("B"))


def engine_main(socket: str, index: int, seconds: float, conn: Any) -> None:
    engine = f"soak-{index}"
    scheduler = SchedulerDelegate(socket, engine_id=engine, layout=LAYOUT)
    worker = WorkerDelegate(socket, engine_id=engine, layout=LAYOUT)
    assert scheduler.link.wait_attached(20) and worker.link.wait_attached(20)
    rng = random.Random(index)
    checksums: dict[int, int] = {}
    stats = {"steps": 0, "hits": 0, "loads": 0, "loads_verified": 0, "corrupt": 0,
             "loads_failed": 0, "saves_queued": 0, "step_us": []}
    deadline = time.monotonic() + seconds
    request = 0
    while time.monotonic() < deadline:
        keys = rng.sample(range(KEYS), rng.randint(1, 4))
        started = time.perf_counter()
        request += 1
        # Two steps, as vLLM's: the first asks about the request's items and
        # stages the loads of those the cache holds (the workers copy, verify
        # and report them); the second looks them up (hits, counted by the
        # daemon) and adopts what was staged. step_us: the scheduler's calls.
        hashes = [f"k{key}" for key in keys]
        _, meta = staged.plan(scheduler, hashes, f"r{request}", finish=False)
        scheduler_us = (time.perf_counter() - started) * 1e6
        stats["loads"] += len(meta.loads)
        worker.regions.step(meta.keep)
        try:
            result = worker.stage(meta.loads, meta.regions, meta.step)
        finally:
            worker.regions.step_done()
        staged.report(scheduler, result)
        stats["loads_failed"] += len(result.failed)
        started = time.perf_counter()
        hits, used = staged.use(scheduler, hashes, f"r{request}")
        stats["step_us"].append(scheduler_us + (time.perf_counter() - started) * 1e6)
        stats["hits"] += sum(hits)
        misses = [key for key, hit in zip(keys, hits, strict=True) if not hit]
        worker.drop(used.drop)
        for adopt in used.adopt:  # every hit, adopted: exactly the saved bytes
            array = worker.adopt(adopt.transfer_id)
            key = int(adopt.mm_hash[1:])
            want = checksums.setdefault(key, crc(payload(key)))
            if array is not None and crc(array) == want and array.shape == payload(key).shape:
                stats["loads_verified"] += 1
            else:
                stats["corrupt"] += 1
        for key in misses:
            stats["saves_queued"] += worker.save(f"k{key}", payload(key))
        stats["steps"] += 1
    worker.flush(30)
    stats["saves_done"] = worker.stats["saves_done"]
    scheduler.close()
    worker.close()
    conn.send(stats)


def run(processes: int, seconds: float, cpu_bytes: str = "16MiB") -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with Daemon(cpu_bytes=cpu_bytes) as daemon:
        daemon_proc = psutil.Process(daemon.proc.pid)  # type: ignore[union-attr]
        rss_start = daemon_proc.memory_info().rss
        pipes, procs = [], []
        for i in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=engine_main, args=(daemon.socket, i, seconds, child),
                               daemon=True)
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        results = []
        rss_peak = rss_start
        for parent, proc in zip(pipes, procs, strict=True):
            while not parent.poll(1):
                rss_peak = max(rss_peak, daemon_proc.memory_info().rss)
                if not proc.is_alive():
                    raise RuntimeError(f"engine {proc.pid} died: exit {proc.exitcode}")
            results.append(parent.recv())
            proc.join(30)
        daemon.wait_for(lambda: daemon.stats()["sessions"] == 0, what="engines detached")
        stats = daemon.stats()
    times = sorted(t for r in results for t in r["step_us"])
    return {
        "processes": processes, "seconds": seconds,
        "steps": sum(r["steps"] for r in results),
        "hits": sum(r["hits"] for r in results),
        "loads_verified": sum(r["loads_verified"] for r in results),
        "corrupt": sum(r["corrupt"] for r in results),
        "loads_failed": sum(r["loads_failed"] for r in results),
        "saves_done": sum(r["saves_done"] for r in results),
        "loads_dispatched": sum(r["loads"] for r in results),
        "daemon_loads": stats["loads"],
        "daemon_hits": stats["hits"],
        "evictions": stats["evictions"],
        "refused_saves": stats["refused_saves"],
        "pending_bytes_left": stats["pending_bytes"],
        "hidden_bytes_left": stats["hidden_bytes"],
        "quarantined_bytes_left": stats["quarantined_bytes"],
        "ghost_sessions_left": stats["ghost_sessions"],
        "pages_accounted": stats["used_bytes"] + stats["free_bytes"] == stats["capacity_bytes"],
        "step_p50_us": times[len(times) // 2] if times else 0.0,
        "step_p99_us": times[int(len(times) * 0.99)] if times else 0.0,
        "daemon_rss_start_mib": rss_start / 2**20,
        "daemon_rss_peak_mib": rss_peak / 2**20,
    }


def format_summary(summary: dict[str, Any]) -> str:
    width = max(map(len, summary))
    lines = [f"{'soak summary':<{width}}  value", "-" * (width + 14)]
    for name, value in summary.items():
        shown = f"{value:.1f}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<{width}}  {shown}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--cpu-bytes", default="16MiB")
    args = parser.parse_args()
    summary = run(args.processes, args.seconds, args.cpu_bytes)
    print(format_summary(summary))
    ok = (summary["corrupt"] == 0 and summary["loads_failed"] == 0 and summary["pages_accounted"]
          and not any(summary[k] for k in LEFT))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
