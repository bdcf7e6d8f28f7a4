"""`make gpu-check`: the device check, one command that runs as it is on the
borrowed GPU machine (Python 3.12, CUDA torch, cupy-cuda13x, grpcio,
protobuf, pytest; no network, no vLLM) and writes report.md and report.json
into the folder given to it, with the logs beside them (at most 8 files):

1. installs the carried wheels (`.gpu-check/wheels`, made here by `make
   gpu-check-prepare`: the daemon's gRPC and protobuf at the versions the
   generated stubs need) into a temporary folder put on PYTHONPATH with the
   tree; nothing is installed into the machine's Python;
2. the GPU tests (tests/gpu, both backends, EC_GPU_REQUIRED=1: a skipped
   or empty run fails), JUnit into the report;
3. the GPU benchmark (benchmarks/gpu.py): saves and loads against
   cudaMemcpyAsync from pinned memory, and the compute stream during loads;
4. the daemon at scale (benchmarks/concurrency.py): 8 and 16 engines, every
   step with items, on the machine's 16 cores.

Each phase has its own time limit (PHASE_S, 8 minutes together), so one
that hangs cannot take the others' time; a phase's processes are stopped by
their process group. The whole run also keeps within TOTAL_S, stops included,
so the report is written before the `run` tool's 590 s end it: a phase gets
what is left of it, and one with nothing left is reported as not run. The
exit status is 1 when a phase failed; targets missed are in the report, not
in the status.

On the device machine, with the `run` tool (after `make gpu-check-prepare`
in the checkout that travels; the stubs and wheels are ignored files, so
they travel as `carry`):

    command: PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_check run --out $OUT
    carry:   [".gpu-check", "ec_protocol/_proto"]
    timeout_s: 590

`--dry-run` (CI, `make gpu-check DRY_RUN=1`, no GPU): checks that the wheels
install for cp312 manylinux x86_64, collects the GPU tests, imports the
benchmarks, runs the daemon benchmark for one second with two engines, and
renders a fake result set; fails on any error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import gpu_report

ROOT = Path(__file__).resolve().parent.parent
PREPARED = ROOT / ".gpu-check"
WHEELS = PREPARED / "wheels"
STUBS = ROOT / "ec_protocol" / "_proto" / "__init__.py"
# What the device image lacks or may hold in versions the stubs refuse
# (generated code checks grpcio and protobuf at import), and grpcio's one
# dependency: at the .venv's versions.
CARRIED = ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf",
           "prometheus-client", "typing-extensions")
DEVICE_TAGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               *(arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                 "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                                 "manylinux1_x86_64") for arg in ("--platform", tag))]
# What the GPU tests import; cupy and CUDA are checked by tests/gpu/conftest.py.
TEST_NEEDS = ("pytest", "psutil", "numpy", "grpc", "google.protobuf", "torch")
PHASE_S = {"install": 60, "tests": 220, "gpu-bench": 100, "daemon-bench": 110}
STOP_GRACE_S = 20  # the daemon helper stops its daemon within 15 s
# The run's own bound: under the tool's 590 s, with the report written after.
TOTAL_S = 560
PROBE_S = 60
PROBE = """
import json, platform, sys
info = {"python": platform.python_version(), "machine": platform.machine(),
        "cores": __import__("os").cpu_count()}
for name in ("torch", "cupy", "grpc", "google.protobuf", "numpy", "pytest"):
    try:
        module = __import__(name, fromlist=["_"])
        info[name] = getattr(module, "__version__", "?")
    except Exception as exc:
        info[name] = f"missing ({type(exc).__name__}: {exc})"
try:
    import torch
    info["torch cuda"] = torch.version.cuda
    info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception as exc:
    info["devices"] = f"({type(exc).__name__}: {exc})"
try:
    import ec_protocol.protocol  # the generated stubs, with the carried runtime
    info["stubs"] = "import"
except Exception as exc:
    info["stubs"] = f"FAIL ({type(exc).__name__}: {exc})"
