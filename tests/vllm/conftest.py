"""vLLM contract tests: skipped cleanly where vLLM is not installed (the
main dev venv); `make test-vllm` runs them in their own venv."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import groups

pytest.importorskip("vllm", reason=groups.VLLM.reason("vLLM is not installed in this venv"))

from tests.integration.daemon import Daemon
from tests.vllm.cpu_platform import allow_configs_without_triton_cpu
from tests.vllm.engine_proc import A, B, C, D, F, run_engine
from tests.vllm.tiny_model import build_tiny_paligemma

# vLLM 0.34 builds no config on an x86 CPU without triton-cpu (the module says why).
allow_configs_without_triton_cpu()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_paligemma(tmp_path_factory.mktemp("tiny-paligemma"))


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> dict[int, Any]:
    """Outputs of an engine without the connector, by image."""
    return run_engine(tiny_model, [A, B, C, D, F])["results"]


@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A daemon checking its own bookkeeping after every change, unless the
    test is marked `writes_region`: it writes the region as another process
    of the region may (stamps included), which that check takes for a bug."""
    writes = request.node.get_closest_marker("writes_region") is not None
    with Daemon(cpu_bytes="128MiB", check_invariants=not writes) as d:
        yield d
