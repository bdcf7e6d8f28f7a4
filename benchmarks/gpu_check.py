"""`make gpu-check`: the device check, one command that runs as it is on the
borrowed GPU machine (`benchmarks.gpu_device` says what it has) and writes
report.md and report.json into the folder given to it, with the logs and
the raw figures beside them:

0. before any phase, what the run needs: the carried wheels and the stubs
   (missing: the run stops at once, saying how to prepare them), then a
   probe of the machine (Python, torch and CUDA, CuPy, the carried packages,
   /dev/shm's size and free space); a phase whose needs are not met is
   reported as not run, without spending its time;
1. the carried wheels into a folder of this run, put on PYTHONPATH with the
   tree; nothing is installed into the machine's Python;
2. the GPU tests (tests/gpu, both backends, EC_GPU_REQUIRED=1: a skipped or
   empty run fails), JUnit into the report's folder;
3. the GPU benchmark (benchmarks/gpu.py): saves and loads, contiguous and
   fragmented, against cudaMemcpyAsync from pinned memory, and the compute
   stream during loads; each row is written as soon as it is measured;
4. the daemon at scale (benchmarks/concurrency.py): 8 engines, then 16, one
   run each, every step with items, on the machine's 16 cores.

The report is rewritten after every phase, so a run the device tool ends
still leaves every figure measured until then. Each phase has its own limit
(PHASE_S) and the whole run keeps within TOTAL_S (under 8 minutes), stops
included: a phase gets what is left, and one with nothing left is reported
as not run. The exit status is 1 when a phase failed or did not run;
targets missed are in the report, not in the status.

On the device machine, with the `run` tool (after `make gpu-check-prepare`
in the checkout that travels; the stubs and wheels are ignored files, so
they travel as `carry`):

    command: PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_check run --out $OUT
    carry:   [".gpu-check", "ec_protocol/_proto"]
    timeout_s: 540

`--dry-run` (CI, `make gpu-check DRY_RUN=1`, no GPU) runs in a model of the
device (`gpu_device.model_python`: Python 3.12 with the device image's
packages and nothing of the project's venv): installs the carried wheels,
probes, reads and imports everything the device run loads
(`benchmarks.gpu_imports`), collects the GPU tests through the same
conftests, runs the daemon benchmark for a second with two engines, and
renders a fake result set. It fails where the device run would fail before
its first GPU call.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import gpu_device, gpu_report
from benchmarks.gpu_device import ROOT, SHM_NEEDS, STUBS

# What the GPU tests import; cupy and CUDA are checked by tests/gpu/conftest.py.
TEST_NEEDS = ("pytest", "psutil", "numpy", "grpc", "google.protobuf", "torch")
# Modules each phase imports (the probe says which the machine lacks), and
# whether it needs a CUDA device.
PHASE_NEEDS: dict[str, tuple[tuple[str, ...], bool]] = {
    "tests": (("torch", "cupy", *TEST_NEEDS), True),
    "gpu-bench": (("torch", "numpy"), True),
    "daemon-bench": (("grpc", "google.protobuf", "numpy", "psutil"), False),
}
PHASE_S = {"probe": 40, "install": 30, "imports": 120, "tests": 190, "gpu-bench": 90,
           "daemon-bench": 60}
DAEMON_ENGINES = (8, 16)
STOP_GRACE_S = 20  # the daemon helper stops its daemon within 15 s
# The run's own bound, stops included: under 8 minutes, the report written after.
TOTAL_S = 470
MODEL_ENV = "EC_GPU_CHECK_MODEL"  # set in the dry run's model of the device
PROBE = """
import json, os, platform, sys
info = {"python": platform.python_version(), "machine": platform.machine(),
        "cores": os.cpu_count()}
for name in ("torch", "cupy", "grpc", "google.protobuf", "numpy", "pytest", "psutil",
             "xxhash", "prometheus_client"):
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
try:
    shm = os.statvfs("/dev/shm")
    info["shm_bytes"] = shm.f_blocks * shm.f_frsize
    info["shm_free_bytes"] = shm.f_bavail * shm.f_frsize
    with open("/proc/mounts") as mounts:
        kinds = [line.split()[2] for line in mounts if line.split()[1] == "/dev/shm"]
    info["shm_fs"] = kinds[-1] if kinds else "?"
