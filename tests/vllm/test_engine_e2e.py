"""Real vLLM engines on CPU sharing one daemon: an engine restarted fresh
does not run the encoder for images another engine saw, and its outputs
equal those of an engine without the connector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT = 600
A, B, C, D, E, F = 10, 11, 12, 13, 14, 15


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def start_engine(model: Path, images: list[int], socket: str = "", role: str = "ec_both",
                 pause_after: int = 0) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "tests.vllm.engine_run", str(model),
            "--images", ",".join(map(str, images)), "--role", role]
    if socket:
        args += ["--socket", socket]
    if pause_after:
        args += ["--pause-after", str(pause_after)]
    return subprocess.Popen(args, cwd=ROOT, env=engine_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        output, _ = proc.communicate(timeout=ENGINE_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, output[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    result["results"] = {int(k): v for k, v in result["results"].items()}
    return result


def run_engine(model: Path, images: list[int], **kwargs: Any) -> dict[str, Any]:
    return finish(start_engine(model, images, **kwargs))


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Outputs of an engine without the connector."""
    return run_engine(tiny_model, [A, C, D, F])["results"]


@pytest.fixture(scope="module")
def shared_daemon():
    with Daemon(cpu_bytes="128MiB") as d:
        yield d


def same_output(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return got["tokens"] == want["tokens"] and got["logprobs"] == want["logprobs"]


def test_images_differ_so_the_comparison_means_something(reference):
    assert len({tuple(r["tokens"]) for r in reference.values()}) == len(reference)


def test_a_fresh_engine_loads_what_another_engine_encoded(tiny_model, shared_daemon,
                                                          reference):
    first = run_engine(tiny_model, [A, B, C], socket=shared_daemon.socket)
    assert first["encoder_images"] == 3
    assert same_output(first["results"][A], reference[A])
    stats = shared_daemon.stats()
    assert stats["saves"] == 3 and stats["entries"] == 3

    second = run_engine(tiny_model, [A, C], socket=shared_daemon.socket)
    assert second["encoder_images"] == 0  # both came from the daemon
    for image in (A, C):
        assert same_output(second["results"][image], reference[image])
    stats = shared_daemon.stats()
    assert stats["loads"] == 2 and stats["pinned_bytes"] == 0
    assert stats["sessions"] == 0  # both engines left cleanly


def test_a_consumer_engine_loads_but_never_saves(tiny_model, shared_daemon, reference):
    saves_before = shared_daemon.stats()["saves"]
    if saves_before == 0:  # runs alone: seed the cache first
        run_engine(tiny_model, [A], socket=shared_daemon.socket)
        saves_before = shared_daemon.stats()["saves"]
    consumer = run_engine(tiny_model, [A, D], socket=shared_daemon.socket, role="ec_consumer")
    assert consumer["encoder_images"] == 1  # D only
    assert same_output(consumer["results"][A], reference[A])
    assert same_output(consumer["results"][D], reference[D])
    assert shared_daemon.stats()["saves"] == saves_before


def test_an_engine_keeps_serving_when_its_daemon_dies(tiny_model, reference):
    daemon = Daemon(cpu_bytes="64MiB").start()
    try:
        proc = start_engine(tiny_model, [A, F], socket=daemon.socket, pause_after=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("PAUSED"):
                break
        else:
            raise AssertionError("the engine never paused")
        assert daemon.stats()["saves"] == 1
        daemon.kill()
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = finish(proc)
        assert result["encoder_images"] == 2
        assert same_output(result["results"][A], reference[A])
        assert same_output(result["results"][F], reference[F])
    finally:
        daemon.cleanup()
