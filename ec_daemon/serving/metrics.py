"""Prometheus metrics (`--metrics-port`, off by default), via prometheus-client.

Everything is read at scrape time from one `stats.Snapshot` (the same one
the Stats RPC answers with), never on the hot path: the scrape runs in
prometheus-client's HTTP thread and asks the event loop for the snapshot
(the core is owned by the loop and is not thread-safe). RPC latencies are a
Histogram observed by the service's handlers.

The exporter is handed a snapshot function and the collectors to serve
beside it, never the service: the service imports this module (for its
histogram), so this one imports nothing of the service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ec_daemon.core.limits import SNAPSHOT_TIMEOUT_SECONDS

if TYPE_CHECKING:
    from ec_daemon.core.stats import Snapshot

COUNTERS = {
    "saves": "Entries saved (copies landed and reported)",
    "loads": "Loads dispatched from the views (reported with their touches)",
    "bytes_saved": "Payload bytes saved",
    "bytes_loaded": "Payload bytes of dispatched loads",
    "evictions": "Entries chosen by eviction (hidden)",
    "refused_saves": "Saves refused for lack of room (RESOURCE_EXHAUSTED)",
    "capped_saves": "Saves refused for their session's cap of pending saves "
                    "(--session-pending-bytes, --session-pending-entries)",
    "refused_attaches": "Attach calls refused for the session caps (--max-sessions, "
                        "--max-sessions-per-engine, --max-tokenless-sessions)",
    "preempted_sessions": "Sessions whose stream never opened, ended to make room for an "
                          "engine presenting its token",
    "ack_timeouts": "Scheduler sessions ended for not acknowledging an eviction within "
                    "--ack-wait-seconds",
    "stalled_streams": "Session and Watch streams ended because their client stopped reading",
    "mismatch_reports": "Entries a loader reported as not matching their checksum",
    "checksum_mismatches": "Entries whose pages the daemon found not to match their checksum "
                           "(hidden)",
    "region_truncations": "Times the region file was found truncated by a client (restored)",
}


CONVERGENCE = {
    "wants": "Items views asked about before scheduling them (not held locally)",
    "claims": "Items an engine was told to encode while others may wait for it",
    "waits": "Answers telling an engine to wait for another's encode or a promotion",
    "handovers": "Claims passed to a waiting engine (the claimant ended or was too slow)",
    "releases": "Claims given back by their engine (its request was not scheduled or ended)",
    "promotions": "Entries fetched from the second tier into this host's region",
    "promotion_failures": "Promotions that failed (the waiting engines encoded)",
    "promoted_bytes": "Payload bytes promoted from the second tier",
    "slow_resolutions": "Wants told to wait because the second tier had not answered "
                        "within 0.25 s (a slow store or a busy host)",
}


ADOPTION = {
    "adopted_entries": "Entries adopted from the previous daemon's region at start",
    "rejected_records": "Index records not adopted at start: their pages no longer carry "
                        "their stamp",
    "invalid_records": "Index records not adopted at start: not records a daemon writes "
                       "(corruption)",
    "corrupt_stamp_pages": "Pages quarantined at start: stamped with an id no daemon issued "
                           "(corruption)",
    "refused_corrupt_index": "Regions not adopted at start: their index's id reservation is "
                             "corrupt (started fresh)",
    "refused_access": "Regions not adopted at start: their mode or group is not "
                      "--socket-mode/--group (started fresh)",
    "refused_errors": "Regions not adopted at start: adopting failed unexpectedly (started "
                      "fresh; the log has the traceback)",
}


def rpc_histogram() -> Histogram:
    """Per-method handler latency; not registered until an exporter starts."""
    return Histogram("ec_daemon_rpc_duration_seconds", "gRPC handler latency", ["method"],
                     registry=None,
                     buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0))


class CacheCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot],
                 loop: asyncio.AbstractEventLoop) -> None:
        """`snapshot()` is called on `loop`, the event loop that owns the core."""
        self.snapshot = snapshot
        self.loop = loop

    def _snapshot(self) -> Snapshot:
        async def take() -> Snapshot:
            return self.snapshot()

        return asyncio.run_coroutine_threadsafe(take(), self.loop).result(
            SNAPSHOT_TIMEOUT_SECONDS)

    def collect(self) -> Iterator[Metric]:
        data = self._snapshot()
        size = GaugeMetricFamily("ec_daemon_bytes", "Region bytes by state", labels=["state"])
        size.add_metric(["capacity"], data.capacity_bytes)
        size.add_metric(["used"], data.used_bytes)
        for state, value in data.bytes_by_state.items():
            size.add_metric([state], value)
        yield size
        entries = GaugeMetricFamily("ec_daemon_entries", "Visible entries by state",
                                    labels=["state"])
        entries.add_metric(["ready"], data.ready_entries)
        entries.add_metric(["hidden"], data.hidden_entries)
        yield entries
        for name, help_text in COUNTERS.items():
            yield CounterMetricFamily(f"ec_daemon_{name}", help_text, value=data.counters[name])
        yield from _namespace_metrics(data)
        yield GaugeMetricFamily("ec_daemon_namespaces_not_listed",
                                "Namespaces left out of the per-namespace families (they list "
                                "the ones holding the most bytes)",
                                value=data.namespaces_not_listed)
        sessions = GaugeMetricFamily("ec_daemon_sessions", "Attached sessions",
                                     labels=["role", "component"])
        for (role, component), count in sorted(data.sessions_by_kind.items()):
            sessions.add_metric([role, component], count)
        yield sessions
        yield GaugeMetricFamily("ec_daemon_ghost_sessions",
                                "Scheduler sessions ended without detaching, still awaited",
                                value=data.ghost_sessions)
        yield GaugeMetricFamily("ec_daemon_watchers", "Open Watch calls (routers)",
                                value=data.watchers)
        yield CounterMetricFamily("ec_daemon_dropped_watchers",
                                  "Watch calls dropped for reading too slowly",
                                  value=data.dropped_watchers)
        for name, value in sorted(data.convergence.items()):
            yield CounterMetricFamily(f"ec_daemon_convergence_{name}",
                                      CONVERGENCE.get(name, name), value=value)
        for name, value in sorted(data.adoption.items()):
            yield CounterMetricFamily(f"ec_daemon_adoption_{name}", ADOPTION.get(name, name),
                                      value=value)
        # An info metric: a 63-bit generation does not survive a float gauge.
        yield InfoMetricFamily("ec_daemon_region", "The region (generation changes on every start)",
                               value={"generation": f"{data.generation:016x}",
                                      "path": data.region_path})


def _namespace_metrics(data: Snapshot) -> Iterator[Metric]:
    labels = ["namespace"]
    lookups = CounterMetricFamily("ec_daemon_lookups", "Scheduler lookups, per namespace",
                                  labels=labels)
    hits = CounterMetricFamily("ec_daemon_hits", "Lookups that hit", labels=labels)
    misses = CounterMetricFamily("ec_daemon_misses", "Lookups that missed", labels=labels)
    loads = CounterMetricFamily("ec_daemon_namespace_loads", "Loads dispatched, per namespace",
                                labels=labels)
    stored = GaugeMetricFamily("ec_daemon_namespace_bytes", "Visible bytes per namespace",
                               labels=labels)
    for ns in data.namespaces:
        lookups.add_metric([ns.name], ns.hits + ns.misses)
        hits.add_metric([ns.name], ns.hits)
        misses.add_metric([ns.name], ns.misses)
        loads.add_metric([ns.name], ns.loads)
        stored.add_metric([ns.name], ns.bytes)
    yield from (lookups, hits, misses, loads, stored)


def start_exporter(snapshot: Callable[[], Snapshot], loop: asyncio.AbstractEventLoop,
                   port: int, address: str, collectors: Iterable[Collector] = ()) -> Any:
    """Serve /metrics on address:port in a background thread; returns the server.
    Each scrape reads `snapshot()` on `loop`, then each of `collectors` (the
    service's RPC histogram, the second tier's own ec_daemon_remote_* families)."""
    registry = CollectorRegistry()
    registry.register(CacheCollector(snapshot, loop))
    for collector in collectors:
        registry.register(collector)
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server
