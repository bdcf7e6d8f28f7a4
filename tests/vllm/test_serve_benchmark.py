"""`make bench-serve` runs: real `vllm serve` engines, vLLM's own client, the
three modes, in its `--quick` form (too small to measure anything)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1200)


def test_the_serving_benchmark_runs_every_mode_and_every_request_completes(tmp_path):
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--quick", "--json", str(out)],
                         cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                         timeout=1100)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = {row["mode"]: row for row in result["workload_a"]}
    assert sorted(rows) == ["ec-daemon", "example", "none"]
    for row in rows.values():
        assert row["requests"] == result["requests"] and row["failed"] == 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    assert rows["ec-daemon"]["daemon_saves"] > 0  # the engines saved into the daemon
    assert "ttft_mean_ms_vs_none" in rows["ec-daemon"]
