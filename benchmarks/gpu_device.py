"""The device machine as the check (`benchmarks/gpu_check.py`) knows it,
what travels to it, and its model here for the dry run.

The device: Python 3.12 with a CUDA build of torch, cupy-cuda13x, grpcio,
protobuf, pytest, xxhash and prometheus-client; no network, so what the tree
needs beyond that travels as wheels (`CARRIED`, downloaded here by `make
gpu-check-prepare` into `.gpu-check/wheels`, with the generated stubs beside
the tree) and is installed into a folder of the run, never into the
machine's Python.

The model (`model_python`): a venv of a Python 3.12 of this machine
holding the device image's packages that install here (`DEVICE_IMAGE`), and
nothing of the project's own venv. Its torch and CuPy are missing: PyPI has
only CUDA builds of torch for Linux x86_64, several GB with their CUDA
libraries, and CPU wheels come from an index this machine cannot reach. Not
needed either: the GPU tests skip at `importorskip("torch")` and the
benchmarks that import torch are read instead of imported
(`benchmarks.gpu_imports`), so the model still loads, collects and imports
everything else the device run does, with the same Python and packages.

Python 3.12 is found as `$GPU_CHECK_PYTHON`, `python3.12` on PATH, or
pyenv's; a machine without one gets it from `pyenv install 3.12` where
pyenv can download it (python.org), else the dry run stops and says how.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from ec_client.copy.pinning import REGISTER_CHUNK_BYTES

ROOT = Path(__file__).resolve().parent.parent
PREPARED = ROOT / ".gpu-check"
WHEELS = PREPARED / "wheels"
MANIFEST = PREPARED / "manifest.json"
STUBS = ROOT / "ec_protocol" / "_proto" / "__init__.py"
STUB_MODULES = (ROOT / "ec_protocol/_proto/ec_daemon/v1/ec_daemon_pb2.py",
                ROOT / "ec_protocol/_proto/ec_daemon/v1/ec_daemon_pb2_grpc.py")
DEVICE_PYTHON = (3, 12)
# The device image's packages that install here (pip names), for the model...
DEVICE_IMAGE = ("pytest", "grpcio", "protobuf", "xxhash", "prometheus-client",
                "numpy")  # numpy: CuPy's dependency
# ... and the import names of everything the image holds, torch and CuPy too.
DEVICE_MODULES = ("torch", "cupy", "cupyx", "cupy_backends", "numpy", "grpc", "google",
                  "pytest", "_pytest", "pluggy", "xxhash", "prometheus_client")
# What travels as wheels, at the project venv's versions: the daemon's gRPC
# and protobuf at the versions the generated stubs need (the image's may be
# older), grpcio's one dependency, and what the tests' conftest and the
# daemon benchmark import beyond the image (psutil), and pytest-timeout, so
# the per-test timeouts of pyproject.toml bound a GPU test that hangs (the
# image's pytest alone warns the option unknown, and only the phase's cap
# would stop it).
CARRIED = ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf",
           "prometheus-client", "typing-extensions", "psutil", "pytest-timeout")
DEVICE_TAGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               *(arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                 "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                                 "manylinux_2_12_x86_64", "manylinux2010_x86_64",
                                 "manylinux1_x86_64") for arg in ("--platform", tag))]
MODEL_VENV = ROOT / ".venv-gpu-check"
# /dev/shm each phase needs at once: the largest region a GPU test maps
# (tests/gpu/test_gpu_regions.py: entries across two 1 GiB chunks), the
# copy benchmark's region (one across the first chunk), the daemon
# benchmark's 64 MiB cache with room for its stamp table.
TEST_REGION_BYTES = 2 * REGISTER_CHUNK_BYTES + REGISTER_CHUNK_BYTES // 4
BENCH_REGION_BYTES = REGISTER_CHUNK_BYTES + (128 << 20)
SHM_NEEDS = {"tests": TEST_REGION_BYTES + (64 << 20), "gpu-bench": BENCH_REGION_BYTES,
             "daemon-bench": 80 << 20}


def prepare() -> None:
    """Here (with the project venv's Python): the wheels of CARRIED at its
    versions, for the device's Python; the stubs must exist."""
    if not STUBS.exists():
        raise SystemExit(f"{STUBS.parent} is missing: run `make proto` first")
    pins = {name: importlib.metadata.version(name) for name in CARRIED}
    shutil.rmtree(WHEELS, ignore_errors=True)  # one version of each, never two
    WHEELS.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *DEVICE_TAGS,
                    "-d", str(WHEELS), *(f"{n}=={v}" for n, v in pins.items())], check=True)
    wheels = {pin: _wheel_of(pin, version) for pin, version in pins.items()}
    MANIFEST.write_text(json.dumps({"wheels": pins, "files": wheels}, indent=1) + "\n")
    size = sum(p.stat().st_size for p in WHEELS.iterdir()) / 2**20
    print(f">> {len(pins)} wheels ({size:.1f} MiB) in {WHEELS} and the stubs in {STUBS.parent}"
          "; on the device machine: python3 -m benchmarks.gpu_check run --out $OUT, "
          'carry [".gpu-check", "ec_protocol/_proto"]')


