"""The second tier beside the daemon's event loop: its parts composed around
one backend, and the face the data plane calls (`plane.second_tier.SecondTier`).

The event loop only ever calls what cannot block: `publish` enqueues
(bounded in bytes, dropped when full or while the store is down),
`available` answers from what the backend knows of its store, `reserve`
takes from the promotion budget (`budget`: the bytes fetched values may
hold), `follow`, `resolve` (answered from the resolver's threads),
`snapshot`. What talks to the store runs on the tier's threads or the
caller's worker thread (`fetch`, `fetch_into`), through one circuit breaker
per failure domain (a node), so a store that is down or slow costs misses and
dropped publications, never a stuck daemon, and comes back by itself.

This module owns the parts' life (start, the stop order). How each part is
done for a kind of store is its backend's (`backend.Backend`: `redis`,
`mooncake`), which the URL's scheme chooses once (`open_tier`); the tier never
asks which store it has. The publisher (`publisher`) and the resolver
(`resolver`) hold the common state (`common`) and the backend, not the tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ec_daemon.core.events import Fetched, Resolution
from ec_daemon.core.limits import RECENT_S, RESOLVER_THREADS
from ec_daemon.remote.backend import Backend, Extent, Publication, RegionPages
from ec_daemon.remote.breaker import CLOSED, STATE_CODES
from ec_daemon.remote.budget import PromotionBudget, Reservation
from ec_daemon.remote.common import COUNTERS, Common
from ec_daemon.remote.publisher import Publisher
from ec_daemon.remote.resolver import Resolver

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


def open_tier(url: str, *, token_file: str = "", ttl_s: float, publish_queue_bytes: int,
              index_bytes: int, promotion_bytes: int, claim_s: float) -> RemoteTier:
    """The tier on the store `url` names (its scheme chooses the backend,
    once); connects lazily or in the background, so a store that is down at
    start is not an error. Raises ValueError for a bad URL or token file."""
    common = Common(promotion_bytes=promotion_bytes)
    backend: Backend
    if url.lower().startswith("mooncake://"):
        from ec_daemon.remote.mooncake.backend import open_backend as open_mooncake

        backend = open_mooncake(url, common, token_file=token_file, index_bytes=index_bytes)
    else:
        from ec_daemon.remote.redis.backend import open_backend as open_redis

        backend = open_redis(url, common, token_file=token_file, ttl_s=ttl_s,
                             index_bytes=index_bytes)
    return RemoteTier(backend, publish_queue_bytes=publish_queue_bytes, claim_s=claim_s)


class RemoteTier:
    """The tier: its backend, publisher and resolver. Thread-safe: every
    public method may be called from any thread; only `fetch` and
    `fetch_into` block (on the network)."""

    def __init__(self, backend: Backend, *, publish_queue_bytes: int,
                 claim_s: float = 0.0) -> None:
        """`claim_s`: a key nobody holds is claimed across hosts for this long
        (0: no claims)."""
        self.backend = backend
        self.common = backend.common
        self.resolver = Resolver(self.common, backend, claim_s)
        self.publisher = Publisher(self.common, backend, queue_bytes=publish_queue_bytes,
                                   on_done=self.resolver.release_claim)
        self._threads: list[threading.Thread] = []

    @property
    def budget(self) -> PromotionBudget:
        """The promotion budget (`reserve` takes from it)."""
        return self.common.budget

    @property
    def token(self) -> str:
        """This daemon's name in the claims it takes across hosts."""
        return self.common.token

    # ------------------------------------------------------------ life

    def start(self) -> None:
        if self._threads:
            return
        threads: list[tuple[str, Callable[[], None]]] = [
            ("ec-remote-publisher", self.publisher.run),
            *((f"ec-remote-resolver-{i}", self.resolver.run) for i in range(RESOLVER_THREADS)),
            *self.backend.threads()]
        for name, target in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the threads (within about the backend's longest wait plus one
        store call), drop what is queued, and close the store."""
        self.common.stopping.set()
        self.publisher.wake()
        self.resolver.wake()
        deadline = time.monotonic() + self.backend.wait_s + self.backend.timeout_s + 1
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.publisher.drain()
        # Closing the store under a call still running would crash the
        # binding: what the resolver runs ends first.
        self.resolver.stop(deadline)
        self.backend.close()

    # ------------------------------------------------------------ follow

    def follow(self, namespace: str, store_namespace: str = "") -> None:
        """A local session uses `namespace` (`store_namespace`: its engine's
        name for it in a store shared with vLLM's own connector)."""
        self.backend.follow(namespace, store_namespace)

    def unfollow(self, namespace: str) -> None:
        """No local session uses `namespace` any more: forget what is known of it."""
        self.backend.unfollow(namespace)

    def available(self, namespace: str, mm_hash: str) -> int | None:
        """nbytes when the store is known to hold the key; never touches the network."""
        return self.backend.available(namespace, mm_hash)

    def forget(self, namespace: str, mm_hash: str) -> None:
        """The key could not be promoted: no longer offered."""
        self.backend.forget(namespace, mm_hash)

    # ------------------------------------------------------------ publish

    def publish(self, namespace: str, mm_hash: str, shape: tuple[int, ...], dtype: str,
                region: RegionPages, extents: Sequence[Extent],
                current: Callable[[], bool]) -> bool:
        """Queue a ready entry for the store, written from its pages in
        `region` by the publisher thread; never blocks. False (nothing
        queued) when stopped, when the key's store node is down, or when the
        queue would exceed its bytes. The pages may be reused meanwhile:
        `current()` says whether they still hold the entry, asked once they
        are read (False: skipped) and once sent (False: not announced; the
        stored value fails its checksum or holds the entry)."""
        return self.publisher.publish(Publication(namespace, mm_hash, tuple(shape), dtype,
                                                  region, tuple(extents), current))

    # ------------------------------------------------------------ fetch

    def reserve(self, namespace: str, mm_hash: str) -> Reservation | None:
        """Take the promotion budget for the key's value (call before
        `fetch`; never blocks). None when the key is no longer known held, or
        when the budget is spent (counted: promotions_refused); a value that
        could never fit the budget is forgotten. The caller must `release()`
        the reservation once the value is written or dropped (a `finally`:
        releasing twice is harmless)."""
        nbytes = self.backend.available(namespace, mm_hash)
        if nbytes is None:
            return None
        most = self.backend.promotion_bytes(namespace, mm_hash, nbytes)
        budget = self.common.budget
        reservation = budget.reserve(nbytes, most)
        if reservation is None and self.backend.trim():
            reservation = budget.reserve(nbytes, most)  # (what idled was freed)
        if reservation is None:
            self.common.count(promotions_refused=1)
            if most > budget.limit:
                self.backend.forget(namespace, mm_hash)
        return reservation

    def fetch(self, namespace: str, mm_hash: str, nbytes: int) -> Fetched | None:
        """What the stored value of `nbytes` payload bytes is, blocking on the
        store (call it from a worker thread, within a reservation). None when
        absent, refused (counted, logged at most once per key a minute) or
        the key's node is down. Never raises."""
        return self.backend.fetch(namespace, mm_hash, nbytes)

    def fetch_into(self, namespace: str, mm_hash: str, found: Fetched, region: RegionPages,
                   extents: Sequence[Extent]) -> bool:
        """Write what `fetch` found into `extents` of `region`, verified; False
        (counted, the key forgotten) when that failed. Never raises."""
        return self.backend.fetch_into(namespace, mm_hash, found, region, extents)

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
        common = self.common
        data: dict[str, float | int | bool] = dict(common.counts())
        data["publish_queue_bytes"] = self.publisher.queued_bytes
        data.update(self.backend.gauges())
        data["promotion_bytes"] = common.budget.held
        data["promotion_bytes_peak"] = common.budget.peak
        states = [b.state for b in common.breakers.recent(RECENT_S)]
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
        yield from self.common.latency.collect()

    def states(self) -> dict[str, str]:
        """Each failure domain's breaker state (diagnostics)."""
        return {b.name: b.state for b in self.common.breakers.all()}
