"""The circuit breaker's states, on a fake clock."""

from __future__ import annotations

import logging

import pytest

from ec_daemon.remote.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, Breakers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock) -> Breaker:
    return Breaker("127.0.0.1:6379", threshold=3, base_s=0.5, max_s=4.0, clock=clock)


def test_opens_after_consecutive_failures_and_logs_once(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    clock = Clock()
    breaker = make(clock)
    with caplog.at_level(logging.INFO, logger="ec_daemon.remote"):
        for _ in range(2):
            assert breaker.allow()
            breaker.failure(ConnectionError("refused"))
        breaker.success()  # not consecutive: counting starts again
        for _ in range(3):
            assert breaker.allow()
            breaker.failure(ConnectionError("refused"))
        assert breaker.state == OPEN and not breaker.allow() and breaker.rejecting()
        for _ in range(5):  # refused calls log nothing more
            assert not breaker.allow()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "127.0.0.1:6379: unreachable after 3 failures" in warnings[0].getMessage()
    assert "ConnectionError: refused" in warnings[0].getMessage()


def test_backoff_doubles_to_the_cap_and_one_probe_at_a_time(caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    clock = Clock()
    breaker = make(clock)
    for _ in range(3):
        breaker.allow()
        breaker.failure(OSError("down"))
    waits = []
    for _ in range(6):
        waits.append(breaker.retry_in())
        clock.now += breaker.retry_in()
        assert breaker.state == HALF_OPEN and not breaker.rejecting()
        assert breaker.allow()  # the probe
        assert not breaker.allow()  # nobody else meanwhile
        breaker.failure(OSError("still down"))
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    clock.now += breaker.retry_in()
    with caplog.at_level(logging.INFO, logger="ec_daemon.remote"):
        assert breaker.allow()
        breaker.success()
    assert breaker.state == CLOSED and breaker.allow()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        "remote store 127.0.0.1:6379: reachable again (after 19.5 s)"]
    # Open again: the backoff starts from the bottom.
    for _ in range(3):
        breaker.failure(OSError("down"))
    assert breaker.retry_in() == 0.5


def test_a_probe_that_never_reports_is_replaced() -> None:
    clock = Clock()
    breaker = make(clock)
    for _ in range(3):
        breaker.failure(OSError("down"))
    clock.now += 0.5
    assert breaker.allow() and not breaker.allow()
    clock.now += breaker.probe_s
    assert breaker.allow()


def test_breakers_by_domain() -> None:
    clock = Clock()
    breakers = Breakers(threshold=1, base_s=1.0, max_s=2.0, clock=clock)
    breakers.get("a:1").failure(OSError("down"))
    assert breakers.get("a:1").state == OPEN and breakers.get("b:2").state == CLOSED
    assert breakers.get("a:1") is breakers.get("a:1")
    clock.now += 1000
    breakers.get("b:2").allow()
    assert [b.name for b in breakers.recent(10)] == ["b:2"]
