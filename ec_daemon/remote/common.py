"""What the second tier's parts have in common: one circuit breaker per
failure domain, the promotion budget, the counters and the store calls'
latency, this daemon's claim token, the stop, and the errors a store call
raises.

`RemoteTier` (`tier`) composes its publisher (`publisher`), resolver
(`resolver`) and backend (`backend`: Redis or Mooncake, each with what it
knows of its store) around one `Common`; each part holds it rather than the
tier, so no part imports the tier or another part. Every store call goes
through its domain's breaker (`through`), so a store that is down costs one
quick refusal per call and comes back by itself. Thread-safe.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import Histogram

from ec_daemon.core.limits import (
    BAD_VALUE_LOG_S,
    BREAKER_BASE_S,
    BREAKER_MAX_S,
    BREAKER_THRESHOLD,
)
from ec_daemon.remote.breaker import Breaker, Breakers
from ec_daemon.remote.budget import PromotionBudget
from ec_daemon.remote.values import BadValue

log = logging.getLogger("ec_daemon.remote")

T = TypeVar("T")

COUNTERS = {
    "publishes": "Entries written to the store and announced",
    "publish_bytes": "Payload bytes written to the store",
    "publish_drops": "Publications dropped: queue full, store down, or stopped",
    "publish_skips": "Publications skipped: the pages were reused before they were read",
    "publish_errors": "Publications that failed (store errors, unreadable payloads)",
    "remote_hits": "Fetches that returned a verified value",
    "remote_misses": "Fetches that found nothing (absent or expired)",
    "fetch_bytes": "Payload bytes fetched and verified",
    "fetch_refused": "Fetches not attempted: the key's store node is down (breaker open)",
    "bad_values": "Values refused: corrupt, truncated, foreign, or not the size announced",
    "errors": "Store calls that failed (fetches, publications, index reads)",
    "index_announcements": "Announcements read from the index (every namespace)",
    "index_evictions": "Index entries dropped to keep within --remote-index-bytes",
    "promotions_refused": "Promotions not started: --remote-promotion-bytes was spent "
                          "(the engine encodes)",
    "lookups": "Wanted keys the local index did not hold, resolved against the store",
    "lookup_hits": "Resolved keys the store held (promoted)",
    "lookup_cached": "Wanted keys answered absent from the negative cache (no store call)",
    "lookups_late": "Wanted keys the store did not settle within 2 s (a host that died "
                    "holds their claim or value): answered FAILED, the engine encodes",
    "claims_taken": "Cross-host claims this daemon took (its engine encodes, the others wait)",
    "claims_elsewhere": "Resolved keys another host had claimed (waited for its value)",
    "claim_timeouts": "Waits for another host's value that ran past the claim (encoded here)",
    "publish_exists": "Publications skipped: the store already held the key",
}


class RemoteError(Exception):
    """A store call failed (unreachable, timed out, refused); str() says which
    call and why."""


class RemotePeerError(RemoteError):
    """A transfer from or to another host of the store failed (a host that
    died, whose segment the store still lists): the store itself answered,
    so this does not count against its circuit breaker."""


class LocalWriteError(Exception):
    """Writing what the store returned into this host's region failed (the
    region's file refused the write): the store answered, so this does not
    count against its circuit breaker."""


class RemoteAuthError(RemoteError):
    """The store refused our credentials (a wrong or missing token): an
    operator's mistake, worth failing start-up for."""


class UnexpectedSize(Exception):
    """The stored value's size is outside what the caller allows (not the
    announced value: rewritten or forged); nothing past the allowed size was
    read. The store answered: this is not a store failure."""


class Refused(Exception):
    """The call's failure domain is refused by its breaker (open): nothing
    was asked of the store."""


def latency_histogram() -> Histogram:
    """Store call latency by operation; registered by whoever collects the tier."""
    return Histogram("ec_daemon_remote_op_duration_seconds",
                     "Second-tier store call latency", ["op"], registry=None,
                     buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                              0.25, 0.5, 1.0, 2.5))


class Common:
    """The state the tier's parts share, and the calls they all make."""

    def __init__(self, *, promotion_bytes: int, breaker_threshold: int = BREAKER_THRESHOLD,
                 breaker_base_s: float = BREAKER_BASE_S,
                 breaker_max_s: float = BREAKER_MAX_S) -> None:
        self.breakers = Breakers(threshold=breaker_threshold, base_s=breaker_base_s,
                                 max_s=breaker_max_s)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.latency = latency_histogram()
        self.stopping = threading.Event()
        self.budget = PromotionBudget(promotion_bytes)
        # Counters and rate-limited logs.
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._bad_logged: dict[tuple[str, str], float] = {}

    def through(self, domain: str, call: Callable[[], T],
                answered: tuple[type[BaseException], ...] = ()) -> T:
        """Make a store call through `domain`'s breaker. Raises Refused
        (nothing asked) when the breaker refuses. A call that raises tells
        its breaker and the exception propagates: as a failure of the store,
        unless the store answered (a value it refused, a write here that
        failed, a host that is gone: `tell_breaker`; or one of `answered`)."""
        breaker = self.breakers.get(domain)
        if not breaker.allow():
            raise Refused(domain)
        try:
            result = call()
        except answered:
            breaker.success()
            raise
        except BaseException as exc:
            tell_breaker(breaker, exc)
            raise
        breaker.success()
        return result

    def timed(self, op: str, call: Callable[[], T]) -> T:
        """`call()`, its latency observed as `op` when it returns."""
        started = time.perf_counter()
        result = call()
        self.latency.labels(op).observe(time.perf_counter() - started)
        return result

    def bad_value(self, namespace: str, mm_hash: str, exc: BadValue) -> None:
        """A value refused: counted, logged at most once per key every
        BAD_VALUE_LOG_S (the caller forgets the key)."""
        self.count(bad_values=1)
        now = time.monotonic()
        key = (namespace, mm_hash)
        with self._stats_lock:
            if len(self._bad_logged) > 10_000:
                self._bad_logged = {k: t for k, t in self._bad_logged.items()
                                    if now - t < BAD_VALUE_LOG_S}
            last = self._bad_logged.get(key)
            if last is not None and now - last < BAD_VALUE_LOG_S:
                return
            self._bad_logged[key] = now
        log.warning("remote value %s in namespace %r refused (not served): %s",
                    mm_hash, namespace, exc)

    def counts(self) -> dict[str, int]:
        """A copy of the counters (`COUNTERS`)."""
        with self._stats_lock:
            return dict(self._counts)

    def count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._counts[name] += delta


def tell_breaker(breaker: Breaker, exc: BaseException) -> None:
    """A call that raised, told to its breaker: the store failed, unless it
    answered (a value it holds refused, a transfer from a host that is gone,
    a write into this host's region that failed)."""
    if isinstance(exc, (BadValue, UnexpectedSize, RemotePeerError, LocalWriteError)):
        breaker.success()
    else:
        breaker.failure(exc)
