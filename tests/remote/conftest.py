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
from typing import Any

import pytest

from ec_daemon.durable.region import Region
from ec_daemon.remote.common import Common
from ec_daemon.remote.redis.backend import RedisBackend
from ec_daemon.remote.redis.store import open_store
from ec_daemon.remote.tier import RemoteTier
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


class Pages:
    """A region file of a test's host (`region`: the daemon's `Region`, read
    and written with pread/pwrite as the tier does): entries' bytes placed at
    page-aligned offsets (`place`), read back (`read`)."""

    def __init__(self, folder: Path, size: int = 64 << 20, page: int = 4096) -> None:
        path = folder / f"region-{os.getpid()}-{id(self)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        self.region = Region(path, size, 1, fd)
        self.page = page
        self._next = 0

    def extents(self, nbytes: int) -> tuple[tuple[int, int], ...]:
        """Extents of `nbytes` not used yet (one run)."""
        offset = self._next
        self._next += -(-max(nbytes, 1) // self.page) * self.page
        assert self._next <= self.region.size, "the test's region is full"
        return ((offset, nbytes),)

    def place(self, data: bytes | memoryview) -> tuple[tuple[int, int], ...]:
        """`data` written into pages of its own: their extents."""
        extents = self.extents(len(data))
        self.region.write(extents, [data])
        return extents

    def read(self, extents: Any) -> bytes:
        return b"".join(self.region.read(extents))

    def close(self) -> None:
        self.region.close()


@pytest.fixture()
def pages(tmp_path: Path) -> Iterator[Pages]:
    """A region file for the test's tiers to publish from and promote into."""
    made = Pages(tmp_path)
    yield made
    made.close()


def redis_tier(url: str, *, ttl_s: float = 60.0, publish_queue_bytes: int = 64 << 20,
               index_bytes: int = 64 << 20, promotion_bytes: int = 256 << 20,
               block_s: float = 0.5, claim_s: float = 0.0, timeout_s: float = 2.0,
               breaker_base_s: float = 0.5, breaker_max_s: float = 30.0) -> RemoteTier:
    """A tier on the Redis store at `url` (not started)."""
    common = Common(promotion_bytes=promotion_bytes, breaker_base_s=breaker_base_s,
                    breaker_max_s=breaker_max_s)
    backend = RedisBackend(common, open_store(url, timeout_s=timeout_s), ttl_s=ttl_s,
                           index_bytes=index_bytes, block_s=block_s)
    return RemoteTier(backend, publish_queue_bytes=publish_queue_bytes, claim_s=claim_s)


def publish(tier: RemoteTier, pages: Pages, mm_hash: str, data: bytes,
            namespace: str = NAMESPACE, shape: tuple[int, ...] | None = None,
            dtype: str = "uint8", current: Callable[[], bool] = lambda: True) -> bool:
    """`data` placed in `pages` and published from there, as the daemon
    publishes a ready entry (1-D uint8 unless `shape` and `dtype` say)."""
    return tier.publish(namespace, mm_hash, shape or (len(data),), dtype, pages.region,
                        pages.place(data), current)


def fetched(tier: RemoteTier, pages: Pages, mm_hash: str, nbytes: int | None = None,
            namespace: str = NAMESPACE) -> bytes | None:
    """The payload the tier promotes for the key, as the daemon does (`fetch`
    the value of `nbytes`, by default what the tier knows held, then
    `fetch_into` pages of its own), or None when either refused."""
    if nbytes is None:
        nbytes = tier.available(namespace, mm_hash)
        if nbytes is None:
            return None
    found = tier.fetch(namespace, mm_hash, nbytes)
    if found is None:
        return None
    extents = pages.extents(found.nbytes)
    if not tier.fetch_into(namespace, mm_hash, found, pages.region, extents):
        return None
    return pages.read(extents)


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