def _wheel_of(name: str, version: str) -> str:
    prefix = f"{name.replace('-', '_').lower()}-{version}-"
    found = [p.name for p in WHEELS.glob("*.whl") if p.name.lower().startswith(prefix)]
    if len(found) != 1:
        raise SystemExit(f"expected one wheel of {name}=={version} in {WHEELS}, found {found}")
    return found[0]


def carried_problems() -> list[str]:
    """What is missing of what must travel: the manifest, a wheel it names,
    the stubs. Empty when all of it is here."""
    fix = ("run `make gpu-check-prepare` in the checkout and carry "
           '[".gpu-check", "ec_protocol/_proto"]')
    problems = [f"{_shown(path)} is missing: {fix}" for path in (STUBS, *STUB_MODULES)
                if not path.is_file()]
    if not MANIFEST.is_file():
        return [*problems, f"{_shown(MANIFEST)} is missing: {fix}"]
    manifest = json.loads(MANIFEST.read_text())
    files = manifest.get("files", {})
    for name in CARRIED:
        wheel = files.get(name)
        if wheel is None:
            problems.append(f"the manifest names no wheel of {name} (prepared by an older "
                            f"check): {fix}")
        elif not (WHEELS / wheel).is_file():
            problems.append(f"{_shown(WHEELS / wheel)} is missing: {fix}")
    return problems


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def carried_wheels() -> list[Path]:
    files = json.loads(MANIFEST.read_text()).get("files", {}) if MANIFEST.is_file() else {}
    return [WHEELS / f for f in files.values() if (WHEELS / f).is_file()]


def carried_modules() -> set[str]:
    """The top-level import names the carried wheels provide."""
    names: set[str] = set()
    for wheel in carried_wheels():
        with zipfile.ZipFile(wheel) as archive:
            for entry in archive.namelist():
                top = entry.split("/")[0]
                if top.endswith((".dist-info", ".data")):
                    continue
                names.add(top.removesuffix(".py").split(".")[0])
    return names


def _version_of(python: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return tuple(int(v) for v in out.stdout.split()) if out.returncode == 0 else None


def find_python() -> str | None:
    """A Python 3.12 of this machine, or None."""
    candidates = [os.environ.get("GPU_CHECK_PYTHON", ""), shutil.which("python3.12") or "",
                  *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")),
                          reverse=True),
                  "/usr/local/bin/python3.12", "/usr/bin/python3.12"]
    for python in filter(None, candidates):
        if _version_of(python) == DEVICE_PYTHON:
            return python
    return None


def device_python() -> str:
    """A Python 3.12, installed with pyenv when the machine has none; raises
    SystemExit saying how to get one when that fails too."""
    python = find_python()
    pyenv = shutil.which("pyenv")
    if python is None and pyenv:
        print(">> no Python 3.12 here: `pyenv install -s 3.12` (downloads from python.org)",
              flush=True)
        subprocess.run([pyenv, "install", "-s", "3.12"], check=False)
        python = find_python()
    if python is None:
        raise SystemExit(
            "gpu-check dry run: no Python 3.12 found (GPU_CHECK_PYTHON, python3.12 on PATH, "
            "~/.pyenv/versions/3.12*)" + (", and `pyenv install 3.12` failed" if pyenv else "")
            + ". The device runs Python 3.12, so the dry run needs one: `pyenv install 3.12` "
            "where python.org is reachable, `apt-get install python3.12` on Ubuntu 24.04, or "
            "GPU_CHECK_PYTHON=/path/to/python3.12.")
    return python


def model_python() -> str:
    """The model's interpreter: MODEL_VENV, made (or remade when its Python
    or the image's list changed) with a Python 3.12 and DEVICE_IMAGE only."""
    python = device_python()
    stamp = MODEL_VENV / ".installed"
    want = json.dumps({"python": python, "packages": DEVICE_IMAGE})
    venv_python = MODEL_VENV / "bin" / "python"
    if stamp.is_file() and stamp.read_text() == want and venv_python.exists():
        return str(venv_python)
    print(f">> the device's model: a venv of {python} with {', '.join(DEVICE_IMAGE)} "
          f"in {MODEL_VENV.relative_to(ROOT)}", flush=True)
    shutil.rmtree(MODEL_VENV, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(MODEL_VENV)], check=True)
    subprocess.run([str(venv_python), "-m", "pip", "install", "-q", *DEVICE_IMAGE], check=True)
    stamp.write_text(want)
    return str(venv_python)


def model_env() -> dict[str, str]:
    """The environment the model runs in: nothing of this shell's Python."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env
