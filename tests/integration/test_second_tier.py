"""Two "hosts" (two daemons, each with its own socket and region) sharing one
store: what host 1 saved, host 2 promotes on a miss and loads bit-exact;
a value that does not verify is never served; a store that dies costs
misses, never a stuck engine; an entry past its TTL is a miss."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import numpy as np
import pytest

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.scheduler_side.wants import ANSWER_SECONDS
from ec_client.worker_side.worker import WorkerDelegate
from ec_daemon.remote.redis.store import value_key
from tests import groups, redis_servers, staged
from tests.integration.daemon import Daemon, free_port
from tests.integration.engines import LAYOUT, ensure_within, wait_until

pytestmark = [pytest.mark.integration, groups.needs_redis]
WAIT = 20.0


def data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (512, 2048), dtype=np.uint8)


class Host:
    """A daemon with the second tier on, and one engine: its scheduler side
    and one worker rank, in this process."""

    def __init__(self, url: str, name: str, *, ttl: float = 3600.0,
                 max_defer: float = 30.0, extra: tuple[str, ...] = (),
                 layout: Any = LAYOUT) -> None:
        self.name = name
        self.daemon = Daemon(cpu_bytes="32MiB", extra=(
            "--remote", url, "--remote-ttl-seconds", str(ttl), *extra)).start()
        self.scheduler = SchedulerDelegate(self.daemon.socket, engine_id=name, layout=layout,
                                           max_defer_seconds=max_defer)
        self.worker = WorkerDelegate(self.daemon.socket, engine_id=name, layout=layout)
        for d in (self.scheduler, self.worker):
            assert d.link.wait_attached(WAIT), d.link.last_error
        wait_until(lambda: self.scheduler.wanting and self.scheduler.link.fresh(),
                   "the view never learnt that a second tier is on")
        # its worker rank mapped the region (until then every lookup misses
        # and no want is sent: a busy machine delays the rank count)
        wait_until(self.scheduler.serving, f"{name}'s view never served")

    @property
    def namespace(self) -> str:
        attachment = self.scheduler.link.attachment
        assert attachment is not None
        return attachment.namespace

    def tier(self) -> dict[str, float]:
        return self.daemon.stats()["remote_tier"]

    def save(self, mm_hash: str, array: Any) -> None:
        done = self.worker.stats["saves_done"]
        assert self.worker.save(mm_hash, array) and self.worker.flush(WAIT)
        assert self.worker.stats["saves_done"] == done + 1, dict(self.worker.stats)

    def load(self, mm_hash: str) -> np.ndarray:
        """A step that hits `mm_hash`, and the worker's load of it."""
        assert staged.servable(self.scheduler, mm_hash)
        result = staged.load(self.scheduler, self.worker, [mm_hash])
        assert not result.failed, result.failed
        return np.asarray(result.loaded[mm_hash])

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
        self.daemon.stop()
        self.daemon.cleanup()


@pytest.fixture
def hosts() -> Iterator[Any]:
    with ExitStack() as stack:
        def make(url: str, name: str, **kwargs: Any) -> Host:
            host = Host(url, name, **kwargs)
            stack.callback(host.close)
            return host
        yield make


def published(host: Host, count: int) -> None:
    wait_until(lambda: host.tier()["publishes"] >= count, f"{host.name} never published")


def indexed(host: Host, count: int) -> None:
    wait_until(lambda: host.tier()["index_entries"] >= count,
               f"{host.name} never saw the other host's publication")


