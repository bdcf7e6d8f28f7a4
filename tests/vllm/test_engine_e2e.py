"""Real vLLM engines on CPU sharing one daemon: an engine restarted fresh
does not run the encoder for images another engine saw, its outputs equal
those of an engine without the connector, and a load in flight while the
daemon restarts still serves exactly the saved encoder output."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.daemon import Daemon
from tests.vllm.engine_proc import (
    ENGINE_TIMEOUT,
    A,
    B,
    C,
    D,
    Engine,
    F,
    run_engine,
    same_output,
    start_engine,
)
from tests.vllm.slow_copy import MARKER_ENV, SECONDS_ENV, marker_state

pytestmark = pytest.mark.timeout(1200)

SLOW_BACKEND = "tests.vllm.slow_copy:SlowLoadBackend"
# How long the slow load holds its copy: room for the test to kill the
# daemon, start another and see the engine re-attach, on a busy machine.
SLOW_LOAD_SECONDS = 12


@pytest.fixture(scope="module")
def shared_daemon():
    with Daemon(cpu_bytes="128MiB") as d:
        yield d


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
    assert stats["loads"] == 2  # the daemon counts loads from the engine's heartbeats
    # Both engines' sessions ended with them. (Not necessarily detached: vLLM
    # stops the scheduler's connector only after its workers exited, and
    # kills an EngineCore that takes over 5 s; the daemon then awaits that
    # view as a ghost for one lease.)
    assert stats["sessions"] == 0


def test_a_consumer_engine_loads_but_never_saves(tiny_model, shared_daemon, reference):
    saves_before = shared_daemon.stats()["saves"]
    if saves_before == 0:  # runs alone: seed the cache first
        run_engine(tiny_model, [A], socket=shared_daemon.socket)
        saves_before = shared_daemon.stats()["saves"]
    consumer = run_engine(tiny_model, [A, D], socket=shared_daemon.socket, role="ec_consumer")
    assert [r["encoder_images"] for r in consumer["requests"]] == [0, 1]  # D only
    assert same_output(consumer["results"][A], reference[A])
    assert same_output(consumer["results"][D], reference[D])
    assert shared_daemon.stats()["saves"] == saves_before


def test_an_engine_keeps_serving_when_its_daemon_dies(tiny_model, reference):
    daemon = Daemon(cpu_bytes="64MiB").start()
    engine = start_engine(tiny_model, [A, F], socket=daemon.socket, pause_after=1)
    try:
        engine.wait_for_line("PAUSED", ENGINE_TIMEOUT)
        assert daemon.stats()["saves"] == 1
        daemon.kill()
        engine.send("go\n")
        result = engine.finish()
        assert result["encoder_images"] == 2
        assert same_output(result["results"][A], reference[A])
        assert same_output(result["results"][F], reference[F])
    finally:
        engine.stop()
        daemon.cleanup()


def wait_for_marker(engine: Engine, marker: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not marker_state(str(marker)):
        assert engine.proc.poll() is None, (
            f"engine 2 ended before its slow load:\n{engine.output[-4000:]}")
        assert time.monotonic() < deadline, "engine 2 never started its slow load"
        time.sleep(0.05)


def test_a_load_in_flight_when_the_daemon_restarts_serves_the_saved_output(
        tiny_model, reference, tmp_path):
    """Loads that cannot serve wrong output: engine 2's load of A is held in
    flight (a slow copy backend) while its daemon is killed and a new one
    starts on the same socket. The load still returns the bytes engine 1
    saved (the worker keeps the old region mapped; nobody reuses its
    pages), and every later request is right too."""
    daemon = Daemon(cpu_bytes="64MiB").start()
    restarted: Daemon | None = None
    engine: Engine | None = None
    try:
        first = run_engine(tiny_model, [A, B], socket=daemon.socket)
        assert first["encoder_images"] == 2
        daemon.wait_for(lambda: daemon.stats()["entries"] == 2, what="A and B saved")

        marker = tmp_path / "slow-load"
        engine = start_engine(tiny_model, [A, A, B, A], socket=daemon.socket,
                              copy_backend=SLOW_BACKEND,
                              env={MARKER_ENV: str(marker), SECONDS_ENV: str(SLOW_LOAD_SECONDS)})
        wait_for_marker(engine, marker, ENGINE_TIMEOUT)
        daemon.kill()  # SIGKILL, by pid, while the copy of A is in flight
        restarted = Daemon(cpu_bytes="64MiB", folder=daemon.folder).start()
        assert restarted.socket == daemon.socket
        restarted.wait_for(lambda: restarted.stats()["sessions"] == 2, timeout=30,
                           what="engine 2's scheduler and worker to attach again")
        # Otherwise the restart did not happen inside the window: retry on a quieter machine.
        assert marker_state(str(marker)) == ["start"], "the slow load ended before the restart"

        second = engine.finish()
        assert marker_state(str(marker)) == ["start", "done"]
        requests = second["requests"]
        assert [r["image"] for r in requests] == [A, A, B, A]
        for request in requests:
            assert "error" not in request, second["output"][-4000:]
            assert same_output(request, reference[request["image"]]), request
        # A came from the old daemon's region; vLLM's encoder cache kept the
        # loaded tensor for the later As; B had to be encoded (the new daemon
        # was empty), and engine 2 saved it there.
        assert [r["encoder_images"] for r in requests] == [0, 0, 1, 0]
        stats = restarted.stats()
        assert stats["saves"] == 1 and stats["loads"] == 0
    finally:
        if engine is not None:
            engine.stop()
        if restarted is not None:
            restarted.cleanup()
        daemon.cleanup()
