"""`make gpu-check`'s report and `make gpu-test`'s refusal, without a GPU:
the report names every target with its worst value and verdict, counts
the GPU tests per backend from JUnit, and a machine without CUDA fails
`make gpu-test` with what is missing instead of passing with nothing run.
What the device run imports is read from the source and must all be on the
device; what it needs is checked before any phase spends device time."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_device, gpu_imports, gpu_report

ROOT = Path(__file__).resolve().parents[2]


def test_the_report_names_every_target_with_its_worst_value():
    results = gpu_report.fake_results()
    cupy = next(p for p in results["gpu_bench"]["backends"] if p["backend"] == "cupy")
    cupy["rows"][1]["load_ratio"] = 0.5  # 8 MiB loads at half memcpy's speed
    cupy["compute_stream"]["host_syncs_per_load"] = 1.0
    results["targets"] = gpu_report.targets(results)
    by_figure = {t["figure"]: t for t in results["targets"]}
    ratio = by_figure["save and load, 8 and 64 MiB, contiguous and fragmented, cupy, vs "
                      "cudaMemcpyAsync from pinned memory"]
    assert (ratio["value"], ratio["where"], ratio["met"]) == (0.5, "load of 8 MiB", False)
    assert ratio["target"] == ">= 0.95x"
    small = by_figure["save and load, 1 MiB, cupy, vs cudaMemcpyAsync from pinned memory"]
    assert (small["target"], small["met"]) == (">= 0.85x", True)
    torch_row = next(r for p in results["gpu_bench"]["backends"] if p["backend"] == "torch"
                     for r in p["rows"] if r["case"] == "64 MiB fragmented")
    torch_row["save_ratio"] = 0.9  # fragmented saves at 0.9x: below 0.95
    results["targets"] = gpu_report.targets(results)
    by_figure = {t["figure"]: t for t in results["targets"]}
    fragmented = by_figure["save and load, 8 and 64 MiB, contiguous and fragmented, torch, vs "
                           "cudaMemcpyAsync from pinned memory"]
    assert (fragmented["value"], fragmented["where"], fragmented["met"]) == (
        0.9, "save of 64 MiB fragmented", False)
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
    """The device tool ends a command at its timeout_s and the report is written last:
    each phase gets only what is left of TOTAL_S (less the time stopping an
    overrun takes), and a phase with nothing left is reported as not run."""
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "STOP_GRACE_S", 1)
    monkeypatch.setattr(gpu_check, "TOTAL_S", 8)
    monkeypatch.setattr(gpu_check, "PHASE_S", {"slow": 60, "next": 60})
    check = gpu_check.Check(tmp_path, dry_run=True)
    started = time.monotonic()
    assert not check.phase("slow", ["sleep", "60"], "slow.log")
    # written as soon as the phase ended, before the run's end
    assert "| slow | timed out after" in (tmp_path / "report.md").read_text()
    assert not check.phase("next", ["true"], "next.log")
    assert time.monotonic() - started < 30
    slow, after = check.results["phases"]
    assert slow["status"] in ("timed out after 4 s", "timed out after 5 s")
    assert after["status"].startswith("not run: the check's 8 s were spent")
    assert not check.write()
    assert "not run" in (tmp_path / "report.md").read_text()


def _device_and_carried_modules() -> set[str]:
    """The device image's import names and those of the carried packages (as
    this venv installs them: the wheels need not have been downloaded)."""
    import importlib.metadata

    carried = {name.lower() for name in gpu_device.CARRIED}
    tops = {top for top, dists in importlib.metadata.packages_distributions().items()
            if any(d.lower().replace("_", "-") in carried for d in dists)}
    return tops | set(gpu_device.DEVICE_MODULES)


def test_the_device_run_imports_nothing_the_device_lacks():
    """The conftests, GPU tests, benchmarks and daemon the device run loads
    import only the standard library, this tree, the device image and the
    carried wheels (redis-py, imported by tests/redis_servers.py through the
    root conftest, stopped pytest before any GPU test on the device)."""
    assert gpu_imports.missing(_device_and_carried_modules()) == []
    reached = gpu_imports.loadable()
    assert {"tests.conftest", "tests.groups", "tests.redis_servers", "tests.gpu.support",
            "tests.gpu.test_gpu_backends", "ec_client.copy.cuda",
            "benchmarks.concurrency"} <= set(reached)


def test_the_import_reader_counts_what_runs_and_only_that(tmp_path):
    """Top-level imports count, and in tests those inside functions too; an
    import under TYPE_CHECKING, in a library function, or in a `try` that
    goes on without it does not; one whose handler raises again does."""
    files = {
        "tests/__init__.py": "",
        "tests/conftest.py": "import os\nfrom tests import helpers\n",
        "tests/helpers.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    import typed_only\ntry:\n    import optional\n"
                             "except ImportError:\n    optional = None\ntry:\n"
                             "    import reworded\nexcept ImportError as exc:\n"
                             "    raise ImportError('install it') from exc\n"
                             "def later():\n    import lazy_in_library\n"),
        "tests/gpu/__init__.py": "",
        "tests/gpu/test_x.py": ("import pytest\ntorch = pytest.importorskip('torch')\n"
                                "def test_x():\n    import in_a_test_body\n"
                                "    from tests.deep import thing\n"),
        "tests/deep.py": "import from_deep\nthing = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = {(m.module, m.path) for m in gpu_imports.missing({"pytest"}, tmp_path)}
    assert found == {("reworded", "tests/helpers.py"), ("in_a_test_body", "tests/gpu/test_x.py"),
                     ("from_deep", "tests/deep.py")}
    deep = next(m for m in gpu_imports.missing({"pytest"}, tmp_path) if m.module == "from_deep")
    assert deep.chain == ("tests/gpu/test_x.py", "tests/deep.py")
    assert "tests/deep.py:1 imports from_deep (reached by tests/gpu/test_x.py -> tests/deep.py)" \
        in str(deep)


def test_a_run_without_its_carried_files_stops_before_any_phase(monkeypatch, tmp_path):
    """Missing wheels or stubs end the run at once, saying how to prepare
    them, instead of spending device time on phases that cannot pass."""
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_device, "MANIFEST", tmp_path / "none.json")
    out = tmp_path / "out"
    monkeypatch.setattr(gpu_check.Check, "install", lambda self: pytest.fail("a phase ran"))
    assert gpu_check.run(out, dry_run=False) == 1
    report = json.loads((out / "report.json").read_text())
    assert [p["name"] for p in report["phases"]] == ["carried"]
    assert "make gpu-check-prepare" in report["phases"][0]["status"]
    assert "make gpu-check-prepare" in (out / "report.md").read_text()


def test_a_carried_wheel_missing_from_the_folder_is_named(monkeypatch, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    files = {name: f"{name}-1-py3-none-any.whl" for name in gpu_device.CARRIED}
    for wheel in list(files.values())[1:]:
        (wheels / wheel).write_bytes(b"")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"files": files}))
    monkeypatch.setattr(gpu_device, "MANIFEST", manifest)
    monkeypatch.setattr(gpu_device, "WHEELS", wheels)
    monkeypatch.setattr(gpu_device, "ROOT", tmp_path)
    problems = gpu_device.carried_problems()
    first = gpu_device.CARRIED[0]
    assert [p for p in problems if "wheels/" in p] == [
        f"wheels/{first}-1-py3-none-any.whl is missing: run `make gpu-check-prepare` in the "
        'checkout and carry [".gpu-check", "ec_protocol/_proto"]']


def test_a_phase_whose_needs_the_probe_did_not_find_is_not_run(tmp_path):
    """/dev/shm too small for the tests' 2.25 GiB region, no CUDA device, a
    missing package: each named, and the phase reported as not run."""
    from benchmarks import gpu_check

    check = gpu_check.Check(tmp_path, dry_run=False)
    ok = "1.0"
    check.results["environment"] = {
        "torch": "2.11.0", "cupy": ok, "pytest": ok, "psutil": "missing (ImportError: x)",
        "numpy": ok, "grpc": ok, "google.protobuf": ok, "stubs": "import", "devices": [],
        "shm_bytes": 2 << 30, "shm_free_bytes": 2 << 30}
    why = check.lacks("tests")
    assert why is not None and why.startswith("not run: needs psutil (missing")
    assert "a CUDA device (torch sees [])" in why
    assert "2.31 GiB free in /dev/shm (2.00 GiB free of 2.00)" in why
    check.results["environment"].update(psutil=ok, devices=["NVIDIA H100"])
    assert check.lacks("gpu-bench") is None  # 1.125 GiB fit
    check.tests()
    assert check.results["phases"][-1]["status"].startswith("not run: needs 2.31 GiB")
    assert "not run: needs 2.31 GiB" in (tmp_path / "report.md").read_text()


def test_the_worst_case_keeps_under_eight_minutes():
    """The Makefile and docs promise under 8 minutes; the device tool's call
    gives the run more than that (docs/development.md)."""
    from benchmarks import gpu_check

    assert gpu_check.TOTAL_S < 8 * 60
    text = (ROOT / "docs" / "development.md").read_text()
    call = re.search(r"timeout_s: (\d+)", text)
    assert call is not None and gpu_check.TOTAL_S + 30 <= int(call.group(1)) <= 600
    assert 'carry: [".gpu-check", "ec_protocol/_proto"]' in text


def test_the_copy_benchmark_dry_runs_every_case_through_the_model(tmp_path):
    """benchmarks/gpu.py imports here (CPU torch) and each of its cases, the
    fragmented ones too (64 KiB pages, shuffled), round-trips bit-exact
    through the copy path under the model of CUDA's rules."""
    from benchmarks import gpu

    cases = dict(gpu.CASES)
    assert len(cases["64 MiB fragmented"]) == 1024 and len(cases["8 MiB fragmented"]) == 128
    for extents in cases.values():  # pages of their own, inside the region
        assert len({o for o, _ in extents}) == len(extents)
        assert all(o > 0 and o + n <= gpu.REGION_BYTES for o, n in extents)
    rows = gpu.dry_run(str(tmp_path))
    assert [r["case"] for r in rows] == list(cases)
    assert all(r["bit_exact"] for r in rows)
    assert set(gpu_report.TARGET_CASES) <= set(cases)


def test_a_dry_run_without_a_python_3_12_says_how_to_get_one(monkeypatch):
    """No 3.12 and no pyenv to install one: the dry run stops with what to
    do, instead of running in a Python the device does not have."""
    monkeypatch.setattr(gpu_device, "find_python", lambda: None)
    monkeypatch.setattr(gpu_device.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as stop:
        gpu_device.model_python()
    message = str(stop.value)
    assert "no Python 3.12 found" in message
    assert "pyenv install 3.12" in message and "GPU_CHECK_PYTHON" in message
