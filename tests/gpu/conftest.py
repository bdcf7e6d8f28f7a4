"""The GPU tests' hooks: a required GPU run never passes without testing.

`EC_GPU_REQUIRED=1` (`make gpu-test`, `make gpu-check`): a machine without
what the tests need fails at start with what is missing, and a run in which
no test passed, or a test skipped for any reason but a second GPU, fails.
"""

from __future__ import annotations

import os

import pytest

from tests.gpu.support import CUDA_PROBLEM, cupy_problem, tested_nothing

REQUIRED = os.environ.get("EC_GPU_REQUIRED") == "1"


def pytest_configure(config: pytest.Config) -> None:
    if not REQUIRED:
        return
    missing = [p for p in (CUDA_PROBLEM, None if CUDA_PROBLEM else cupy_problem()) if p]
    if missing:
        raise pytest.UsageError("EC_GPU_REQUIRED=1 but the GPU tests cannot run here: "
                                + "; ".join(missing))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not REQUIRED or session.config.option.collectonly:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    why = tested_nothing(len(stats.get("passed", [])),
                         [str(r.longrepr) for r in stats.get("skipped", [])])
    if why:
        if reporter:
            reporter.write_line(f"EC_GPU_REQUIRED=1: {why}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

