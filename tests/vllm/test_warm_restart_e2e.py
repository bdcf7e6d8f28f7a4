"""Real vLLM engines on CPU across daemon restarts: a restarted daemon (kill -9,
or a graceful stop with its package reinstalled) keeps the cache, so a fresh
engine and a running one load what was saved before with no encoder forward
and the outputs of an engine without the connector; a load whose step is slow
across a restart, adopting or fresh, never stops the engine."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.daemon import Daemon
from tests.vllm.engine_proc import (
    ENGINE_TIMEOUT,
    ROOT,
    A,
    B,
    C,
    D,
    Engine,
    run_engine,
    same_output,
    start_engine,
)
from tests.vllm.slow_copy import MARKER_ENV, SECONDS_ENV, marker_state

pytestmark = pytest.mark.timeout(1500)

SLOW_START = "tests.vllm.slow_start:SlowStartConnector"
# How long the slow step waits before its load touches the region: longer
# than the workers' grace for a retired region (5 s), with room for the test
# to kill the daemon, start another and see the engine attach again.
SLOW_STEP_SECONDS = 14


def restart(daemon: Daemon, how: signal.Signals, *flags: str) -> Daemon:
    """Stop `daemon` with `how` (if it still runs) and start another on the
    same socket and tmpfs with `flags`."""
    daemon.stop(how)
    return Daemon(folder=daemon.folder, cpu_bytes="64MiB", extra=flags).start()


def reinstall() -> None:
    """Reinstall the daemon's package, as an upgrade does."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--force-reinstall", "-e", str(ROOT)],
                   check=True, timeout=600)


def test_engines_hit_what_was_saved_before_a_kill_9_and_an_upgrade(tiny_model, reference):
    """Engine 0 saves C and D; engine 1 saves A and B and pauses. The daemon
    is killed (kill -9) and restarted, then stopped (SIGTERM), its package
    reinstalled, and started again: both adopt the region. A fresh engine
    then loads A and B, and engine 1, still running, loads C and D (which
    its own encoder cache never held), all with no encoder forward and the
    reference outputs."""
    daemon = Daemon(cpu_bytes="64MiB").start()
    engine: Engine | None = None
    try:
        assert run_engine(tiny_model, [C, D], socket=daemon.socket)["encoder_images"] == 2
        engine = start_engine(tiny_model, [A, B, C, D], socket=daemon.socket, pause_after=2)
        engine.wait_for_line("PAUSED", ENGINE_TIMEOUT)
        daemon.wait_for(lambda: daemon.stats()["entries"] == 4, what="A, B, C and D saved")

        daemon = restart(daemon, signal.SIGKILL)
        assert "adopted region" in daemon.log() and "4 entries" in daemon.log()
        daemon.stop(signal.SIGTERM)
        reinstall()
        daemon = restart(daemon, signal.SIGTERM)
        assert "adopted region" in daemon.log() and "4 entries" in daemon.log()

        fresh = run_engine(tiny_model, [A, B], socket=daemon.socket)
        assert [r["encoder_images"] for r in fresh["requests"]] == [0, 0], (
            fresh["output"][-6000:] + daemon.log()[-4000:])
        engine.send("go\n")
        running = engine.finish()
        engine = None
        requests = running["requests"]
        assert [r["image"] for r in requests] == [A, B, C, D]
        assert [r["encoder_images"] for r in requests] == [1, 1, 0, 0], running["output"][-3000:]
        for result in (*fresh["requests"], *requests):
            assert same_output(result, reference[result["image"]]), result
        stats = daemon.stats()
        assert stats["saves"] == 0 and stats["loads"] >= 4 and stats["entries"] == 4
    finally:
        if engine is not None:
            engine.stop()
        daemon.cleanup()


def wait_for_marker(engine: Engine, marker: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not marker_state(str(marker)):
        assert engine.proc.poll() is None, (
            f"the engine ended before its slow step:\n{engine.output[-4000:]}")
        assert time.monotonic() < deadline, "the engine never began its slow step"
        time.sleep(0.05)


@pytest.mark.parametrize("lease", [10, 30])
@pytest.mark.parametrize("start_as", ["adopting", "fresh"])
def test_a_slow_step_across_a_daemon_restart_serves_the_saved_output(
        tiny_model, reference, tmp_path, start_as, lease):
    """Engine 2's worker begins working on A's load only SLOW_STEP_SECONDS
    after its scheduler dispatched it (this idle engine's loads are staged
    by its scheduler's process on vLLM's V1 runner: its worker's step that
    uses A is the slow one); meanwhile the daemon is killed (kill -9) and
    another starts on the same socket, adopting the region or starting
    fresh (--fresh-start). The engine keeps running, and A, A, B, A all
    return the reference outputs."""
    lease_flags = ("--lease-seconds", str(lease))
    daemon = Daemon(cpu_bytes="64MiB", extra=lease_flags).start()
    engine: Engine | None = None
    try:
        assert run_engine(tiny_model, [A, B], socket=daemon.socket)["encoder_images"] == 2
        daemon.wait_for(lambda: daemon.stats()["entries"] == 2, what="A and B saved")
        marker = tmp_path / "slow-step"
        engine = start_engine(tiny_model, [A, A, B, A], socket=daemon.socket,
                              connector=SLOW_START,
                              env={MARKER_ENV: str(marker), SECONDS_ENV: str(SLOW_STEP_SECONDS)})
        wait_for_marker(engine, marker, ENGINE_TIMEOUT)
        fresh = ("--fresh-start",) if start_as == "fresh" else ()
        daemon = restart(daemon, signal.SIGKILL, *lease_flags, *fresh)
        assert ("adopted region" in daemon.log() and "2 entries" in daemon.log()) == (
            start_as == "adopting"), daemon.log()
        daemon.wait_for(lambda: daemon.stats()["sessions"] == 2, timeout=30,
                        what="engine 2's scheduler and worker to attach again")
        # Otherwise the restart did not happen inside the window: retry on a quieter machine.
        assert marker_state(str(marker)) == ["start"], "the slow step ended before the restart"

        second = engine.finish()
        engine = None
        assert marker_state(str(marker)) == ["start", "done"]
        requests = second["requests"]
        assert [r["image"] for r in requests] == [A, A, B, A]
        for request in requests:
            assert "error" not in request, second["output"][-4000:]
            assert same_output(request, reference[request["image"]]), request
        # A came from the region the dead daemon served; later As from vLLM's
        # own encoder cache. B: from the adopted region, or encoded (and
        # saved) when the new daemon started empty.
        encoded = [r["encoder_images"] for r in requests]
        assert encoded == ([0, 0, 0, 0] if start_as == "adopting" else [0, 0, 1, 0])
        assert daemon.stats()["saves"] == (0 if start_as == "adopting" else 1)
    finally:
        if engine is not None:
            engine.stop()
        daemon.cleanup()
