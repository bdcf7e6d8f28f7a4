"""tests/docker: the images in real containers (`make docker-test`).

Skipped when no Docker engine answers or the images are not built, unless
EC_DOCKER_REQUIRED=1 (set by `make docker-test`): then that is a failure."""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from tests import groups
from tests.docker import harness


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "docker: runs the images in Docker containers (make docker-test)")


@pytest.fixture(scope="session", autouse=True)
def no_leftovers() -> Iterator[None]:
    """Replaces the suite-wide guard on the host's /dev/shm (tests/conftest.py),
    which these tests never use (every container has its own, or a tmpfs
    volume) and which other processes on a shared host change meanwhile: no
    container or volume of this run survives it."""
    yield
    if harness.engine_problem() is not None:
        return
    prefix = f"name={harness.RUN_PREFIX}"
    containers = harness.docker("ps", "--all", "--quiet", "--filter", prefix).stdout.split()
    volumes = harness.docker("volume", "ls", "--quiet", "--filter", prefix).stdout.split()
    assert not containers and not volumes, f"left behind: {containers} {volumes}"


@pytest.fixture(scope="session")
def docker_engine() -> None:
    problem = harness.engine_problem()
    if problem is None:
        return
    if harness.REQUIRED:
        pytest.fail(f"Docker tests required (EC_DOCKER_REQUIRED) but cannot run: {problem}",
                    pytrace=False)
    pytest.skip(groups.DOCKER.reason(problem))


@pytest.fixture
def res(docker_engine: None, request: pytest.FixtureRequest) -> Iterator[harness.Resources]:
    """This test's containers and volumes; their logs are printed on failure,
    and all are removed at the end."""
    resources = harness.Resources()
    yield resources
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print(resources.logs())
    resources.cleanup()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"rep_{report.when}", report)  # read by `res` to print logs on failure
    return report
