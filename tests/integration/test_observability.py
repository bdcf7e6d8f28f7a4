"""Metrics, reflection and logs of a running daemon, as an SRE sees them."""

from __future__ import annotations

import json
import socket
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from prometheus_client.parser import text_string_to_metric_families

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout
from tests import staged
from tests.integration.daemon import Daemon, free_port

pytestmark = pytest.mark.integration
LAYOUT = Layout("metrics-model", "float32", {"image": 512})


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_endpoint_reports_cache_activity():
    port = free_port()
    with Daemon(extra=("--metrics-port", str(port), "--log-format", "json")) as daemon:
        scheduler = SchedulerDelegate(daemon.socket, engine_id="E", layout=LAYOUT)
        worker = WorkerDelegate(daemon.socket, engine_id="E", layout=LAYOUT)
        try:
            assert scheduler.link.wait_attached(10) and worker.link.wait_attached(10)
            data = np.ones((4, 128), np.float32)
            assert worker.save("k", data) and worker.flush(10)
            daemon.wait_for(lambda: scheduler.view.get("k"), what="ready")
            _, metadata = staged.plan(scheduler, ["k"], finish=False)  # staged, as vLLM's hits
            result = worker.load(metadata.loads, metadata.regions)
            assert result.failed == {} and np.array_equal(result.loaded["k"], data)
            staged.report(scheduler, result)
            assert staged.use(scheduler, ["k"])[0] == [True]  # vLLM's lookup: a hit
            assert not scheduler.has_item("missing")
        finally:
            scheduler.close()  # flushes the lookup counters on its last heartbeat
            worker.close()
        daemon.wait_for(lambda: daemon.stats()["sessions"] == 0, what="detach")
        metrics = scrape(port)
        namespace = (("namespace", "metrics-model|float32|image=512|"),)
        assert metrics[("ec_daemon_saves_total", ())] == 1
        assert metrics[("ec_daemon_loads_total", ())] == 1
        assert metrics[("ec_daemon_bytes_saved_total", ())] == data.nbytes
        assert metrics[("ec_daemon_bytes_loaded_total", ())] == data.nbytes
        assert metrics[("ec_daemon_hits_total", namespace)] == 1
        assert metrics[("ec_daemon_namespace_loads_total", namespace)] == 1
        assert metrics[("ec_daemon_lookups_total", namespace)] == 2
        assert metrics[("ec_daemon_misses_total", namespace)] == 1
        assert metrics[("ec_daemon_bytes", (("state", "capacity"),))] == 64 << 20
        assert metrics[("ec_daemon_bytes", (("state", "used"),))] == 64 << 10  # one page
        assert metrics[("ec_daemon_bytes", (("state", "hidden"),))] == 0
        assert metrics[("ec_daemon_entries", (("state", "ready"),))] == 1
        assert metrics[("ec_daemon_ghost_sessions", ())] == 0
        assert metrics[("ec_daemon_namespaces_not_listed", ())] == 0
        stats = daemon.stats()
        region = (("generation", f"{stats['generation']:016x}"), ("path", stats["region_path"]))
        assert metrics[("ec_daemon_region_info", region)] == 1
        assert metrics[("ec_daemon_rpc_duration_seconds_count", (("method", "Attach"),))] == 2
        # The save went on the worker's session stream, and loads make no call at all.
        for method in ("Allocate", "Report"):
            assert ("ec_daemon_rpc_duration_seconds_count", (("method", method),)) not in metrics
        lines = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
        assert any("serving on" in line["message"] for line in lines)
        assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)


def test_sessions_by_role_are_exported():
    port = free_port()
    with Daemon(extra=("--metrics-port", str(port))) as daemon:
        scheduler = SchedulerDelegate(daemon.socket, engine_id="E", layout=LAYOUT,
                                      role="consumer")
        try:
            assert scheduler.link.wait_attached(10)
            metrics = scrape(port)
            key = ("ec_daemon_sessions", (("component", "scheduler"), ("role", "consumer")))
            assert metrics[key] == 1
        finally:
            scheduler.close()


def test_reflection_lists_the_services(daemon):
    with grpc.insecure_channel(daemon.socket) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"ec_daemon.v1.ECDaemon", "grpc.health.v1.Health"} <= services


def test_metrics_port_in_use_fails_at_start():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        daemon = Daemon(extra=("--metrics-port", str(port)))
        try:
            daemon.start(wait=False)
            assert daemon.proc is not None and daemon.proc.wait(30) == 2
            assert "cannot serve metrics" in daemon.log()
        finally:
            daemon.cleanup()