def test_a_miss_another_host_saved_is_promoted_and_loads_bit_exact(hosts):
    with redis_servers.cluster(3) as store:
        one, two = hosts(store.url, "host-1"), hosts(store.url, "host-2")
        arrays = {f"img-{i}": data(i) for i in range(3)}
        for mm_hash, array in arrays.items():
            one.save(mm_hash, array)
        published(one, 3)
        indexed(two, 3)
        for mm_hash, array in arrays.items():
            # Deferred while it is promoted; or promoted within the step's
            # answer wait already: a hit. Never "encode here".
            if two.scheduler.ensure([mm_hash]):
                assert staged.servable(two.scheduler, mm_hash)
            ok, _ = ensure_within(two.scheduler, [mm_hash], WAIT)
            assert ok
            loaded = two.load(mm_hash)
            assert loaded.tobytes() == array.tobytes() and loaded.shape == array.shape
        stats = two.daemon.stats()
        assert stats["convergence"]["promotions"] == 3
        assert stats["convergence"]["promoted_bytes"] == sum(a.nbytes for a in arrays.values())
        assert stats["remote_tier"]["remote_hits"] == 3
        assert stats["saves"] == 3  # promoted entries are ready as any save
        # Host 2 does not publish back what it promoted.
        assert two.tier()["publishes"] == 0
        shown = subprocess.run([sys.executable, "-m", "ec_daemon", "stats", "--socket",
                                two.daemon.socket], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "2nd tier   reachable" in shown.stdout and "3 promoted" in shown.stdout
        # The values are spread over the cluster's masters.
        assert len({store.node_of(value_key(one.namespace, h)).address for h in arrays}) >= 2


def test_a_value_that_does_not_verify_is_never_served(hosts):
    with redis_servers.single_node() as store:
        one, two = hosts(store.url, "host-1"), hosts(store.url, "host-2")
        one.save("img", data(1))
        published(one, 1)
        indexed(two, 1)
        client = store.client()
        key = value_key(one.namespace, "img")
        value = bytearray(client.get(key))
        value[-1] ^= 0xFF  # one payload byte flipped
        client.set(key, bytes(value))
        ok, _ = ensure_within(two.scheduler, ["img"], WAIT)
        assert ok and not staged.servable(two.scheduler, "img")  # encoded here, not served
        assert two.scheduler.take_stats().get("defer_timeouts", 0) == 0
        tier = two.tier()
        assert tier["bad_values"] == 1 and tier["remote_hits"] == 0
        assert two.daemon.stats()["convergence"]["promotion_failures"] == 1
        assert two.daemon.lookup(LAYOUT, "img")[0].state == 1  # ABSENT


def test_a_store_that_dies_costs_misses_and_the_tier_recovers(hosts):
    with redis_servers.single_node() as store:
        one, two = hosts(store.url, "host-1"), hosts(store.url, "host-2")
        store.kill()
        # Host 1 keeps saving and serving locally; its publication is dropped.
        one.save("img", data(2))
        wait_until(lambda: staged.servable(one.scheduler, "img"), "host 1 lost its own save")
        wait_until(lambda: one.tier()["publish_drops"] + one.tier()["publish_errors"] >= 1,
                   "the publication was neither dropped nor failed")
        # Host 2 is never stuck: an unknown item is encoded at once.
        ok, seconds = ensure_within(two.scheduler, ["other"], WAIT)
        assert ok and seconds < 5
        store.start()
        one.save("img-2", data(3))
        published(one, 1)
        indexed(two, 1)
        ok, _ = ensure_within(two.scheduler, ["img-2"], WAIT)
        assert ok and two.load("img-2").tobytes() == data(3).tobytes()
        assert one.tier()["reachable"] == 1


def test_a_store_slower_than_the_engines_answer_bound_defers_the_engine_not_encodes(hosts):
    """The store stalls (SIGSTOP) longer than a view waits for an answer
    (ANSWER_SECONDS) but within its own timeout: the daemon tells the engine
    to wait meanwhile, so the request stays deferred instead of turning into
    an encode for want of an answer; once the store answers (the cold key is
    claimed here) the engine is told to encode."""
    with redis_servers.single_node() as store:
        two = hosts(store.url, "host-2")
        wait_until(two.scheduler.serving, "host 2's ranks never mapped the region")
        assert store.pid is not None
        os.kill(store.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            while time.monotonic() - started < ANSWER_SECONDS + 0.5:
                assert not two.scheduler.ensure(["cold"]), \
                    f"scheduled {time.monotonic() - started:.2f}s into the store's stall"
                time.sleep(0.01)
            convergence = two.daemon.stats()["convergence"]
            assert convergence["slow_resolutions"] == 1, convergence
        finally:
            os.kill(store.pid, signal.SIGCONT)
        ok, _ = ensure_within(two.scheduler, ["cold"], WAIT)
        assert ok


def test_an_entry_past_its_ttl_is_a_miss(hosts):
    with redis_servers.single_node() as store:
        one = hosts(store.url, "host-1", ttl=1.0)
        two = hosts(store.url, "host-2", ttl=1.0)
        one.save("img", data(4))
        published(one, 1)
        time.sleep(1.5)
        ok, _ = ensure_within(two.scheduler, ["img"], WAIT)
        assert ok and not staged.servable(two.scheduler, "img")
        assert two.daemon.stats()["convergence"].get("promotions", 0) == 0


def forge(store: Any, host: Host, mm_hash: str, shape: tuple[int, ...], dtype: str,
          payload: Any) -> None:
    """A value whose header and checksum are consistent, written (and
    announced) by someone other than a daemon."""
    from ec_daemon.remote.redis.shards import IndexShards
    from ec_daemon.remote.redis.store import open_store
    from ec_daemon.remote.values import encode

    namespace = host.namespace
    parts = encode(namespace, mm_hash, shape, dtype, payload)
    store.client().set(value_key(namespace, mm_hash), bytes(parts[0]) + bytes(parts[1]),
                       px=600_000)
    writer = open_store(store.url)
    IndexShards(writer).announce(namespace, mm_hash, len(parts[1]), 600)
    writer.close()


def test_a_value_that_cannot_be_cached_here_is_fetched_once(hosts):
    with redis_servers.single_node() as store:
        two = hosts(store.url, "host-2")
        forge(store, two, "img", (1 << 16,), "not-a-dtype", np.zeros(1 << 16, np.uint8))
        indexed(two, 1)
        for _ in range(3):
            two.scheduler.wants.clear()  # a later request for the same item
            ok, _ = ensure_within(two.scheduler, ["img"], WAIT)
            assert ok and not staged.servable(two.scheduler, "img")
        tier = two.tier()
        assert tier["remote_hits"] == 1 and tier["index_entries"] == 0
        assert two.daemon.stats()["convergence"]["promotion_failures"] == 1


def test_a_namespace_nobody_uses_is_no_longer_followed(hosts):
    with redis_servers.single_node() as store:
        one = hosts(store.url, "host-1")
        assert one.tier()["followed_namespaces"] == 1
        one.scheduler.close()
        one.worker.close()
        wait_until(lambda: one.tier()["followed_namespaces"] == 0,
                   "the namespace stayed followed after its last session ended")


def test_metrics_show_the_tier_and_the_promotions(hosts):
    port = free_port()
    with redis_servers.single_node() as store:
        one = hosts(store.url, "host-1")
        two = hosts(store.url, "host-2", extra=("--metrics-port", str(port)))
        one.save("img", data(5))
        published(one, 1)
        indexed(two, 1)
        ok, _ = ensure_within(two.scheduler, ["img"], WAIT)
        assert ok and staged.servable(two.scheduler, "img")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        for line in ("ec_daemon_remote_reachable 1.0", "ec_daemon_remote_remote_hits_total 1.0",
                     "ec_daemon_convergence_promotions_total 1.0",
                     "ec_daemon_convergence_wants_total 1.0"):
            assert line in text, line
        assert 'ec_daemon_remote_op_duration_seconds_count{op="get"} 1.0' in text
        assert 'ec_daemon_remote_op_duration_seconds_count{op="put"} 1.0' not in text  # host 1's


def test_promotions_at_once_hold_no_more_than_the_promotion_budget(hosts):
    """Eight 1 MiB entries wanted at once, with room for two: the rest are
    encoded at once, and fetched values never held more than the budget."""
    with redis_servers.single_node() as store:
        one = hosts(store.url, "host-1")
        two = hosts(store.url, "host-2", extra=("--remote-promotion-bytes", "3MiB"))
        arrays = {f"img-{i}": data(10 + i) for i in range(8)}
        for mm_hash, array in arrays.items():
            one.save(mm_hash, array)
        published(one, 8)
        indexed(two, 8)
        ok, _ = ensure_within(two.scheduler, list(arrays), WAIT)
        assert ok
        wait_until(lambda: two.tier()["promotion_bytes"] == 0, "a reservation was never released")
        tier, convergence = two.tier(), two.daemon.stats()["convergence"]
        assert 2 << 20 < tier["promotion_bytes_peak"] <= 3 << 20
        assert tier["promotions_refused"] >= 1
        assert convergence["promotions"] + tier["promotions_refused"] == 8
        promoted = [h for h in arrays if staged.servable(two.scheduler, h)]
        assert len(promoted) == convergence["promotions"]
        result = staged.load(two.scheduler, two.worker, promoted)  # (one step loads them all)
        assert not result.failed
        for mm_hash in promoted:
            assert np.asarray(result.loaded[mm_hash]).tobytes() == arrays[mm_hash].tobytes()
