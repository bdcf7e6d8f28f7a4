"""Mooncake's transfer buffers count against --remote-promotion-bytes, against
a real mooncake_master. Every byte a promotion moves passes through a
registered buffer; buffers were sized to the next power of two (a value just
over 512 KiB took 1 MiB) and up to 128 MiB of them stayed pooled, so promotions
within the budget held about twice it, plus the pool, uncounted."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ec_daemon.core.events import Resolution
from ec_daemon.durable.region import Region
from ec_daemon.remote.common import Common
from ec_daemon.remote.mooncake.backend import MooncakeBackend
from ec_daemon.remote.mooncake.buffers import buffer_bytes
from ec_daemon.remote.mooncake.store import MooncakeStore
from ec_daemon.remote.mooncake.url import parse_url
from ec_daemon.remote.tier import RemoteTier
from tests import mooncake_servers
from tests.remote.conftest import needs_mooncake, wait_for

pytestmark = needs_mooncake
STORE_NS = ("embedding@model:buffers#weights=x@revision:default@encoder:e"
            "@dtype:torch.float16@protocol:v3")
NS = "model|float16|image=2048"
SHAPE = (257, 1024)  # float16: 526,336 bytes, just over 512 KiB
NBYTES = SHAPE[0] * SHAPE[1] * 2
REGION = 4 << 20
BUDGET = 2 << 20
PROMOTIONS = 3


class Registered:
    """A MooncakeDistributedStore that keeps the bytes registered with it
    (now and at most), and whose value reads wait for each other (`meet`),
    so that the promotions' buffers all exist at once."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}
        self.now = self.peak = 0
        self.meet: threading.Barrier | None = None

    def register_buffer(self, address: int, size: int) -> int:
        code = self._client.register_buffer(address, size)
        with self._lock:
            self._sizes[address] = size
            self.now += size
            self.peak = max(self.peak, self.now)
        return int(code)

    def unregister_buffer(self, address: int) -> int:
        with self._lock:
            self.now -= self._sizes.pop(address, 0)
        return int(self._client.unregister_buffer(address))

    def get_into(self, key: str, address: int, size: int) -> Any:
        meet = self.meet
        if meet is not None and size > 1 << 16:  # (a value's read, not a checksum's)
            meet.wait(timeout=30)
        return self._client.get_into(key, address, size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.fixture
def tier(mooncake_master: mooncake_servers.MooncakeMaster) -> Iterator[
        tuple[RemoteTier, MooncakeStore, Registered, Region]]:
    from mooncake.store import MooncakeDistributedStore

    registered = Registered(MooncakeDistributedStore())
    spec = parse_url(mooncake_master.url_with(segment="32MiB", buffer="8MiB"))
    common = Common(promotion_bytes=BUDGET)
    moon = MooncakeStore(spec, client_factory=lambda: registered, budget=common.budget)
    fd = os.memfd_create("region")
    os.ftruncate(fd, REGION)
    region = Region(Path("/proc/self/fd") / str(fd), REGION, 1, fd)
    tier = RemoteTier(MooncakeBackend(common, moon, index_bytes=64 << 20),
                      publish_queue_bytes=1 << 20)
    try:
        tier.follow(NS, STORE_NS)
        assert wait_for(lambda: moon.connection.current[0] is not None, 60), \
            moon.connection._last_error
        tier.start()
        yield tier, moon, registered, region
    finally:
        tier.stop()
        os.close(fd)


def publish(moon: MooncakeStore, region: Region, mm_hash: str, seed: int) -> bytes:
    data = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float16).tobytes()
    region.write([(0, NBYTES)], [data])
    assert moon.put_entry(STORE_NS, mm_hash, SHAPE, "float16", region,
                          [(0, NBYTES)]) == "stored"
    return data


def found(tier: RemoteTier, mm_hash: str) -> None:
    told: list[Resolution] = []
    assert tier.resolve(NS, mm_hash, told.append, claim=False)
    assert wait_for(lambda: told, 10) and told[0] is Resolution.FOUND, told


def test_promotions_within_the_budget_never_hold_more_buffers_than_it(tier: Any) -> None:
    tier, moon, registered, region = tier
    keys = [f"buffers-{os.getpid()}-{i}" for i in range(PROMOTIONS + 1)]
    data = {mm_hash: publish(moon, region, mm_hash, seed) for seed, mm_hash in enumerate(keys)}
    for mm_hash in keys:
        found(tier, mm_hash)
    # Every promotion the budget lets start reads its value at the same time.
    reservations = [tier.reserve(NS, mm_hash) for mm_hash in keys[:PROMOTIONS]]
    assert all(r is not None for r in reservations), reservations
    registered.meet = threading.Barrier(PROMOTIONS)
    results: dict[str, bool] = {}

    def promote(i: int, mm_hash: str) -> None:
        value = tier.fetch(NS, mm_hash, NBYTES)
        assert value is not None
        results[mm_hash] = tier.fetch_into(NS, mm_hash, value, region,
                                           [(NBYTES * (i + 1), NBYTES)])

    threads = [threading.Thread(target=promote, args=(i, h))
               for i, h in enumerate(keys[:PROMOTIONS])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for reservation in reservations:
        assert reservation is not None
        reservation.release()
    registered.meet = None
    assert results == dict.fromkeys(keys[:PROMOTIONS], True)
    for i, mm_hash in enumerate(keys[:PROMOTIONS]):
        assert region.read([(NBYTES * (i + 1), NBYTES)])[0] == data[mm_hash]
    # The transfer buffers never held more than the budget.
    assert registered.peak <= BUDGET, (registered.peak, BUDGET)
    assert moon.buffers.buffers_bytes == registered.now == tier.budget.held
    # A promotion alone: its buffer stays pooled, held in the budget.
    last = tier.reserve(NS, keys[-1])
    assert last is not None and last.bytes == buffer_bytes(24 + NBYTES)
    value = tier.fetch(NS, keys[-1], NBYTES)
    assert value is not None and tier.fetch_into(NS, keys[-1], value, region, [(0, NBYTES)])
    last.release()
    assert moon.buffers.buffers_bytes == registered.now == tier.budget.held >= last.bytes
    assert tier.snapshot()["promotion_bytes"] == tier.budget.held
    # Promotions are not refused for buffers that sit idle: those are freed.
    again = [tier.reserve(NS, mm_hash) for mm_hash in keys[:PROMOTIONS]]
    assert all(r is not None for r in again), (again, tier.budget.held)
    assert registered.now == moon.buffers.buffers_bytes < last.bytes
    for reservation in again:
        assert reservation is not None
        reservation.release()
    assert tier.snapshot()["promotions_refused"] == 0
    assert registered.peak <= BUDGET, (registered.peak, BUDGET)


def test_buffer_sizes_waste_at_most_an_eighth_or_64_kib() -> None:
    for size in (1, 1 << 16, (1 << 16) + 1, 526_360, 1 << 20, (1 << 20) + 1, 3 << 20,
                 (1 << 30) - 5):
        capacity = buffer_bytes(size)
        assert capacity >= size and capacity % (1 << 16) == 0
        assert capacity - size < max(1 << 16, size // 8), (size, capacity)
