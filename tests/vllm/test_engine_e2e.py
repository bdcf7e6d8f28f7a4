"""Real vLLM engines on CPU sharing one daemon: an engine restarted fresh
does not run the encoder for images another engine saw, its outputs equal
those of an engine without the connector, and an engine keeps serving when
its daemon dies. (Daemon restarts: test_warm_restart_e2e.)"""

from __future__ import annotations

import pytest

from tests.integration.daemon import Daemon
from tests.vllm.engine_proc import (
    ENGINE_TIMEOUT,
    A,
    B,
    C,
    D,
    F,
    run_engine,
    same_output,
    start_engine,
)

pytestmark = pytest.mark.timeout(1200)



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
        daemon.wait_for(lambda: daemon.stats()["saves"] == 1, what="the first save")  # (async)
        daemon.kill()
        engine.send("go\n")
        result = engine.finish()
        assert result["encoder_images"] == 2
        assert same_output(result["results"][A], reference[A])
        assert same_output(result["results"][F], reference[F])
    finally:
        engine.stop()
        daemon.cleanup()
