"""The processes of `make bench-serve` (benchmarks/serve.py): `vllm serve`
engines and ec-daemons, each started, stopped and restarted by its pid (its
own process group), never by name.

An engine logs vLLM's per-step details (`--enable-logging-iteration-details`):
each step that runs the encoder says how many inputs it encoded, which is how
encoder forwards are counted for every mode (vLLM exports no counter of
them). Its log is appended to across restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "benchmarks.vllm_cli"]
ENGINE_START_S = 900.0
STOP_S = 60.0
START_RETRIES = 1
SERVING = "ec-daemon serving on "  # the daemon's line once it serves
ENCODER_INPUTS = re.compile(r"encoder inputs: (\d+)")
CONNECTOR_COUNTER = re.compile(r"^vllm:ec_daemon_(\w+)_total\{[^}]*\} ([0-9.e+-]+)$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_group(proc: subprocess.Popen[Any], grace_s: float = STOP_S) -> None:
    """SIGTERM to the process group `proc` leads, SIGKILL to what is left of
    it after `grace_s`; returns once the whole group is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _group_alive(proc) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _group_alive(proc: subprocess.Popen[Any]) -> bool:
    proc.poll()  # reaps the leader once it exits; its children are init's
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass(frozen=True)
class EngineSetup:
    """What every engine of a run serves, and where. On "cpu", engine i is
    pinned to core i (`taskset`, one OpenMP thread) and runs float32 and
    eager; on "cuda", engines share the visible GPUs (one each when there
    are two)."""

    device: str
    model: str
    chat_template: str | None
    cores: tuple[int, ...] = ()
    gpus: int = 0
    max_model_len: int = 512

    def argv(self, index: int, port: int) -> list[str]:
        argv = ["serve", self.model, "--port", str(port), "--host", "127.0.0.1",
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", "8",
                "--limit-mm-per-prompt", '{"image": 1}', "--enable-prefix-caching",
                "--seed", "0", "--enable-logging-iteration-details"]
        if self.chat_template:
            argv += ["--chat-template", self.chat_template]
        if self.device == "cpu":
            # torch.compile's warm-up costs minutes per engine start on a small
            # CPU host; vLLM does not compile the vision encoder either way.
            core = self.cores[index % len(self.cores)]
            return ["taskset", "-c", str(core), *CLI, *argv, "--dtype", "float32",
                    "--enforce-eager"]
        if self.gpus < 2:
            argv += ["--gpu-memory-utilization", "0.4"]
        return [*CLI, *argv]

    @property
    def shares_a_gpu(self) -> bool:
        """Both engines on one GPU: each sizes its KV cache from the memory
        it finds free while profiling, so they start one after the other."""
        return self.device == "cuda" and self.gpus < 2

    def env(self, index: int, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ, **extra)
        # This tree's ec_client in every process of the engine, whatever else
        # the environment has installed (an editable install of another tree).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if self.device == "cpu":
            core = self.cores[index % len(self.cores)]
            env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=str(core),
                       VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
        elif self.gpus >= 2:
            env["CUDA_VISIBLE_DEVICES"] = str(index)
        return env


def start_engines(engines: list[Engine], setup: EngineSetup) -> None:
    """Start `engines` and wait until each serves: at once, or one after the
    other where they share a GPU (two engines at 0.4 of its memory each,
    profiling at the same time, each count the other's memory as theirs)."""
    if setup.shares_a_gpu:
        for engine in engines:
            engine.start()
            engine.wait_ready()
        return
    for engine in engines:
        engine.start()
    for engine in engines:
        engine.wait_ready()


