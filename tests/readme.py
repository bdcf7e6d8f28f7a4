"""The README's quick start as a new user pastes it: its shell blocks parsed
into commands, the daemon `make run` starts, and the connector settings its
`vllm serve` block gives. Shared by the integration test (a real daemon and
a real client) and the vLLM test (a real engine)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICK_START = "## Quick start"
TRANSFER_CONFIG = "--ec-transfer-config"
START_TIMEOUT = 60.0


def quick_start_commands(readme: str | None = None) -> list[list[str]]:
    """Every command of the shell blocks of the README's quick start, in
    order, as argv lists (comments dropped, quoted newlines kept)."""
    text = README.read_text() if readme is None else readme
    section = text[text.index(QUICK_START):]
    section = section[:section.find("\n## ", len(QUICK_START))]
    commands: list[list[str]] = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        pending = ""
        for line in block.splitlines():
            pending = f"{pending}\n{line}" if pending else line
            try:
                argv = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            if pending.rstrip().endswith("\\"):
                continue
            if argv:
                commands.append(argv)
            pending = ""
    return commands


def command(commands: list[list[str]], *prefix: str) -> list[str]:
    """The first command starting with `prefix`."""
    for argv in commands:
        if argv[:len(prefix)] == list(prefix):
            return argv
    raise AssertionError(f"the README's quick start has no `{' '.join(prefix)}` command")


def transfer_config(argv: list[str]) -> dict[str, Any]:
    """The JSON of a `vllm serve` command's --ec-transfer-config."""
    if TRANSFER_CONFIG not in argv:
        raise AssertionError(f"no {TRANSFER_CONFIG} in {argv}")
    config = json.loads(argv[argv.index(TRANSFER_CONFIG) + 1])
    assert isinstance(config, dict)
    return config


def user_env(runtime_dir: Path) -> dict[str, str]:
    """A user's environment: their own XDG_RUNTIME_DIR, no EC_DAEMON_SOCKET."""
    env = {k: v for k, v in os.environ.items() if k != "EC_DAEMON_SOCKET"}
    env["XDG_RUNTIME_DIR"] = str(runtime_dir)
    return env


def daemon_argv(make_run: list[str], env: dict[str, str], cpu_bytes: str = "64MiB") -> list[str]:
    """What `make run` (with its arguments as the README gives them) would
    run, from `make -n`, as `python -m ec_daemon ...` with the same flags;
    `cpu_bytes` only keeps the region small."""
    dry = subprocess.run(["make", "-n", "--no-print-directory", *make_run[1:],
                          f"CPU_BYTES={cpu_bytes}"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    lines = [line for line in dry.splitlines() if re.search(r"bin/ec-daemon(\s|$)", line)]
    assert lines, f"`make -n run` runs no ec-daemon:\n{dry}"
    argv = shlex.split(lines[-1])
    return [sys.executable, "-m", "ec_daemon", *argv[1:]]


@dataclass
class QuickStartDaemon:
    """The daemon `make run` starts, in a user's environment of its own."""

    proc: subprocess.Popen[bytes]
    env: dict[str, str]
    log_path: Path
    socket: str = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def printed_config(self) -> dict[str, Any]:
        """The --ec-transfer-config the daemon's start-up log prints."""
        found = re.search(rf"{TRANSFER_CONFIG} '(.*?)'", self.log())
        assert found, f"the daemon printed no {TRANSFER_CONFIG}:\n{self.log()}"
        config = json.loads(found.group(1))
        assert isinstance(config, dict)
        return config


@contextlib.contextmanager
def quick_start_daemon(readme: str | None = None) -> Iterator[QuickStartDaemon]:
    """Start the daemon the README's `make run` starts, with XDG_RUNTIME_DIR
    a folder of its own (so its default socket is nobody else's); stop it
    and remove what it made (its region, by its socket) at the end."""
    from tests.integration.daemon import remove_regions_of

    runtime = Path(tempfile.mkdtemp(prefix="ecd-rt-", dir="/tmp"))
    runtime.chmod(0o700)
    env = user_env(runtime)
    argv = daemon_argv(command(quick_start_commands(readme), "make", "run"), env)
    log_path = runtime / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    daemon = QuickStartDaemon(proc, env, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (found := re.search(r"serving on (\S+):", daemon.log())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`make run`'s daemon did not serve:\n{daemon.log()}")
            time.sleep(0.05)
        daemon.socket = found.group(1)
        yield daemon
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if daemon.socket:
            remove_regions_of("/dev/shm", daemon.socket)
        shutil.rmtree(runtime, ignore_errors=True)
