"""Real vLLM engines on one host that get the same new image at once encode
it once: one is told to encode, the other defers (vLLM's
ensure_cache_available) and loads the first one's save. When the encoding
engine dies mid-way, the other encodes it itself. Outputs always equal an
engine's without the connector."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.daemon import Daemon
from tests.vllm.engine_proc import (
    ENGINE_TIMEOUT,
    SERVING_LINE,
    C,
    D,
    Engine,
    run_engine,
    same_output,
    start_engine,
)
from tests.vllm.slow_copy import MARKER_ENV, SECONDS_ENV, marker_state

pytestmark = pytest.mark.timeout(1200)

# Generous: two engines share two cores here; a deferral this long is never
# reached when the daemon answers as it should.
MAX_DEFER_SECONDS = 120
SLOW_SAVE = "tests.vllm.slow_copy:SlowSaveBackend"
SAVE_SECONDS = 5
# The two engines run on cores of their own (each engine's processes on one
# core, one OpenMP thread): on a host with two cores a deferred engine's
# scheduler loop otherwise starved the other's forward pass of the very image
# it waited for, until its wait ran out (tens of seconds, on main too).
CORES = [0, 1 % (os.cpu_count() or 1)]


@pytest.fixture(scope="module")
def one_core_reference(tiny_model: Path) -> dict[int, Any]:
    """Outputs of a one-core engine without the connector (one OpenMP
    thread: its logprobs are those of the pinned engines, to the bit)."""
    return run_engine(tiny_model, [C, D], core=CORES[0])["results"]


def started(*engines: Engine) -> None:
    for engine in engines:
        engine.wait_for_line("STARTED", ENGINE_TIMEOUT)


def asking(*engines: Engine) -> None:
    """Until every engine's scheduler knows another engine shares its
    namespace (so it asks before it encodes) and answers hits (its worker
    mapped the region): attached sessions alone do not say so."""
    for engine in engines:
        engine.wait_for_line("2 engine(s) share this namespace", ENGINE_TIMEOUT, anywhere=True)
        engine.wait_for_line(SERVING_LINE, ENGINE_TIMEOUT, anywhere=True)


def test_two_engines_that_get_one_new_image_at_once_encode_it_once(tiny_model,
                                                                   one_core_reference, tmp_path):
    # Each engine's save takes a few seconds, so that whichever encodes first
    # is still saving when the other asks: the other must wait, not encode
    # (without it, the faster engine may have saved before the other asked,
    # which is a plain hit). The encoding engine answers its request before
    # its save lands, so both stay up until both answered (vLLM kills an
    # engine 5 s into its shutdown, a save in flight with it).
    with Daemon(cpu_bytes="64MiB", extra=("--log-level", "debug")) as daemon:
        engines = [start_engine(tiny_model, [C], socket=daemon.socket, wait_start=True,
                                max_defer_seconds=MAX_DEFER_SECONDS, copy_backend=SLOW_SAVE,
                                env={MARKER_ENV: str(tmp_path / f"save-{i}"),
                                     SECONDS_ENV: str(SAVE_SECONDS)}, hold_end=True,
                                core=CORES[i])
                   for i in range(2)]
        try:
            started(*engines)
            asking(*engines)
            for engine in engines:
                engine.send("go\n")
            for engine in engines:
                engine.wait_for_line("RESULT ", ENGINE_TIMEOUT)
            for engine in engines:
                engine.send("\n")
            results = [engine.finish() for engine in engines]
        finally:
            for engine in engines:
                engine.stop()
        for result in results:
            assert same_output(result["results"][C], one_core_reference[C]), \
                result["output"][-3000:]
        # One encoder forward in total: the other engine loaded its save.
        stats = daemon.stats()
        wants = [line for line in daemon.log_path.read_text().splitlines()
                 if "ec_daemon" in line and "grpc" not in line]
        assert sorted(r["encoder_images"] for r in results) == [0, 1], (stats, wants)
        assert stats["saves"] == 1 and stats["loads"] == 1
        assert stats["convergence"]["claims"] == 1 and stats["convergence"]["waits"] >= 1


def test_when_the_encoding_engine_dies_mid_way_the_other_encodes(tiny_model,
                                                                 one_core_reference, tmp_path):
    marker = tmp_path / "slow-save"
    with Daemon(cpu_bytes="64MiB") as daemon:
        # Engine 1 encodes D and is slow to save it; engine 2 asks for D then.
        first = start_engine(tiny_model, [D], socket=daemon.socket, wait_start=True,
                             copy_backend=SLOW_SAVE,
                             env={MARKER_ENV: str(marker), SECONDS_ENV: "600"}, core=CORES[0])
        second = start_engine(tiny_model, [D], socket=daemon.socket, wait_start=True,
                              max_defer_seconds=MAX_DEFER_SECONDS, core=CORES[1])
        try:
            started(first, second)
            asking(first, second)
            first.send("go\n")
            deadline = time.monotonic() + ENGINE_TIMEOUT
            while marker_state(str(marker)) != ["start"]:
                assert first.proc.poll() is None and time.monotonic() < deadline, \
                    first.output[-3000:]
                time.sleep(0.05)
            second.send("go\n")
            daemon.wait_for(lambda: daemon.stats()["convergence"].get("waits", 0) >= 1,
                            what="engine 2 waiting for engine 1's encode")
            first.stop()  # SIGKILL to its process group, mid-save
            asked = time.monotonic()
            result = second.finish()
            waited = time.monotonic() - asked
        finally:
            first.stop()
            second.stop()
        assert same_output(result["results"][D], one_core_reference[D]), \
            result["output"][-3000:]
        assert result["encoder_images"] == 1  # engine 2 encoded D itself
        # Told to at once (the claim passed on when engine 1's session ended),
        # not after its deferral bound ran out.
        assert waited < MAX_DEFER_SECONDS
        assert daemon.stats()["convergence"]["handovers"] >= 1
