"""One mode of `make bench-serve` (benchmarks/serve.py): its pair of engines,
and for ec-daemon its daemons, through every workload it takes part in.

ec-daemon's engines reach their daemon through two socket folders, host-1
(engine 0) and host-2 (engine 1). For one host, host-2 is a link to host-1
and one daemon serves both engines; for workload (d) each folder gets a
daemon of its own (two sockets, two regions: two hosts), on one Redis for
the second tier. The engines re-attach by themselves whenever their daemon
changes; a change of layout waits until they have.

Counters are read before and after each phase from every source (each
engine's log and /metrics, each daemon's `stats --json`); a source that an
event restarted counts again from zero.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.serve_hosts import Daemon, Engine, EngineSetup, start_engines
from benchmarks.serve_stream import Client, Outcome, Request, make_images

ATTACH_S = 60.0
PUBLISH_WAIT_S = 10.0
ADOPTED = re.compile(r"adopted region .*?: (\d+) entries")
Snapshot = dict[tuple[str, str], float]


@dataclass(frozen=True)
class Workload:
    key: str  # "a@1", "b", "c", "d"
    workload: str  # "a" .. "d"
    title: str
    event: str  # what happens between the halves; "" for one phase
    seed: int
    rate: float
    stream: list[Request]
    affected_engines: tuple[int, ...]
    # (d) only: the stream again on images of its own, for the second tier's
    # run on the same engines (which hold the first run's images)
    tier_stream: list[Request] | None = None
    reuse: float | None = None  # (f)'s level; the others: the run's

    def describe(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for request in self.stream:
            kinds[request.kind] = kinds.get(request.kind, 0) + 1
        return {"key": self.key, "workload": self.workload, "title": self.title,
                "event": self.event, "seed": self.seed, "rate": self.rate,
                "requests": len(self.stream), "images": len({r.image for r in self.stream}),
                "kinds": kinds, "affected_engines": list(self.affected_engines),
                "before_engines": sorted({r.engine for r in self.stream if r.phase == 0}),
                **({"reuse": self.reuse} if self.reuse is not None else {})}


def ec_config(mode: str, device: str, socket_uri: str, shared: Path,
              role: str = "ec_both") -> list[str]:
    """`--ec-transfer-config` of an engine of `mode`; `role`: vLLM's
    ec_role (an E/PD pair's ec_producer and ec_consumer, workload (e))."""
    if mode == "none":
        return []
    if mode == "example":
        config: dict[str, Any] = {
            "ec_connector": "ECExampleConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(shared)}}
    elif mode == "cpu":
        config = {"ec_connector": "ECCPUConnector", "ec_role": "ec_both",
                  "ec_connector_extra_config": {"ec_cpu_bytes": 2 << 30}}
    else:
        extra = {"ec_daemon_socket": socket_uri}
        if device == "cpu":
            extra["ec_daemon_copy_backend"] = "cpu"
        config = {"ec_connector": "ECDaemonConnector",
                  "ec_connector_module_path": "ec_client.vllm_connector", "ec_role": role,
                  "ec_connector_extra_config": extra}
    return ["--ec-transfer-config", json.dumps(config)]


class ModeRun:
    """Context manager: starts the mode's engines (and daemons), warms each
    engine up with one request of its own image; stops everything by pid
    and frees the daemons' regions on exit."""

    def __init__(self, mode: str, setup: EngineSetup, client: Client, folder: Path,
                 image_size: int) -> None:
        folder.mkdir(parents=True)
        self.mode = mode
        self.setup = setup
        self.client = client
        self.folder = folder
        self.hosts = [folder / "host-1", folder / "host-2"]
        self.daemons: list[Daemon] = []
        self.layout: tuple[int, bool] | None = None  # (hosts, second tier)
        self.redis: Any = None
        env = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if mode == "cpu" else {}
        self.engines = [
            Engine(i, setup, ec_config(mode, setup.device, f"unix://{self.hosts[i]}/ec.sock",
                                       folder / "ec-shared"), env, folder / f"engine-{i}.log")
            for i in range(2)]
        self.warm_images = make_images(folder, 2, image_size, 10_000, "warm-up")

    def __enter__(self) -> ModeRun:
        try:
            if self.mode == "ec-daemon":
                self._set_layout(1, False)
            start_engines(self.engines, self.setup)
            warm = [Request(i, image, i, 0, 0.0, "cold")
                    for i, image in enumerate(self.warm_images)]
            failed = [o.error for o in self._send(warm) if not o.ok]
            if failed:
                raise RuntimeError(f"{self.mode}: the warm-up failed: {failed[0][-2000:]}")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for engine in self.engines:
            engine.stop()
        self._stop_daemons()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    def _send(self, requests: list[Request]) -> list[Outcome]:
        return self.client.send(requests, self.urls) if requests else []

    def workload(self, workload: Workload, tier: bool = False
                 ) -> tuple[list[Outcome], dict[str, float], dict[str, Any]]:
        """Run `workload`'s phases (and its event between them); returns
        the outcomes, the counters over the phases, and what the event did
        (with `zero`: the times each phase's send times count from)."""
        if self.mode == "ec-daemon":
            self._set_layout(2 if workload.workload == "d" else 1, tier)
        stream = workload.tier_stream if tier and workload.tier_stream else workload.stream
        first = [r for r in stream if r.phase == 0]
        second = [r for r in stream if r.phase == 1]
        before = self.snapshot()
        outcomes = self._send(first)
        if not second:
            return outcomes, totals(before, self.snapshot()), {}
        mid = self.snapshot()
        start = time.monotonic()
        info, restarted = self._event(workload, tier)
        resume = time.monotonic()
        info["event_s"] = resume - start
        later = self._send(second)
        counters = totals(before, mid, restarted, self.snapshot())
        info["zero"] = (start, resume)
        return outcomes + later, counters, info

    def phases(self, *phases: list[Request]) -> list[tuple[list[Outcome], dict[str, float]]]:
        """Each list of requests sent in turn (both engines on one daemon),
        with the counters of its span: the reuse sweep's phases."""
        if self.mode == "ec-daemon":
            self._set_layout(1, False)
        out = []
        for requests in phases:
            before = self.snapshot()
            outcomes = self._send(requests)
            out.append((outcomes, totals(before, self.snapshot())))
        return out

    def _event(self, workload: Workload, tier: bool) -> tuple[dict[str, Any], set[str]]:
        """The event between the halves; what it did, and the counter
        sources it restarted."""
        if workload.workload == "b":
            engine = self.engines[0]
            old = engine.proc.pid if engine.proc else None
            engine.stop()
            engine.start()
            retries = engine.wait_ready()
            return {"restarted": engine.proc is not None and engine.proc.pid != old,
                    "restarted_pid": [old, engine.proc.pid if engine.proc else None],
                    "start_retries": retries}, {"engine-0"}
        if workload.workload == "c" and self.mode == "ec-daemon":
            daemon = self.daemons[0]
            old = daemon.proc.pid if daemon.proc else None
            daemon.stop()
            adoption = daemon.start()  # not fresh: it adopts the region its predecessor left
            adopted = ADOPTED.search(adoption)
            return {"restarted": daemon.proc is not None and daemon.proc.pid != old,
                    "adoption": adoption,
                    "adopted_entries": int(adopted.group(1)) if adopted else 0}, {"daemon-0"}
        if workload.workload == "d" and tier:
            return {"publish_wait_s": self._wait_published()}, set()
        return {"restarted": False}, set()

    def _wait_published(self) -> float:
        """Until host 1 published every entry it saved (bounded)."""
        start = time.monotonic()
        while time.monotonic() - start < PUBLISH_WAIT_S:
            stats = self.daemons[0].stats()
            if stats.get("remote_tier", {}).get("publishes", 0) >= stats["saves"]:
                break
            time.sleep(0.05)
        return time.monotonic() - start

    def _set_layout(self, hosts: int, tier: bool) -> None:
        """One daemon for both engines, or one each (on one Redis with
        `tier`); each change starts empty daemons and waits until both
        engines attached to them."""
        if self.layout == (hosts, tier):
            return
        self._stop_daemons()
        remote = self._redis_url() if tier else ""
        shutil.rmtree(self.hosts[1], ignore_errors=True)
        self.hosts[1].unlink(missing_ok=True)
        if hosts == 1:
            self.hosts[1].symlink_to(self.hosts[0].name)
        self.daemons = [Daemon(folder, remote) for folder in self.hosts[:hosts]]
        for daemon in self.daemons:
            daemon.start(fresh=True)
        if self.layout is not None:
            self._wait_attached(2 // hosts)
        self.layout = (hosts, tier)

    def _wait_attached(self, engines_per_daemon: int) -> None:
        # An engine holds two sessions: its scheduler's and its worker's.
        deadline = time.monotonic() + ATTACH_S
        while True:
            try:
                if all(d.stats()["sessions"] >= 2 * engines_per_daemon for d in self.daemons):
                    return
            except RuntimeError as exc:  # a daemon still starting; give up at the deadline
                failure = str(exc)
            else:
                failure = "the engines did not attach to the new daemons"
            if time.monotonic() > deadline:
                raise RuntimeError(failure)
            time.sleep(0.2)

    def _redis_url(self) -> str:
        if self.redis is None:
            from tests.redis_servers import RedisServer

            self.redis = RedisServer(self.folder / "redis")
            self.redis.start()
        return str(self.redis.url)

    def _stop_daemons(self) -> None:
        for daemon in self.daemons:
            daemon.stop()
            daemon.clean()
        self.daemons = []

    def snapshot(self) -> Snapshot:
        """Every counter, by (source, name)."""
        out: Snapshot = {}
        for i, daemon in enumerate(self.daemons):
            stats = daemon.stats()
            tier = stats.get("remote_tier") or {}
            for name, value in (("daemon_hits", stats["hits"]),
                                ("daemon_misses", stats["misses"]),
                                ("daemon_saves", stats["saves"]),
                                ("daemon_loads", stats["loads"]),
                                ("promotions", stats["convergence"]["promotions"]),
                                ("publishes", tier.get("publishes", 0)),
                                ("remote_hits", tier.get("remote_hits", 0))):
                out[(f"daemon-{i}", name)] = float(value)
        for i, engine in enumerate(self.engines):
            # The log runs on across restarts: its source never restarts.
            out[(f"log-{i}", "encoder_forwards")] = float(engine.encoder_forwards())
            for name, value in engine.connector_counters().items():
                out[(f"engine-{i}", f"connector_{name}")] = value
        return out


def totals(before: Snapshot, mid: Snapshot, restarted: set[str] | None = None,
           after: Snapshot | None = None) -> dict[str, float]:
    """Counters summed over sources: mid - before, plus after - mid where a
    second phase ran (from zero for the sources in `restarted`)."""
    out: dict[str, float] = {}

    def add(start: Snapshot, end: Snapshot, fresh: set[str]) -> None:
        for (source, name), value in end.items():
            base = 0.0 if source in fresh else start.get((source, name), 0.0)
            out[name] = out.get(name, 0.0) + value - base

    add(before, mid, set())
    if after is not None:
        add(mid, after, restarted or set())
    return {name: int(value) if value == int(value) else value for name, value in out.items()}
