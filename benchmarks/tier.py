"""Saves and hits on a host with the second tier on, against the same host
with it off, in the same run: two daemons (one with `--remote` on a local
redis-server, one without), each with one engine (a scheduler side and a
worker rank in this process). The redis-server runs at the lowest CPU
priority: in a fleet the store is other machines' work. Rounds alternate between the two, and each
figure is the best round, so both see the same machine.

- saves/s: a worker saves 1 MiB entries and waits for them to land (with the
  tier on, each is then published in the background);
- hit steps/s: a scheduler step of 8 hits (`ensure`, `has_item`,
  `after_alloc`, `build_step_metadata`, every rank reporting), vLLM's calls,
  measured once the publications of the saves went out (write-behind: on a
  two-core machine they would otherwise share the cores with the steps).

    python -m benchmarks.tier [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

MiB = 1 << 20


class _Host:
    def __init__(self, remote: str) -> None:
        from ec_client.scheduler import SchedulerDelegate
        from ec_client.worker import WorkerDelegate
        from tests.integration.daemon import Daemon
        from tests.integration.engines import LAYOUT

        extra = ("--remote", remote) if remote else ()
        self.daemon = Daemon(cpu_bytes="512MiB", extra=extra, check_invariants=False).start()
        self.scheduler = SchedulerDelegate(self.daemon.socket, engine_id="bench",
                                           layout=LAYOUT)
        self.worker = WorkerDelegate(self.daemon.socket, engine_id="bench", layout=LAYOUT)
        for d in (self.scheduler, self.worker):
            assert d.link.wait_attached(30), d.link.last_error
        self.saved = 0

    def saves(self, count: int, data: Any) -> float:
        started = time.perf_counter()
        for _ in range(count):
            self.saved += 1
            assert self.worker.save(f"save-{self.saved}", data)
        assert self.worker.flush(120)
        return count / (time.perf_counter() - started)

    def hit_steps(self, keys: list[str], steps: int) -> float:
        s = self.scheduler
        started = time.perf_counter()
        for _ in range(steps):
            assert s.ensure(keys)
            for key in keys:
                assert s.has_item(key)
                s.after_alloc("req", key)
            loads = s.build_step_metadata().loads
            s.apply_worker_output([spec.transfer_id for spec in loads])
        return steps / (time.perf_counter() - started)

    def drained(self) -> None:
        deadline = time.monotonic() + 120
        while self.daemon.stats()["remote_tier"].get("publish_queue_bytes", 0):
            assert time.monotonic() < deadline, "the publish queue never drained"
            time.sleep(0.05)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
        self.daemon.cleanup()


def measure(quick: bool = False) -> list[dict[str, Any]]:
    from tests.redis_servers import single_node

    rounds, saves, steps = (2, 20, 500) if quick else (5, 100, 5000)
    data = np.random.default_rng(0).integers(0, 256, (MiB // 2048, 2048), dtype=np.uint8)
    keys = [f"hit-{i}" for i in range(8)]
    with single_node() as server:
        # The store is another machine's work in a fleet: its server runs
        # here at the lowest priority, so it takes only idle cycles.
        assert server.pid is not None
        os.setpriority(os.PRIO_PROCESS, server.pid, 19)
        hosts = {"off": _Host(""), "on": _Host(server.url)}
        try:
            for host in hosts.values():
                for key in keys:
                    assert host.worker.save(key, data)
                assert host.worker.flush(60)
                deadline = time.monotonic() + 30
                while not all(host.scheduler.view.get(k) for k in keys):
                    assert time.monotonic() < deadline, "the hits never reached the view"
                    time.sleep(0.01)
            best: dict[tuple[str, str], float] = {}
            for _ in range(rounds):
                for name, host in hosts.items():
                    value = host.saves(saves, data)
                    best[name, "saves"] = max(best.get((name, "saves"), 0.0), value)
                # Publishing is write-behind: let it finish before the hits,
                # so they do not share two cores with it (saves already did).
                hosts["on"].drained()
                for name, host in hosts.items():
                    value = host.hit_steps(keys, steps)
                    best[name, "hits"] = max(best.get((name, "hits"), 0.0), value)
            published = hosts["on"].daemon.stats()["remote_tier"]["publishes"]
        finally:
            for host in hosts.values():
                host.close()
    return [{"what": "saves/s (1 MiB)", "off": best["off", "saves"], "on": best["on", "saves"],
             "ratio": best["on", "saves"] / best["off", "saves"], "published": published},
            {"what": "hit steps/s (8 hits)", "off": best["off", "hits"],
             "on": best["on", "hits"], "ratio": best["on", "hits"] / best["off", "hits"]}]


def promotion_latency(quick: bool = False) -> list[dict[str, Any]]:
    """End to end, through two daemons and a local redis-server: host 1
    saves an entry; host 2's scheduler misses it, and `ensure` defers the
    request until the daemon promoted it (want, fetch, verify, write,
    ready event). The time until `ensure` says yes, per entry size."""
    from tests.redis_servers import single_node

    sizes = (MiB, 8 * MiB) if quick else (MiB, 8 * MiB, 32 * MiB)
    repeat = 2 if quick else 5
    rows = []
    with single_node() as server:
        assert server.pid is not None
        os.setpriority(os.PRIO_PROCESS, server.pid, 19)
        one, two = _Host(server.url), _Host(server.url)
        try:
            for size in sizes:
                data = np.random.default_rng(size).integers(0, 256, (size // 2048, 2048),
                                                            dtype=np.uint8)
                best = float("inf")
                for i in range(repeat):
                    key = f"promote-{size}-{i}"
                    assert one.worker.save(key, data) and one.worker.flush(60)
                    deadline = time.monotonic() + 60
                    while two.daemon.stats()["remote_tier"]["index_entries"] < \
                            len(rows) * repeat + i + 1:
                        assert time.monotonic() < deadline, "never indexed"
                        time.sleep(0.01)
                    started = time.perf_counter()
                    while not two.scheduler.ensure([key]):
                        assert time.perf_counter() - started < 60, "never promoted"
                        time.sleep(0.0002)
                    best = min(best, time.perf_counter() - started)
                    assert two.scheduler.has_item(key)
                    two.scheduler.build_step_metadata()
                rows.append({"MiB": size // MiB, "promote_ms": best * 1e3,
                             "promote_gbps": size / best / 1e9})
        finally:
            one.close()
            two.close()
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args(argv).quick
    rows = measure(quick) + promotion_latency(quick)
    for row in rows:
        print(row)
    return rows


if __name__ == "__main__":
    main()
