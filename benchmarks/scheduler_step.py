"""Scheduler-side step cost of the vLLM-free delegate against a real daemon.

One step is what vLLM's scheduler does per engine step: `ensure` per
request (a cached item's load is staged and its request waits), has_item
and after_alloc per multimodal item of the requests that go ahead,
build_step_metadata once, and applying the workers' output of the previous
step once (`apply_worker_output(done, failed)`: one entry per rank and
transfer, here one rank). A hit case's items are cached: each request for
them waits while their loads are staged, then hits. Measured on the calling
thread: wall time per step, blocking RPCs made on it, messages it queued on
the session stream (touches ride on heartbeats: a hit sends nothing), and the
pickled size of the metadata sent to workers. The worker's part
(`WorkerDelegate.stage`: copy, stamp check; adoptions and drops) runs after
each step, off the timed path; the RPCs it makes are counted too (none by
design). The full comparison with vLLM's in-process connector is `make
bench`.

    python -m benchmarks.scheduler_step [--steps N]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import threading
import time
from typing import Any

import numpy as np

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout
from tests.integration.daemon import Daemon

LAYOUT = Layout("bench-model", "bfloat16", {"image": 2048})
CASES = ((1, 256), (8, 256), (8, 1024), (32, 1024))


def count_sends(link: Any) -> dict[int, int]:
    """Messages `link` is asked to queue on its stream, per thread."""
    sent: dict[int, int] = {}
    send = link.send

    def counted(message: Any) -> bool:
        ident = threading.get_ident()
        sent[ident] = sent.get(ident, 0) + 1
        return bool(send(message))

    link.send = counted
    return sent


def run_case(daemon: Daemon, items: int, rows: int, hit: bool, steps: int) -> dict[str, float]:
    engine = f"bench-{items}x{rows}-{hit}"
    scheduler = SchedulerDelegate(daemon.socket, engine_id=engine, layout=LAYOUT)
    worker = WorkerDelegate(daemon.socket, engine_id=engine, layout=LAYOUT)
    try:
        assert scheduler.link.wait_attached(10) and worker.link.wait_attached(10)
        sent = count_sends(scheduler.link)
        me = threading.get_ident()
        hashes = [f"{engine}-{i}" for i in range(items)]
        if hit:
            for h in hashes:
                assert worker.save(h, np.zeros((rows, 1024), np.uint16))
            assert worker.flush(30)
            daemon.wait_for(lambda: all(scheduler.view.get(h) for h in hashes), what="view")
        rpcs_before = scheduler.transport.calls_from_this_thread()
        msgs_before = sent.get(me, 0)
        times, meta_bytes = [], []
        load_rpcs = hits = failed = 0
        done: list[int] = []
        failures: list[tuple[int, str]] = []
        waiting: list[str] = []  # requests deferred while their loads stage
        for step in range(steps):
            started = time.perf_counter()
            requests = [*waiting, *(f"r{step}-{i}" for i in range(items))]
            waiting = []
            for request in requests:
                i = int(request.rsplit("-", 1)[1])
                h = hashes[i] if hit else f"{hashes[i]}-miss-{request}"
                if not scheduler.ensure([h], request):
                    waiting.append(request)
                    continue
                hits += scheduler.has_item(h)
                scheduler.after_alloc(request, h)
            meta = scheduler.build_step_metadata()
            scheduler.apply_worker_output(done, failures)  # the previous step's loads
            times.append(time.perf_counter() - started)
            meta_bytes.append(len(pickle.dumps(meta)))
            for adopt in meta.adopt:  # the worker's part, untimed
                assert worker.adopt(adopt.transfer_id) is not None
            worker.drop(meta.drop)
            before = worker.transport.calls_from_this_thread()
            result = worker.stage(meta.loads, meta.regions, meta.step)
            load_rpcs += worker.transport.calls_from_this_thread() - before
            done, failures = result.done, [(t, result.kinds[t]) for t in result.failed]
            failed += len(failures)
        assert (hits > 0) == hit and not failed, (hits, failed)
        times.sort()
        return {"median_us": statistics.median(times) * 1e6,
                "p99_us": times[int(len(times) * 0.99) - 1] * 1e6,
                "rpcs_per_step": (scheduler.transport.calls_from_this_thread() - rpcs_before)
                / steps,
                "msgs_per_step": (sent.get(me, 0) - msgs_before) / steps,
                "worker_rpcs_per_step": load_rpcs / steps,
                "meta_bytes": statistics.median(meta_bytes)}
    finally:
        scheduler.close()
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    with Daemon(cpu_bytes="1GiB", check_invariants=False) as daemon:
        print(f"{'case':<16}{'median us':>11}{'p99 us':>9}{'RPCs/step':>11}{'msgs/step':>11}"
              f"{'worker RPCs':>13}{'meta B':>8}")
        for items, rows in CASES:
            for hit in (False, True):
                r = run_case(daemon, items, rows, hit, args.steps)
                case = f"{items}x{rows} {'hit' if hit else 'miss'}"
                print(f"{case:<16}{r['median_us']:>11.1f}{r['p99_us']:>9.1f}"
                      f"{r['rpcs_per_step']:>11.2f}{r['msgs_per_step']:>11.2f}"
                      f"{r['worker_rpcs_per_step']:>13.2f}{r['meta_bytes']:>8.0f}")


if __name__ == "__main__":
    main()
