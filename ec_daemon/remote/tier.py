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

A wanted item the local index does not hold is *resolved* (`resolve`, on the
resolver thread, batched): a store without an index (Mooncake) is asked
whether it holds the key, and a key nobody holds is claimed across hosts
(`claim_s`), so that when two hosts miss one new image at once one encodes
and the other waits for its value (bounded by the claim) and promotes it. A
key found absent is remembered for NEGATIVE_S: a storm of misses is not a
storm of lookups.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ec_daemon.remote.breaker import CLOSED, STATE_CODES, Breakers
from ec_daemon.remote.budget import PromotionBudget, Reservation
from ec_daemon.remote.index import RemoteIndex
from ec_daemon.remote.store import (
    Announcement,
    LocalWriteError,
    RemoteAuthError,
    RemoteError,
    RemotePeerError,
    RemoteStore,
    UnexpectedSize,
)
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
    "lookups": "Wanted keys the local index did not hold, resolved against the store",
    "lookup_hits": "Resolved keys the store held (promoted)",
    "lookup_cached": "Wanted keys answered absent from the negative cache (no store call)",
    "claims_taken": "Cross-host claims this daemon took (its engine encodes, the others wait)",
    "claims_elsewhere": "Resolved keys another host had claimed (waited for its value)",
    "claim_timeouts": "Waits for another host's value that ran past the claim (encoded here)",
    "publish_exists": "Publications skipped: the store already held the key",
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
NEGATIVE_S = 1.0  # a key found absent (and not claimable) is not looked up again this soon
NEGATIVE_KEYS = 65536  # the most keys the negative cache holds
POLL_S = 0.05  # keys another host claimed: the store is asked again this often
RESOLVE_BATCH = 64  # keys resolved in one round (one batched lookup)
# Resolver threads: a key whose value or claim sits on a host that died takes
# about 1 s to fail (until the store forgets that host); it holds up one.
RESOLVER_THREADS = 4
FOUND_S = 30.0  # (stores without an index) a key found is taken as present this long


class Outcome(Enum):
    """How a resolution ended (`RemoteTier.resolve`)."""

    FOUND = "found"  # the store holds it: promote (nbytes known to `available`)
    CLAIMED = "claimed"  # nobody holds it and this host claimed it: encode here
    ELSEWHERE = "elsewhere"  # another host claimed it: waiting for its value
    ABSENT = "absent"  # not held, not claimable (claims off, or waited past the claim)
    FAILED = "failed"  # the store could not say (down, slow): encode here


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
    extents: list[tuple[int, int]] | None = None


@dataclass
class _Resolving:
    key: tuple[str, str]
    done: Callable[[Outcome], None]
    claim: bool = True  # False: only looked up (no engine here would save it)
    deadline: float = 0.0  # (ELSEWHERE) waited for until then


class StoredValue:
    """A value in a store without an index, read straight into the pages a
    promotion allocated (`write_into`): its header is known, its payload not
    yet read."""

    def __init__(self, tier: RemoteTier, namespace: str, mm_hash: str, head: Any) -> None:
        self._tier, self._namespace, self._mm_hash, self._head = tier, namespace, mm_hash, head
        self.shape, self.dtype, self.nbytes = head.shape, head.dtype, head.nbytes

    def write_into(self, region_file: Any, extents: list[tuple[int, int]]) -> bool:
        """Read and verify the payload into `extents` (never raises): False
        when it failed (counted; the pages hold nothing to serve)."""
        return self._tier.read_into(self._namespace, self._mm_hash, self._head, extents)


