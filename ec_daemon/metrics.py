"""Prometheus metrics (`--metrics-port`, off by default), via prometheus-client.

Gauges and counters are read from the cache at scrape time, never on the hot
path: the scrape runs in prometheus-client's HTTP thread and asks the event
loop for a snapshot (the core is owned by the loop and is not thread-safe).
RPC latencies are a Histogram observed by the service's handlers.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ec_daemon.service import ECDaemonService

SNAPSHOT_TIMEOUT_SECONDS = 5.0
COUNTERS = {
    "saves": "Entries saved (copies landed and reported)",
    "loads": "Loads completed by every expected rank",
    "bytes_saved": "Payload bytes saved",
    "bytes_loaded": "Payload bytes loaded (once per completed load)",
    "evictions": "Entries chosen by eviction",
    "refused_saves": "Saves refused for lack of room (RESOURCE_EXHAUSTED)",
    "pins": "Pins taken for load dispatches",
    "pin_failures": "Pins refused (entry gone, bad transfer id, no worker)",
}


def rpc_histogram() -> Histogram:
    """Per-method handler latency; not registered until an exporter starts."""
    return Histogram("ec_daemon_rpc_duration_seconds", "gRPC handler latency", ["method"],
                     registry=None,
                     buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0))


def snapshot(service: ECDaemonService) -> dict[str, Any]:
    """Everything the collector reports, read on the event loop."""
    cache = service.cache
    page = cache.page_bytes
    sessions = Counter((s.role, "scheduler" if s.is_scheduler else "worker")
                       for s in cache.sessions)
    return {
        "bytes": {"capacity": cache.capacity_bytes,
                  "used": cache.capacity_bytes - cache.allocator.free_pages * page,
                  "free": cache.allocator.free_pages * page,
                  "pinned": cache.pinned_pages * page,
                  "pending": cache.pending_pages * page,
                  "evicting": cache.hidden_pages * page,
                  "quarantined": cache.quarantined_pages * page},
        "entries": {"ready": cache.ready_entries, "evicting": cache.hidden_entries},
        "counters": dict(cache.counters),
        "namespaces": {name: dict(counts) for name, counts in cache.namespace_counters.items()},
        "usage": {name: tuple(u) for name, u in cache.namespace_usage.items()},
        "sessions": dict(sessions),
        "generation": service.region.generation,
        "path": service.region.path,
    }


class CacheCollector(Collector):
    def __init__(self, service: ECDaemonService, loop: asyncio.AbstractEventLoop) -> None:
        self.service = service
        self.loop = loop

    def _snapshot(self) -> dict[str, Any]:
        async def take() -> dict[str, Any]:
            return snapshot(self.service)

        return asyncio.run_coroutine_threadsafe(take(), self.loop).result(
            SNAPSHOT_TIMEOUT_SECONDS)

    def collect(self) -> Iterator[Metric]:
        data = self._snapshot()
        size = GaugeMetricFamily("ec_daemon_bytes", "Region bytes by state", labels=["state"])
        for state, value in data["bytes"].items():
            size.add_metric([state], value)
        yield size
        entries = GaugeMetricFamily("ec_daemon_entries", "Visible entries by state",
                                    labels=["state"])
        for state, value in data["entries"].items():
            entries.add_metric([state], value)
        yield entries
        yield GaugeMetricFamily("ec_daemon_hidden_entries_awaiting_ack",
                                "Evicted entries whose pages wait for views to acknowledge",
                                value=data["entries"]["evicting"])
        for name, help_text in COUNTERS.items():
            yield CounterMetricFamily(f"ec_daemon_{name}", help_text,
                                      value=data["counters"][name])
        lookups = CounterMetricFamily("ec_daemon_lookups", "Scheduler lookups, per namespace",
                                      labels=["namespace"])
        hits = CounterMetricFamily("ec_daemon_hits", "Lookups that hit", labels=["namespace"])
        misses = CounterMetricFamily("ec_daemon_misses", "Lookups that missed",
                                     labels=["namespace"])
        stored = GaugeMetricFamily("ec_daemon_namespace_bytes", "Visible bytes per namespace",
                                   labels=["namespace"])
        for name, counts in data["namespaces"].items():
            lookups.add_metric([name], counts["hits"] + counts["misses"])
            hits.add_metric([name], counts["hits"])
            misses.add_metric([name], counts["misses"])
            stored.add_metric([name], data["usage"].get(name, (0, 0))[1])
        yield from (lookups, hits, misses, stored)
        sessions = GaugeMetricFamily("ec_daemon_sessions", "Attached sessions",
                                     labels=["role", "component"])
        for (role, component), count in sorted(data["sessions"].items()):
            sessions.add_metric([role, component], count)
        yield sessions
        # An info metric: a 63-bit generation does not survive a float gauge.
        yield InfoMetricFamily("ec_daemon_region", "The region (generation changes on every start)",
                               value={"generation": f"{data['generation']:016x}",
                                      "path": data["path"]})


def start_exporter(service: ECDaemonService, loop: asyncio.AbstractEventLoop, port: int,
                   address: str) -> Any:
    """Serve /metrics on address:port in a background thread; returns the server."""
    registry = CollectorRegistry()
    registry.register(CacheCollector(service, loop))
    registry.register(service.rpc_seconds)
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server