@dataclass
class Engine:
    """One `vllm serve` process on a fixed port (kept across restarts)."""

    index: int
    setup: EngineSetup
    ec_args: list[str]
    env_extra: dict[str, str]
    log_path: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start; `wait_ready` waits until it serves."""
        with open(self.log_path, "ab") as log:  # (the child keeps its own descriptor)
            self.proc = subprocess.Popen(
                [*self.setup.argv(self.index, self.port), *self.ec_args], cwd=ROOT,
                env=self.setup.env(self.index, self.env_extra), stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, retries: int = START_RETRIES) -> int:
        """Until it serves; returns how many times it was started again
        because it exited during its start-up (on a busy host vLLM's CPU
        start-up now and then loses a worker's semaphore and exits)."""
        assert self.proc is not None
        deadline = time.monotonic() + ENGINE_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if retries <= 0:
                    raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n"
                                       + self.log_tail())
                print(f"!! engine {self.index} exited during its start-up "
                      f"({self.proc.returncode}); starting it again", flush=True)
                self.stop()
                self.start()
                return 1 + self.wait_ready(retries - 1)
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return 0
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"engine {self.index} not healthy after {ENGINE_START_S:.0f}s:\n"
                           + self.log_tail())

    def stop(self) -> None:
        """SIGTERM (vLLM's graceful stop), SIGKILL after a minute."""
        if self.proc is not None:
            _stop_group(self.proc)
            self.proc = None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def encoder_forwards(self) -> int:
        """Images this engine's encoder ran on since its log began (every
        start of it)."""
        text = self.log_path.read_text(errors="replace")
        return sum(int(n) for n in ENCODER_INPUTS.findall(text))

    def connector_counters(self) -> dict[str, float]:
        """ec-daemon's connector counters of this engine since it started
        (`vllm:ec_daemon_*_total` in its /metrics); {} for other modes."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as reply:
                text = reply.read().decode()
        except OSError:
            return {}
        return {name: float(value) for name, value in CONNECTOR_COUNTER.findall(text)}


class Daemon:
    """One ec-daemon (a "host"'s) on a socket in its own folder. `stop` is
    SIGTERM, which keeps its region for the next start on the socket to
    adopt (a warm restart); `clean` frees the region at the end."""

    def __init__(self, folder: Path, remote: str = "", cpu_bytes: str = "1GiB") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.uri = f"unix://{folder / 'ec.sock'}"
        self.remote = remote
        self.cpu_bytes = cpu_bytes
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = folder / "daemon.log"

    def start(self, *, fresh: bool = False) -> str:
        """Start and wait until it serves; `fresh` empties what a previous
        daemon on the socket left, otherwise it is adopted. Returns what
        became of the previous region (the daemon's own line: "adopted
        region ...: N entries ..." or "starting with an empty cache: why")."""
        starts = self._log().count(SERVING)
        argv = [sys.executable, "-m", "ec_daemon", "--cpu-bytes", self.cpu_bytes,
                "--socket", self.uri]
        if fresh:
            argv.append("--fresh-start")
        if self.remote:
            argv += ["--remote", self.remote]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                                         stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        # Its socket is bound before it adopts or pre-faults the region: its
        # "serving on" line says when it serves.
        while self._log().count(SERVING) == starts:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("ec-daemon did not start:\n" + self._log())
            time.sleep(0.02)
        lines = self._log().splitlines()
        served = max(i for i, line in enumerate(lines) if SERVING in line)
        return next((line.split("ec_daemon: ", 1)[-1] for line in reversed(lines[:served])
                     if "adopted region" in line or "starting with an empty cache" in line),
                    "")

    def _log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc, 30)
            self.proc = None

    def clean(self) -> None:
        """Remove the region a stopped daemon left on this socket."""
        self._cli("clean", check=False)

    def stats(self) -> dict[str, Any]:
        """`ec-daemon stats --json`; RuntimeError with its stderr if it fails."""
        done = self._cli("stats", "--json", check=False)
        if done.returncode != 0:
            raise RuntimeError(f"ec-daemon stats on {self.uri} failed ({done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
        return dict(json.loads(done.stdout))

    def _cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ec_daemon", *args, "--socket", self.uri],
                              cwd=ROOT, capture_output=True, text=True, timeout=60, check=check)
