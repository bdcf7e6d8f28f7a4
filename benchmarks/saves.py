"""The daemon's CPU per stored save, as a user would measure it.

Two worker processes save 1 MiB outputs through the public client
(`WorkerDelegate.save`) as fast as they can: each offers its saves one
after the other, and one that its save queue refuses is offered again a
moment later, so every save is stored and the workload is fixed. The
daemon's CPU time (user + system, psutil) is read around the whole run,
from the first save offered to the last one reported.

Two paths in the same run: `unary` (an Allocate and a Report call per
save, as clients did before the stream saves and as they still do against
a daemon that does not take them; `stream_saves=False`) is the baseline;
`stream` (allocations and reports as messages on the worker's session
stream, pipelined and batched). The cache is smaller than the workload, so
it evicts as it would at full load (no views: an evicted entry's pages come
back at once).

With `--profile` the daemon runs under cProfile for the stream path and the
top functions by own time, and the daemon's own by cumulative time, are
printed.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout
from tests.integration.daemon import Daemon

LAYOUT = Layout("saves-model", "uint8", {"image": 1 << 20})
MiB = 1 << 20
WORKERS = 2
CACHE = "256MiB"
RETRY_SECONDS = 0.0005
# The daemon's modules in the profile, less those only start-up runs.
STEADY = r"ec_daemon/(?!__main__|durable/region|serving/(?:cli|server|metrics|config|startup))"


def _saver(socket: str, index: int, saves: int, stream: bool, conn: Any) -> None:
    worker = WorkerDelegate(socket, engine_id=f"saver-{index}", layout=LAYOUT,
                            role="producer", stream_saves=stream, save_queue_bytes=32 * MiB)
    assert worker.link.wait_attached(20) is not None
    output = np.full(MiB, index, np.uint8)
    conn.send("ready")
    conn.recv()
    busy = 0
    started = time.monotonic()
    for i in range(saves):
        while not worker.save(f"{'s' if stream else 'u'}{index}-{i}", output):
            busy += 1
            time.sleep(RETRY_SECONDS)
    assert worker.flush(120)
    elapsed = time.monotonic() - started
    conn.send({"stats": dict(worker.stats), "busy": busy, "elapsed": elapsed,
               "messages": worker.save_messages,
               "rpcs": sum(worker.transport.calls.values())})
    worker.close()


def run(stream: bool, saves: int, profile: Path | None = None,
        cache: str = CACHE) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    daemon = Daemon(cpu_bytes=cache, page_bytes="64KiB", check_invariants=False)
    if profile is not None:  # the daemon under cProfile, written at its (clean) exit
        daemon.args[1:1] = ["-m", "cProfile", "-o", str(profile)]
    with daemon:
        assert daemon.proc is not None
        proc = psutil.Process(daemon.proc.pid)
        pipes, procs = [], []
        for index in range(WORKERS):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_saver, args=(daemon.socket, index, saves, stream, child),
                            daemon=True)
            p.start()
            pipes.append(parent)
            procs.append(p)
        for parent in pipes:
            assert parent.poll(60) and parent.recv() == "ready"
        before = proc.cpu_times()
        started = time.monotonic()
        for parent in pipes:
            parent.send("go")
        results = [parent.recv() for parent in pipes]
        wall = time.monotonic() - started
        after = proc.cpu_times()
        for p in procs:
            p.join(30)
        stored = daemon.stats()["saves"]
    cpu = (after.user - before.user) + (after.system - before.system)
    done = sum(r["stats"].get("saves_done", 0) for r in results)
    return {"path": "stream" if stream else "unary", "workers": WORKERS, "saves": WORKERS * saves,
            "stored": stored, "done": done,
            "lost": sum(r["stats"].get("saves_lost", 0) + r["stats"].get("saves_failed", 0)
                        + r["stats"].get("saves_refused", 0) for r in results),
            "busy_retries": sum(r["busy"] for r in results),
            "rpcs": sum(r["rpcs"] for r in results),
            "msgs_per_save": sum(r["messages"] for r in results) / (WORKERS * saves),
            "daemon_cpu_s": cpu, "daemon_cpu_ms_per_save": cpu * 1000 / max(1, stored),
            "saves_per_s": stored / wall, "wall_s": wall}


def measure(saves: int = 500) -> list[dict[str, Any]]:
    """Unary (the baseline) then stream, `saves` per worker, with ratios to
    the baseline."""
    rows = [run(stream=False, saves=saves), run(stream=True, saves=saves)]
    base = rows[0]
    for row in rows:
        row["cpu_ratio"] = row["daemon_cpu_ms_per_save"] / base["daemon_cpu_ms_per_save"]
        row["rate_ratio"] = row["saves_per_s"] / base["saves_per_s"]
    return rows


def profile_stream(saves: int, top: int = 25) -> str:
    """The daemon's top functions over the stream path: by own time, then
    its own (`ec_daemon`) by cumulative time. Start-up is in the profile
    too (imports, pre-faulting the region): it is not in the CPU measured."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "daemon.prof"
        run(stream=True, saves=saves, profile=out)
        if not out.exists():
            return "(no profile written: the daemon did not exit cleanly)"
        text = io.StringIO()
        stats = pstats.Stats(str(out), stream=text)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(STEADY, top)
        return text.getvalue()


def main() -> None:
    from benchmarks.tables import table

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--saves", type=int, default=None,
                        help="saves per worker (default 500, --quick 100); more read the "
                             "CPU (10 ms ticks) more finely")
    args = parser.parse_args()
    saves = args.saves or (100 if args.quick else 500)
    rows = measure(saves)
    print(table("daemon CPU per stored 1 MiB save, 2 worker processes (ratio = vs unary)",
                rows, COLUMNS))
    if args.profile:
        print(profile_stream(saves))


COLUMNS = ["path", "saves", "stored", "lost", "busy_retries", "rpcs", "msgs_per_save",
           "daemon_cpu_s",
           "daemon_cpu_ms_per_save", "cpu_ratio", "saves_per_s", "rate_ratio"]

if __name__ == "__main__":
    sys.exit(main())
