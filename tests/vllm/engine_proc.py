"""Real vLLM engines as processes (tests.vllm.engine_run), for the
end-to-end tests: start one, wait for its lines, collect its RESULT."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Each engine is three processes that import vLLM and torch: minutes on a
# busy two-core machine. Every wait on an engine is bounded by ENGINE_TIMEOUT.
ENGINE_TIMEOUT = 420
# Image seeds: each makes a different picture (and a different answer).
A, B, C, D, E, F = 10, 11, 12, 13, 14, 15


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


class Engine:
    """An engine process; a thread drains its output (vLLM logs a lot, and a
    full pipe would stall the engine), so the test can wait on lines."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for_line(self, prefix: str, timeout: float, anywhere: bool = False) -> None:
        """Until a line starts with `prefix` (`anywhere`: contains it, as a
        log line does)."""
        with self._changed:
            found = self._changed.wait_for(
                lambda: any(prefix in line if anywhere else line.startswith(prefix)
                            for line in self.lines)
                or self.proc.poll() is not None, timeout)
        assert found and self.proc.poll() is None, (
            f"no {prefix!r} from the engine:\n{self.output[-4000:]}")

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def stop(self) -> None:
        """Kill the engine and the processes vLLM started for it (its own
        process group), if it has not ended by itself, and remove the shared
        memory they left (their resource tracker died with them): by the
        names they mapped, never another process's."""
        if self.proc.poll() is None:
            theirs = _shm_mapped_by_group(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            _wait_group_gone(self.proc.pid)
            _remove_unmapped(theirs)
        self.proc.wait()

    def finish(self) -> dict[str, Any]:
        """Wait (bounded) for the engine to end by itself; its parsed
        RESULT, with `results`: the first request of each image."""
        try:
            self.proc.wait(timeout=ENGINE_TIMEOUT)
        finally:
            self.stop()
            self._reader.join(timeout=10)
        output = self.output
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        assert self.proc.returncode == 0 and lines, output[-4000:]
        result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
        result["output"] = output
        result["results"] = {}
        for request in result["requests"]:
            result["results"].setdefault(request["image"], request)
        result["encoder_images"] = sum(r.get("encoder_images", 0) for r in result["requests"])
        return result


# What Python's multiprocessing leaves in /dev/shm when its processes are
# killed: vLLM's shared-memory buffers (SharedMemory names start "psm_") and
# semaphores.
SHM = Path("/dev/shm")
SHM_PREFIXES = ("psm_", "sem.mp-")


def _shm_mapped(pid: str) -> set[str]:
    """The names in /dev/shm (vLLM's kinds) that process `pid` maps now."""
    try:
        maps = (Path("/proc") / pid / "maps").read_text()
    except OSError:
        return set()
    names = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
            name = fields[5][len(f"{SHM}/"):]
            if name.startswith(SHM_PREFIXES) and not name.endswith(" (deleted)"):
                names.add(name)
    return names


def _shm_mapped_by_group(pgid: int) -> set[str]:
    """What the processes of group `pgid` (an engine's) map in /dev/shm."""
    names: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.getpgid(int(proc.name)) == pgid:
                names |= _shm_mapped(proc.name)
        except OSError:
            continue
    return names


def _wait_group_gone(pgid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _remove_unmapped(names: set[str]) -> None:
    """Remove those of `names` that no live process maps any more."""
    if not names:
        return
    mapped: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        mapped |= _shm_mapped(proc.name) & names
    for name in names - mapped:
        with contextlib.suppress(OSError):
            (SHM / name).unlink()


def start_engine(model: Path, images: list[int], socket: str = "", role: str = "ec_both",
                 pause_after: int = 0, copy_backend: str = "cpu",
                 env: dict[str, str] | None = None, wait_start: bool = False,
                 max_defer_seconds: float = 0, connector: str = "",
                 hold_end: bool = False, core: int | None = None,
                 extra_config: dict[str, Any] | None = None,
                 transfer_config: dict[str, Any] | None = None) -> Engine:
    """`wait_start`: the engine prints STARTED once built and waits for a
    line on stdin before its first request; `hold_end`: it waits for one
    after its RESULT before it shuts down. `core`: the engine's processes run
    on that core only, its forward passes on one OpenMP thread (engines that
    run at once then cannot starve each other's forward passes; their
    numerics are a one-thread engine's). `extra_config`: more keys of the
    connector's extra config (e.g. embedding_model_identity); `transfer_config`:
    the whole --ec-transfer-config instead, as given (socket, role and the
    rest ignored)."""
    args = [sys.executable, "-m", "tests.vllm.engine_run", str(model),
            "--images", ",".join(map(str, images)), "--role", role,
            "--copy-backend", copy_backend]
    if socket:
        args += ["--socket", socket]
    if pause_after:
        args += ["--pause-after", str(pause_after)]
    if wait_start:
        args += ["--wait-start"]
    if hold_end:
        args += ["--hold-end"]
    if core is not None:
        args = ["taskset", "-c", str(core), *args]
        env = {**(env or {}), "VLLM_CPU_OMP_THREADS_BIND": str(core)}
    if max_defer_seconds:
        args += ["--max-defer-seconds", str(max_defer_seconds)]
    if connector:
        args += ["--connector", connector]
    if extra_config:
        args += ["--extra-config", json.dumps(extra_config)]
    if transfer_config is not None:
        args += ["--transfer-config", json.dumps(transfer_config)]
    return Engine(subprocess.Popen(args, cwd=ROOT, env=engine_env(env), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True))


# What an engine's scheduler logs once it answers hits (every worker rank
# mapped the daemon's region, after the view's snapshot).
SERVING_LINE = "worker ranks mapped the region; hits are answered"


def run_engine(model: Path, images: list[int], **kwargs: Any) -> dict[str, Any]:
    """Run an engine to its end. With ec-daemon's connector, its first
    request waits until the engine answers hits: attaching runs beside the
    engine's start-up, and on a busy machine may end after it (a request
    then misses, which is right but not what a test of hits wants)."""
    connected = kwargs.get("socket") or kwargs.get("transfer_config") is not None
    if not connected or kwargs.get("connector") or kwargs.get("wait_start"):
        return start_engine(model, images, **kwargs).finish()
    engine = start_engine(model, images, wait_start=True, **kwargs)
    try:
        engine.wait_for_line("STARTED", ENGINE_TIMEOUT)
        engine.wait_for_line(SERVING_LINE, ENGINE_TIMEOUT, anywhere=True)
        engine.send("go\n")
        return engine.finish()
    finally:
        engine.stop()


def same_output(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return (got.get("tokens") == want["tokens"] and got.get("logprobs") == want["logprobs"]
            and len(want["tokens"]) == 8)
