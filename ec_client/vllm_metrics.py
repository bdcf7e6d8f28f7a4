"""This engine's EC connector figures in vLLM's own stats and /metrics.

`ECDaemonStats` is what `get_ec_connector_stats` returns each step: plain
counters since the previous step (the scheduler's lookups, hits, loads and
load failures; the workers' saves and skipped saves, carried to the
scheduler in their metadata) and the workers' per-step load times. vLLM's
logger aggregates and logs them; `ECDaemonPromMetrics` turns them into
`vllm:ec_daemon_*` counters, a load-time histogram and the `attached` gauge
(is the engine's scheduler attached to its daemon: 1, or serving without
the cache: 0), labelled per engine like vLLM's other metrics. A gauge is a
state, not a count: merging keeps its latest value, and stats that carry
only a gauge are not empty (vLLM drops empty stats, and "detached" is 0).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

# stats key -> (metric name, help)
COUNTERS = {
    "lookups": ("vllm:ec_daemon_lookups", "Encoder cache lookups by the scheduler"),
    "hits": ("vllm:ec_daemon_hits", "Lookups answered from the ec-daemon cache"),
    "loads": ("vllm:ec_daemon_loads", "Loads dispatched to the workers"),
    "load_bytes": ("vllm:ec_daemon_load_bytes", "Bytes of dispatched loads"),
    "load_failures": ("vllm:ec_daemon_load_failures",
                      "Loads a worker found unusable: their requests encoded the item, or "
                      "failed without its media"),
    "loads_checksum_mismatch": ("vllm:ec_daemon_loads_checksum_mismatch",
                                "Loads whose bytes did not match their entry's checksum "
                                "(another process rewrote them): refused, reported to the daemon"),
    "loads_stamp_mismatch": ("vllm:ec_daemon_loads_stamp_mismatch",
                             "Loads whose pages no longer carried their entry's stamp: refused"),
    "loads_inline": ("vllm:ec_daemon_loads_inline",
                     "Loads the scheduler's process staged itself (a step its workers did "
                     "not run)"),
    "saves_done": ("vllm:ec_daemon_saves", "Encoder outputs saved to the cache"),
    "saves_already_cached": ("vllm:ec_daemon_saves_already_cached",
                             "Saves dropped: the key was cached or being saved"),
    "saves_skipped_busy": ("vllm:ec_daemon_saves_skipped_busy",
                           "Saves dropped: the save queue held its byte limit"),
    "saves_refused": ("vllm:ec_daemon_saves_refused", "Saves refused: the cache was full"),
    "saves_failed": ("vllm:ec_daemon_saves_failed",
                     "Saves the daemon did not take: no answer in time (or the stream was "
                     "lost), or refused for another reason than a full cache"),
    "saves_lost": ("vllm:ec_daemon_saves_lost",
                   "Saves copied whose report the daemon did not accept (their session "
                   "ended first): not cached"),
    "save_errors": ("vllm:ec_daemon_save_errors",
                    "Saves that raised in the worker (its log has the error): not cached"),
    "saves_stale": ("vllm:ec_daemon_saves_stale",
                    "Saves given up before copying: the worker's session was no longer fresh, "
                    "or its pages were given to another entry (a worker frozen past its lease)"),
    "saves_region_cut": ("vllm:ec_daemon_saves_region_cut",
                         "Saves given up: the region file was cut under the copy (another "
                         "process truncated it)"),
    "saves_skipped_detached": ("vllm:ec_daemon_saves_skipped_detached",
                               "Saves dropped: the worker was not attached to its daemon"),
    "saves_off_namespace": ("vllm:ec_daemon_saves_off_namespace",
                            "Saves dropped: the worker identified other weights than its "
                            "scheduler (it saves nothing from then on)"),
    "deferred": ("vllm:ec_daemon_deferred_items",
                 "Items a request was deferred for: asked whether another engine or the "
                 "second tier makes them"),
    "defer_timeouts": ("vllm:ec_daemon_defer_timeouts",
                       "Deferrals given up (ec_daemon_max_defer_seconds): the engine encoded"),
    "answer_waits": ("vllm:ec_daemon_answer_waits",
                     "Times the scheduler waited for the daemon's answer to a cold miss"),
    "answer_wait_us": ("vllm:ec_daemon_answer_wait_microseconds",
                       "Time the scheduler waited for those answers"),
    "metadata_only_items": ("vllm:ec_daemon_metadata_only_items",
                            "Items of finished requests that came without their media (an "
                            "encoder instance announced them): never preprocessed here"),
    "metadata_only_failures": ("vllm:ec_daemon_metadata_only_failures",
                               "Requests failed: an item that came without its media was not "
                               "in the cache and nobody would make it, or not in time"),
    "loads_staging_full": ("vllm:ec_daemon_loads_staging_full",
                           "Loads a worker could not stage: its staging area "
                           "(ec_daemon_staging_bytes) was full; their requests encoded"),
    "staged_expired": ("vllm:ec_daemon_staged_expired",
                       "Staged loads no step adopted in time: dropped"),
    "pin_refused": ("vllm:ec_daemon_pin_refused",
                    "Region mappings a CUDA worker could not pin (cudaHostRegister refused): "
                    "its copies run unpinned, slower and still correct"),
}
# stats keys on no metric of their own, and why (each key a connector's stats
# can carry is in COUNTERS, GAUGES or here: tests/vllm/test_connector_contract.py)
NOT_EXPORTED = {
    "loads_done": "a worker's loads: the scheduler counts each load once (loads)",
    "loads_failed": "a worker's failed loads: the scheduler counts them once (load_failures)",
    "loads_adopted": "a worker's staged loads that a step used: the scheduler's hits",
    "staged_dropped": "staged loads whose requests ended first: no loss",
    "saves_held": "saves waiting for the first step to name the namespace: not an outcome",
}
# stats key -> (metric name, help): states, the latest value wins
GAUGES = {
    "attached": ("vllm:ec_daemon_attached",
                 "1 while the engine's scheduler is attached to its ec-daemon (hits are "
                 "answered), 0 while it serves without the cache (the daemon is unreachable: "
                 "its log says which socket it tries)"),
}
LOAD_SECONDS = "load_seconds"
LOAD_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5, 1.0)


def merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum counters, concatenate lists, keep `b`'s gauges; neither argument
    is changed."""
    merged = dict(a)
    for key, value in b.items():
        if key in GAUGES:
            merged[key] = value
        elif isinstance(value, list):
            merged[key] = [*merged.get(key, []), *value]
        else:
            merged[key] = merged.get(key, 0) + value
    return merged


