"""The report of `make gpu-check` (benchmarks/gpu_check.py): the issue's
targets first, then the GPU tests by backend, the copy benchmark against
cudaMemcpyAsync from pinned memory, the compute stream during loads, and
the daemon at 8 and 16 engines. Standard library only: it runs before the
carried wheels are installed, and in CI's dry run on a fake result set.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# The targets: save and load against cudaMemcpyAsync of the same bytes from
# pinned memory (the copy engine is the same; what the path adds is
# bookkeeping), contiguous and fragmented, by benchmarks/gpu.py's case names.
RATIO_MIN = {"1 MiB": 0.85, "8 MiB": 0.95, "64 MiB": 0.95, "8 MiB fragmented": 0.95,
             "64 MiB fragmented": 0.95}
HOST_SYNCS_MAX = 0.0
LAG_P99_MAX_MS = 10.0
TARGET_CASES = tuple(RATIO_MIN)
# The target rows: (label, cases) with one bound each.
RATIO_GROUPS = (("1 MiB", ("1 MiB",)),
                ("8 and 64 MiB, contiguous and fragmented",
                 ("8 MiB", "64 MiB", "8 MiB fragmented", "64 MiB fragmented")))
BACKENDS = ("torch", "cupy")


def junit_summary(path: Path) -> dict[str, Any]:
    """Passed, failed, skipped per backend and the failures' first lines."""
    root = ET.parse(path).getroot()
    backends = {b: {"passed": 0, "failed": 0, "skipped": 0} for b in BACKENDS}
    failures = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        backend = "cupy" if "cupy" in name else "torch"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            backends[backend]["failed"] += 1
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append({"test": name, "message": message[0][:300] if message else ""})
        elif case.find("skipped") is not None:
            backends[backend]["skipped"] += 1
        else:
            backends[backend]["passed"] += 1
    return {"backends": backends, "failures": failures}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its worst measured value and whether it was met
    (None: not measured in this run)."""
    rows = []
    bench = results.get("gpu_bench") or {}
    parts = {p["backend"]: p for p in bench.get("backends", [])}
    for backend in BACKENDS:
        for label, cases in RATIO_GROUPS:
            bound = RATIO_MIN[cases[0]]
            measured = [(min(r["save_ratio"], r["load_ratio"]), r["case"],
                         "save" if r["save_ratio"] <= r["load_ratio"] else "load")
                        for r in parts.get(backend, {}).get("rows", []) if r["case"] in cases]
            worst = min(measured, default=None)
            rows.append(_target(f"save and load, {label}, {backend}, vs cudaMemcpyAsync from "
                                "pinned memory", f">= {bound}x",
                                None if worst is None else worst[0],
                                None if worst is None else f"{worst[2]} of {worst[1]}",
                                lambda v, bound=bound: v >= bound))
    syncs = [(p["compute_stream"]["host_syncs_per_load"], p["backend"])
             for p in parts.values() if "compute_stream" in p]
    worst_sync = max(syncs, default=None)
    rows.append(_target("host synchronisations of the compute stream per load", "0",
                        None if worst_sync is None else worst_sync[0],
                        None if worst_sync is None else worst_sync[1],
                        lambda v: v <= HOST_SYNCS_MAX))
    lag = [r["event_lag_p99_ms"] for r in results.get("daemon_bench") or []
           if r["engines"] == 8 and r["mix"] == "every step"]
    rows.append(_target("8 engines, every step with items, 16 cores: event lag p99",
                        f"<= {LAG_P99_MAX_MS:g} ms", lag[0] if lag else None, None,
                        lambda v: v <= LAG_P99_MAX_MS))
    return rows


def _target(figure: str, target: str, value: float | None, where: str | None,
            ok: Any) -> dict[str, Any]:
    return {"figure": figure, "target": target, "value": value, "where": where,
            "met": None if value is None else bool(ok(value))}


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines


def markdown(results: dict[str, Any]) -> str:
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    title = "GPU check" + (" (dry run: no GPU, nothing measured)" if results.get("dry_run")
                           else "")
    lines = [f"# {title}", "", f"Started {results.get('started', '?')}, "
             f"{_fmt(results.get('seconds'), 0)} s in all.", "", "## Targets", ""]
    lines += _table(["figure", "target", "measured", "where", "verdict"],
                    [[t["figure"], t["target"], t["value"], t["where"], verdict[t["met"]]]
                     for t in results.get("targets", [])])
    lines += ["", "## Phases", ""]
    lines += _table(["phase", "status", "seconds", "log"],
                    [[p["name"], p["status"], p["seconds"], p.get("log")]
                     for p in results.get("phases", [])])
    lines += ["", "## Environment", ""]
    lines += _table(["what", "value"], [[k, v] for k, v in
                                         (results.get("environment") or {}).items()])
    tests = results.get("tests") or {}
    lines += ["", "## GPU tests (tests/gpu)", ""]
    if not tests:
        lines.append("No results: see the tests phase's log.")
    if "collected" in tests:
        lines.append(f"Collected {tests['collected']} tests (collection only).")
    if "backends" in tests:
        lines += _table(["backend", "passed", "failed", "skipped"],
                        [[b, c["passed"], c["failed"], c["skipped"]]
                         for b, c in tests["backends"].items()])
        for failure in tests.get("failures", []):
            lines.append(f"- FAILED `{failure['test']}`: {failure['message']}")
    lines += _gpu_bench(results.get("gpu_bench"))
    lines += _daemon_bench(results.get("daemon_bench"))
    return "\n".join(lines) + "\n"


def _gpu_bench(bench: dict[str, Any] | None) -> list[str]:
    lines = ["", "## Copy backends against cudaMemcpyAsync from pinned memory", ""]
    if not bench:
        return [*lines, "Not measured."]
    lines += [f"{bench['device']}, a region of {bench['region_bytes'] >> 20} MiB in /dev/shm. "
              "Ratios: memcpy's time over the backend's (1.0: as fast).", ""]
    rows = []
    for part in bench["backends"]:
        for r in part.get("rows", []):
            rows.append([r["case"], part["backend"], r["save_gbps"], r["memcpy_d2h_gbps"],
                         r["save_ratio"], r["load_gbps"], r["memcpy_h2d_gbps"],
                         r["load_ratio"], r["bit_exact"]])
    lines += _table(["entry", "backend", "save GB/s", "memcpy D2H GB/s", "save ratio",
                     "load GB/s", "memcpy H2D GB/s", "load ratio", "bit-exact"], rows)
    lines += ["", "Per backend: registration, the compute stream during loads "
              "(a sleep-kernel chain with one load after each kernel):", ""]
    lines += _table(["backend", "registered in s", "pinned", "batched copies",
                     "host syncs per load", "compute idle ms per load", "stats", "error"],
                    [[p["backend"], p.get("register_s"), p.get("pinned"), p.get("batch"),
                      p.get("compute_stream", {}).get("host_syncs_per_load"),
                      p.get("compute_stream", {}).get("idle_ms_per_load"),
                      p.get("stats"), p.get("error")] for p in bench["backends"]])
    return lines


def _daemon_bench(rows: list[dict[str, Any]] | None) -> list[str]:
    lines = ["", "## The daemon at scale (benchmarks/concurrency.py)", ""]
    if not rows:
        return [*lines, "Not measured."]
    fields = ["engines", "mix", "event_lag_p50_ms", "event_lag_p99_ms",
              "lag_after_reply_p99_ms", "steps_per_s_min", "loads_per_s_host", "loads_failed",
              "hit_ratio", "daemon_cpu_percent", "host_cpu_busy_percent"]
    return lines + _table(fields, [[r.get(f) for f in fields] for r in rows])


def check_markdown(text: str, results: dict[str, Any]) -> list[str]:
    """What a rendered report lacks: a target row, a measured ratio; empty if complete."""
    missing = [t["figure"] for t in results["targets"] if t["figure"] not in text]
    missing += [f"{r['case']} ({p['backend']})" for p in
                (results.get("gpu_bench") or {}).get("backends", []) for r in p.get("rows", [])
                if not re.search(rf"\| {re.escape(r['case'])} \| {p['backend']} \|", text)]
    return missing


def fake_results() -> dict[str, Any]:
    """A complete result set in the shapes the phases produce (CI's dry run
    renders it: the report writer cannot rot without a GPU)."""
    rows = [{"case": case, "backend": b, "bytes": 1 << 20, "extents": 1, "bit_exact": True,
             "save_gbps": 40.0, "load_gbps": 45.0, "memcpy_d2h_gbps": 44.0,
             "memcpy_h2d_gbps": 50.0, "save_ratio": 0.9, "load_ratio": 0.9}
            for b in BACKENDS for case in (*TARGET_CASES, "64 MiB across the 1 GiB chunk")]
    for row in rows:
        row["save_ratio"] = row["load_ratio"] = 0.97
    results: dict[str, Any] = {
        "started": "2026-01-01T00:00:00Z", "seconds": 300.0, "dry_run": False,
        "environment": {"python": "3.12.3", "torch": "2.11.0+cu130"},
        "phases": [{"name": "tests", "status": "ok", "seconds": 100.0, "log": "gpu-tests.log"}],
        "tests": {"backends": {b: {"passed": 20, "failed": 0, "skipped": 0} for b in BACKENDS},
                  "failures": []},
        "gpu_bench": {"device": "NVIDIA H200", "region_bytes": 1 << 30, "backends": [
            {"backend": b, "register_s": 0.1, "pinned": True, "batch": b == "torch", "stats": {},
             "rows": [r for r in rows if r["backend"] == b],
             "compute_stream": {"case": "8 MiB", "loads": 20, "kernel_ms": 20.0,
                                "host_syncs": 0, "host_syncs_per_load": 0.0,
                                "idle_ms_per_load": 0.01}} for b in BACKENDS]},
        "daemon_bench": [{"engines": n, "mix": "every step", "event_lag_p50_ms": 2.0,
                          "event_lag_p99_ms": 8.0, "lag_after_reply_p99_ms": 7.0,
                          "steps_per_s_min": 99.0, "loads_per_s_host": 2400.0 * n / 8,
                          "loads_failed": 0, "hit_ratio": 0.75, "daemon_cpu_percent": 40.0,
                          "host_cpu_busy_percent": 30.0} for n in (8, 16)],
    }
    results["targets"] = targets(results)
    return results
