"""vLLM contract tests: skipped cleanly where vLLM is not installed (the
main dev venv); `make test-vllm` runs them in their own venv."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import groups

pytest.importorskip("vllm", reason=groups.VLLM.reason("vLLM is not installed in this venv"))

from benchmarks.vllm_source import SourceUnavailable, epd_proxy
from tests.integration.daemon import Daemon
from tests.vllm.cpu_platform import allow_configs_without_triton_cpu
from tests.vllm.engine_proc import A, B, C, D, F, run_engine
from tests.vllm.tiny_model import build_tiny_paligemma
from tests.vllm.tiny_qwen2vl import build_tiny_qwen2vl

# Set by CI (.ci/run): vLLM's proxy must be had, from the cache or PyPI.
SOURCE_REQUIRED_ENV = "EC_VLLM_SOURCE_REQUIRED"

# vLLM 0.34 builds no config on an x86 CPU without triton-cpu (the module says why).
allow_configs_without_triton_cpu()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_paligemma(tmp_path_factory.mktemp("tiny-paligemma"))


@pytest.fixture(scope="session")
def tiny_qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny-qwen2vl"))


@pytest.fixture(scope="session")
def vllm_proxy_script() -> Path:
    """vLLM's own `disagg_epd_proxy.py`, from the source release of the
    installed vLLM (benchmarks.vllm_source: cached, else from PyPI). Where
    PyPI cannot be reached the tests that run it skip, saying so, except
    under $EC_VLLM_SOURCE_REQUIRED=1 (CI), where they fail; a wrong answer
    (no such release, another sha256) always fails them."""
    try:
        return epd_proxy()
    except SourceUnavailable as exc:
        if not exc.unreachable or os.environ.get(SOURCE_REQUIRED_ENV) == "1":
            pytest.fail(f"vLLM's E/PD proxy could not be had: {exc}")
        pytest.skip(groups.VLLM.reason(f"vLLM's E/PD proxy could not be had: {exc}"))


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
