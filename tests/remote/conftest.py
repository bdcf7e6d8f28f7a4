"""Fixtures for the second tier's tests: real redis-server processes on
127.0.0.1 (tests/redis_servers.py), skipped only when redis-server is absent;
real mooncake_master processes (tests/mooncake_servers.py), skipped only when
mooncake_master is absent or mooncake.store does not import (the reasons:
tests/groups.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import groups, mooncake_servers, redis_servers

needs_redis = groups.needs_redis
MOONCAKE_MISSING = groups.mooncake_missing()
needs_mooncake = (pytest.mark.usefixtures("mooncake_required")
                  if MOONCAKE_MISSING and groups.MOONCAKE_REQUIRED
                  else pytest.mark.skipif(MOONCAKE_MISSING is not None,
                                          reason=MOONCAKE_MISSING or ""))
NAMESPACE = "Qwen/Qwen2.5-VL-3B-Instruct|bfloat16|image=2304|" + "v" * 200


def wait_for(predicate: Callable[[], object], timeout_s: float, step_s: float = 0.02) -> bool:
    """Poll `predicate` until it is truthy or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)


def payload(size: int, seed: int = 0) -> bytes:
    return (os.urandom(16) * ((size + 15) // 16))[:size] if seed else os.urandom(size)


@pytest.fixture(scope="module")
def node() -> Iterator[redis_servers.RedisServer]:
    """A single node shared by a module's tests (which must not kill it)."""
    with redis_servers.single_node() as server:
        yield server


@pytest.fixture()
def own_node() -> Iterator[redis_servers.RedisServer]:
    """A single node for one test (it may kill and restart it)."""
    with redis_servers.single_node() as server:
        yield server


check_mooncake = groups.check_mooncake


@pytest.fixture()
def mooncake_required() -> None:
    check_mooncake()


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[mooncake_servers.MooncakeMaster]:
    """A mooncake_master shared by a module's tests (which must not kill it)."""
    check_mooncake()
    with mooncake_servers.master() as server:
        yield server


@pytest.fixture()
def own_mooncake_master() -> Iterator[mooncake_servers.MooncakeMaster]:
    """A mooncake_master for one test (it may kill and restart it)."""
    check_mooncake()
    with mooncake_servers.master() as server:
        yield server


@pytest.fixture(scope="module")
def cluster() -> Iterator[redis_servers.Cluster]:
    with redis_servers.cluster(3) as group:
        yield group


@pytest.fixture()
def token_file(tmp_path: Path) -> Callable[[str], str]:
    def write(text: str) -> str:
        path = tmp_path / "redis-token"
        path.write_text(text)
        path.chmod(0o600)
        return str(path)

    return write
