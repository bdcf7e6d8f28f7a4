"""The second tier beside the daemon's event loop: its parts composed
around one core, and the blocking fetches for the daemon's worker pool.

The event loop only ever calls what cannot block: `publish` enqueues (bounded
in bytes, dropped when full or while the store is down), `available` reads
the local index (`index`: what other daemons announced, learnt ahead of any
lookup, bounded in bytes), `reserve` takes from the promotion budget
(`budget`: the bytes fetched values may hold), `follow`, `snapshot`.
Everything that talks to the store runs on the tier's threads or the caller's
worker thread, through one circuit breaker per failure domain (a node), so a
store that is down or slow costs misses and dropped publications, never a
stuck daemon, and comes back by itself.

This module is the tier's one face to the daemon (the server, the data plane,
benchmarks): it owns the parts' life (start, the stop order) and the fetches,
which run on the caller's thread. The parts are their own modules, each
holding the core (`core`: the store, breakers, budget, counters) rather than
the tier: `publisher` (the write-behind queue and thread), `follower` (an
indexed store's index thread) and `resolver` (wanted keys looked up and
claimed across hosts).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ec_daemon.core.events import Resolution
from ec_daemon.remote.backend import (
    AnyStore,
    Head,
    LocalWriteError,
    ProbedStore,
    RemoteError,
    UnexpectedSize,
)
from ec_daemon.remote.breaker import CLOSED, STATE_CODES
from ec_daemon.remote.budget import PromotionBudget, Reservation
from ec_daemon.remote.core import COUNTERS, TierCore, tell_breaker
from ec_daemon.remote.follower import Follower
from ec_daemon.remote.publisher import Publisher
from ec_daemon.remote.resolver import RESOLVER_THREADS, Resolver
from ec_daemon.remote.values import BadValue, RegionFile, Value, decode, size_bounds

log = logging.getLogger("ec_daemon.remote")

GAUGES = {
    "publish_queue_bytes": "Payload bytes waiting to be published",
    "index_entries": "Entries the local index holds (followed namespaces, not expired)",
    "index_bytes": "Memory of the local index, as counted against --remote-index-bytes",
    "promotion_bytes": "Bytes reserved by promotions between their fetch and their write "
                       "(Mooncake: and its transfer buffers, in use or pooled)",
    "promotion_bytes_peak": "The most promotion_bytes has been since start",
    "followed_namespaces": "Namespaces whose announcements are kept",
    "reachable": "1 when no store node's breaker is open",
    "breaker_state": "Worst breaker state: 0 closed, 1 half-open, 2 open",
    "breakers_open": "Store nodes currently refused (breaker open or half-open)",
}
RECENT_S = 120.0  # a breaker unused this long (a node that left) stops counting


class StoredValue:
    """A value in a store without an index, read straight into the pages a
    promotion allocated (`write_into`): its header is known, its payload not
    yet read."""

    def __init__(self, tier: RemoteTier, store: ProbedStore, namespace: str, mm_hash: str,
                 head: Head) -> None:
        self._tier, self._store, self._head = tier, store, head
        self._namespace, self._mm_hash = namespace, mm_hash
        self.shape, self.dtype, self.nbytes = head.shape, head.dtype, head.nbytes

    def write_into(self, region_file: RegionFile, extents: Sequence[tuple[int, int]]) -> bool:
        """Read and verify the payload into `extents` (never raises): False
        when it failed (counted; the pages hold nothing to serve). The store
        writes the region itself (`ProbedStore.use_region`): `region_file`
        is not used."""
        return self._tier.read_into(self._store, self._namespace, self._mm_hash, self._head,
                                    extents)


# What `RemoteTier.fetch` returns: either writes itself into a promotion's
# pages (`write_into`), a value in memory or one the store reads in place.
Fetched = Value | StoredValue


class RemoteTier:
    """The tier: its core, publisher, follower and resolver, and the fetches.
    Thread-safe: every public method may be called from any thread; only
    `fetch` (and `read_into`) blocks (on the network)."""

    def __init__(self, store: AnyStore, *, ttl_s: float, publish_queue_bytes: int,
                 index_bytes: int = 64 << 20, promotion_bytes: int = 256 << 20,
                 block_s: float = 0.5, index_batch: int = 1000, breaker_threshold: int = 3,
                 breaker_base_s: float = 0.5, breaker_max_s: float = 30.0,
                 claim_s: float = 0.0) -> None:
        """`claim_s`: a key nobody holds is claimed across hosts for this long
        (0: no claims); stores without an index (`indexed` False) are asked
        for every wanted key the daemon does not know."""
        if ttl_s <= 0 or publish_queue_bytes <= 0:
            raise ValueError("ttl_s and publish_queue_bytes must be positive")
        self.core = TierCore(store, ttl_s=ttl_s, index_bytes=index_bytes,
                             promotion_bytes=promotion_bytes,
                             breaker_threshold=breaker_threshold,
                             breaker_base_s=breaker_base_s, breaker_max_s=breaker_max_s)
        self.ttl_s = ttl_s
        self.publish_queue_bytes = publish_queue_bytes
        self.block_s = block_s
        self.index_batch = index_batch
        self.resolver = Resolver(self.core, claim_s)
        self.publisher = Publisher(self.core, ttl_s=ttl_s, queue_bytes=publish_queue_bytes,
                                   on_done=self.resolver.release_claim)
        self.follower = Follower(self.core, store, block_s=block_s, batch=index_batch) \
            if store.indexed else None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ the core's

    @property
    def store(self) -> AnyStore:
        """The store (`backend`), which the tier closes on `stop`."""
        return self.core.store

    @property
    def indexed(self) -> bool:
        """Whether the store keeps an index the tier follows (`backend`)."""
        return self.core.indexed

    @property
    def budget(self) -> PromotionBudget:
        """The promotion budget (`reserve` takes from it)."""
        return self.core.budget

    @property
    def token(self) -> str:
        """This daemon's name in the claims it takes across hosts."""
        return self.core.token

    def follow(self, namespace: str, store_namespace: str = "") -> None:
        """`TierCore.follow`: keep index entries of `namespace`."""
        self.core.follow(namespace, store_namespace)

    def unfollow(self, namespace: str) -> None:
        """`TierCore.unfollow`: forget `namespace`'s entries."""
        self.core.unfollow(namespace)

    def available(self, namespace: str, mm_hash: str) -> int | None:
        """`TierCore.available`: nbytes when the store is known to hold the
        key; never touches the network."""
        return self.core.available(namespace, mm_hash)

    def forget(self, namespace: str, mm_hash: str) -> None:
        """Drop a key from the local index (it could not be promoted)."""
        self.core.forget(namespace, mm_hash)

    # ------------------------------------------------------------ life

    def start(self) -> None:
        if self._threads:
            return
        threads: list[tuple[str, Callable[[], None]]] = [
            ("ec-remote-publisher", self.publisher.run),
            *((f"ec-remote-resolver-{i}", self.resolver.run) for i in range(RESOLVER_THREADS))]
        if self.follower is not None:
            threads.append(("ec-remote-index", self.follower.run))
        for name, target in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the threads (within about block_s plus one store call), drop
        what is queued, and close the store."""
        self.core.stopping.set()
        self.publisher.wake()
        self.resolver.wake()
        deadline = time.monotonic() + self.block_s + self.store.timeout_s + 1
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.publisher.drain()
        # Closing the store under a call still running would crash the
        # binding: what the resolver runs ends first.
        self.resolver.stop(deadline)
        self.store.close()

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
        return self.publisher.publish(namespace, mm_hash, shape, dtype, nbytes, read,
                                      release, current, extents)

    # ------------------------------------------------------------ fetch

    def reserve(self, namespace: str, mm_hash: str) -> Reservation | None:
        """Take the promotion budget for the key's announced value (call
        before `fetch`; never blocks). None when the index no longer holds
        the key, or when the budget is spent (counted: promotions_refused);
        a value that could never fit the budget is forgotten. The caller
        must `release()` the reservation once the value is written or
        dropped (a `finally`: releasing twice is harmless)."""
        nbytes = self.core.available(namespace, mm_hash)
        if nbytes is None:
            return None
        # (A store without an index reads the value into a transfer buffer:
        # its capacity is what the promotion holds.)
        store = self.core.store
        most = size_bounds(namespace, mm_hash, nbytes)[1] if store.indexed \
            else store.promotion_bytes(nbytes)
        reservation = self.core.budget.reserve(nbytes, most)
        if reservation is None and not store.indexed and store.trim():
            reservation = self.core.budget.reserve(nbytes, most)  # (idle buffers were freed)
        if reservation is None:
            self.core.count(promotions_refused=1)
            if most > self.core.budget.limit:
                self.core.forget(namespace, mm_hash)
        return reservation

    def fetch(self, namespace: str, mm_hash: str,
              nbytes: int | None = None) -> Fetched | None:
        """The verified value of (namespace, mm_hash), blocking on the store
        (call it from a worker thread). With `nbytes` (the announced payload;
        by default the index's, if it holds the key), a stored value of
        another size is refused having read no more than such a value takes.
        None when absent or expired, when the value is refused (counted,
        logged at most once per key a minute), or when the key's node is
        down. Never raises."""
        store = self.core.store
        if not store.indexed:
            return self._stored_value(store, namespace, mm_hash, nbytes)
        if nbytes is None:
            nbytes = self.core.available(namespace, mm_hash)
        size = size_bounds(namespace, mm_hash, nbytes) if nbytes is not None else None
        breaker = self.core.breakers.get(self.core.store.domain(namespace, mm_hash))
        for attempt in (1, 2):
            if not breaker.allow():
                self.core.count(fetch_refused=1)
                return None
            started = time.perf_counter()
            try:
                parts = store.get(namespace, mm_hash, size)
            except UnexpectedSize as exc:  # the store answered: not its failure
                breaker.success()
                self.core.bad_value(namespace, mm_hash, BadValue(f"not the announced value: {exc}"))
                return None
            except RemoteError as exc:
                tell_breaker(breaker, exc)
                self.core.count(errors=1)
                log.debug("fetch of %s failed: %s", mm_hash, exc)
                return None
            except Exception as exc:
                tell_breaker(breaker, exc)
                self.core.count(errors=1)
                log.exception("fetch of %s failed", mm_hash)
                return None
            breaker.success()
            self.core.latency.labels("get").observe(time.perf_counter() - started)
            if parts is None:
                self.core.count(remote_misses=1)
                self.core.forget(namespace, mm_hash)
                return None
            try:
                value = decode(parts, namespace=namespace, mm_hash=mm_hash)
                if nbytes is not None and value.nbytes != nbytes:
                    raise BadValue(f"not the announced value: {value.nbytes} payload bytes, "
                                   f"{nbytes} announced")
            except BadValue as exc:
                if attempt == 1:
                    continue  # a rewrite or an expiry may have raced the read: once more
                self.core.bad_value(namespace, mm_hash, exc)
                return None
            self.core.count(remote_hits=1, fetch_bytes=value.nbytes)
            return value
        return None

    def _stored_value(self, store: ProbedStore, namespace: str, mm_hash: str,
                      nbytes: int | None) -> StoredValue | None:
        """A store without an index: the value's header (read when resolved,
        or now), its payload read later straight into the pages."""
        head = self.core.found_head(namespace, mm_hash)
        if head is None:
            head = self.core.read_head(store, namespace, mm_hash)
            if head is None:
                return None
        if nbytes is not None and head.nbytes != nbytes:
            self.core.bad_value(namespace, mm_hash, BadValue(
                f"not the value found: {head.nbytes} payload bytes, {nbytes} expected"))
            return None
        return StoredValue(self, store, namespace, mm_hash, head)

    def read_into(self, store: ProbedStore, namespace: str, mm_hash: str, head: Head,
                  extents: Sequence[tuple[int, int]]) -> bool:
        """Read a value of a store without an index into `extents` and verify
        it there; False (counted, the key forgotten) when that failed."""
        breaker = self.core.breakers.get(store.domain(namespace, mm_hash))
        if not breaker.allow():
            self.core.count(fetch_refused=1)
            self.core.forget(namespace, mm_hash)
            return False
        started = time.perf_counter()
        try:
            found = store.get_into(self.core.store_name(namespace), mm_hash, head, extents)
        except BadValue as exc:
            breaker.success()
            self.core.bad_value(namespace, mm_hash, exc)
            if head.sidecar is not None:
                # A value and a checksum that do not match (two writers raced, or
                # a stale checksum): both go, and the next encode publishes anew.
                with contextlib.suppress(Exception):
                    store.forget(self.core.store_name(namespace), mm_hash)
            return False
        except LocalWriteError as exc:  # (the store answered: not its breaker's business)
            self.core.count(errors=1)
            self.core.forget(namespace, mm_hash)
            log.warning("promotion of %s failed here: %s", mm_hash, exc)
            return False
        except Exception as exc:
            tell_breaker(breaker, exc)
            self.core.count(errors=1)
            self.core.forget(namespace, mm_hash)
            log.debug("fetch of %s failed: %s", mm_hash, exc)
            return False
        breaker.success()
        self.core.latency.labels("get").observe(time.perf_counter() - started)
        if not found:
            self.core.count(remote_misses=1)
            self.core.forget(namespace, mm_hash)
            return False
        self.core.count(remote_hits=1, fetch_bytes=head.nbytes)
        return True

    # ------------------------------------------------------------ resolve

    @property
    def claim_s(self) -> float:
        """How long a key nobody holds is claimed across hosts (0: no claims)."""
        return self.resolver.claim_s

    def resolve(self, namespace: str, mm_hash: str, done: Callable[[Resolution], None],
                claim: bool = True) -> bool:
        """`Resolver.resolve`: whether another host has or makes the key,
        found out off the caller's thread; `done(outcome)` called once."""
        return self.resolver.resolve(namespace, mm_hash, done, claim)

    # ------------------------------------------------------------ stats

    def snapshot(self) -> dict[str, float | int | bool]:
        """Counters and gauges for the Stats RPC, the CLI and /metrics."""
        core = self.core
        data: dict[str, float | int | bool] = dict(core.counts())
        data["publish_queue_bytes"] = self.publisher.queued_bytes
        with core.index_lock:
            data["index_entries"] = core.index.entries
            data["index_bytes"] = core.index.bytes
            data["followed_namespaces"] = core.index.namespaces
        data["promotion_bytes"] = self.core.budget.held
        data["promotion_bytes_peak"] = self.core.budget.peak
        states = [b.state for b in self.core.breakers.recent(RECENT_S)]
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
        yield from self.core.latency.collect()

    def states(self) -> dict[str, str]:
        """Each failure domain's breaker state (diagnostics)."""
        return {b.name: b.state for b in self.core.breakers.all()}

