"""Circuit breakers: a store that is down costs one quick refusal per call,
never a timeout per call, and comes back by itself.

closed -> open after `threshold` consecutive failures (one warning naming the
error); while open every call is refused without touching the network; once
the backoff (doubling from `base_s` to `max_s`) has passed, one call goes
through as a probe (half-open): success closes the breaker (one "reachable
again" line), failure opens it again for twice as long. There is one breaker
per failure domain (`Breakers`): a single node is one domain, each node of a
cluster is its own, so a dead node costs only the keys it holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ec_daemon.core.limits import BREAKER_BASE_S, BREAKER_MAX_S, BREAKER_PROBE_S, BREAKER_THRESHOLD

log = logging.getLogger("ec_daemon.remote")

CLOSED = "closed"
HALF_OPEN = "half_open"
OPEN = "open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class Breaker:
    """One failure domain's breaker; thread-safe. Every call that `allow()`
    let through must report `success()` or `failure(exc)` (a probe that
    reports neither keeps the breaker half-open, refusing, until `probe_s`)."""

    def __init__(self, name: str, *, threshold: int = BREAKER_THRESHOLD,
                 base_s: float = BREAKER_BASE_S, max_s: float = BREAKER_MAX_S,
                 probe_s: float = BREAKER_PROBE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1 or base_s <= 0 or max_s < base_s:
            raise ValueError("threshold >= 1 and 0 < base_s <= max_s")
        self.name = name
        self.threshold = threshold
        self.base_s = base_s
        self.max_s = max_s
        self.probe_s = probe_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._backoff = base_s
        self._retry_at = 0.0
        self._opened_at = 0.0
        self._probe_started = 0.0
        self.opened = 0  # times it opened (closed -> open)
        self.last_used = clock()

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == OPEN and self._clock() >= self._retry_at:
                return HALF_OPEN
            return self._state

    def retry_in(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when it would now)."""
        with self._lock:
            if self._state == CLOSED:
                return 0.0
            if self._state == HALF_OPEN:
                return max(0.0, self._probe_started + self.probe_s - self._clock())
            return max(0.0, self._retry_at - self._clock())

    def rejecting(self) -> bool:
        """True while calls are refused and the next probe is not due: a
        cheap check that does not take the probe (publish uses it)."""
        return self.retry_in() > 0.0

    def allow(self) -> bool:
        """Whether a call may go to the store now; in half-open, only one."""
        with self._lock:
            now = self._clock()
            self.last_used = now
            if self._state == CLOSED:
                return True
            if self._state == OPEN and now >= self._retry_at:
                self._state = HALF_OPEN
                self._probe_started = now
                return True
            if self._state == HALF_OPEN and now >= self._probe_started + self.probe_s:
                self._probe_started = now  # the previous probe never reported
                return True
            return False

    def success(self) -> None:
        with self._lock:
            was = self._state
            self._state = CLOSED
            self._failures = 0
            self._backoff = self.base_s
            down = self._clock() - self._opened_at
        if was != CLOSED:
            log.info("remote store %s: reachable again (after %.1f s)", self.name, down)

    def failure(self, exc: BaseException) -> None:
        with self._lock:
            now = self._clock()
            if self._state == CLOSED:
                self._failures += 1
                if self._failures < self.threshold:
                    return
                self._state = OPEN
                self._opened_at = now
                self._backoff = self.base_s
                self._retry_at = now + self._backoff
                self.opened += 1
                failures = self._failures
            else:  # a failed probe (or a late failure): open again, twice as long
                self._backoff = min(self.max_s, self._backoff * 2)
                self._state = OPEN
                self._retry_at = now + self._backoff
                return
        log.warning("remote store %s: unreachable after %d failures in a row (%s: %s); "
                    "its keys miss until it answers again (retrying with backoff up to "
                    "%.0f s)", self.name, failures, type(exc).__name__, exc, self.max_s)


class Breakers:
    """The breakers by failure domain, created on first use; thread-safe."""

    def __init__(self, *, threshold: int = BREAKER_THRESHOLD, base_s: float = BREAKER_BASE_S,
                 max_s: float = BREAKER_MAX_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.base_s = base_s
        self.max_s = max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_domain: dict[str, Breaker] = {}

    def get(self, domain: str) -> Breaker:
        breaker = self._by_domain.get(domain)
        if breaker is None:
            with self._lock:
                breaker = self._by_domain.get(domain)
                if breaker is None:
                    breaker = Breaker(domain, threshold=self.threshold, base_s=self.base_s,
                                      max_s=self.max_s, clock=self._clock)
                    self._by_domain[domain] = breaker
        return breaker

    def all(self) -> list[Breaker]:
        with self._lock:
            return list(self._by_domain.values())

    def recent(self, within_s: float) -> list[Breaker]:
        """Breakers used within the last `within_s` seconds (a domain that
        left the cluster stops counting)."""
        now = self._clock()
        return [b for b in self.all() if now - b.last_used <= within_s]
