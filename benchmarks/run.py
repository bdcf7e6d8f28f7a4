"""`make bench`: every benchmark, each with its baseline run in the same
process tree, printed as tables and written to results/bench-<time>.json.

1. scheduler step cost of ECDaemonConnector vs vLLM's ECCPUScheduler
   (in the vLLM venv: benchmarks/scheduler_vs_upstream.py), with the
   messages our scheduler queues per hit and the RPCs our worker makes per
   step on the load path;
2. cpu copy backend vs the bare pread/pwrite (and the memcpy through a
   mapping it replaced); 3. the stamp check vs the copy it
   follows; 4. allocator extents under churn; 5. start-up vs a MAP_POPULATE
   mmap; 6. eight and sixteen engines at 100 steps/s; 7. daemon bookkeeping memory with
   1M entries, and one eviction round published to 1 vs 200 watchers;
   8. the second tier: a verified fetch and a promotion vs a raw
   redis GET of the same bytes, promotion end to end through two daemons,
   and saves and hits with the tier on vs off, the daemon's CPU per
   published 1 MiB (benchmarks/remote.py, tier.py);
9. warm restart: adoption time by entries and region size vs reading the
   index alone, the index's cost to saves (core, and two daemons on vs off),
   seconds until engines hit again, the hit rate around a kill -9
   (benchmarks/warm_restart.py);
10. the daemon's CPU per stored 1 MiB save, two worker processes saving
   through WorkerDelegate as fast as they can: Allocate and Report calls
   (the baseline) vs saves on the session stream (benchmarks/saves.py);
11. the second tier on Mooncake Store (a local mooncake_master and a store
   node): a promotion vs a raw get_into of the same bytes (and the Redis
   tier's promotion beside it), saves and hits with the tier on vs off, the
   daemon's CPU per published 1 MiB, promotion end to end through two
   daemons on Mooncake and on Redis (benchmarks/mooncake_tier.py).
`--quick` shrinks every benchmark (a couple of minutes in all) to check that
they run; its numbers are not results. This machine is noisy: ratios hold,
absolute times do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import (
    checksums,
    concurrency,
    micro,
    mooncake_tier,
    remote,
    saves,
    tier,
    warm_restart,
)
from benchmarks.tables import table

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
SECTIONS = 11


class Sizes:
    """How much each benchmark runs: the full run, or `--quick`."""

    def __init__(self, quick: bool) -> None:
        self.upstream_scale = 0.01 if quick else 1.0
        self.copy_sizes = (64 << 10, MiB, 16 * MiB) if quick else (
            64 << 10, MiB, 16 * MiB, 64 * MiB, 256 * MiB)
        self.stamp_repeat = 20 if quick else 200
        self.allocator = {"pages": 1 << 14, "operations": 20_000} if quick else {}
        self.startup = {"size": 256 * MiB, "repeat": 1} if quick else {}
        self.concurrency_seconds = 1.5 if quick else 10.0
        self.memory_entries = 50_000 if quick else 1_000_000
        self.watcher_repeat = 1 if quick else 5
        self.saves_each = 100 if quick else 500


def upstream_comparison(vllm_python: str, torchvision: str, scale: float) -> list[dict[str, Any]]:
    if not Path(vllm_python).exists():
        print(f"!! {vllm_python} missing: run `make install-vllm`; skipping the upstream table")
        return []
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), torchvision)
                                                          if p))
        subprocess.run([vllm_python, "-m", "benchmarks.scheduler_vs_upstream", "--json",
                        out.name, "--scale", str(scale)], cwd=ROOT, env=env, check=True)
        rows: list[dict[str, Any]] = json.loads(Path(out.name).read_text())
    return with_ratios(rows)


OURS_ONLY = ("msgs_per_hit", "msgs_per_step", "worker_rpcs_per_step", "heartbeats_per_s",
             "touches_per_load")


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case: ours, upstream, and ours/upstream ratios."""
    merged = {}
    for row in rows:
        key = (row["case"], row["hit_ratio"], row.get("evictions", False))
        prefix = "ours" if row["impl"] == "ec-daemon" else "upstream"
        entry = merged.setdefault(key, {"case": row["case"], "hits": row["hit_ratio"],
                                        "evict": row.get("evictions", False)})
        for name in ("blocking_rpcs_per_step", "median_us", "p99_us", "cpu_us_per_step",
                     "meta_bytes"):
            entry[f"{prefix}_{name}"] = row[name]
        if prefix == "ours":
            entry.update({name: row.get(name) for name in OURS_ONLY})
    for entry in merged.values():
        for name in ("median_us", "p99_us", "cpu_us_per_step", "meta_bytes"):
            theirs = entry.get(f"upstream_{name}")
            if theirs:
                entry[f"ratio_{name}"] = entry[f"ours_{name}"] / theirs
    return list(merged.values())


