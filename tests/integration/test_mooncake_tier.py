"""Two "hosts" (two daemons, each with its own socket and region) sharing one
Mooncake Store (a real mooncake_master on loopback): what host 1 saved, host
2 finds by asking the store, promotes straight into its region and loads
bit-exact; two hosts missing one new item encode it once; a claimant that
dies costs the other host one bounded wait; a master that dies costs misses,
never a stuck engine, and publishing and promoting resume when it is back."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ec_protocol.protocol import Layout
from tests import mooncake_servers, staged
from tests.integration.engines import ensure_within, wait_until
from tests.integration.test_second_tier import WAIT, Host
from tests.remote.conftest import check_mooncake

pytestmark = [pytest.mark.integration]
STORE_NAMESPACE = ("embedding@model:test-model#weights=test@revision:default"
                   "@encoder:abc@dtype:torch.float16@protocol:v3")
LAYOUT = Layout("test-model", "float16", {"image": 2048}, store_namespace=STORE_NAMESPACE)


def tensor(seed: int, tokens: int = 256) -> np.ndarray:
    """An encoder output as vLLM makes one: 2-D float16 (1 KiB rows)."""
    return np.random.default_rng(seed).standard_normal((tokens, 512)).astype(np.float16)


@pytest.fixture
def master() -> Iterator[mooncake_servers.MooncakeMaster]:
    check_mooncake()
    with mooncake_servers.master() as server:
        yield server


@pytest.fixture
def hosts(master: Any) -> Iterator[Any]:
    with ExitStack() as stack:
        def make(name: str, *, claim_seconds: float = 30.0, **kwargs: Any) -> Host:
            url = master.url_with(segment="128MiB", buffer="16MiB")
            host = Host(url, name, layout=LAYOUT,
                        extra=("--remote-claim-seconds", str(claim_seconds)), **kwargs)
            stack.callback(host.close)
            wait_until(lambda: host.tier()["reachable"] == 1,
                       f"{name} never connected to the Mooncake master", seconds=WAIT)
            return host
        yield make


def published(host: Host, count: int) -> None:
    wait_until(lambda: host.tier()["publishes"] >= count, f"{host.name} never published",
               seconds=WAIT)


def test_a_miss_another_host_published_is_promoted_in_place_and_loads_bit_exact(master, hosts):
    one, two = hosts("host-1"), hosts("host-2")
    arrays = {f"img-{i}": tensor(i) for i in range(3)}
    for mm_hash, array in arrays.items():
        one.save(mm_hash, array)
    published(one, 3)
    with mooncake_servers.raw_client(master) as raw:  # vLLM's key: namespace@id:hash
        assert raw.is_exist(f"{STORE_NAMESPACE}@id:img-0") == 1
        assert raw.is_exist(f"{STORE_NAMESPACE}@id:img-0@ecd1") == 1
        assert raw.get_size(f"{STORE_NAMESPACE}@id:img-0") == 24 + arrays["img-0"].nbytes
    for mm_hash, array in arrays.items():
        ok, _ = ensure_within(two.scheduler, [mm_hash], WAIT)
        assert ok
        loaded = two.load(mm_hash)
        assert loaded.tobytes() == array.tobytes()
    stats = two.daemon.stats()
    tier = stats["remote_tier"]
    assert stats["convergence"]["promotions"] == 3
    assert stats["convergence"]["promoted_bytes"] == sum(a.nbytes for a in arrays.values())
    assert tier["remote_hits"] == 3 and tier["lookup_hits"] == 3 and tier["bad_values"] == 0
    assert tier["publishes"] == 0  # promoted entries are not published back
    assert stats["saves"] == 3


def test_two_hosts_that_miss_one_new_item_at_once_encode_it_once(hosts):
    one, two = hosts("host-1"), hosts("host-2")
    array = tensor(7)
    ok, _ = ensure_within(one.scheduler, ["new"], WAIT)  # claims it: encodes
    assert ok and not staged.servable(one.scheduler, "new")
    assert one.tier()["claims_taken"] == 1
    # Host 2 misses it meanwhile: host 1 holds the claim, so host 2 waits.
    assert not two.scheduler.ensure(["new"])
    wait_until(lambda: two.tier()["claims_elsewhere"] == 1, "host 2 did not see the claim")
    time.sleep(0.3)
    assert not two.scheduler.ensure(["new"])  # still waiting, not encoding
    one.save("new", array)  # host 1's encode lands and is published
    published(one, 1)
    ok, _ = ensure_within(two.scheduler, ["new"], WAIT)
    assert ok and staged.servable(two.scheduler, "new")
    assert two.load("new").tobytes() == array.tobytes()
    assert two.tier()["claims_taken"] == 0 and two.tier()["remote_hits"] == 1
    assert two.daemon.stats()["convergence"]["claims"] == 0  # no engine on host 2 encoded


def test_a_claimant_that_dies_costs_the_other_host_one_bounded_wait(hosts):
    one = hosts("host-1", claim_seconds=2.0)
    two = hosts("host-2", claim_seconds=2.0)
    ok, _ = ensure_within(one.scheduler, ["orphan"], WAIT)
    assert ok and one.tier()["claims_taken"] == 1
    one.daemon.kill()  # host 1 dies before its encode lands: its claim stays
    started = time.monotonic()
    assert not two.scheduler.ensure(["orphan"])
    ok, _ = ensure_within(two.scheduler, ["orphan"], WAIT)
    waited = time.monotonic() - started
    assert ok and not staged.servable(two.scheduler, "orphan")  # told to encode it
    assert waited < 5, waited
    # Host 2 took the dead host's claim over (its bytes were unreadable), or
    # waited out its time: either way it does not wait for host 1 again.
    wait_until(lambda: two.tier()["claims_taken"] + two.tier()["claim_timeouts"] == 1,
               "host 2 neither took the dead host's claim over nor waited it out")


def test_a_master_that_dies_costs_misses_and_the_tier_recovers(master, hosts):
    one, two = hosts("host-1"), hosts("host-2")
    one.save("before", tensor(1))
    published(one, 1)
    master.kill()
    # Host 1 keeps saving and serving its own entries; the publication fails.
    one.save("during", tensor(2))
    wait_until(lambda: staged.servable(one.scheduler, "during"), "host 1 lost its own save")
    wait_until(lambda: one.tier()["publish_drops"] + one.tier()["publish_errors"] >= 1,
               "the publication was neither dropped nor failed", seconds=WAIT)
    # Host 2 is never stuck: what it misses is encoded within the bound.
    ok, seconds = ensure_within(two.scheduler, ["before"], WAIT)
    assert ok and seconds < 5 and not staged.servable(two.scheduler, "before")
    master.restart()  # (a new master holds nothing: what was published is gone)
    wait_until(lambda: one.tier()["reachable"] == 1 and two.tier()["reachable"] == 1,
               "the tier did not come back", seconds=WAIT)
    array = tensor(3)

    def republished() -> bool:
        one.save(f"after-{time.monotonic_ns()}", array)
        return one.tier()["publishes"] >= 2
    wait_until(republished, "publishing never resumed", seconds=WAIT)

    def promoted_on_host_2() -> bool:
        """A new item host 1 publishes is promoted by host 2. A resolution
        slower than its bound (a busy machine, a master just restarted) is
        answered FAILED and encoded, which is right: then try another."""
        mm_hash = f"after-check-{time.monotonic_ns()}"
        before = one.tier()["publishes"]
        one.save(mm_hash, array)
        wait_until(lambda: one.tier()["publishes"] > before, "publishing stopped again",
                   seconds=WAIT)
        ok, _ = ensure_within(two.scheduler, [mm_hash], WAIT)
        assert ok, "host 2 was deferred past its bound"
        if not staged.servable(two.scheduler, mm_hash):
            return False
        assert two.load(mm_hash).tobytes() == array.tobytes()
        return True
    wait_until(promoted_on_host_2, "host 2 never promoted what host 1 published",
               seconds=3 * WAIT)


def test_entries_the_shared_format_cannot_carry_stay_on_their_host(hosts):
    one = hosts("host-1")
    raw = np.random.default_rng(0).integers(0, 256, (64, 2048), dtype=np.uint8)
    one.save("bytes", raw)
    wait_until(lambda: one.tier()["publish_skips"] >= 1, "a uint8 entry was not skipped")
    assert one.tier()["publishes"] == 0 and one.tier()["publish_errors"] == 0


def test_a_client_that_truncates_the_region_cannot_kill_a_daemon_on_mooncake(master):
    """The Mooncake backend read the pages it published through a mapping of
    the region of its own: a client that truncated the region (every engine
    worker opens it read-write) killed the daemon with SIGBUS on the next
    publication. It reads them as the rest of the daemon does, with pread
    through the daemon's own descriptor: a cut file reads short, the
    publication is skipped, the daemon gives the file its size back and goes
    on publishing."""
    from ec_protocol.protocol import pb
    from tests.integration.daemon import Daemon
    from tests.integration.raw import attach

    shape, dtype = (256, 512), "float16"  # vLLM's format carries it: published
    nbytes = shape[0] * shape[1] * 2

    def allocate(stub: Any, session_id: str, mm_hash: str) -> Any:
        reply = stub.Allocate(pb.AllocateRequest(session_id=session_id, mm_hash=mm_hash,
                                                 nbytes=nbytes, shape=list(shape),
                                                 dtype=dtype), timeout=10)
        assert reply.status == pb.ALLOCATED, reply
        return reply

    def report(stub: Any, session_id: str, mm_hash: str) -> None:
        saved = stub.Report(pb.ReportRequest(session_id=session_id, saved=[mm_hash]),
                            timeout=10).saved
        assert list(saved) == [pb.ACCEPTED]

    url = master.url_with(segment="128MiB", buffer="16MiB")
    daemon = Daemon(cpu_bytes="16MiB", check_invariants=False,
                    extra=("--remote", url)).start()
    try:
        stub = daemon.stub
        writer = attach(stub, LAYOUT, engine="writer", token="7" * 32,
                        store_namespace=STORE_NAMESPACE).session_id
        region = Path(daemon.stats()["region_path"])
        fd = os.open(region, os.O_RDWR)  # as every engine worker opens it
        size = os.fstat(fd).st_size
        try:
            data = tensor(1).tobytes()
            reply = allocate(stub, writer, "warm")
            os.pwrite(fd, data, reply.extents[0].offset)
            report(stub, writer, "warm")
            # (Published: the store is connected, the next publication reads its pages.)
            daemon.wait_for(lambda: daemon.stats()["remote_tier"]["publishes"] == 1,
                            timeout=WAIT, what="the first publication")
            reply = allocate(stub, writer, "cut")
            os.pwrite(fd, data, reply.extents[0].offset)
            os.ftruncate(fd, 0)
            report(stub, writer, "cut")  # ready: published from pages cut off the file
            daemon.wait_for(lambda: daemon.stats()["region_truncations"] == 1, timeout=WAIT,
                            what="the truncation to be noticed")
            assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
            assert os.fstat(fd).st_size == size  # given back
            tier = daemon.stats()["remote_tier"]
            assert tier["publishes"] == 1 and tier["publish_skips"] == 1
            # The tier goes on: a save after the cut is published.
            reply = allocate(stub, writer, "after")
            os.pwrite(fd, data, reply.extents[0].offset)
            report(stub, writer, "after")
            daemon.wait_for(lambda: daemon.stats()["remote_tier"]["publishes"] == 2,
                            timeout=WAIT, what="a publication after the cut")
        finally:
            os.close(fd)
        with mooncake_servers.raw_client(master) as raw:
            key = f"{STORE_NAMESPACE}@id:"
            assert raw.get(key + "after")[24:] == data  # vLLM's header, then the bytes
            assert raw.is_exist(key + "cut") == 0  # never published from a short file
    finally:
        daemon.stop()
        daemon.cleanup()
