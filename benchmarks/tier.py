"""Saves and hits on a host with the second tier on, against the same host
with it off, in the same run: two daemons (one with `--remote` on a local
redis-server, one without), each with one engine (a scheduler side and a
worker rank in this process). The redis-server runs at the lowest CPU
priority: in a fleet the store is other machines' work. Rounds alternate between the two, and each
figure is the best round, so both see the same machine.

- saves/s: a worker saves 1 MiB entries and waits for them to land (with the
  tier on, each is then published in the background);
- hit steps/s: 8 hits through the two scheduler steps each takes (`ensure`
  stages their loads, every rank reports, then `ensure`, `has_item`,
  `after_alloc`, `build_step_metadata` use them), vLLM's calls,
  measured once the publications of the saves went out (write-behind: on a
  two-core machine they would otherwise share the cores with the steps);
- the daemon's CPU per published 1 MiB (`publish_cpu`): the same saves on
  both daemons, waited for until published, the daemon with the tier less
  the one without, per entry (on-CPU time from /proc/PID/task/*/schedstat);
  and the publisher thread's own.

    python -m benchmarks.tier [--quick] [--part saves|cpu|promotion]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20


class _Host:
    def __init__(self, remote: str, layout: Any = None) -> None:
        """`layout`: the engines' (tests.integration.engines.LAYOUT unless given)."""
        from ec_client.scheduler_side.scheduler import SchedulerDelegate
        from ec_client.worker_side.worker import WorkerDelegate
        from tests.integration.daemon import Daemon
        from tests.integration.engines import LAYOUT

        layout = layout or LAYOUT
        extra = ("--remote", remote) if remote else ()
        self.daemon = Daemon(cpu_bytes="512MiB", extra=extra, check_invariants=False).start()
        self.scheduler = SchedulerDelegate(self.daemon.socket, engine_id="bench",
                                           layout=layout)
        self.worker = WorkerDelegate(self.daemon.socket, engine_id="bench", layout=layout)
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
        """Hits per second as steps of `keys`: each hit two scheduler steps,
        the one that stages its load (the request waits) and the one that
        uses it, every rank reporting in between."""
        from tests import staged

        s = self.scheduler
        started = time.perf_counter()
        for step in range(steps):
            assert not s.ensure(keys, f"req-{step}")  # cached: their loads are staged
            loads = s.build_step_metadata().loads
            s.apply_worker_output([spec.transfer_id for spec in loads])
            assert s.ensure(keys, f"req-{step}")
            hits, _ = staged.use(s, keys, f"req-{step}")
            assert all(hits)
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

    data = np.random.default_rng(0).integers(0, 256, (MiB // 2048, 2048), dtype=np.uint8)
    with single_node() as server:
        # The store is another machine's work in a fleet: its server runs
        # here at the lowest priority, so it takes only idle cycles.
        assert server.pid is not None
        os.setpriority(os.PRIO_PROCESS, server.pid, 19)
        hosts = {"off": _Host(""), "on": _Host(server.url)}
        try:
            return saves_and_hits(hosts, data, quick)
        finally:
            for host in hosts.values():
                host.close()


def saves_and_hits(hosts: dict[str, _Host], data: Any, quick: bool) -> list[dict[str, Any]]:
    """Rounds of saves then hit steps on hosts "off" and "on", alternated;
    the best round of each."""
    rounds, saves, steps = (2, 20, 500) if quick else (5, 100, 5000)
    keys = [f"hit-{i}" for i in range(8)]
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
    return [{"what": "saves/s (1 MiB)", "off": best["off", "saves"], "on": best["on", "saves"],
             "ratio": best["on", "saves"] / best["off", "saves"], "published": published},
            {"what": "hit steps/s (8 hits)", "off": best["off", "hits"],
             "on": best["on", "hits"], "ratio": best["on", "hits"] / best["off", "hits"]}]


def _cpu_s(pid: int, nice: int | None = None) -> float:
    """On-CPU seconds of a process's threads (those at `nice` only, when
    given): schedstat counts nanoseconds, /proc/PID/stat 10 ms ticks."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            if nice is None or int(stat[16]) == nice:
                total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def publish_cpu(quick: bool = False) -> list[dict[str, Any]]:
    """The daemon's CPU per published 1 MiB entry: each round, the same
    saves on a daemon with the tier and one without, 100 at a time, each
    batch waited for until stored (and, with the tier, published: polled on
    the redis-server, not the daemon); the least CPU of each over the rounds,
    per announcement with the tier, per save without."""
    from ec_daemon.remote.redis.store import INDEX_SHARDS, index_key
    from tests.redis_servers import single_node

    data = np.random.default_rng(1).integers(0, 256, (MiB // 2048, 2048), dtype=np.uint8)
    with single_node() as server:
        assert server.pid is not None
        os.setpriority(os.PRIO_PROCESS, server.pid, 19)
        client = server.client()

        def announced() -> int:
            pipe = client.pipeline(transaction=False)
            for k in range(INDEX_SHARDS):
                pipe.xlen(index_key(k))
            return sum(pipe.execute())

        hosts = {"off": _Host(""), "on": _Host(server.url)}
        try:
            return cpu_rounds(hosts, data, quick, announced)
        finally:
            client.close()
            for host in hosts.values():
                host.close()


def cpu_rounds(hosts: dict[str, _Host], data: Any, quick: bool,
               announced: Callable[[], int]) -> list[dict[str, Any]]:
    """publish_cpu's rounds on hosts "off" and "on"; `announced()`: the
    publications the store holds, asked of the store (not the daemon)."""
    from ec_daemon.remote.publisher import PUBLISHER_NICE

    rounds, saves = (2, 100) if quick else (3, 300)

    def published(count: int) -> None:
        """Until `count` announcements, or none for a second (dropped or skipped)."""
        last, quiet_since = announced(), time.monotonic()
        while last < count and time.monotonic() - quiet_since < 1.0:
            time.sleep(0.02)
            now = announced()
            if now != last:
                last, quiet_since = now, time.monotonic()

    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, host in hosts.items():
            assert host.daemon.proc is not None
            pid = host.daemon.proc.pid
            before = _cpu_s(pid), _cpu_s(pid, PUBLISHER_NICE), announced()
            for _ in range(saves // 100):  # (within the worker's save queue)
                host.saves(100, data)
                if name == "on":
                    published(announced() + 100)
            after = _cpu_s(pid), _cpu_s(pid, PUBLISHER_NICE), announced()
            count = after[2] - before[2] if name == "on" else saves
            for what, spent in ((name, after[0] - before[0]),
                                (f"{name} publisher", after[1] - before[1])):
                best[what] = min(best.get(what, float("inf")), spent / max(1, count))
    publishes = hosts["on"].daemon.stats()["remote_tier"]["publishes"]
    return [{"what": "daemon CPU per published 1 MiB (ms)",
             "off_ms_per_save": best["off"] * 1e3, "on_ms_per_save": best["on"] * 1e3,
             "daemon_cpu_ms_per_mib": (best["on"] - best["off"]) * 1e3,
             "publisher_cpu_ms_per_mib": best["on publisher"] * 1e3, "published": publishes}]


def promotion_latency(quick: bool = False) -> list[dict[str, Any]]:
    """End to end, through two daemons and a local redis-server: host 1
    saves an entry; host 2's scheduler misses it, and `ensure` defers the
    request until the daemon promoted it (want, fetch, verify, write,
    ready event). The time until `ensure` says yes, per entry size."""
    from tests.redis_servers import single_node

    with single_node() as server:
        assert server.pid is not None
        os.setpriority(os.PRIO_PROCESS, server.pid, 19)
        one, two = _Host(server.url), _Host(server.url)
        try:
            return promotions(one, two, quick, lambda size: np.random.default_rng(size).integers(
                0, 256, (size // 2048, 2048), dtype=np.uint8),
                lambda count: two.daemon.stats()["remote_tier"]["index_entries"] >= count)
        finally:
            one.close()
            two.close()


def promotions(one: _Host, two: _Host, quick: bool, data_of: Callable[[int], Any],
               found: Callable[[int], bool]) -> list[dict[str, Any]]:
    """promotion_latency's measure: `data_of(size)` an entry of `size`
    bytes; `found(count)` whether host 2 can find the first `count` entries
    host 1 saved (say so without asking the scheduler: a miss asked too
    early is remembered)."""
    sizes = (MiB, 8 * MiB) if quick else (MiB, 8 * MiB, 32 * MiB)
    repeat = 2 if quick else 5
    rows: list[dict[str, Any]] = []
    for size in sizes:
        data = data_of(size)
        best = float("inf")
        for i in range(repeat):
            key = f"promote-{size}-{i}"
            assert one.worker.save(key, data) and one.worker.flush(60)
            deadline = time.monotonic() + 60
            while not found(len(rows) * repeat + i + 1):
                assert time.monotonic() < deadline, "never found"
                time.sleep(0.01)
            started = time.perf_counter()
            while not two.scheduler.ensure([key]):
                assert time.perf_counter() - started < 60, "never promoted"
                time.sleep(0.0002)
            best = min(best, time.perf_counter() - started)
            assert two.scheduler.view.get(key) is not None
        rows.append({"MiB": size // MiB, "promote_ms": best * 1e3,
                     "promote_gbps": size / best / 1e9})
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", choices=("saves", "cpu", "promotion"),
                        help="only saves and hits on/off, the CPU per publication, or "
                             "promotions end to end")
    args = parser.parse_args(argv)
    parts = {"saves": measure, "cpu": publish_cpu, "promotion": promotion_latency}
    rows = [row for name, part in parts.items() if args.part in (None, name)
            for row in part(args.quick)]
    for row in rows:
        print(row)
    return rows


if __name__ == "__main__":
    main()
