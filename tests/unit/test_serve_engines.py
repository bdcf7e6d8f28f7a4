"""`make gpu-bench-serve`'s engines on one GPU start one after the other:
each sizes its KV cache from the memory free while it profiles, so two
profiling at once would each count the other's allocations as theirs."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.serve_hosts import EngineSetup, start_engines


class FakeEngine:
    def __init__(self, index: int, calls: list[tuple[str, int]]) -> None:
        self.index = index
        self.calls = calls

    def start(self) -> None:
        self.calls.append(("start", self.index))

    def wait_ready(self) -> int:
        self.calls.append(("ready", self.index))
        return 0


def _order(setup: EngineSetup) -> list[tuple[str, int]]:
    calls: list[tuple[str, int]] = []
    engines: Any = [FakeEngine(i, calls) for i in range(2)]
    start_engines(engines, setup)
    return calls


def test_engines_sharing_a_gpu_start_one_after_the_other():
    setup = EngineSetup("cuda", "model", None, gpus=1)
    assert setup.shares_a_gpu
    assert _order(setup) == [("start", 0), ("ready", 0), ("start", 1), ("ready", 1)]


@pytest.mark.parametrize("setup", [EngineSetup("cuda", "model", None, gpus=2),
                                   EngineSetup("cpu", "model", None, cores=(0, 1))])
def test_engines_on_their_own_devices_start_together(setup):
    assert _order(setup) == [("start", 0), ("start", 1), ("ready", 0), ("ready", 1)]
