"""Eight (and sixteen) engines stepping at 100 steps/s against one daemon.

Each engine process runs the scheduler side and a worker (the delegates the
connector uses, in one process as vLLM's single-GPU executor has them) and
steps on a fixed cadence. The scheduler's part is timed: `ensure` (a cached
key's load is staged, its request waits a step or two), lookups, the step's
metadata (`build_step_metadata`) and the previous step's worker output
(`apply_worker_output(done, failed)`, as vLLM applies step k's in step
k+1). The worker's part is not: staged loads (`WorkerDelegate.stage`: copy
and stamp check, no RPC), adoptions, and saves of the misses (queued for the
saver thread).

A probe process saves a fresh key every 20 ms; every engine's view records
when the ready event arrives, so the lag is measured from just before the
probe's report to arrival in each view (an upper bound: it includes that
RPC reaching the daemon). Two more figures take that RPC out: the lag from
the probe's reply (the daemon queues the events before it replies), and the
spread between the first and the last view to get each event. The daemon's
CPU time over the run comes from /proc, the host's from psutil.

The cache starts warm: the probe saves the 200 hot keys before the run.
A step with items looks up 3 hot keys and one fresh key (a miss its worker
computes and saves), so in steady state 3 of 4 items hit and the fresh saves
keep the 64 MiB cache evicting: ready and evicted events both flow.

Three mixes, run one after the other: `every step` carries items (3,200
lookups/s asked of the host, 3 of 4 hits: 2,400 loads/s with no daemon
message of their own, their touches ride on the heartbeats; 800 saves/s);
`1 step in 10` does (a busy multimodal engine: 40 items/s each); `no items`
steps without lookups, the control plane's floor. Then sixteen engines with
items every step (an eight-GPU host with two engines per GPU: 1,600 saves/s).

Per engine: steps/s reached against the 100 asked (each engine's own count
over its own run time), blocking RPCs on the scheduler's thread per step,
messages its scheduler queued on the session stream per step (acks released
at step boundaries; heartbeats are timed, not per step), and blocking RPCs
on the load path (the worker's calls made on the engine's thread: saves run
on the saver thread).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import threading
import time
from typing import Any

import numpy as np
import psutil

from benchmarks.scheduler_step import count_sends
from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout, pb
from tests.integration.daemon import Daemon

LAYOUT = Layout("concurrency-model", "uint8", {"image": 1024})
STEP_SECONDS = 0.01  # 100 steps/s
HOT_KEYS = 200
CACHE = "64MiB"


def _engine(socket: str, index: int, items_every: int, seconds: float,
            conn: Any) -> None:
    scheduler = SchedulerDelegate(socket, engine_id=f"engine-{index}", layout=LAYOUT)
    worker = WorkerDelegate(socket, engine_id=f"engine-{index}", layout=LAYOUT)
    assert scheduler.link.wait_attached(20) and worker.link.wait_attached(20)
    arrivals: dict[str, float] = {}
    apply = scheduler.view.apply

    def timed_apply(message: Any, send_acks: Any) -> None:
        now = time.monotonic()
        for info in message.ready:
            if info.mm_hash.startswith("probe-"):
                arrivals.setdefault(info.mm_hash, now)
        apply(message, send_acks)

    scheduler.view.apply = timed_apply  # type: ignore[method-assign]
    conn.send("ready")
    conn.recv()
    rng = random.Random(index)
    sent = count_sends(scheduler.link)
    me = threading.get_ident()
    step_us: list[float] = []
    started_at = time.monotonic()
    deadline = started_at + seconds
    # Engines are not phase-locked: each starts its cadence at its own offset.
    next_step = time.monotonic() + STEP_SECONDS * rng.random()
    time.sleep(max(0.0, next_step - time.monotonic()))
    request = loads = failed = 0
    done: list[int] = []
    failures: list[tuple[int, str]] = []
    waiting: list[tuple[str, str]] = []  # (request, key) deferred while a load stages
    while time.monotonic() < deadline:
        count = len(step_us)
        keys = [*(hot_key(rng.randrange(HOT_KEYS)) for _ in range(3)), f"f{index}-{count}"] \
            if items_every and (count + index) % items_every == 0 else []
        started = time.perf_counter()
        misses = []
        asked = waiting
        waiting = []
        for key in keys:
            request += 1
            asked.append((f"r{request}", key))
        for rid, key in asked:
            if not scheduler.ensure([key], rid):
                waiting.append((rid, key))
                continue
            if not scheduler.has_item(key):
                misses.append(key)
            scheduler.after_alloc(rid, key)
        meta = scheduler.build_step_metadata()
        scheduler.apply_worker_output(done, failures)  # the previous step's
        step_us.append((time.perf_counter() - started) * 1e6)
        # The worker's part, off the scheduler's path.
        for adopt in meta.adopt:
            worker.adopt(adopt.transfer_id)
        worker.drop(meta.drop)
        result = worker.stage(meta.loads, meta.regions, meta.step)
        loads += len(meta.loads)
        done, failures = result.done, [(t, result.kinds[t]) for t in result.failed]
        failed += len(failures)
        for key in misses:
            worker.save(key, entry(rng.randrange(192)))
        next_step += STEP_SECONDS
        time.sleep(max(0.0, next_step - time.monotonic()))
    elapsed = time.monotonic() - started_at
    scheduler.apply_worker_output(done, failures)
    lookups, hits = scheduler.view.counts()
    conn.send({"step_us": step_us, "arrivals": arrivals, "loads": loads, "failed": failed,
               "lookups": lookups, "hits": hits,
               "elapsed": elapsed, "rpcs": scheduler.transport.calls_from_this_thread(),
               "msgs": sent.get(me, 0),
               "worker_rpcs": worker.transport.calls_from_this_thread()})
    scheduler.close()
    worker.close()


def hot_key(i: int) -> str:
    return f"k{i}"


def entry(size: int) -> np.ndarray:
    """An encoder output of 64-255 rows of 1 KiB."""
    return np.zeros((64 + size % 192, 1024), np.uint8)


def _probe(socket: str, seconds: float, conn: Any) -> None:
    worker = WorkerDelegate(socket, engine_id="probe", layout=LAYOUT, role="producer")
    attachment = worker.link.wait_attached(20)
    assert attachment is not None
    for i in range(HOT_KEYS):  # a warm cache: no fill-up transient in the run
        worker.save(hot_key(i), entry(i))
    assert worker.flush(60)
    conn.send("ready")
    conn.recv()
    sent: dict[str, float] = {}
    replied: dict[str, float] = {}
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        key = f"probe-{i}"
        reply = worker.transport.call("Allocate", pb.AllocateRequest(
            session_id=attachment.session_id, mm_hash=key, nbytes=1024, shape=[1024],
            dtype="uint8"))
        if reply.status == pb.ALLOCATED:
            sent[key] = time.monotonic()
            worker.transport.call("Report", pb.ReportRequest(
                session_id=attachment.session_id, saved=[key]))
            replied[key] = time.monotonic()
        i += 1
        time.sleep(0.02)
    conn.send((sent, replied))
    worker.close()


MIXES = {"every step": 1, "1 step in 10": 10, "no items": 0}


def run_all(seconds: float = 10.0) -> list[dict[str, Any]]:
    """The three mixes with eight engines, then every step with items on
    sixteen (an eight-GPU host running two engines per GPU)."""
    return [*(run(mix=mix, seconds=seconds) for mix in MIXES),
            run(engines=16, mix="every step", seconds=seconds)]


def run(engines: int = 8, seconds: float = 10.0, mix: str = "every step") -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with Daemon(cpu_bytes=CACHE, check_invariants=False) as daemon:
        assert daemon.proc is not None
        daemon_proc = psutil.Process(daemon.proc.pid)
        pipes = []
        procs = []
        engine_args = ((_engine, (i, MIXES[mix])) for i in range(engines))
        for target, args in [*engine_args, (_probe, ())]:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(daemon.socket, *args, seconds, child),
                               daemon=True)
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for parent in pipes:
            assert parent.poll(60) and parent.recv() == "ready"
        cpu_before = sum(daemon_proc.cpu_times()[:2])
        psutil.cpu_percent()
        started = time.monotonic()
        for parent in pipes:
            parent.send("go")
        results = [parent.recv() for parent in pipes]
        wall = time.monotonic() - started
        cpu = sum(daemon_proc.cpu_times()[:2]) - cpu_before
        host_busy = psutil.cpu_percent()
        for proc in procs:
            proc.join(30)
    sent, replied = results[-1]
    engine_results = results[:-1]
    views = [r["arrivals"] for r in engine_results]
    steps = sorted(t for r in engine_results for t in r["step_us"])
    reached = [len(r["step_us"]) / r["elapsed"] for r in engine_results]
    lags = sorted((view[k] - t) * 1e3 for view in views for k, t in sent.items() if k in view)
    # The same events from the probe's reply on: without the probe's own
    # call reaching the daemon (the daemon sends the events as it replies).
    after_reply = sorted((view[k] - t) * 1e3 for view in views for k, t in replied.items()
                         if k in view)
    spread = sorted((max(times) - min(times)) * 1e3 for times in
                    ([view[k] for view in views if k in view] for k in sent) if times)
    expected = len(sent) * engines
    return {"mix": mix, "engines": engines, "seconds": seconds,
            "steps_per_s_asked": 1 / STEP_SECONDS,
            "steps_per_s_each": statistics.mean(reached),
            "steps_per_s_min": min(reached),
            "steps_reached_ratio": statistics.mean(reached) * STEP_SECONDS,
            "loads_per_s_host": sum(r["loads"] for r in engine_results) / wall,
            "loads_failed": sum(r["failed"] for r in engine_results),
            "hit_ratio": sum(r["hits"] for r in engine_results)
            / max(1, sum(r["lookups"] for r in engine_results)),
            "step_p50_us": steps[len(steps) // 2], "step_p99_us": p99(steps),
            "blocking_rpcs_per_step": sum(r["rpcs"] for r in engine_results) / len(steps),
            "msgs_per_step": sum(r["msgs"] for r in engine_results) / len(steps),
            "worker_rpcs_per_step": sum(r["worker_rpcs"] for r in engine_results) / len(steps),
            "event_lag_p50_ms": statistics.median(lags),
            "event_lag_p99_ms": p99(lags),
            "lag_after_reply_p99_ms": p99(after_reply),
            "fanout_spread_p99_ms": p99(spread),
            "events_seen": len(lags), "events_expected": expected,
            "daemon_cpu_percent": 100 * cpu / wall, "host_cpu_busy_percent": host_busy}


def p99(ordered: list[float]) -> float:
    """The 99th percentile of already sorted values."""
    return ordered[int(len(ordered) * 0.99)]


def main() -> None:
    """All mixes (`make bench` runs them through benchmarks/run.py), or the
    engine counts and mix asked for (`make gpu-check`: 8 and 16 engines,
    every step with items, on the device machine's 16 cores)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, nargs="+", help="engine counts, one run each")
    parser.add_argument("--mix", choices=list(MIXES), default="every step")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = ([run(engines=n, seconds=args.seconds, mix=args.mix) for n in args.engines]
            if args.engines else run_all(args.seconds))
    for row in rows:
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
