"""The second tier beside the daemon's event loop: a publisher thread, an
index follower thread, and a blocking `fetch` for the daemon's worker pool.

The event loop only ever calls what cannot block: `publish` enqueues (bounded
in bytes, dropped when full or while the store is down), `available` reads
the local index (`index`: what other daemons announced, learnt ahead of any
lookup, bounded in bytes), `reserve` takes from the promotion budget
(`budget`: the bytes fetched values may hold), `follow`, `snapshot`.
Everything that talks to the store runs on the tier's threads or the caller's
worker thread, through one circuit breaker per failure domain (a node), so a
store that is down or slow costs misses and dropped publications, never a
stuck daemon, and comes back by itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ec_daemon.remote.breaker import CLOSED, STATE_CODES, Breakers
from ec_daemon.remote.budget import PromotionBudget, Reservation
from ec_daemon.remote.index import RemoteIndex
from ec_daemon.remote.store import Announcement, RemoteError, RemoteStore, UnexpectedSize
from ec_daemon.remote.values import BadValue, Value, decode, encode, size_bounds

log = logging.getLogger("ec_daemon.remote")

# Niceness of the publisher thread (write-behind, below the daemon's loop).
PUBLISHER_NICE = 10
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
}
GAUGES = {
    "publish_queue_bytes": "Payload bytes waiting to be published",
    "index_entries": "Entries the local index holds (followed namespaces, not expired)",
    "index_bytes": "Memory of the local index, as counted against --remote-index-bytes",
    "promotion_bytes": "Bytes reserved by promotions between their fetch and their write",
    "promotion_bytes_peak": "The most promotion_bytes has been since start",
    "followed_namespaces": "Namespaces whose announcements are kept",
    "reachable": "1 when no store node's breaker is open",
    "breaker_state": "Worst breaker state: 0 closed, 1 half-open, 2 open",
    "breakers_open": "Store nodes currently refused (breaker open or half-open)",
}
BAD_VALUE_LOG_S = 60.0
UPKEEP_S = 5.0  # the index: expired entries swept, the store's clock read, this often
RECENT_S = 120.0  # a breaker unused this long (a node that left) stops counting
FOLLOW_PAUSE_S = 0.02  # after a read that found announcements, the index is read again this late


def latency_histogram() -> Histogram:
    """Store call latency by operation; registered by whoever collects the tier."""
    return Histogram("ec_daemon_remote_op_duration_seconds",
                     "Second-tier store call latency", ["op"], registry=None,
                     buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                              0.25, 0.5, 1.0, 2.5))


@dataclass
class _Job:
    namespace: str
    mm_hash: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    read: Callable[[], Any]
    release: Callable[[], None] | None
    current: Callable[[], bool] | None


class RemoteTier:
    """The tier's threads and state. Thread-safe: every public method may be
    called from any thread; only `fetch` blocks (on the network)."""

    def __init__(self, store: RemoteStore, *, ttl_s: float, publish_queue_bytes: int,
                 index_bytes: int = 64 << 20, promotion_bytes: int = 256 << 20,
                 block_s: float = 0.5, index_batch: int = 1000, breaker_threshold: int = 3,
                 breaker_base_s: float = 0.5, breaker_max_s: float = 30.0) -> None:
        if ttl_s <= 0 or publish_queue_bytes <= 0:
            raise ValueError("ttl_s and publish_queue_bytes must be positive")
        self.store = store
        self.ttl_s = ttl_s
        self.publish_queue_bytes = publish_queue_bytes
        self.block_s = block_s
        self.index_batch = index_batch
        self.breakers = Breakers(threshold=breaker_threshold, base_s=breaker_base_s,
                                 max_s=breaker_max_s)
        self.latency = latency_histogram()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        # Publisher queue.
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._queued_bytes = 0
        # The index, and whether the follower must read the shards again.
        self._index_lock = threading.Lock()
        self.index = RemoteIndex(max_bytes=index_bytes, ttl_ms=max(1, int(ttl_s * 1000)))
        self._rescan = False
        self.budget = PromotionBudget(promotion_bytes)
        # Counters and rate-limited logs.
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._bad_logged: dict[tuple[str, str], float] = {}

    # ------------------------------------------------------------ life

    def start(self) -> None:
        if self._threads:
            return
        for name, target in (("ec-remote-publisher", self._publisher),
                             ("ec-remote-index", self._follower)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the threads (within about block_s plus one store call), drop
        what is queued, and close the store."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        deadline = time.monotonic() + self.block_s + getattr(self.store, "timeout_s", 2.0) + 1
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._drain()
        self.store.close()

    # ------------------------------------------------------------ index

    def follow(self, namespace: str) -> None:
        """Keep index entries of `namespace` (entries announced before are
        read again from the index)."""
        with self._index_lock:
            if self.index.follow(namespace):
                self._rescan = True

    def unfollow(self, namespace: str) -> None:
        """No local session uses `namespace` any more: forget its entries."""
        with self._index_lock:
            self.index.unfollow(namespace)

    def forget(self, namespace: str, mm_hash: str) -> None:
        """Drop a key from the local index (it could not be promoted)."""
        self._forget(namespace, mm_hash)

    def available(self, namespace: str, mm_hash: str) -> int | None:
        """nbytes when the index says the store holds the key and it has not
        expired; never touches the network."""
        with self._index_lock:
            return self.index.get(namespace, mm_hash)

    def _forget(self, namespace: str, mm_hash: str) -> None:
        with self._index_lock:
            self.index.forget(namespace, mm_hash)

    def _absorb(self, found: list[Announcement]) -> None:
        with self._index_lock:
            evicted = self.index.absorb(found)
        self._count(index_announcements=len(found), index_evictions=evicted)

    def _sweep(self) -> None:
        with self._index_lock:
            self.index.sweep()

    def _learn_time(self) -> None:
        """Read the store's clock: a daemon that starts, or an index nobody
        announced on for a while, must still see which entries expired.
        (Store failures go to the breakers; the index keeps its time.)"""
        try:
            now_ms = self.store.clock_ms(self.breakers)
        except Exception:
            self._count(errors=1)
            log.exception("reading the store's clock failed")
            return
        if now_ms is not None:
            with self._index_lock:
                self.index.clock.observe(now_ms)

    def _follower(self) -> None:
        cursor: str | None = None
        next_upkeep = time.monotonic()
        while not self._stopping.is_set():
            with self._index_lock:
                if self._rescan:
                    cursor, self._rescan = None, False
            try:
                found, cursor = self.store.read_index(cursor, self.block_s, self.index_batch,
                                                      breakers=self.breakers)
            except RemoteError as exc:
                if self._stopping.is_set():
                    break
                self._count(errors=1)
                log.debug("index read failed: %s", exc)
                self._stopping.wait(self.block_s)
                continue
            except Exception:
                if self._stopping.is_set():
                    break
                self._count(errors=1)
                log.exception("index read failed")
                self._stopping.wait(self.block_s)
                continue
            if time.monotonic() >= next_upkeep:  # (before the absorb: the first read's too)
                self._learn_time()
                next_upkeep = time.monotonic() + UPKEEP_S
                self._sweep()
            if found:
                self._absorb(found)
                # Let announcements gather (each read costs 0.3 ms of CPU; a
                # publishing host would read back each of its own alone).
                self._stopping.wait(FOLLOW_PAUSE_S)

    # ------------------------------------------------------------ publish

    def publish(self, namespace: str, mm_hash: str, shape: tuple[int, ...], dtype: str,
                nbytes: int, read: Callable[[], Any],
                release: Callable[[], None] | None = None,
                current: Callable[[], bool] | None = None) -> bool:
        """Queue (namespace, mm_hash) for writing to the store; never blocks.
        False (nothing queued, `release` not called) when stopped, when the
        key's store node is down, or when the queue would exceed
        publish_queue_bytes. Otherwise the publisher thread calls `read()`
        (the payload, any buffer of nbytes or a list of buffers, or None when
        the bytes are gone: skipped), writes and announces it, then calls
        `release()` (always once, even when the job is dropped or fails).
        With `current`, the payload is the entry's memory, which may be
        rewritten meanwhile: `current()` says whether it still holds the
        entry, asked once it is checksummed (False: skipped) and once it is
        sent (False: not announced; the stored value fails its checksum or
        holds the entry)."""
        breaker = self.breakers.get(self.store.domain(namespace, mm_hash))
        if self._stopping.is_set() or breaker.rejecting():
            self._count(publish_drops=1)
            return False
        with self._cond:
            if self._queued_bytes + nbytes > self.publish_queue_bytes:
                dropped = True
            else:
                dropped = False
                self._queue.append(_Job(namespace, mm_hash, tuple(shape), dtype, nbytes,
                                        read, release, current))
                self._queued_bytes += nbytes
                self._cond.notify()
        if dropped:
            self._count(publish_drops=1)
        return not dropped

    def _publisher(self) -> None:
        _background_priority()
        while True:
            with self._cond:
                while not self._queue and not self._stopping.is_set():
                    self._cond.wait()
                if self._stopping.is_set():
                    return
                job = self._queue.popleft()
            try:
                self._publish_one(job)
            except Exception:
                self._count(publish_errors=1)
                log.exception("publishing %s failed", job.mm_hash)
            finally:
                with self._cond:
                    self._queued_bytes -= job.nbytes
                _release(job)

    def _publish_one(self, job: _Job) -> None:
        payload = job.read()
        if payload is None:
            self._count(publish_skips=1)
            return
        parts = encode(job.namespace, job.mm_hash, job.shape, job.dtype, payload)
        if sum(len(part) for part in parts[1:]) != job.nbytes:
            raise ValueError(f"read() returned {sum(len(p) for p in parts[1:])} bytes, "
                             f"expected {job.nbytes}")
        if job.current is not None and not job.current():
            self._count(publish_skips=1)  # rewritten before the checksum was taken
            return
        breaker = self.breakers.get(self.store.domain(job.namespace, job.mm_hash))
        if not breaker.allow():
            self._count(publish_drops=1)
            return
        started = time.monotonic()
        try:
            self.store.put(job.namespace, job.mm_hash, parts, self.ttl_s)
            self.latency.labels("put").observe(time.monotonic() - started)
            if job.current is not None and not job.current():
                breaker.success()
                self._count(publish_skips=1)  # perhaps sent rewritten: not announced
                return
            announced = time.monotonic()
            # The announcement must not outlive the value: its TTL runs from the put.
            self.store.announce(job.namespace, job.mm_hash, job.nbytes,
                                self.ttl_s - (announced - started))
            self.latency.labels("announce").observe(time.monotonic() - announced)
        except RemoteError as exc:
            breaker.failure(exc)
            self._count(publish_errors=1, errors=1)
            log.debug("publishing %s failed: %s", job.mm_hash, exc)
            return
        except BaseException as exc:
            breaker.failure(exc)
            raise
        breaker.success()
        self._count(publishes=1, publish_bytes=job.nbytes)

    def _drain(self) -> None:
        with self._cond:
            jobs = list(self._queue)
            self._queue.clear()
            self._queued_bytes -= sum(job.nbytes for job in jobs)
        if jobs:
            self._count(publish_drops=len(jobs))
        for job in jobs:
            _release(job)

    # ------------------------------------------------------------ fetch

    def reserve(self, namespace: str, mm_hash: str) -> Reservation | None:
        """Take the promotion budget for the key's announced value (call
        before `fetch`; never blocks). None when the index no longer holds
        the key, or when the budget is spent (counted: promotions_refused);
        a value that could never fit the budget is forgotten. The caller
        must `release()` the reservation once the value is written or
        dropped (a `finally`: releasing twice is harmless)."""
        nbytes = self.available(namespace, mm_hash)
        if nbytes is None:
            return None
        most = size_bounds(namespace, mm_hash, nbytes)[1]
        reservation = self.budget.reserve(nbytes, most)
        if reservation is None:
            self._count(promotions_refused=1)
            if most > self.budget.limit:
                self._forget(namespace, mm_hash)
        return reservation

    def fetch(self, namespace: str, mm_hash: str, nbytes: int | None = None) -> Value | None:
        """The verified value of (namespace, mm_hash), blocking on the store
        (call it from a worker thread). With `nbytes` (the announced payload;
        by default the index's, if it holds the key), a stored value of
        another size is refused having read no more than such a value takes.
        None when absent or expired, when the value is refused (counted,
        logged at most once per key a minute), or when the key's node is
        down. Never raises."""
        if nbytes is None:
            nbytes = self.available(namespace, mm_hash)
        size = size_bounds(namespace, mm_hash, nbytes) if nbytes is not None else None
        breaker = self.breakers.get(self.store.domain(namespace, mm_hash))
        for attempt in (1, 2):
            if not breaker.allow():
                self._count(fetch_refused=1)
                return None
            started = time.perf_counter()
            try:
                parts = self.store.get(namespace, mm_hash, size)
            except UnexpectedSize as exc:  # the store answered: not its failure
                breaker.success()
                self._bad_value(namespace, mm_hash, BadValue(f"not the announced value: {exc}"))
                return None
            except RemoteError as exc:
                breaker.failure(exc)
                self._count(errors=1)
                log.debug("fetch of %s failed: %s", mm_hash, exc)
                return None
            except Exception as exc:
                breaker.failure(exc)
                self._count(errors=1)
                log.exception("fetch of %s failed", mm_hash)
                return None
            breaker.success()
            self.latency.labels("get").observe(time.perf_counter() - started)
            if parts is None:
                self._count(remote_misses=1)
                self._forget(namespace, mm_hash)
                return None
            try:
                value = decode(parts, namespace=namespace, mm_hash=mm_hash)
                if nbytes is not None and value.nbytes != nbytes:
                    raise BadValue(f"not the announced value: {value.nbytes} payload bytes, "
                                   f"{nbytes} announced")
            except BadValue as exc:
                if attempt == 1:
                    continue  # a rewrite or an expiry may have raced the read: once more
                self._bad_value(namespace, mm_hash, exc)
                return None
            self._count(remote_hits=1, fetch_bytes=value.nbytes)
            return value
        return None

    def _bad_value(self, namespace: str, mm_hash: str, exc: BadValue) -> None:
        self._count(bad_values=1)
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

    # ------------------------------------------------------------ stats

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def snapshot(self) -> dict[str, float | int | bool]:
        """Counters and gauges for the Stats RPC, the CLI and /metrics."""
        with self._stats_lock:
            data: dict[str, float | int | bool] = dict(self._counts)
        with self._cond:
            data["publish_queue_bytes"] = self._queued_bytes
        with self._index_lock:
            data["index_entries"] = self.index.entries
            data["index_bytes"] = self.index.bytes
            data["followed_namespaces"] = self.index.namespaces
        data["promotion_bytes"] = self.budget.held
        data["promotion_bytes_peak"] = self.budget.peak
        states = [b.state for b in self.breakers.recent(RECENT_S)]
        down = [s for s in states if s != CLOSED]
        data["breakers_open"] = len(down)
        data["breaker_state"] = max((STATE_CODES[s] for s in states), default=0)
        data["reachable"] = not down
        return data

    def collect(self) -> Iterator[Metric]:
        """The tier's Prometheus families (ec_daemon_remote_*): register the
        tier itself as a collector."""
        data = self.snapshot()
        for name, help_text in COUNTERS.items():
            yield CounterMetricFamily(f"ec_daemon_remote_{name}", help_text,
                                      value=float(data[name]))
        for name, help_text in GAUGES.items():
            yield GaugeMetricFamily(f"ec_daemon_remote_{name}", help_text,
                                    value=float(data[name]))
        yield from self.latency.collect()

    def states(self) -> dict[str, str]:
        """Each failure domain's breaker state (diagnostics)."""
        return {b.name: b.state for b in self.breakers.all()}


def _background_priority() -> None:
    """Lower this thread's CPU priority (Linux: per thread): publishing is
    write-behind and must yield the cores to the engines' saves and loads."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUBLISHER_NICE)


def _release(job: _Job) -> None:
    if job.release is None:
        return
    try:
        job.release()
    except Exception:
        log.exception("release callback of %s failed", job.mm_hash)