class ECDaemonStats(ECConnectorStats):
    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        self.data = merge_stats(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items()
                                       if not isinstance(v, list)}
        lookups = out.get("lookups", 0)
        if lookups:
            out["hit_rate"] = round(out.get("hits", 0) / lookups, 4)
        times = self.data.get(LOAD_SECONDS, [])
        if times:
            out["avg_load_ms"] = round(1000 * sum(times) / len(times), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values()) and not any(k in self.data for k in GAUGES)


class ECDaemonPromMetrics(ECConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._per_engine(self._counter_cls(name=name, documentation=doc,
                                                    labelnames=labelnames))
            for key, (name, doc) in COUNTERS.items()}
        self._load_time = self._per_engine(self._histogram_cls(
            name="vllm:ec_daemon_load_seconds",
            documentation="Time a worker spent loading one step's encoder outputs",
            buckets=LOAD_BUCKETS, labelnames=labelnames))
        # Children made on their first value: no sample until the engine said.
        self._gauges = {key: self._gauge_cls(name=name, documentation=doc,
                                             multiprocess_mode="mostrecent",
                                             labelnames=labelnames)
                        for key, (name, doc) in GAUGES.items()}

    def _per_engine(self, metric: Counter | Histogram) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._counters and value:
                self._counters[key][engine_idx].inc(value)
        for seconds in transfer_stats_data.get(LOAD_SECONDS, []):
            self._load_time[engine_idx].observe(seconds)
        for key, gauge in self._gauges.items():
            if key in transfer_stats_data:
                gauge.labels(*self.per_engine_labelvalues[engine_idx]).set(
                    transfer_stats_data[key])