def with_floor(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mix's event lag p99 against the mix without items."""
    floor = next(r["event_lag_p99_ms"] for r in rows if r["mix"] == "no items"
                 and r["engines"] == 8)
    return [{**r, "lag_p99_vs_floor": r["event_lag_p99_ms"] / floor} for r in rows]


# ---------------------------------------------------------------- targets

Check = Callable[[dict[str, Any]], list[float]]


def _scheduler(field: str, hits: float | None = None) -> Check:
    return lambda r: [row[field] for row in r["scheduler"]
                      if row.get(field) is not None and (hits is None or row["hits"] == hits)]


def _mix(field: str, mix: str | None = None, engines: int = 8) -> Check:
    return lambda r: [row[field] for row in r["concurrency"]
                      if (mix is None or row["mix"] == mix) and row["engines"] == engines]


# (what, the worst measured value must be <= this (or >= for "min"), values)
TARGETS: list[tuple[str, str, float, Check]] = [
    ("all-hit step median, ours / upstream (every size)", "max", 1.0,
     _scheduler("ratio_median_us", hits=1.0)),
    ("blocking RPCs per step on the scheduler's thread", "max", 0,
     _scheduler("ours_blocking_rpcs_per_step")),
    ("messages queued on the session stream per hit", "max", 0, _scheduler("msgs_per_hit")),
    ("worker RPCs per step on the load path", "max", 0, _scheduler("worker_rpcs_per_step")),
    ("all-miss 32x1024 step median, ours / upstream", "max", 0.1,
     lambda r: [row["ratio_median_us"] for row in r["scheduler"]
                if row["case"] == "32x1024" and row["hits"] == 0.0 and "ratio_median_us" in row]),
    ("copy ratio to the bare pread/pwrite, entries >= 1 MiB (save and load)", "min", 0.9,
     lambda r: [row[k] for row in r["copy"] if row["bytes"] >= MiB
                for k in ("save_ratio", "load_ratio")]),
    ("allocator extents p50", "max", 1, lambda r: [r["allocator"]["extents_p50"]]),
    ("allocator extents p99", "max", 4, lambda r: [r["allocator"]["extents_p99"]]),
    ("start-up / MAP_POPULATE", "max", 1.2, lambda r: [r["startup"]["ratio"]]),
    ("event lag p99 from the producer's report, every step has items (ms)", "max", 10,
     _mix("event_lag_p99_ms", "every step")),
    ("event lag p99 from the producer's report, every mix (ms)", "max", 10,
     _mix("event_lag_p99_ms")),
    ("steps/s reached / asked, every engine of every mix, 8 engines", "min", 0.98,
     lambda r: [row["steps_per_s_min"] / row["steps_per_s_asked"] for row in r["concurrency"]
                if row["engines"] == 8]),
    ("steps/s reached / asked (mean), 16 engines, every step has items", "min", 0.99,
     _mix("steps_reached_ratio", "every step", engines=16)),
    ("event lag p99 from the producer's report, 16 engines, every step (ms)", "max", 10,
     _mix("event_lag_p99_ms", "every step", engines=16)),
    ("step p99, 8 engines (us)", "max", 2000, _mix("step_p99_us")),
    ("blocking RPCs per step, 8 engines (scheduler and load path)", "max", 0,
     lambda r: [row[k] for row in r["concurrency"]
                for k in ("blocking_rpcs_per_step", "worker_rpcs_per_step")]),
    ("failed loads, 8 engines", "max", 0, _mix("loads_failed")),
    ("one eviction round published to 200 watchers / to 1 (the loop's stall)", "max", 2.0,
     lambda r: [row["publish_ratio"] for row in r.get("watchers", [])]),
    ("promotion (verified fetch + copy) / raw GET, 1-32 MiB", "min", 0.8,
     lambda r: [row["promote_ratio"] for row in r.get("remote", [])
                if row["parser"] == "hiredis"]),
    ("saves and hits, second tier on / off", "min", 0.95,
     lambda r: [row["ratio"] for row in r.get("tier", [])]),
    ("daemon CPU per published 1 MiB, second tier (ms)", "max", 0.1,
     lambda r: [row["daemon_cpu_ms_per_mib"] for row in r.get("publish_cpu", [])]),
    ("daemon CPU per stored 1 MiB save, on the session stream (ms)", "max", 0.1,
     lambda r: [row["daemon_cpu_ms_per_save"] for row in r.get("saves", [])
                if row["path"] == "stream"]),
    ("promotion through the Mooncake tier / raw get_into, 1-32 MiB", "min", 0.9,
     lambda r: [row["promote_ratio"] for row in r.get("mooncake_promotion", [])]),
    ("saves and hits, Mooncake tier on / off", "min", 0.95,
     lambda r: [row["ratio"] for row in r.get("mooncake_saves", [])]),
    ("daemon CPU per published 1 MiB, Mooncake tier (ms)", "max", 0.1,
     lambda r: [row["daemon_cpu_ms_per_mib"] for row in r.get("mooncake_cpu", [])]),
    ("saves through the daemon, warm restart on / off", "min", 0.95,
     lambda r: [r["warm"]["daemon_saves"]["ratio"]] if "warm" in r else []),
    ("seconds from a restarted daemon's start to an engine's hit, 100k entries", "max", 1.0,
     lambda r: [r["warm"]["engines_back"]["first_hit_s"]] if "warm" in r else []),
    ("hit rate in the minute after a kill -9 / before (adopting)", "min", 0.95,
     lambda r: [row["hit_rate_after"] / row["hit_rate_before"] for row in r["warm"]["hit_rate"]
                if row["start"] == "adopting"] if "warm" in r else []),
]


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for what, kind, limit, values_of in TARGETS:
        try:
            values = values_of(results)
        except KeyError:  # its section was not run (--only)
            values = []
        if not values:
            rows.append({"target": what, "limit": limit, "measured": None, "met": "not run"})
            continue
        worst = max(values) if kind == "max" else min(values)
        met = worst <= limit if kind == "max" else worst >= limit
        rows.append({"target": what, "limit": f"{'<=' if kind == 'max' else '>='} {limit}",
                     "measured": worst, "met": "yes" if met else "NO"})
    return rows


# ------------------------------------------------------------------ main

def _sections(value: str) -> set[int]:
    """`--only`: section numbers, comma-separated, each 1-11."""
    try:
        numbers = {int(part) for part in value.split(",") if part.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of section numbers: {value!r}") from None
    if not numbers or not numbers <= set(range(1, SECTIONS + 1)):
        raise argparse.ArgumentTypeError(f"sections are 1-{SECTIONS}, got {value!r}")
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--torchvision", default=str(ROOT / ".venv-vllm" / "torchvision"))
    parser.add_argument("--skip-upstream", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="shrink every benchmark: checks they run, measures nothing")
    parser.add_argument("--only", type=_sections, default=set(range(1, SECTIONS + 1)),
                        metavar="N,N", help=f"run only these sections (1-{SECTIONS}), "
                        "e.g. --only 1,6,10")
    args = parser.parse_args()
    run = args.only.__contains__
    sizes = Sizes(args.quick)
    started = time.monotonic()
    results: dict[str, Any] = {"quick": args.quick}
    if run(1):
        print(">> 1/11 scheduler step: ECDaemonConnector vs vLLM's ECCPUScheduler", flush=True)
        results["scheduler"] = [] if args.skip_upstream else upstream_comparison(
            args.vllm_python, args.torchvision, sizes.upstream_scale)
    if run(2):
        print(">> 2/11 copy throughput, and what checksums cost a save", flush=True)
        results["copy"] = micro.copy_throughput(sizes.copy_sizes)
        results["checksums"] = checksums.measure(repeat=3 if args.quick else 20)
    if run(3):
        print(">> 3/11 stamp check", flush=True)
        results["stamps"] = micro.stamp_check(repeat=sizes.stamp_repeat)
    if run(4):
        print(">> 4/11 allocator quality", flush=True)
        results["allocator"] = micro.allocator_quality(**sizes.allocator)
    if run(5):
        print(">> 5/11 start-up", flush=True)
        results["startup"] = micro.startup(**sizes.startup)
    if run(6):
        print(f">> 6/11 eight engines at 100 steps/s (three mixes), then sixteen "
              f"({sizes.concurrency_seconds:g} s each)", flush=True)
        results["concurrency"] = with_floor(concurrency.run_all(sizes.concurrency_seconds))
    if run(7):
        print(">> 7/11 memory, and one eviction round published to 1 vs 200 watchers",
              flush=True)
        results["memory"] = micro.memory(sizes.memory_entries)
        results["watchers"] = micro.watcher_fanout(repeat=sizes.watcher_repeat)
    if run(8):
        print(">> 8/11 second tier (a local redis-server)", flush=True)
        results["remote"] = remote.measure(quick=args.quick)
        results["tier"] = tier.measure(args.quick)
        results["publish_cpu"] = tier.publish_cpu(args.quick)
        results["promotion"] = tier.promotion_latency(args.quick)
    if run(9):
        print(">> 9/11 warm restart (adoption up to 1M entries, two daemons, kill -9 around "
              "an engine: a few minutes)", flush=True)
        results["warm"] = warm_restart.measure(args.quick)
    if run(10):
        print(f">> 10/11 daemon CPU per save: 2 workers x {sizes.saves_each} saves of 1 MiB, "
              "unary calls vs the session stream", flush=True)
        results["saves"] = saves.measure(sizes.saves_each)
    if run(11):
        print(">> 11/11 second tier on Mooncake Store (a local mooncake_master and store node)",
              flush=True)
        for part, run_part in mooncake_tier.PARTS.items():
            results[f"mooncake_{part}"] = run_part(args.quick)
    results["targets"] = check_targets(results)
    results["seconds"] = time.monotonic() - started

    print()
    if args.quick:
        print("!! --quick: every benchmark shrunk; these numbers are not results\n")
    if results.get("scheduler"):
        print(table("1. scheduler step (us; ratio = ours / upstream; msgs/hit and worker "
                    "RPCs/step: ours)", results["scheduler"],
                    ["case", "hits", "evict", "ours_blocking_rpcs_per_step", "ours_median_us",
                     "upstream_median_us", "ratio_median_us", "ours_p99_us", "upstream_p99_us",
                     "ratio_p99_us", "ratio_cpu_us_per_step", "ours_meta_bytes",
                     "upstream_meta_bytes", "ratio_meta_bytes", "msgs_per_hit",
                     "worker_rpcs_per_step"]))
        print()
    if "copy" in results:
        print(table("2. copy (GB/s; ratio = cpu backend / the bare system call; vs_mapped = "
                    "cpu backend / memcpy through a mapping, the copy before issue 40)",
                    results["copy"],
                    ["bytes", "save_gbps", "pwrite_gbps", "save_ratio", "mapped_in_gbps",
                     "save_vs_mapped", "load_gbps", "pread_gbps", "load_ratio",
                     "mapped_out_gbps", "load_vs_mapped"]))
        print()
    if "checksums" in results:
        print(table("2b. checksums: a save's copy on the saver thread, and the daemon's check "
                    "of a reported mismatch (ms; ratio = with the checksum / without)",
                    results["checksums"], checksums.COLUMNS))
        print()
    if "stamps" in results:
        print(table("3. stamp check after a load, pread (us; ratio = check / copy; "
                    "mapped = the check through a mapping, before)", results["stamps"],
                    ["entry_bytes", "pages", "extents", "check_us", "copy_us", "ratio",
                     "mapped_check_us"]))
        print()
    if "concurrency" in results:
        print(table("6. 8 and 16 engines at 100 steps/s (floor = the `no items` mix)",
                    results["concurrency"],
                    ["engines", "mix", "steps_per_s_asked", "steps_per_s_each",
                     "steps_per_s_min", "loads_per_s_host", "hit_ratio", "step_p50_us",
                     "step_p99_us",
                     "blocking_rpcs_per_step", "worker_rpcs_per_step", "msgs_per_step",
                     "event_lag_p50_ms", "event_lag_p99_ms", "lag_p99_vs_floor",
                     "lag_after_reply_p99_ms", "fanout_spread_p99_ms", "daemon_cpu_percent",
                     "host_cpu_busy_percent"]))
        print()
    if "remote" in results:
        print(table("8a. second tier: raw GET vs verified fetch, and fetch + copy into the "
                    "region (GB/s; ratio = GET time / ours)", results["remote"],
                    ["parser", "MiB", "get_gbps", "fetch_gbps", "fetch_ratio", "promote_gbps",
                     "promote_ratio"]))
        print()
    if "tier" in results:
        print(table("8b. second tier on vs off, same host (ratio = on / off)",
                    results["tier"],
                    ["what", "off", "on", "ratio"]))
        print()
    if "publish_cpu" in results:
        print(table("8b. the daemon's CPU per published 1 MiB (ms; on / off: per save, with "
                    "the tier / without; daemon: the difference; publisher: its thread alone)",
                    results["publish_cpu"], ["off_ms_per_save", "on_ms_per_save",
                                             "daemon_cpu_ms_per_mib",
                                             "publisher_cpu_ms_per_mib", "published"]))
        print()
    if "promotion" in results:
        print(table("8c. promotion end to end: a miss deferred until the entry is ready "
                    "(best)", results["promotion"], ["MiB", "promote_ms", "promote_gbps"]))
        print()
    if "warm" in results:
        warm = results["warm"]
        print(table("9a. adoption of a crashed region (ms; ratio = adoption in all / reading "
                    "the index alone)", warm["adoption"],
                    ["entries", "region_GiB", "index_MiB", "read_index_ms", "adopt_ms",
                     "restore_ms", "total_ms", "ratio_to_read"]))
        print()
        print(table("9b. the index's cost to saves (ratio = on / off)",
                    [{"what": "saves/s on the cache core (with evictions)",
                      "off": warm["index_cost"]["off_saves_per_s"],
                      "on": warm["index_cost"]["on_saves_per_s"],
                      "ratio": warm["index_cost"]["ratio"]}, warm["daemon_saves"]],
                    ["what", "off", "on", "ratio"]))
        print()
        print(table("9c. a kill -9 around an engine (hit rates; first_hit_s from the kill)",
                    warm["hit_rate"], ["start", "hit_rate_before", "hit_rate_first_s",
                                       "hit_rate_after", "first_hit_s", "curve_first_5s"]))
        print()
        print(table("9d. engines back: a daemon started on a crashed region",
                    [warm["engines_back"]], list(warm["engines_back"])))
        print()
    if "saves" in results:
        print(table("10. daemon CPU per stored 1 MiB save, 2 worker processes as fast as they "
                    "can (ratio = vs unary calls; msgs = stream messages sent per save)",
                    results["saves"], saves.COLUMNS))
        print()
    for part in mooncake_tier.PARTS:
        if f"mooncake_{part}" in results:
            print(table(mooncake_tier.TITLES[part], results[f"mooncake_{part}"],
                        mooncake_tier.COLUMNS[part]))
            print()
    for number, name in ((4, "allocator"), (5, "startup"), (7, "memory")):
        if name not in results:
            continue
        print(table(f"{number}. {name}", [results[name]], list(results[name])))
        print()
    if "watchers" in results:
        print(table("7b. one eviction round of 16,384 entries published to watchers that "
                    "read nothing meanwhile (ms, on the daemon's loop; ratio = vs 1 watcher), "
                    "and the time for all of them to take their events afterwards",
                    results["watchers"],
                    ["watchers", "entries", "publish_ms", "publish_ratio", "take_all_ms"]))
        print()
    print(table("targets", results["targets"], ["target", "limit", "measured", "met"]))
    print()
    out = ROOT / "results" / (f"bench-{'quick-' if args.quick else ''}"
                              f"{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"written to {out} in {results['seconds']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
