"""Summaries, tables and figures of `make bench-serve` (benchmarks/serve.py).

Steady state after an event (a restart, a move), per mode: the mode's steady
TTFT is the mean TTFT of its repeat requests in the second half of the phase
before the event (the first requests of a stream find its images new on
every engine: their repeats are still being encoded somewhere). After the
event, the affected requests are the non-cold ones of the affected engines
(a cold request costs an encode in every mode and says nothing about
recovery), in send order. The mode is back in its steady state at the first
run of `WINDOW` consecutive affected requests whose mean TTFT is within
`STEADY_FACTOR` times its steady TTFT; `recovery_requests` counts the
affected requests sent before that run (0: it never left its steady state;
None: not within the run).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.serve_stream import Outcome

WINDOW = 3
STEADY_FACTOR = 1.2
MS_TICKS = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
RATIO_FIELDS = ("ttft_mean_ms", "ttft_p90_ms", "cold_ttft_mean_ms", "repeat_ttft_mean_ms",
                "requests_per_s")


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summarise(mode: str, outcomes: list[Outcome], counters: dict[str, Any],
              zero: tuple[float, float] | None = None) -> dict[str, Any]:
    """TTFT over all requests of a workload and by kind, throughput, the
    encoder and cache counters of the workload (`counters`), and every
    request (`requests_detail`; with `zero`, the times phases 0 and 1 count
    from, each request's send time `t_s`)."""
    done = [o for o in outcomes if o.ok]
    if not done:
        errors = [o.error for o in outcomes if o.error]
        raise RuntimeError(f"{mode}: no request completed; first errors: {errors[:3]}")
    ttfts = [o.ttft_ms for o in done]
    span = 0.0  # the phases' spans: an event's downtime is no serving time
    for phase in {o.request.phase for o in done}:
        of_phase = [o for o in done if o.request.phase == phase]
        span += max(o.sent + o.latency_ms / 1000 for o in of_phase) - min(
            o.sent for o in of_phase)
    row: dict[str, Any] = {
        "mode": mode, "requests": len(done), "failed": len(outcomes) - len(done),
        "ttft_mean_ms": statistics.fmean(ttfts), "ttft_p50_ms": _percentile(ttfts, 50),
        "ttft_p90_ms": _percentile(ttfts, 90), "ttft_p99_ms": _percentile(ttfts, 99),
        "requests_per_s": len(done) / span}
    for kind in ("cold", "repeat", "moved"):
        of_kind = [o.ttft_ms for o in done if o.request.kind == kind]
        if of_kind:
            row[f"{kind}_requests"] = len(of_kind)
            row[f"{kind}_ttft_mean_ms"] = statistics.fmean(of_kind)
    forwards = counters.get("encoder_forwards")
    if forwards is not None:
        row["encoder_forwards"] = forwards
        row["forwards_per_request"] = forwards / len(outcomes)
        row["encodes_avoided"] = 1 - forwards / len(outcomes)
    row.update({k: v for k, v in counters.items() if k != "encoder_forwards"})
    hits, misses = row.get("daemon_hits"), row.get("daemon_misses")
    if hits is not None and misses is not None and hits + misses:
        row["daemon_hit_rate"] = hits / (hits + misses)
    row["requests_detail"] = [o.row(zero[o.request.phase] if zero else None) for o in outcomes]
    return row


def recovery(requests: list[dict[str, Any]], affected_engines: set[int]) -> dict[str, Any]:
    """The steady TTFT before the event and the requests it took after it
    to return to it (see the module's docstring), from the workload's
    `requests_detail` rows."""
    before = [r for r in requests if r["phase"] == 0]
    late = before[len(before) // 2:]
    steady = _mean([r["ttft_ms"] for r in late if r["ok"] and r["kind"] == "repeat"])
    after = [r["ttft_ms"] for r in requests
             if r["phase"] == 1 and r["engine"] in affected_engines and r["kind"] != "cold"]
    result: dict[str, Any] = {"steady_ttft_ms": steady, "affected_after": len(after),
                              "recovery_requests": None}
    if after:
        result["first_after_ttft_ms"] = after[0]
        result["after_ttft_mean_ms"] = statistics.fmean(after)
    if steady is None:
        return result
    for start in range(len(after) - WINDOW + 1):
        if statistics.fmean(after[start:start + WINDOW]) <= STEADY_FACTOR * steady:
            result["recovery_requests"] = start
            break
    return result


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's fields as ratios to the same run's "none" and "example"
    rows, and how many requests generated other text than with "none" (on
    the same images: not the second tier's run of (d))."""
    base = {r["mode"]: r for r in rows}
    for row in rows:
        mine, theirs = row["requests_detail"], base.get("none", {}).get("requests_detail")
        if theirs and [r["image"] for r in mine] == [r["image"] for r in theirs]:
            row["outputs_unlike_none"] = sum(
                a["text"] != b["text"] for a, b in zip(mine, theirs, strict=True))
        for ref in ("none", "example"):
            if ref not in base or ref == row["mode"]:
                continue
            for field in RATIO_FIELDS:
                if row.get(field) and base[ref].get(field):
                    row[f"{field}_vs_{ref}"] = row[field] / base[ref][field]
    return rows


TABLE = ["mode", "requests", "failed", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms",
         "ttft_p99_ms", "requests_per_s", "cold_ttft_mean_ms", "repeat_ttft_mean_ms",
         "moved_ttft_mean_ms", "ttft_mean_ms_vs_none", "cold_ttft_mean_ms_vs_none",
         "repeat_ttft_mean_ms_vs_none", "ttft_mean_ms_vs_example", "forwards_per_request",
         "daemon_hits", "daemon_misses", "daemon_saves", "promotions", "recovery_requests",
         "pd_ttfb_mean_ms", "pd_ttfb_p50_ms", "pd_media_kib_per_request",
         "pd_preprocess_ms_per_request", "pd_metadata_only_items",
         "pd_encoder_forwards", "outputs_unlike_none"]


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    columns = [c for c in TABLE if any(c in r for r in rows)]
    print(title)
    print("  ".join(columns))
    for row in rows:
        print("  ".join(f"{row[c]:.3g}" if isinstance(row.get(c), float)
                        else str(row.get(c, "-")) for c in columns))


def figures(results: dict[str, Any], folder: Path) -> list[Path]:
    """TTFT distributions of workload (a) (CDFs, one panel per rate) and
    TTFT over time across the event of (b), (c) and (d); PNGs in `folder`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    rates = [w for w in results["workloads"] if w["workload"] == "a"]
    if rates:
        fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 3.6), squeeze=False)
        for ax, workload in zip(axes[0], rates, strict=True):
            _cdf(ax, workload)
        fig.tight_layout()
        paths.append(folder / "serve-ttft-cdf.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    events = [w for w in results["workloads"] if w["workload"] in ("b", "c", "d")]
    if events:
        fig, axes = plt.subplots(len(events), 1, figsize=(8, 3.2 * len(events)), squeeze=False)
        for ax, workload in zip(axes[:, 0], events, strict=True):
            _over_time(ax, workload)
        fig.tight_layout()
        paths.append(folder / "serve-ttft-over-time.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def _ms_ticks(axis: Any) -> None:
    """Plain millisecond labels on a log axis (no 2x10^1 and no crowding)."""
    from matplotlib.ticker import FixedLocator, NullFormatter, StrMethodFormatter

    axis.set_major_locator(FixedLocator(MS_TICKS))
    axis.set_major_formatter(StrMethodFormatter("{x:g}"))
    axis.set_minor_formatter(NullFormatter())


def _cdf(ax: Any, workload: dict[str, Any]) -> None:
    for row in workload["modes"]:
        ttfts = sorted(r["ttft_ms"] for r in row["requests_detail"] if r["ok"])
        ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post",
                label=row["mode"])
    ax.set(title=f"(a) {workload['rate']:g} req/s, {workload['requests']} requests",
           xlabel="TTFT (ms)", ylabel="fraction of requests", xscale="log")
    _ms_ticks(ax.xaxis)
    ax.grid(alpha=0.3)
    ax.legend()


def _over_time(ax: Any, workload: dict[str, Any]) -> None:
    engines = set(workload["affected_engines"]) | set(workload.get("before_engines", []))
    for row in workload["modes"]:
        points = [r for r in row["requests_detail"] if r["ok"] and r["engine"] in engines]
        line = ax.plot([r["t_s"] for r in points], [r["ttft_ms"] for r in points],
                       marker="o", markersize=3, linewidth=1, label=row["mode"])[0]
        cold = [r for r in points if r["kind"] == "cold"]
        ax.plot([r["t_s"] for r in cold], [r["ttft_ms"] for r in cold], linestyle="none",
                marker="o", markersize=7, markerfacecolor="none", color=line.get_color())
    ax.axvline(0, color="grey", linestyle="--", linewidth=1)
    ax.set(title=workload["title"] + " (circled: cold requests)",
           xlabel=f"send time after the {workload['event']} (s; its downtime left out)",
           ylabel="TTFT (ms)", yscale="log")
    _ms_ticks(ax.yaxis)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