print(json.dumps(info))
"""


def prepare() -> None:
    """Here (with the .venv's Python): the wheels of CARRIED at this
    environment's versions, for the device's Python; the stubs must exist."""
    if not STUBS.exists():
        raise SystemExit(f"{STUBS.parent} is missing: run `make proto` first")
    pins = {name: importlib.metadata.version(name) for name in CARRIED}
    shutil.rmtree(WHEELS, ignore_errors=True)  # one version of each, never two
    WHEELS.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *DEVICE_TAGS,
                    "-d", str(WHEELS), *(f"{n}=={v}" for n, v in pins.items())], check=True)
    (PREPARED / "manifest.json").write_text(json.dumps({"wheels": pins}, indent=1) + "\n")
    size = sum(p.stat().st_size for p in WHEELS.iterdir()) / 2**20
    print(f">> {len(pins)} wheels ({size:.1f} MiB) in {WHEELS} and the stubs in {STUBS.parent}"
          "; on the device machine: python3 -m benchmarks.gpu_check run --out $OUT, "
          'carry [".gpu-check", "ec_protocol/_proto"]')


class Check:
    """One run: the phases, their results, the report."""

    def __init__(self, out: Path, dry_run: bool) -> None:
        self.out = out
        self.dry_run = dry_run
        self.started = time.monotonic()
        self.work = Path(tempfile.mkdtemp(prefix="ec-gpu-check-"))
        self.results: dict[str, Any] = {
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dry_run": dry_run, "phases": []}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    def phase(self, name: str, argv: list[str], log: str, env: dict[str, str] | None = None,
              ) -> bool:
        """Run `argv` under the phase's time limit, its output into `log` in
        the report folder; stop its whole process group when it overruns."""
        started = time.monotonic()
        # stopping an overrun takes up to three graces (SIGINT, SIGTERM, SIGKILL)
        left = self.started + TOTAL_S - started - 3 * STOP_GRACE_S
        limit = min(PHASE_S.get(name, 120), int(left))
        if limit <= 0:
            self._fail(name, f"not run: the check's {TOTAL_S} s were spent")
            return False
        with open(self.out / log, "ab") as out:
            out.write(f">> {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(argv, cwd=ROOT, env=env or self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                status = "ok" if proc.wait(limit) == 0 else f"failed (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                status = f"timed out after {limit} s"
            _stop_group(proc)
        seconds = time.monotonic() - started
        self.results["phases"].append({"name": name, "status": status,
                                       "seconds": round(seconds, 1), "log": log})
        print(f">> {name}: {status} in {seconds:.0f} s (log: {self.out / log})", flush=True)
        return status == "ok"

    def install(self) -> None:
        """The carried wheels into a folder of this run, on PYTHONPATH (when
        this Python can import them: the dry run's need not be 3.12)."""
        wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
        site = self.work / "site"
        path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        if wheels:
            can_import = sys.version_info[:2] == (3, 12) and platform.machine() == "x86_64"
            argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                    *([] if can_import else DEVICE_TAGS), *wheels]
            if self.phase("install", argv, "install.log") and can_import:
                path.insert(0, str(site))
        else:
            self.results["phases"].append({"name": "install", "seconds": 0.0, "log": None,
                                           "status": f"no wheels in {WHEELS}: using this "
                                           "Python's packages (make gpu-check-prepare)"})
        self.env["PYTHONPATH"] = os.pathsep.join(path)
        try:
            probe = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=self.env,
                                   capture_output=True, text=True, timeout=PROBE_S)
        except subprocess.TimeoutExpired:
            self.results["environment"] = {"probe": f"timed out after {PROBE_S} s"}
            return
        self.results["environment"] = (json.loads(probe.stdout.splitlines()[-1])
                                       if probe.returncode == 0
                                       else {"probe": probe.stderr[-500:]})

    def tests(self) -> None:
        junit = self.out / "gpu-tests.xml"
        argv = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-p",
                "no:cacheprovider", f"--junitxml={junit}"]
        if self.dry_run:
            ok = self.phase("tests", [*argv, "--collect-only", "-q"], "gpu-tests.log")
            log = self.out / "gpu-tests.log"
            text = log.read_text() if log.exists() else ""
            ids = [line for line in text.splitlines() if line.startswith("tests/gpu/")]
            self.results["tests"] = {"collected": len(ids)}
            for backend in gpu_report.BACKENDS:
                if ok and not any(backend in i for i in ids):
                    self._fail("tests", f"no GPU test of the {backend} backend was collected")
            return
        self.phase("tests", [*argv, "-v", "--durations=10"], "gpu-tests.log",
                   dict(self.env, EC_GPU_REQUIRED="1"))
        if junit.exists():
            self.results["tests"] = gpu_report.junit_summary(junit)

    def gpu_bench(self) -> None:
        if self.dry_run:
            self.phase("gpu-bench", [sys.executable, "-c", "import benchmarks.gpu, "
                                     "tests.gpu.test_gpu_regions, tests.gpu.test_gpu_backends"],
                       "gpu-bench.log")
            return
        path = self.work / "gpu-bench.json"
        self.phase("gpu-bench", [sys.executable, "-m", "benchmarks.gpu", "--json", str(path)],
                   "gpu-bench.log")
        if path.exists():
            self.results["gpu_bench"] = json.loads(path.read_text())

    def daemon_bench(self) -> None:
        path = self.work / "daemon-bench.json"
        scale = ["--engines", "2", "--seconds", "1"] if self.dry_run else \
            ["--engines", "8", "16", "--seconds", "10"]
        self.phase("daemon-bench", [sys.executable, "-m", "benchmarks.concurrency", *scale,
                                    "--mix", "every step", "--json", str(path)],
                   "daemon-bench.log")
        if path.exists():
            rows = json.loads(path.read_text())
            if self.dry_run and not all("event_lag_p99_ms" in r for r in rows):
                self._fail("daemon-bench", "rows without event_lag_p99_ms")
            else:
                self.results["daemon_bench"] = rows

    def report_writer(self) -> None:
        """Dry run: the writer renders a complete fake result set."""
        fake = gpu_report.fake_results()
        missing = gpu_report.check_markdown(gpu_report.markdown(fake), fake)
        if missing or any(t["met"] is None for t in fake["targets"]):
            self._fail("report", f"the report writer lost {missing or 'a target'}")
        else:
            self.results["phases"].append({"name": "report", "status": "ok", "seconds": 0.0,
                                           "log": None})

    def _fail(self, name: str, why: str) -> None:
        self.results["phases"].append({"name": name, "status": f"failed: {why}",
                                       "seconds": 0.0, "log": None})
        print(f">> {name}: failed: {why}", flush=True)

    def write(self) -> bool:
        self.results["seconds"] = round(time.monotonic() - self.started, 1)
        self.results["targets"] = gpu_report.targets(self.results)
        (self.out / "report.json").write_text(json.dumps(self.results, indent=1) + "\n")
        text = gpu_report.markdown(self.results)
        (self.out / "report.md").write_text(text)
        print(text, flush=True)
        shutil.rmtree(self.work, ignore_errors=True)
        return all(p["status"] == "ok" for p in self.results["phases"]
                   if p["name"] != "install" or p["log"])


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop what is left of a phase: SIGINT to its leader first (Python then
    runs its cleanup: a benchmark's daemon is stopped and its region
    removed), then SIGTERM and SIGKILL to its process group, STOP_GRACE_S
    apart. Returns once no process of the group runs."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_GRACE_S)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_alive(proc.pid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + STOP_GRACE_S
        while proc.poll() is None or _group_alive(proc.pid):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` runs (zombies do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after it
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                return True
    return False


def run(out: Path, dry_run: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, dry_run)
    check.install()
    check.tests()
    check.gpu_bench()
    check.daemon_bench()
    if dry_run:
        check.report_writer()
    return 0 if check.write() else 1


def test(pytest_args: list[str]) -> int:
    """`make gpu-test`: the GPU tests with this Python, required to run."""
    if not STUBS.exists():
        print(f"make gpu-test: {STUBS.parent} is missing: run `make proto` first",
              file=sys.stderr)
        return 1
    missing = [name for name in TEST_NEEDS if not _importable(name)]
    if missing:
        print(f"make gpu-test: {sys.executable} (GPU_PYTHON) lacks {', '.join(missing)}: "
              "install them there (torch: a CUDA build; cupy: cupy-cuda13x or "
              "cupy-cuda12x[ctk]; the rest: pip install -e . pytest psutil numpy)",
              file=sys.stderr)
        return 1
    env = dict(os.environ, EC_GPU_REQUIRED="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    status = subprocess.call([sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu",
                              *pytest_args], cwd=ROOT, env=env)
    if status == 5:
        print("make gpu-test: pytest collected no GPU test", file=sys.stderr)
    return status


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="download the wheels the device machine lacks")
    check = commands.add_parser("run", help="run the check, write the report")
    check.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT"),
                       help="the report's folder (default: $GPU_CHECK_OUT)")
    check.add_argument("--dry-run", action="store_true", help="no GPU: install, collect, "
                       "import, check the report writer")
    commands.add_parser("test", help="the GPU tests, required to run (the arguments "
                        "after `test` go to pytest)")
    if sys.argv[1:2] == ["test"]:
        sys.exit(test(sys.argv[2:]))
    args = parser.parse_args()
    if args.command == "prepare":
        prepare()
    else:
        if not args.out:
            parser.error("give the report's folder: --out DIR (make gpu-check OUT=DIR) "
                         "or GPU_CHECK_OUT")
        sys.exit(run(Path(args.out), args.dry_run))


if __name__ == "__main__":
    main()
