"""`make bench`: every benchmark, each with its baseline run in the same
process tree, printed as tables and written to results/bench-<time>.json.

1. scheduler step cost of ECDaemonConnector vs vLLM's ECCPUScheduler
   (in the vLLM venv: benchmarks/scheduler_vs_upstream.py);
2. cpu copy backend vs numpy copies; 3. allocator extents under churn;
4. start-up vs a MAP_POPULATE mmap; 5. eight engines at 100 steps/s;
6. daemon bookkeeping memory with 1M entries.
This machine is noisy: ratios hold, absolute times do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import concurrency, micro

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {
    "copy_ratio_min (>= 1 MiB)": 0.9, "extents_p50": 1, "extents_p99": 4,
    "startup_ratio": 1.2, "step_p99_us (8 engines)": 2000, "event_lag_p99_ms": 10,
}


def table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = [title, "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(columns, widths, strict=True))
              for r in rows]
    return "\n".join(lines)


def upstream_comparison(vllm_python: str, torchvision: str) -> list[dict[str, Any]]:
    if not Path(vllm_python).exists():
        print(f"!! {vllm_python} missing: run `make install-vllm`; skipping the upstream table")
        return []
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), torchvision)
                                                          if p))
        subprocess.run([vllm_python, "-m", "benchmarks.scheduler_vs_upstream", "--json",
                        out.name], cwd=ROOT, env=env, check=True)
        rows: list[dict[str, Any]] = json.loads(Path(out.name).read_text())
    return with_ratios(rows)


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
    for entry in merged.values():
        for name in ("median_us", "p99_us", "cpu_us_per_step", "meta_bytes"):
            theirs = entry.get(f"upstream_{name}")
            if theirs:
                entry[f"ratio_{name}"] = entry[f"ours_{name}"] / theirs
    return list(merged.values())


def with_floor(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mix's event lag p99 against the mix without items."""
    floor = next(r["event_lag_p99_ms"] for r in rows if r["mix"] == "no items")
    return [{**r, "lag_p99_vs_floor": r["event_lag_p99_ms"] / floor} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--torchvision", default=str(ROOT / ".venv-vllm" / "torchvision"))
    parser.add_argument("--skip-upstream", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    results: dict[str, Any] = {}
    print(">> 1/6 scheduler step: ECDaemonConnector vs vLLM's ECCPUScheduler", flush=True)
    results["scheduler"] = [] if args.skip_upstream else upstream_comparison(
        args.vllm_python, args.torchvision)
    print(">> 2/6 copy throughput", flush=True)
    results["copy"] = micro.copy_throughput()
    print(">> 3/6 allocator quality", flush=True)
    results["allocator"] = micro.allocator_quality()
    print(">> 4/6 start-up", flush=True)
    results["startup"] = micro.startup()
    print(">> 5/6 eight engines at 100 steps/s (three mixes, 10 s each)", flush=True)
    results["concurrency"] = with_floor(concurrency.run_all())
    print(">> 6/6 memory with 1M entries", flush=True)
    results["memory"] = micro.memory()
    results["seconds"] = time.monotonic() - started

    print()
    if results["scheduler"]:
        print(table("1. scheduler step (us; ratio = ours / upstream)", results["scheduler"],
                    ["case", "hits", "evict", "ours_blocking_rpcs_per_step", "ours_median_us",
                     "upstream_median_us", "ratio_median_us", "ours_p99_us", "upstream_p99_us",
                     "ratio_p99_us", "ratio_cpu_us_per_step", "ours_meta_bytes",
                     "upstream_meta_bytes", "ratio_meta_bytes"]))
        print()
    print(table("2. copy (GB/s; ratio = cpu backend / numpy)", results["copy"],
                ["bytes", "save_gbps", "numpy_in_gbps", "save_ratio", "load_gbps",
                 "numpy_out_gbps", "load_ratio"]))
    print()
    print(table("5. eight engines at 100 steps/s (floor = the `no items` mix)",
                results["concurrency"],
                ["mix", "steps_per_s_each", "loads_per_s_host", "step_p50_us", "step_p99_us",
                 "blocking_rpcs_per_step", "event_lag_p50_ms", "event_lag_p99_ms",
                 "lag_p99_vs_floor", "lag_after_reply_p99_ms", "fanout_spread_p99_ms",
                 "daemon_cpu_percent", "host_cpu_busy_percent"]))
    print()
    for name in ("allocator", "startup", "memory"):
        print(table(f"{name}", [results[name]], list(results[name])))
        print()
    out = ROOT / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"targets: {TARGETS}")
    print(f"written to {out} in {results['seconds']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
