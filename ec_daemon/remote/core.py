"""The second tier's core, which its publisher, follower, fetches and
resolver (`resolver`) share: the store, one circuit breaker per failure
domain, the promotion budget, the counters, and what the tier knows of the
store without asking it (the followed index of an indexed store, the keys
a probed store was found to hold, each namespace's name in the store).

`RemoteTier` (`tier`) composes this core with its publisher (`publisher`),
index follower (`follower`) and resolver (`resolver`); each part holds the
core rather than the tier, so no part imports the tier or another part.
Thread-safe, like the tier.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict

from prometheus_client import Histogram

from ec_daemon.remote.backend import AnyStore, Head, ProbedStore, RemotePeerError
from ec_daemon.remote.breaker import Breaker, Breakers
from ec_daemon.remote.budget import PromotionBudget
from ec_daemon.remote.index import RemoteIndex
from ec_daemon.remote.values import BadValue

log = logging.getLogger("ec_daemon.remote")

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
BAD_VALUE_LOG_S = 60.0
FOUND_S = 30.0  # (stores without an index) a key found is taken as present this long


def latency_histogram() -> Histogram:
    """Store call latency by operation; registered by whoever collects the tier."""
    return Histogram("ec_daemon_remote_op_duration_seconds",
                     "Second-tier store call latency", ["op"], registry=None,
                     buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                              0.25, 0.5, 1.0, 2.5))


class TierCore:
    """The state the tier's parts share, and the calls they all make."""

    def __init__(self, store: AnyStore, *, ttl_s: float, index_bytes: int,
                 promotion_bytes: int, breaker_threshold: int, breaker_base_s: float,
                 breaker_max_s: float) -> None:
        # An indexed store (Redis), or one asked for each key (Mooncake):
        # `store.indexed` says which (`backend`).
        self.store: AnyStore = store
        self.breakers = Breakers(threshold=breaker_threshold, base_s=breaker_base_s,
                                 max_s=breaker_max_s)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.latency = latency_histogram()
        self.stopping = threading.Event()
        # The index, and whether the follower must read the shards again
        # (`index_lock` guards both, and `_found`).
        self.index_lock = threading.Lock()
        self.index = RemoteIndex(max_bytes=index_bytes, ttl_ms=max(1, int(ttl_s * 1000)))
        self._rescan = False
        self.budget = PromotionBudget(promotion_bytes)
        if not store.indexed:  # (its transfer buffers, pooled or in use, count in it)
            store.use_budget(self.budget)
        # The store's name of each followed namespace (stores shared with
        # vLLM's own connector key entries by the engine's scheme).
        self._store_names: dict[str, str] = {}
        # Stores without an index: keys found, with their header, until FOUND_S.
        self._found: OrderedDict[tuple[str, str], tuple[float, Head]] = OrderedDict()
        self._found_max = max(1, index_bytes // 512)
        # Counters and rate-limited logs.
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._bad_logged: dict[tuple[str, str], float] = {}

    @property
    def indexed(self) -> bool:
        """Whether the store keeps an index the tier follows (`backend`)."""
        return self.store.indexed

    def follow(self, namespace: str, store_namespace: str = "") -> None:
        """Keep index entries of `namespace` (entries announced before are
        read again from the index). `store_namespace`: the engine's name for
        it in a store shared with vLLM's own connector (Mooncake); the first
        one given is kept."""
        with self.index_lock:
            if self.index.follow(namespace):
                self._rescan = True
            if namespace not in self._store_names or not self._store_names[namespace]:
                self._store_names[namespace] = store_namespace

    def unfollow(self, namespace: str) -> None:
        """No local session uses `namespace` any more: forget its entries."""
        with self.index_lock:
            self.index.unfollow(namespace)
            self._store_names.pop(namespace, None)
            for key in [k for k in self._found if k[0] == namespace]:
                del self._found[key]

    def store_name(self, namespace: str) -> str:
        """The key prefix of `namespace` in a store without an index: the
        engine's store namespace, or one of ec-daemon's own (an engine that
        sent none: shared only with other ec-daemon hosts)."""
        return self._store_names.get(namespace) or f"ec-daemon@{namespace}"

    def keyspace(self, namespace: str) -> str:
        """The namespace under which the store keys `namespace`'s items: the
        daemon's own in an indexed store, `store_name` in the other."""
        return namespace if self.store.indexed else self.store_name(namespace)

    def forget(self, namespace: str, mm_hash: str) -> None:
        """Drop a key from the local index (it could not be promoted)."""
        self._forget(namespace, mm_hash)

    def take_rescan(self) -> bool:
        """Whether the index must be read again from its start (a namespace
        was followed since the last call): said once."""
        with self.index_lock:
            rescan, self._rescan = self._rescan, False
        return rescan

    def found_head(self, namespace: str, mm_hash: str) -> Head | None:
        """(Stores without an index) the header of a key found held, if the
        tier still remembers it (`remember`)."""
        with self.index_lock:
            found = self._found.get((namespace, mm_hash))
        return found[1] if found is not None else None

    def available(self, namespace: str, mm_hash: str) -> int | None:
        """nbytes when the index says the store holds the key and it has not
        expired; never touches the network."""
        with self.index_lock:
            if not self.store.indexed:
                found = self._found.get((namespace, mm_hash))
                if found is None or found[0] <= time.monotonic():
                    return None
                return int(found[1].nbytes)
            return self.index.get(namespace, mm_hash)

    def _forget(self, namespace: str, mm_hash: str) -> None:
        with self.index_lock:
            self.index.forget(namespace, mm_hash)
            self._found.pop((namespace, mm_hash), None)

    def remember(self, namespace: str, mm_hash: str, head: Head) -> None:
        with self.index_lock:
            self._found[(namespace, mm_hash)] = (time.monotonic() + FOUND_S, head)
            self._found.move_to_end((namespace, mm_hash))
            while len(self._found) > self._found_max:
                self._found.popitem(last=False)

    def read_head(self, store: ProbedStore, namespace: str, mm_hash: str) -> Head | None:
        """The value's header (`MooncakeStore.head`), through the breaker;
        None when absent, refused or unreachable (counted)."""
        breaker = self.breakers.get(store.domain(namespace, mm_hash))
        if not breaker.allow():
            self.count(fetch_refused=1)
            return None
        started = time.perf_counter()
        try:
            head = store.head(self.store_name(namespace), mm_hash)
        except BadValue as exc:
            breaker.success()
            self.bad_value(namespace, mm_hash, exc)
            return None
        except Exception as exc:
            tell_breaker(breaker, exc)
            self.count(errors=1)
            log.debug("reading the header of %s failed: %s", mm_hash, exc)
            return None
        breaker.success()
        self.latency.labels("head").observe(time.perf_counter() - started)
        if head is None:
            self.count(remote_misses=1)
            self._forget(namespace, mm_hash)
        return head

    def bad_value(self, namespace: str, mm_hash: str, exc: BadValue) -> None:
        """A value refused: counted, its key forgotten, logged at most once
        per key every BAD_VALUE_LOG_S."""
        self.count(bad_values=1)
        self._forget(namespace, mm_hash)
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
    """A failed store call, told to its breaker: a transfer from a host that
    is gone is not the store failing (the store answered)."""
    if isinstance(exc, RemotePeerError):
        breaker.success()
    else:
        breaker.failure(exc)
