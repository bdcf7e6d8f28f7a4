"""`make gpu-check`'s report and `make gpu-test`'s refusal, without a GPU:
the report names every target with its worst value and verdict, counts
the GPU tests per backend from JUnit, and a machine without CUDA fails
`make gpu-test` with what is missing instead of passing with nothing run."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import gpu_report

ROOT = Path(__file__).resolve().parents[2]


def test_the_report_names_every_target_with_its_worst_value():
    results = gpu_report.fake_results()
    cupy = next(p for p in results["gpu_bench"]["backends"] if p["backend"] == "cupy")
    cupy["rows"][1]["load_ratio"] = 0.5  # 8 MiB loads at half memcpy's speed
    cupy["compute_stream"]["host_syncs_per_load"] = 1.0
    results["targets"] = gpu_report.targets(results)
    by_figure = {t["figure"]: t for t in results["targets"]}
    ratio = by_figure["save and load, 1 / 8 / 64 MiB, cupy, vs cudaMemcpyAsync from pinned "
                      "memory"]
    assert (ratio["value"], ratio["where"], ratio["met"]) == (0.5, "load of 8 MiB", False)
    assert by_figure["save and load, 1 / 8 / 64 MiB, torch, vs cudaMemcpyAsync from pinned "
                     "memory"]["met"] is True
    syncs = by_figure["host synchronisations of the compute stream per load"]
    assert (syncs["value"], syncs["where"], syncs["met"]) == (1.0, "cupy", False)
    lag = by_figure["8 engines, every step with items, 16 cores: event lag p99"]
    assert (lag["value"], lag["met"]) == (8.0, True)
    text = gpu_report.markdown(results)
    assert gpu_report.check_markdown(text, results) == []
    assert "| 0.50 | load of 8 MiB | MISSED |" in text


def test_a_target_without_its_figures_is_not_measured_and_the_writer_notices_a_loss():
    results = copy.deepcopy(gpu_report.fake_results())
    results["daemon_bench"] = [r for r in results["daemon_bench"] if r["engines"] != 8]
    results["targets"] = gpu_report.targets(results)
    lag = results["targets"][-1]
    assert (lag["value"], lag["met"]) == (None, None)
    text = gpu_report.markdown(results)
    assert "not measured" in text
    lost = text.replace("| 64 MiB | cupy |", "| 64 MiB | ? |")
    assert gpu_report.check_markdown(lost, results) == ["64 MiB (cupy)"]


def test_junit_results_are_counted_per_backend(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text("""<testsuites><testsuite tests="4">
<testcase classname="tests.gpu.test_gpu_regions" name="test_a[torch]"/>
<testcase classname="tests.gpu.test_gpu_regions" name="test_a[cupy]">
  <failure message="AssertionError: bytes differ">long trace</failure></testcase>
<testcase classname="tests.gpu.test_gpu_backends" name="test_the_cupy_backend_x[offset]"/>
<testcase classname="tests.gpu.test_gpu_backends" name="test_b[torch]">
  <skipped message="needs a second GPU"/></testcase>
</testsuite></testsuites>""")
    summary = gpu_report.junit_summary(junit)
    assert summary["backends"] == {"torch": {"passed": 1, "failed": 0, "skipped": 1},
                                   "cupy": {"passed": 1, "failed": 1, "skipped": 0}}
    assert summary["failures"] == [{"test": "tests.gpu.test_gpu_regions::test_a[cupy]",
                                    "message": "AssertionError: bytes differ"}]


def test_gpu_test_without_cuda_fails_and_says_what_is_missing():
    """This Python's torch is the CPU build (the .venv's): the run must fail
    at once with that reason, never pass with every GPU test skipped."""
    import torch

    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "test", "-q",
                          "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    if torch.version.cuda is None:
        assert "EC_GPU_REQUIRED=1 but the GPU tests cannot run here" in output
        assert "is a CPU build" in output


def test_a_required_gpu_run_fails_when_it_tested_nothing_or_skipped():
    from tests.gpu.support import tested_nothing

    assert tested_nothing(0, []) == "no GPU test passed: this run tested nothing"
    assert tested_nothing(0, ["Skipped: CUDA is not available"]) is not None
    assert tested_nothing(40, ["('t.py', 3, 'Skipped: cupy is not installed')"]) == (
        "1 GPU tests skipped (first: ('t.py', 3, 'Skipped: cupy is not installed'))")
    assert tested_nothing(40, ["('t.py', 3, 'Skipped: needs a second GPU')"]) is None


def test_a_phase_that_overran_is_stopped_with_everything_it_started(monkeypatch):
    """A phase's leader that ignores SIGINT and a child it left behind: both
    are gone when _stop_group returns (a benchmark's daemon would otherwise
    outlive the check and its time limit)."""
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "STOP_GRACE_S", 2)
    proc = subprocess.Popen(["bash", "-c", "trap '' INT; sleep 300 & wait"],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(_group(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_group(proc.pid)) == 2
        gpu_check._stop_group(proc)
        assert proc.returncode is not None
        assert not gpu_check._group_alive(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _group(pgid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


def test_the_check_keeps_within_its_total_so_the_report_is_written(monkeypatch, tmp_path):
    """The device tool ends a command at 590 s and the report is written last:
    each phase gets only what is left of TOTAL_S (less the time stopping an
    overrun takes), and a phase with nothing left is reported as not run."""
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "STOP_GRACE_S", 1)
    monkeypatch.setattr(gpu_check, "TOTAL_S", 8)
    monkeypatch.setattr(gpu_check, "PHASE_S", {"slow": 60, "next": 60})
    check = gpu_check.Check(tmp_path, dry_run=True)
    started = time.monotonic()
    assert not check.phase("slow", ["sleep", "60"], "slow.log")
    assert not check.phase("next", ["true"], "next.log")
    assert time.monotonic() - started < 30
    slow, after = check.results["phases"]
    assert slow["status"] in ("timed out after 4 s", "timed out after 5 s")
    assert after["status"].startswith("failed: not run")
    assert not check.write()
    assert "not run" in (tmp_path / "report.md").read_text()
