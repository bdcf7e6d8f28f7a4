"""What promotions may hold: a stored value larger (or smaller) than its
announcement is refused before it is transferred, and fetched values never
hold more than the promotion budget, however many promotions run at once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from ec_daemon.remote.budget import PromotionBudget
from ec_daemon.remote.redis.store import value_key
from ec_daemon.remote.tier import RemoteTier
from ec_daemon.remote.values import encode, size_bounds
from tests import redis_servers
from tests.remote.conftest import (
    NAMESPACE,
    Pages,
    needs_redis,
    payload,
    publish,
    redis_tier,
    wait_for,
)


@pytest.fixture()
def tier(node: redis_servers.RedisServer) -> Iterator[RemoteTier]:
    made = redis_tier(node.url, timeout_s=1.0, promotion_bytes=1 << 20, block_s=0.2)
    made.follow(NAMESPACE)
    made.start()
    yield made
    made.stop()


def published(tier: RemoteTier, pages: Pages, mm_hash: str, data: bytes) -> None:
    assert publish(tier, pages, mm_hash, data)
    assert wait_for(lambda: tier.available(NAMESPACE, mm_hash) == len(data), 3.0)


def sent_by(server: redis_servers.RedisServer) -> int:
    """Bytes the server has written to its clients so far."""
    return int(server.client().info("stats")["total_net_output_bytes"])


def test_the_budget_counts_each_reservation_once() -> None:
    budget = PromotionBudget(100)
    first = budget.reserve(10, 60)
    assert first is not None and first.nbytes == 10 and budget.held == 60
    assert budget.reserve(10, 50) is None and budget.held == 60  # nothing held for it
    second = budget.reserve(10, 40)
    assert second is not None and budget.held == budget.peak == 100
    first.release()
    first.release()  # harmless: a finally may always release
    assert budget.held == 40 and budget.peak == 100
    second.release()
    assert budget.held == 0


@needs_redis
@pytest.mark.parametrize("stored_bytes", [8 << 20, 500])
def test_a_value_not_of_the_announced_size_is_refused_unread(
        node: redis_servers.RedisServer, tier: RemoteTier, stored_bytes: int,
        caplog: pytest.LogCaptureFixture, pages: Pages) -> None:
    key = f"resized-{stored_bytes}"
    published(tier, pages, key, payload(1000))
    # Rewritten by someone else: a consistent value, of another size.
    other = payload(stored_bytes)
    node.client().set(value_key(NAMESPACE, key), b"".join(
        bytes(p) for p in encode(NAMESPACE, key, (stored_bytes,), "uint8", other)))
    before = sent_by(node)
    with caplog.at_level(logging.WARNING, logger="ec_daemon.remote"):
        assert tier.fetch(NAMESPACE, key, 1000) is None
    assert sent_by(node) - before < size_bounds(NAMESPACE, key, 1000)[1] + 4096
    assert tier.snapshot()["bad_values"] == 1 and tier.snapshot()["errors"] == 0
    assert tier.available(NAMESPACE, key) is None  # no longer promised
    assert any("not the announced value" in r.getMessage() for r in caplog.records)
    assert tier.snapshot()["reachable"] is True  # the store is fine


@needs_redis
def test_promotions_at_once_hold_no_more_than_the_budget(tier: RemoteTier, pages: Pages) -> None:
    """Sixteen promotions at once, each holding its value a while (an
    allocation that waits), with room for three."""
    size = 300_000
    for i in range(16):
        published(tier, pages, f"burst-{i}", payload(size))
    fetched: list[int] = []
    gate = threading.Barrier(16)

    def promote(mm_hash: str) -> None:
        gate.wait(5)
        reservation = tier.reserve(NAMESPACE, mm_hash)
        if reservation is None:
            return
        try:
            value = tier.fetch(NAMESPACE, mm_hash, reservation.nbytes)
            assert value is not None
            time.sleep(0.2)
            fetched.append(value.nbytes)
        finally:
            reservation.release()

    threads = [threading.Thread(target=promote, args=(f"burst-{i}",)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    snap = tier.snapshot()
    assert 3 <= len(fetched) < 16 and snap["promotions_refused"] == 16 - len(fetched)
    assert 3 * size < snap["promotion_bytes_peak"] <= tier.budget.limit
    assert snap["promotion_bytes"] == 0
    # Once they are done, the next one starts.
    reservation = tier.reserve(NAMESPACE, "burst-0")
    assert reservation is not None
    reservation.release()


@needs_redis
def test_a_value_larger_than_the_budget_never_promotes(tier: RemoteTier, pages: Pages) -> None:
    published(tier, pages, "too-large", payload(2 << 20))
    assert tier.reserve(NAMESPACE, "too-large") is None
    assert tier.snapshot()["promotions_refused"] == 1
    assert tier.available(NAMESPACE, "too-large") is None  # never asked for again