class RemoteTier:
    """The tier's threads and state. Thread-safe: every public method may be
    called from any thread; only `fetch` blocks (on the network)."""

    def __init__(self, store: RemoteStore, *, ttl_s: float, publish_queue_bytes: int,
                 index_bytes: int = 64 << 20, promotion_bytes: int = 256 << 20,
                 block_s: float = 0.5, index_batch: int = 1000, breaker_threshold: int = 3,
                 breaker_base_s: float = 0.5, breaker_max_s: float = 30.0,
                 claim_s: float = 0.0) -> None:
        """`claim_s`: a key nobody holds is claimed across hosts for this long
        (0: no claims); stores without an index (`indexed` False) are asked
        for every wanted key the daemon does not know."""
        if ttl_s <= 0 or publish_queue_bytes <= 0:
            raise ValueError("ttl_s and publish_queue_bytes must be positive")
        # A RemoteStore (Redis), or a store without an index (`mooncake.MooncakeStore`).
        self.store: Any = store
        self.ttl_s = ttl_s
        self.publish_queue_bytes = publish_queue_bytes
        self.block_s = block_s
        self.index_batch = index_batch
        self.breakers = Breakers(threshold=breaker_threshold, base_s=breaker_base_s,
                                 max_s=breaker_max_s)
        self.indexed = hasattr(store, "read_index")
        self.claim_s = claim_s
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
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
        # The store's name of each followed namespace (stores shared with
        # vLLM's own connector key entries by the engine's scheme).
        self._store_names: dict[str, str] = {}
        # Stores without an index: keys found, with their header, until FOUND_S.
        self._found: OrderedDict[tuple[str, str], tuple[float, Any]] = OrderedDict()
        self._found_max = max(1, index_bytes // 512)
        # Resolutions: queued, waiting for another host; keys found absent;
        # claims this daemon holds (released once the value is published).
        self._resolve_cond = threading.Condition()
        self._resolving: list[_Resolving] = []
        self._elsewhere: list[_Resolving] = []
        self._absent: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._claimed: dict[tuple[str, str], float] = {}
        # Counters and rate-limited logs.
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._bad_logged: dict[tuple[str, str], float] = {}

    # ------------------------------------------------------------ life

    def start(self) -> None:
        if self._threads:
            return
        threads: list[tuple[str, Callable[[], None]]] = [
            ("ec-remote-publisher", self._publisher),
            *((f"ec-remote-resolver-{i}", self._resolver) for i in range(RESOLVER_THREADS))]
        if self.indexed:
            threads.append(("ec-remote-index", self._follower))
        for name, target in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the threads (within about block_s plus one store call), drop
        what is queued, and close the store."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        with self._resolve_cond:
            self._resolve_cond.notify_all()
        deadline = time.monotonic() + self.block_s + getattr(self.store, "timeout_s", 2.0) + 1
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._drain()
        with self._resolve_cond:
            pending, self._resolving, self._elsewhere = \
                self._resolving + self._elsewhere, [], []
        for item in pending:
            _tell(item, Outcome.FAILED)
        self.store.close()

    # ------------------------------------------------------------ index

    def follow(self, namespace: str, store_namespace: str = "") -> None:
        """Keep index entries of `namespace` (entries announced before are
        read again from the index). `store_namespace`: the engine's name for
        it in a store shared with vLLM's own connector (Mooncake); the first
        one given is kept."""
        with self._index_lock:
            if self.index.follow(namespace):
                self._rescan = True
            if namespace not in self._store_names or not self._store_names[namespace]:
                self._store_names[namespace] = store_namespace

    def unfollow(self, namespace: str) -> None:
        """No local session uses `namespace` any more: forget its entries."""
        with self._index_lock:
            self.index.unfollow(namespace)
            self._store_names.pop(namespace, None)
            for key in [k for k in self._found if k[0] == namespace]:
                del self._found[key]

    def store_name(self, namespace: str) -> str:
        """The key prefix of `namespace` in a store without an index: the
        engine's store namespace, or one of ec-daemon's own (an engine that
        sent none: shared only with other ec-daemon hosts)."""
        return self._store_names.get(namespace) or f"ec-daemon@{namespace}"

    def forget(self, namespace: str, mm_hash: str) -> None:
        """Drop a key from the local index (it could not be promoted)."""
        self._forget(namespace, mm_hash)

    def available(self, namespace: str, mm_hash: str) -> int | None:
        """nbytes when the index says the store holds the key and it has not
        expired; never touches the network."""
        with self._index_lock:
            if not self.indexed:
                found = self._found.get((namespace, mm_hash))
                if found is None or found[0] <= time.monotonic():
                    return None
                return int(found[1].nbytes)
            return self.index.get(namespace, mm_hash)

    def _forget(self, namespace: str, mm_hash: str) -> None:
        with self._index_lock:
            self.index.forget(namespace, mm_hash)
            self._found.pop((namespace, mm_hash), None)

    def _remember(self, namespace: str, mm_hash: str, head: Any) -> None:
        with self._index_lock:
            self._found[(namespace, mm_hash)] = (time.monotonic() + FOUND_S, head)
            self._found.move_to_end((namespace, mm_hash))
            while len(self._found) > self._found_max:
                self._found.popitem(last=False)

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
                current: Callable[[], bool] | None = None,
                extents: list[tuple[int, int]] | None = None) -> bool:
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
        holds the entry). `extents`: the entry's place in the region, which a
        store that maps the region (Mooncake) reads itself."""
        breaker = self.breakers.get(self.store.domain(namespace, mm_hash))
        if self._stopping.is_set() or breaker.rejecting():
            self._count(publish_drops=1)
            self._release_claim(namespace, mm_hash)
            return False
        with self._cond:
            if self._queued_bytes + nbytes > self.publish_queue_bytes:
                dropped = True
            else:
                dropped = False
                self._queue.append(_Job(namespace, mm_hash, tuple(shape), dtype, nbytes,
                                        read, release, current, extents))
                self._queued_bytes += nbytes
                self._cond.notify()
        if dropped:
            self._count(publish_drops=1)
            self._release_claim(namespace, mm_hash)
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
                # Published, skipped or failed: other hosts waiting for it stop
                # waiting on this host's claim (they find the value, or encode).
                self._release_claim(job.namespace, job.mm_hash)

    def _publish_one(self, job: _Job) -> None:
        if not self.indexed:
            self._put_entry(job)
            return
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
            _failed(breaker, exc)
            self._count(publish_errors=1, errors=1)
            log.debug("publishing %s failed: %s", job.mm_hash, exc)
            return
        except BaseException as exc:
            _failed(breaker, exc)
            raise
        breaker.success()
        self._count(publishes=1, publish_bytes=job.nbytes)

    def _put_entry(self, job: _Job) -> None:
        """Publish to a store without an index, from the pages in place."""
        if job.extents is None or not getattr(self.store, "mapped", False) \
                or not self.store.accepts(job.mm_hash):
            self._count(publish_skips=1)
            return
        breaker = self.breakers.get(self.store.domain(job.namespace, job.mm_hash))
        if not breaker.allow():
            self._count(publish_drops=1)
            return
        started = time.monotonic()
        try:
            result = self.store.put_entry(self.store_name(job.namespace), job.mm_hash,
                                          job.shape, job.dtype, job.extents, job.current)
        except RemoteError as exc:
            _failed(breaker, exc)
            self._count(publish_errors=1, errors=1)
            log.debug("publishing %s failed: %s", job.mm_hash, exc)
            return
        except ValueError as exc:  # (a tensor the store's format cannot carry)
            breaker.success()
            self._count(publish_skips=1)
            log.debug("not publishing %s: %s", job.mm_hash, exc)
            return
        except BaseException as exc:
            _failed(breaker, exc)
            raise
        breaker.success()
        self.latency.labels("put").observe(time.monotonic() - started)
        if result == "stored":
            self._count(publishes=1, publish_bytes=job.nbytes)
        elif result == "exists":
            self._count(publish_exists=1)
        else:
            self._count(publish_skips=1)

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

    def fetch(self, namespace: str, mm_hash: str,
              nbytes: int | None = None) -> Value | StoredValue | None:
        """The verified value of (namespace, mm_hash), blocking on the store
        (call it from a worker thread). With `nbytes` (the announced payload;
        by default the index's, if it holds the key), a stored value of
        another size is refused having read no more than such a value takes.
        None when absent or expired, when the value is refused (counted,
        logged at most once per key a minute), or when the key's node is
        down. Never raises."""
        if not self.indexed:
            return self._stored_value(namespace, mm_hash, nbytes)
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
                _failed(breaker, exc)
                self._count(errors=1)
                log.debug("fetch of %s failed: %s", mm_hash, exc)
                return None
            except Exception as exc:
                _failed(breaker, exc)
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

    def _stored_value(self, namespace: str, mm_hash: str,
                      nbytes: int | None) -> StoredValue | None:
        """A store without an index: the value's header (read when resolved,
        or now), its payload read later straight into the pages."""
        with self._index_lock:
            found = self._found.get((namespace, mm_hash))
        head = found[1] if found is not None else None
        if head is None:
            head = self._call_head(namespace, mm_hash)
            if head is None:
                return None
        if nbytes is not None and head.nbytes != nbytes:
            self._bad_value(namespace, mm_hash, BadValue(
                f"not the value found: {head.nbytes} payload bytes, {nbytes} expected"))
            return None
        return StoredValue(self, namespace, mm_hash, head)

    def _call_head(self, namespace: str, mm_hash: str) -> Any:
        """The value's header (`MooncakeStore.head`), through the breaker;
        None when absent, refused or unreachable (counted)."""
        breaker = self.breakers.get(self.store.domain(namespace, mm_hash))
        if not breaker.allow():
            self._count(fetch_refused=1)
            return None
        started = time.perf_counter()
        try:
            head = self.store.head(self.store_name(namespace), mm_hash)
        except BadValue as exc:
            breaker.success()
            self._bad_value(namespace, mm_hash, exc)
            return None
        except Exception as exc:
            _failed(breaker, exc)
            self._count(errors=1)
            log.debug("reading the header of %s failed: %s", mm_hash, exc)
            return None
        breaker.success()
        self.latency.labels("head").observe(time.perf_counter() - started)
        if head is None:
            self._count(remote_misses=1)
            self._forget(namespace, mm_hash)
        return head

    def read_into(self, namespace: str, mm_hash: str, head: Any,
                  extents: list[tuple[int, int]]) -> bool:
        """Read a value of a store without an index into `extents` and verify
        it there; False (counted, the key forgotten) when that failed."""
        breaker = self.breakers.get(self.store.domain(namespace, mm_hash))
        if not breaker.allow():
            self._count(fetch_refused=1)
            self._forget(namespace, mm_hash)
            return False
        started = time.perf_counter()
        try:
            found = self.store.get_into(self.store_name(namespace), mm_hash, head, extents)
        except BadValue as exc:
            breaker.success()
            self._bad_value(namespace, mm_hash, exc)
            if head.sidecar is not None:
                # A value and a checksum that do not match (two writers raced, or
                # a stale checksum): both go, and the next encode publishes anew.
                with contextlib.suppress(Exception):
                    self.store.forget(self.store_name(namespace), mm_hash)
            return False
        except LocalWriteError as exc:  # (the store answered: not its breaker's business)
            self._count(errors=1)
            self._forget(namespace, mm_hash)
            log.warning("promotion of %s failed here: %s", mm_hash, exc)
            return False
        except Exception as exc:
            _failed(breaker, exc)
            self._count(errors=1)
            self._forget(namespace, mm_hash)
            log.debug("fetch of %s failed: %s", mm_hash, exc)
            return False
        breaker.success()
        self.latency.labels("get").observe(time.perf_counter() - started)
        if not found:
            self._count(remote_misses=1)
            self._forget(namespace, mm_hash)
            return False
        self._count(remote_hits=1, fetch_bytes=head.nbytes)
        return True

    # ------------------------------------------------------------ resolve

    def resolve(self, namespace: str, mm_hash: str, done: Callable[[Outcome], None],
                claim: bool = True) -> bool:
        """Find out, off the caller's thread, whether another host has or
        makes the key, and claim it if nobody does (`claim`: an engine here
        would encode and save it; a claim nobody here fulfils would make the
        other hosts wait for nothing); `done(outcome)` is called once, from
        the resolver thread (FOUND: `available` now holds it). False
        (nothing started, `done` never called) when there is nothing to ask:
        an indexed store without claims, a key found absent a moment ago, a
        store that is down, or the tier stopping."""
        claim = claim and self.claim_s > 0
        if not self.indexed:
            if not self.store.accepts(mm_hash):
                return False
            # (a namespace whose entries the store's format cannot carry: its
            # claim would make other hosts wait for a value never published)
            claim = claim and self.store.claimable(namespace)
        if not self.indexed or claim:
            key = (namespace, mm_hash)
            breaker = self.breakers.get(self.store.domain(namespace, mm_hash))
            if self._stopping.is_set() or breaker.rejecting():
                return False
            with self._resolve_cond:
                absent_until = self._absent.get(key)
                if absent_until is not None:
                    if absent_until > time.monotonic():
                        self._count(lookup_cached=1)
                        return False
                    del self._absent[key]
                self._resolving.append(_Resolving(key, done, claim))
                self._resolve_cond.notify()
            self._count(lookups=1)
            return True
        return False

    def _resolver(self) -> None:
        while not self._stopping.is_set():
            with self._resolve_cond:
                while not self._resolving and not self._stopping.is_set():
                    if self._elsewhere:
                        self._resolve_cond.wait(POLL_S)
                        break
                    self._resolve_cond.wait()
                batch = self._resolving[:RESOLVE_BATCH]
                del self._resolving[:RESOLVE_BATCH]
                waiting, self._elsewhere = self._elsewhere, []
            if self._stopping.is_set():
                for item in batch + waiting:
                    _tell(item, Outcome.FAILED)
                return
            try:
                self._resolve_round(batch, waiting)
            except Exception:
                log.exception("resolving %d keys failed", len(batch) + len(waiting))
                for item in batch + waiting:
                    _tell(item, Outcome.FAILED)

    def _resolve_round(self, batch: list[_Resolving], waiting: list[_Resolving]) -> None:
        """One round: look the keys up (batched), claim the absent ones, ask
        again about those another host claimed."""
        items = batch + waiting
        held = self._held(items)
        now = time.monotonic()
        claiming = [item.key for item, state in zip(items, held, strict=True)
                    if state is False and not item.deadline and item.claim]
        claimed = dict(zip(claiming, self._claims(claiming), strict=True))
        still: list[_Resolving] = []
        for item, state in zip(items, held, strict=True):
            if state is True:
                self._count(lookup_hits=1)
                _tell(item, Outcome.FOUND)
            elif state is None:
                _tell(item, Outcome.FAILED)
            elif item.deadline:  # waited for another host's value
                if now >= item.deadline:
                    self._count(claim_timeouts=1)
                    self._not_found(item.key)
                    _tell(item, Outcome.ABSENT)
                else:
                    still.append(item)
            else:
                outcome = claimed.get(item.key, Outcome.ABSENT)
                if outcome is Outcome.ELSEWHERE:
                    item.deadline = now + self.claim_s
                    still.append(item)
                elif outcome is Outcome.ABSENT:
                    self._not_found(item.key)
                _tell(item, outcome)
        if still:
            with self._resolve_cond:
                self._elsewhere.extend(still)

    def _held(self, items: list[_Resolving]) -> list[bool | None]:
        """Whether the store holds each key (FOUND: its header remembered);
        None where the store could not say."""
        if self.indexed:  # (the index follower learns what others published)
            return [self.available(*item.key) is not None for item in items]
        out: list[bool | None] = [None] * len(items)
        by_domain: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            by_domain.setdefault(self.store.domain(*item.key), []).append(i)
        for domain, indexes in by_domain.items():
            breaker = self.breakers.get(domain)
            if not breaker.allow():
                continue
            try:
                present = self.store.present([(self.store_name(items[i].key[0]),
                                               items[i].key[1]) for i in indexes])
            except Exception as exc:
                _failed(breaker, exc)
                self._count(errors=1)
                log.debug("looking up %d keys failed: %s", len(indexes), exc)
                continue
            breaker.success()
            for i, there in zip(indexes, present, strict=True):
                out[i] = False
                if there:
                    head = self._call_head(*items[i].key)
                    if head is not None:
                        self._remember(*items[i].key, head)
                        out[i] = True
        return out

    def _claims(self, keys: list[tuple[str, str]]) -> list[Outcome]:
        """Claim each key across hosts: CLAIMED, ELSEWHERE, FAILED (or
        ABSENT: claims are off). One batch per failure domain where the store
        claims in batches (Mooncake: 200 keys in 5 ms, where one at a time
        takes 0.45 ms each)."""
        out = [Outcome.ABSENT] * len(keys)
        if self.claim_s <= 0 or not keys:
            return out
        by_domain: dict[str, list[int]] = {}
        for i, (namespace, mm_hash) in enumerate(keys):
            by_domain.setdefault(self.store.domain(namespace, mm_hash), []).append(i)
        for domain, indexes in by_domain.items():
            breaker = self.breakers.get(domain)
            if not breaker.allow():
                for i in indexes:
                    out[i] = Outcome.FAILED
                continue
            named = [(keys[i][0] if self.indexed else self.store_name(keys[i][0]), keys[i][1])
                     for i in indexes]
            try:
                if hasattr(self.store, "claim_many"):
                    mine = self.store.claim_many(named, self.token, self.claim_s)
                else:
                    mine = [self.store.claim(ns, h, self.token, self.claim_s) for ns, h in named]
            except RemoteAuthError as exc:  # (an ACL without EVAL): not the store failing
                breaker.success()
                self.claim_s = 0.0
                log.warning("cross-host claims are off: the store refused them (%s); every "
                            "host that misses a new item encodes it", exc)
                return [Outcome.ABSENT] * len(keys)
            except Exception as exc:
                _failed(breaker, exc)
                self._count(errors=1)
                log.debug("claiming %d keys failed: %s", len(indexes), exc)
                for i in indexes:
                    out[i] = Outcome.FAILED
                continue
            breaker.success()
            now = time.monotonic()
            for i, taken in zip(indexes, mine, strict=True):
                if taken:
                    out[i] = Outcome.CLAIMED
                    with self._resolve_cond:
                        if len(self._claimed) >= NEGATIVE_KEYS:  # (values that never came)
                            self._claimed = {k: t for k, t in self._claimed.items() if t > now}
                        self._claimed[keys[i]] = now + self.claim_s
                else:
                    out[i] = Outcome.ELSEWHERE
            taken_count = sum(1 for taken in mine if taken)
            self._count(claims_taken=taken_count, claims_elsewhere=len(mine) - taken_count)
        return out

    def _not_found(self, key: tuple[str, str]) -> None:
        with self._resolve_cond:
            self._absent[key] = time.monotonic() + NEGATIVE_S
            self._absent.move_to_end(key)
            while len(self._absent) > NEGATIVE_KEYS:
                self._absent.popitem(last=False)

    def _release_claim(self, namespace: str, mm_hash: str) -> None:
        """The value is published: drop this host's claim on it, if any
        (best effort: it expires anyway)."""
        key = (namespace, mm_hash)
        with self._resolve_cond:
            until = self._claimed.pop(key, None)
            self._absent.pop(key, None)
        if until is None or until <= time.monotonic():
            return
        name = namespace if self.indexed else self.store_name(namespace)
        try:
            self.store.release(name, mm_hash, self.token)
        except Exception as exc:
            log.debug("releasing the claim on %s failed: %s", mm_hash, exc)

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


def _failed(breaker: Any, exc: BaseException) -> None:
    """A failed store call, told to its breaker: a transfer from a host that
    is gone is not the store failing (the store answered)."""
    if isinstance(exc, RemotePeerError):
        breaker.success()
    else:
        breaker.failure(exc)


def _tell(item: _Resolving, outcome: Outcome) -> None:
    try:
        item.done(outcome)
    except Exception:
        log.exception("resolution callback of %s failed", item.key[1])


def _release(job: _Job) -> None:
    if job.release is None:
        return
    try:
        job.release()
    except Exception:
        log.exception("release callback of %s failed", job.mm_hash)
