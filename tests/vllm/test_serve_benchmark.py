"""`make bench-serve` runs: real `vllm serve` engines under vLLM's own client,
every workload in its `--quick` form (too small to measure anything, but
every event must really happen). The run is ec-daemon's mode, the one that
takes part in every workload and event: each mode costs two engine starts
and a restart, minutes on a small machine (and (e) two more, an E/PD
pair). How the modes compare (streams, kinds, ratios, steady state) is
checked on made-up outcomes below."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import serve_metadata
from benchmarks.serve_epd import sweep_streams
from benchmarks.serve_report import recovery, summarise, with_ratios
from benchmarks.serve_stream import MOVE, ROUND_ROBIN, Outcome, Request, make_stream
from tests import groups

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1500)
@groups.needs_redis  # workload d
def test_the_serving_benchmark_runs_every_workload_and_every_event_happens(tmp_path):
    docs = {p: p.stat().st_mtime_ns for p in (ROOT / "docs").glob("serve-*.png")}
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--quick", "--modes",
                          "ec-daemon", "--json", str(out)],
                         cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                         timeout=1400)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(out.read_text())
    workloads = {w["key"]: w for w in result["workloads"]}
    assert sorted(workloads) == ["a@1", "a@2", "b", "c", "d", "e", "e-meta", "f@20", "f@50",
                                 "f@80"]

    # (e)'s metadata-only part runs its own modes on a tiny Qwen2-VL whatever --modes says:
    # one engine, and E/PD through vLLM's proxy with and without its rewrite.
    meta = {row["mode"]: row for row in workloads.pop("e-meta")["modes"]}
    assert set(meta) == set(serve_metadata.MODES)
    for mode, row in meta.items():
        assert row["failed"] == 0 and all(r["ok"] for r in row["requests_detail"]), mode
    assert meta["rewrite"]["pd_media_kib_per_request"] == 0  # PD got no media at all
    assert meta["no-rewrite"]["pd_media_kib_per_request"] > 0
    assert meta["rewrite"]["pd_encoder_forwards"] == 0 == meta["no-rewrite"]["pd_encoder_forwards"]

    for key, workload in workloads.items():
        rows = {row["mode"]: row for row in workload["modes"]}
        assert set(rows) == ({"ec-daemon", "ec-daemon-tier"} if key == "d" else {"ec-daemon"})
        for mode, row in rows.items():
            assert row["requests"] == workload["requests"] and row["failed"] == 0, (key, mode)
            assert all(r["ok"] for r in row["requests_detail"]), (key, mode)
            assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
            assert row["cold_requests"] >= 1 and "cold_ttft_mean_ms" in row
            assert row["encoder_forwards"] >= 1  # the first cold image at least
            if workload["event"]:
                assert {r["phase"] for r in row["requests_detail"]} == {0, 1}
                assert all((r["t_s"] < 0) == (r["phase"] == 0) for r in row["requests_detail"])
        assert rows["ec-daemon"]["daemon_saves"] > 0, key  # the engines saved into the daemon

    engine_restart = {r["mode"]: r for r in workloads["b"]["modes"]}["ec-daemon"]
    old, new = engine_restart["restarted_pid"]
    assert engine_restart["restarted"] and old != new
    assert engine_restart["event_s"] > 1  # a vllm serve start, however fast

    daemon_restart = {r["mode"]: r for r in workloads["c"]["modes"]}["ec-daemon"]
    assert daemon_restart["restarted"]
    # warm: the next daemon adopted the region its predecessor left
    assert daemon_restart["adopted_entries"] > 0, daemon_restart["adoption"]

    # (e) E/PD: the encoder instance encoded, the PD engine loaded every image
    epd = {r["mode"]: r for r in workloads["e"]["modes"]}["ec-daemon"]
    assert epd["topology"] == "E/PD" and epd["proxy_encoder_failed"] == 0
    assert epd["encoder_instance_forwards"] >= 1 and epd["pd_encoder_forwards"] == 0
    assert epd["daemon_loads"] >= 1

    # (f) the sweep: each level's reuse, and its shares measured
    for level in (20, 50, 80):
        sweep = workloads[f"f@{level}"]
        assert sweep["reuse"] == level / 100
        row = sweep["modes"][0]
        assert row["at_once_images"] >= 1 and row["at_once_forwards"] >= 1
        assert row["cross_engine_hit_rate"] is None or 0 <= row["cross_engine_hit_rate"] <= 1
        assert 0 <= row["at_once_encodes_avoided"] <= 1

    move = {r["mode"]: r for r in workloads["d"]["modes"]}
    assert workloads["d"]["kinds"].get("moved", 0) > 0
    assert move["ec-daemon-tier"]["promotions"] > 0  # host 2 fetched what host 1 encoded
    assert move["ec-daemon"]["promotions"] == 0

    folder = Path(result["folder"])
    assert (folder / "serve-ttft-cdf.png").stat().st_size > 0
    assert (folder / "serve-ttft-over-time.png").stat().st_size > 0
    assert (folder / "serve-epd-reuse.png").stat().st_size > 0
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "docs").glob("serve-*.png")} == docs


def test_a_stream_knows_its_cold_moved_and_repeat_requests():
    images = [Path(f"image-{i}.png") for i in range(4)]
    stream = make_stream(images, 20, 2.0, 0.8, seed=3, route=ROUND_ROBIN, phases=2)
    assert [r.engine for r in stream] == [i % 2 for i in range(20)]
    assert [r.phase for r in stream] == [0] * 10 + [1] * 10
    first = {}
    for request in stream:
        first.setdefault(request.image, request.index)
        assert request.kind == ("cold" if first[request.image] == request.index else "repeat")
    assert stream[0].send_s == stream[10].send_s == 0.0  # each phase counts from its start

    moved = make_stream(images, 20, 2.0, 0.8, seed=3, route=MOVE, phases=2)
    assert [r.engine for r in moved] == [0] * 10 + [1] * 10
    shown: dict[int, set[Path]] = {0: set(), 1: set()}  # each engine a host of its own
    for request in moved:
        mine, theirs = shown[request.engine], shown[1 - request.engine]
        assert request.kind == ("repeat" if request.image in mine
                                else "moved" if request.image in theirs else "cold")
        mine.add(request.image)
    assert any(r.kind == "moved" for r in moved)


def outcomes(ttfts: list[float], kinds: list[str], half: int | None = None) -> list[Outcome]:
    """Requests alternating engines, one a second; phase 1 from `half`."""
    return [Outcome(Request(i, Path(f"image-{i}.png"), i % 2, int(half is not None and i >= half),
                            float(i), kind),
                    ok=True, ttft_ms=ttft, latency_ms=ttft + 10, sent=float(i), text=f"t{i % 3}",
                    error="")
            for i, (ttft, kind) in enumerate(zip(ttfts, kinds, strict=True))]


def test_the_sweep_sends_each_new_image_of_its_second_phase_to_both_engines_at_once(tmp_path):
    stream = sweep_streams(tmp_path, 0.5, 10, 5, 3, 1.0, seed=1, image_size=8)
    first, twins = stream[:10], stream[10:]
    assert {r.phase for r in first} == {0} and {r.phase for r in twins} == {1}
    assert [r.engine for r in first] == [i % 2 for i in range(10)]
    assert len({r.image for r in first}) <= 5
    assert len(twins) == 6 and not {r.image for r in twins} & {r.image for r in first}
    for a, b in zip(twins[::2], twins[1::2], strict=True):
        assert a.image == b.image and a.send_s == b.send_s and {a.engine, b.engine} == {0, 1}
    assert len({r.image for r in twins}) == 3
    assert [r.index for r in stream] == list(range(16))


def test_steady_state_after_an_event_is_a_window_of_three_within_1_2x():
    # Before: 8 requests, the steady TTFT from the repeats of the last four
    # (100 ms; the first ones, 900, still wait for encodes). After (engine 0
    # only): 900, 700, 130, 110, 100.
    ttfts = [500, 900, 900, 900, 100, 100, 100, 100,
             900, 50, 700, 50, 130, 50, 110, 50, 100, 50]
    kinds = ["cold"] + ["repeat"] * 17
    rows = summarise("m", outcomes(ttfts, kinds, half=8), {}, (0.0, 0.0))["requests_detail"]
    result = recovery(rows, {0})
    assert result["steady_ttft_ms"] == 100
    assert result["affected_after"] == 5
    assert result["recovery_requests"] == 2  # 130, 110, 100: mean 113 <= 120
    assert recovery(rows[:12], {0})["recovery_requests"] is None  # not within the run


def test_ratios_compare_modes_on_the_same_requests():
    kinds = ["cold", "repeat", "repeat", "cold"]
    rows = [summarise("none", outcomes([400, 200, 200, 400], kinds), {"encoder_forwards": 4}),
            summarise("example", outcomes([400, 100, 100, 400], kinds), {"encoder_forwards": 2}),
            summarise("ec-daemon", outcomes([420, 50, 50, 420], kinds),
                      {"encoder_forwards": 2, "daemon_hits": 2, "daemon_misses": 2})]
    rows = {r["mode"]: r for r in with_ratios(rows)}
    daemon = rows["ec-daemon"]
    assert daemon["cold_ttft_mean_ms_vs_none"] == pytest.approx(1.05)
    assert daemon["repeat_ttft_mean_ms_vs_none"] == pytest.approx(0.25)
    assert daemon["repeat_ttft_mean_ms_vs_example"] == pytest.approx(0.5)
    assert daemon["forwards_per_request"] == 0.5 and daemon["daemon_hit_rate"] == 0.5
    assert daemon["outputs_unlike_none"] == 0
    assert "ttft_mean_ms_vs_none" not in rows["none"]