except OSError as exc:
    info["shm_bytes"] = info["shm_free_bytes"] = 0
    info["shm_fs"] = f"({exc})"
print(json.dumps(info))
"""


class Check:
    """One run: the phases, their results, the report (rewritten as it goes)."""

    def __init__(self, out: Path, dry_run: bool) -> None:
        self.out = out
        self.dry_run = dry_run
        self.started = time.monotonic()
        self.work = Path(tempfile.mkdtemp(prefix="ec-gpu-check-"))
        self.results: dict[str, Any] = {
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dry_run": dry_run, "phases": []}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    def left(self) -> float:
        return self.started + TOTAL_S - time.monotonic()

    def phase(self, name: str, argv: list[str], log: str, env: dict[str, str] | None = None,
              limit_s: int | None = None, ok: tuple[int, ...] = (0,)) -> bool:
        """Run `argv` under the phase's time limit, its output into `log` in
        the report folder; stop its whole process group when it overruns.
        `ok`: the exit statuses that pass."""
        started = time.monotonic()
        # stopping an overrun takes up to three graces (SIGINT, SIGTERM, SIGKILL)
        cap = limit_s or PHASE_S.get(name, PHASE_S.get(name.rsplit("-", 1)[0], 120))
        limit = min(cap, int(self.left() - 3 * STOP_GRACE_S))
        if limit <= 0:
            self._fail(name, f"not run: the check's {TOTAL_S} s were spent")
            return False
        with open(self.out / log, "ab") as out:
            out.write(f">> {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(argv, cwd=ROOT, env=env or self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                status = "ok" if proc.wait(limit) in ok else f"failed (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                status = f"timed out after {limit} s"
            _stop_group(proc)
        seconds = time.monotonic() - started
        self._record(name, status, seconds, log)
        return status == "ok"

    # -------------------------------------------------------- before phases

    def carried(self) -> bool:
        """The wheels and stubs that must travel are here: else nothing runs."""
        problems = gpu_device.carried_problems()
        if problems:
            self._fail("carried", "; ".join(problems))
        else:
            self._record("carried", "ok", 0.0, None)
        return not problems

    def install(self) -> None:
        """The carried wheels into a folder of this run, on PYTHONPATH (when
        this Python can import them: the dry run's model is 3.12 too)."""
        wheels = [str(p) for p in gpu_device.carried_wheels()]
        site = self.work / "site"
        path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        can_import = sys.version_info[:2] == gpu_device.DEVICE_PYTHON
        argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                *([] if can_import else gpu_device.DEVICE_TAGS), *wheels]
        if self.phase("install", argv, "install.log") and can_import:
            path.insert(0, str(site))
        self.env["PYTHONPATH"] = os.pathsep.join(path)

    def probe(self) -> None:
        started = time.monotonic()
        try:
            probe = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=self.env,
                                   capture_output=True, text=True, timeout=PHASE_S["probe"])
        except subprocess.TimeoutExpired:
            self.results["environment"] = {"probe": f"timed out after {PHASE_S['probe']} s"}
            self._fail("probe", f"timed out after {PHASE_S['probe']} s")
            return
        ok = probe.returncode == 0
        self.results["environment"] = (json.loads(probe.stdout.splitlines()[-1]) if ok
                                       else {"probe": probe.stderr[-500:]})
        self._record("probe", "ok" if ok else "failed: " + probe.stderr[-300:],
                     time.monotonic() - started, None)

    def lacks(self, phase: str) -> str | None:
        """What this machine lacks for `phase` (the probe's findings), or None."""
        env = self.results.get("environment") or {}
        modules, cuda = PHASE_NEEDS[phase]
        if self.dry_run:  # the model has no torch, CuPy nor GPU: it checks the rest
            modules, cuda = tuple(m for m in modules if m not in ("torch", "cupy")), False
        why = [f"{m} ({env.get(m, 'not probed')})" for m in modules
               if not isinstance(env.get(m), str) or env[m].startswith("missing")]
        if cuda and not (isinstance(env.get("devices"), list) and env["devices"]):
            why.append(f"a CUDA device (torch sees {env.get('devices', 'none')})")
        if env.get("stubs") != "import":
            why.append(f"the stubs ({env.get('stubs', 'not probed')})")
        free = env.get("shm_free_bytes", 0)
        if not self.dry_run and free < SHM_NEEDS[phase]:
            why.append(f"{SHM_NEEDS[phase] / 2**30:.2f} GiB free in /dev/shm "
                       f"({free / 2**30:.2f} GiB free of {env.get('shm_bytes', 0) / 2**30:.2f})")
        return f"not run: needs {'; '.join(why)}" if why else None

    def ready(self, phase: str, name: str | None = None) -> bool:
        why = self.lacks(phase)
        if why:
            self._fail(name or phase, why)
        return why is None

    # ---------------------------------------------------------------- phases

    def imports(self) -> None:
        """Dry run: what the device run loads, read and imported in the model."""
        self.phase("imports", [sys.executable, "-m", "benchmarks.gpu_check", "imports"],
                   "imports.log")

    def tests(self) -> None:
        if not self.ready("tests"):
            return
        junit = self.out / "gpu-tests.xml"
        argv = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-p",
                "no:cacheprovider", f"--junitxml={junit}"]
        if self.dry_run:
            self._collect(argv)
            return
        self.phase("tests", [*argv, "-v", "--durations=10"], "gpu-tests.log",
                   dict(self.env, EC_GPU_REQUIRED="1"))
        if junit.exists():
            with contextlib.suppress(Exception):  # a file cut short by a stop
                self.results["tests"] = gpu_report.junit_summary(junit)

    def _collect(self, argv: list[str]) -> None:
        """The GPU tests collected through the conftests the device loads;
        in the model every test file may skip only for torch or CuPy."""
        log = self.out / "gpu-tests.log"
        # exit 5: nothing collected, every file skipped (checked below)
        self.phase("tests", [*argv, "--collect-only", "-q", "-rs"], "gpu-tests.log",
                   limit_s=PHASE_S["imports"], ok=(0, 5))
        text = log.read_text() if log.exists() else ""
        files = sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
        skipped = re.findall(r"SKIPPED \[\d+\] tests/gpu/(test_\w+\.py)(?::\d+)?: (.*)", text)
        ids = [line for line in text.splitlines() if line.startswith("tests/gpu/")]
        self.results["tests"] = {"collected": len(ids), "skipped files": len(skipped)}
        other = [f"{f}: {why}" for f, why in skipped
                 if not re.search(r"could not import '(torch|cupy)'", why)]
        unseen = set(files) - {f for f, _ in skipped} - {i.split("::")[0].split("/")[-1]
                                                         for i in ids}
        if other or unseen:
            self._fail("tests", "; ".join([*other, *(f"{f} neither collected nor skipped"
                                                     for f in sorted(unseen))]))

    def gpu_bench(self) -> None:
        if self.dry_run or not self.ready("gpu-bench"):
            return  # the dry run reads benchmarks.gpu (it imports torch) in `imports`
        path = self.out / "gpu-bench.json"
        self.phase("gpu-bench", [sys.executable, "-m", "benchmarks.gpu", "--json", str(path)],
                   "gpu-bench.log")
        if path.exists():
            with contextlib.suppress(ValueError):
                self.results["gpu_bench"] = json.loads(path.read_text())

    def daemon_bench(self) -> None:
        runs = [(2, 1)] if self.dry_run else [(n, 10) for n in DAEMON_ENGINES]
        for engines, seconds in runs:
            name = f"daemon-bench-{engines}"
            if not self.ready("daemon-bench", name):
                continue
            path = self.out / f"{name}.json"
            self.phase(name, [sys.executable, "-m", "benchmarks.concurrency", "--engines",
                              str(engines), "--seconds", str(seconds), "--mix", "every step",
                              "--json", str(path)], "daemon-bench.log")
            if not path.exists():
                continue
            rows = json.loads(path.read_text())
            if not all("event_lag_p99_ms" in r for r in rows):
                self._fail(name, "rows without event_lag_p99_ms")
            elif not self.dry_run:
                self.results.setdefault("daemon_bench", []).extend(rows)
                self.save()

    def report_writer(self) -> None:
        """Dry run: the writer renders a complete fake result set."""
        fake = gpu_report.fake_results()
        missing = gpu_report.check_markdown(gpu_report.markdown(fake), fake)
        if missing or any(t["met"] is None for t in fake["targets"]):
            self._fail("report", f"the report writer lost {missing or 'a target'}")
        else:
            self._record("report", "ok", 0.0, None)

    # ---------------------------------------------------------------- report

    def _record(self, name: str, status: str, seconds: float, log: str | None) -> None:
        self.results["phases"].append({"name": name, "status": status,
                                       "seconds": round(seconds, 1), "log": log})
        print(f">> {name}: {status} in {seconds:.0f} s"
              + (f" (log: {self.out / log})" if log else ""), flush=True)
        self.save()

    def _fail(self, name: str, why: str) -> None:
        self._record(name, f"failed: {why}" if not why.startswith("not run") else why, 0.0,
                     None)

    def save(self) -> None:
        """report.json and report.md as far as measured (rewritten whole:
        a stop in between leaves the previous pair)."""
        self.results["seconds"] = round(time.monotonic() - self.started, 1)
        self.results["targets"] = gpu_report.targets(self.results)
        for name, text in (("report.json", json.dumps(self.results, indent=1) + "\n"),
                           ("report.md", gpu_report.markdown(self.results))):
            part = self.out / f".{name}.part"
            part.write_text(text)
            part.replace(self.out / name)

    def write(self) -> bool:
        self.save()
        print((self.out / "report.md").read_text(), flush=True)
        shutil.rmtree(self.work, ignore_errors=True)
        return all(p["status"] == "ok" for p in self.results["phases"])


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
    if dry_run and os.environ.get(MODEL_ENV) != "1":
        return _in_model(out)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, dry_run)
    if check.carried():
        check.install()
        check.probe()
        if dry_run:
            check.imports()
        check.tests()
        check.gpu_bench()
        check.daemon_bench()
        if dry_run:
            check.report_writer()
    return 0 if check.write() else 1


