"""Real vLLM engines on two "hosts" (two daemons sharing one Mooncake Store)
that get the same new image at once encode it once in all: one host claims
it in the store and encodes, the other defers (vLLM's ensure_cache_available)
until the value is published, promotes it and loads it. When the encoding
host's daemon dies mid-way, the other host encodes it once the claim's bound
has passed. Outputs always equal an engine's without the connector."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests import mooncake_servers
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
from tests.vllm.test_convergence_e2e import CORES, MAX_DEFER_SECONDS, SLOW_SAVE
from tests.vllm.test_two_hosts import check_mooncake

pytestmark = pytest.mark.timeout(1200)
SAVE_SECONDS = 5
CLAIM_SECONDS = 15


@pytest.fixture(scope="module")
def one_core_reference(tiny_model: Path) -> dict[int, Any]:
    """Outputs of a one-core engine without the connector (see test_convergence_e2e)."""
    return run_engine(tiny_model, [C, D], core=CORES[0])["results"]


@pytest.fixture
def two_hosts() -> Iterator[tuple[Daemon, Daemon]]:
    check_mooncake()
    with ExitStack() as stack:
        master = stack.enter_context(mooncake_servers.master())
        url = master.url_with(segment="256MiB", buffer="32MiB")
        hosts = tuple(stack.enter_context(Daemon(cpu_bytes="64MiB", extra=(
            "--remote", url, "--remote-claim-seconds", str(CLAIM_SECONDS),
            "--log-level", "debug"))) for _ in range(2))
        for host in hosts:
            host.wait_for(lambda h=host: h.stats()["remote_tier"]["reachable"] == 1,
                          timeout=30, what="the daemon to reach the master")
        yield hosts[0], hosts[1]


def ready(*engines: Engine) -> None:
    """Until every engine is built, its scheduler knows a second tier is on
    (so it asks before it encodes) and answers hits (its worker mapped the
    region)."""
    for engine in engines:
        engine.wait_for_line("STARTED", ENGINE_TIMEOUT)
    for engine in engines:
        engine.wait_for_line("a second tier is on", ENGINE_TIMEOUT, anywhere=True)
        engine.wait_for_line(SERVING_LINE, ENGINE_TIMEOUT, anywhere=True)


def test_engines_on_two_hosts_that_get_one_new_image_at_once_encode_it_once(
        tiny_model, one_core_reference, two_hosts, tmp_path):
    # Saves are slow (5 s), so whichever host encodes is still saving when the
    # other asks: the other must wait for the value, not encode.
    engines = [start_engine(tiny_model, [C], socket=host.socket, wait_start=True,
                            max_defer_seconds=MAX_DEFER_SECONDS, copy_backend=SLOW_SAVE,
                            env={MARKER_ENV: str(tmp_path / f"save-{i}"),
                                 SECONDS_ENV: str(SAVE_SECONDS)}, hold_end=True,
                            core=CORES[i])
               for i, host in enumerate(two_hosts)]
    try:
        ready(*engines)
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
    tiers = [host.stats()["remote_tier"] for host in two_hosts]
    # One encoder forward in all: the other host promoted the claimant's value.
    assert sorted(r["encoder_images"] for r in results) == [0, 1], tiers
    assert sorted(t["claims_taken"] for t in tiers) == [0, 1], tiers
    waiter = tiers[[r["encoder_images"] for r in results].index(0)]
    assert waiter["claims_elsewhere"] == 1 and waiter["remote_hits"] == 1, tiers


def test_when_the_encoding_host_dies_mid_way_the_other_encodes_after_the_bound(
        tiny_model, one_core_reference, two_hosts, tmp_path):
    host1, host2 = two_hosts
    marker = tmp_path / "slow-save"
    first = start_engine(tiny_model, [D], socket=host1.socket, wait_start=True,
                         copy_backend=SLOW_SAVE,
                         env={MARKER_ENV: str(marker), SECONDS_ENV: "600"}, core=CORES[0])
    second = start_engine(tiny_model, [D], socket=host2.socket, wait_start=True,
                          max_defer_seconds=MAX_DEFER_SECONDS, core=CORES[1])
    try:
        ready(first, second)
        first.send("go\n")  # host 1 claims D and encodes it; its save hangs
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while marker_state(str(marker)) != ["start"]:
            assert first.proc.poll() is None and time.monotonic() < deadline, \
                first.output[-3000:]
            time.sleep(0.05)
        second.send("go\n")
        host2.wait_for(lambda: host2.stats()["remote_tier"]["claims_elsewhere"] >= 1,
                       timeout=ENGINE_TIMEOUT, what="host 2 waiting for host 1's claim")
        host1.kill()  # host 1's daemon dies mid-way: its claim stays in the store
        asked = time.monotonic()
        result = second.finish()
        waited = time.monotonic() - asked
    finally:
        first.stop()
        second.stop()
    assert same_output(result["results"][D], one_core_reference[D]), result["output"][-3000:]
    assert result["encoder_images"] == 1  # host 2 encoded D itself
    assert waited < CLAIM_SECONDS + 30 < MAX_DEFER_SECONDS  # the claim's bound, not the engine's
    assert host2.stats()["remote_tier"]["claim_timeouts"] == 1