def _in_model(out: Path) -> int:
    """The dry run, again, in the model of the device (`gpu_device`)."""
    python = gpu_device.model_python()
    print(f">> gpu-check dry run in the device's model ({python})", flush=True)
    env = dict(gpu_device.model_env(), **{MODEL_ENV: "1"})
    return subprocess.call([python, "-m", "benchmarks.gpu_check", "run", "--dry-run",
                            "--out", str(out)], cwd=ROOT, env=env)


def check_imports() -> int:
    """`imports` (the dry run's phase, in the model): every import the device
    run makes is of a module the device has (read from the source), and every
    module it loads that does not need torch or CuPy imports here."""
    from benchmarks import gpu_imports

    allowed = set(gpu_device.DEVICE_MODULES) | gpu_device.carried_modules()
    missing = gpu_imports.missing(allowed)
    for m in missing:
        print(f"MISSING {m}")
    failed, read = [], []
    for name in gpu_imports.loadable():
        if name.endswith("__main__"):
            continue  # runs its program (the daemon benchmark starts it)
        try:
            importlib.import_module(name)
        except BaseException as exc:  # pytest.importorskip raises a BaseException
            if re.search(r"'(torch|cupy)'", str(exc)) or getattr(exc, "name", "") in (
                    "torch", "cupy"):
                read.append(name)
            else:
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
    for line in failed:
        print(f"FAILED {line}")
    print(f">> {len(gpu_imports.loadable())} modules loaded by the device run; imported here "
          f"but {len(read)} that need torch or CuPy (read: {', '.join(read)}); "
          f"{len(missing)} imports of modules the device lacks; {len(failed)} failed")
    return 1 if missing or failed else 0


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
    check.add_argument("--dry-run", action="store_true", help="no GPU: in a model of the "
                       "device, install, read and import, collect, check the report writer")
    commands.add_parser("imports", help="(the dry run's phase) what the device run imports")
    commands.add_parser("test", help="the GPU tests, required to run (the arguments "
                        "after `test` go to pytest)")
    if sys.argv[1:2] == ["test"]:
        sys.exit(test(sys.argv[2:]))
    args = parser.parse_args()
    if args.command == "prepare":
        gpu_device.prepare()
    elif args.command == "imports":
        sys.exit(check_imports())
    else:
        if not args.out:
            parser.error("give the report's folder: --out DIR (make gpu-check OUT=DIR) "
                         "or GPU_CHECK_OUT")
        sys.exit(run(Path(args.out).resolve(), args.dry_run))


if __name__ == "__main__":
    main()
