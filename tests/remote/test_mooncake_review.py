"""Regressions from a review of the Mooncake backend (each test names a bug, now fixed).

- A value evicted while its checksum beside it stays: the next publication
  of that key keeps the stale checksum (a put on an existing key "succeeds"
  without writing), and every ec-daemon reader refuses the key from then on
  unless the new encode is bit-identical to the old one.
- An mm_hash may contain "@": "<hash>@ecd1" is the key of <hash>'s checksum,
  so an item named so (vLLM lets a request name its items: multi_modal_uuids)
  published first takes that slot and <hash> can never be promoted.
"""

from __future__ import annotations

from typing import Any

import pytest

from ec_daemon.durable.region import Region
from ec_daemon.remote import values
from ec_daemon.remote.mooncake.codec import value_key
from tests import mooncake_servers
from tests.remote.conftest import needs_mooncake
from tests.remote.test_mooncake_store import (  # noqa: F401
    NAMESPACE,
    NBYTES,
    SHAPE,
    clear,
    fill,
    read,
    store,
)

pytestmark = needs_mooncake


def read_back(moon: Any, region: Region, mm_hash: str) -> bytes:
    head = moon.head(NAMESPACE, mm_hash)
    assert head is not None
    clear(region, NBYTES)
    assert moon.get_into(NAMESPACE, mm_hash, head, region, [(NBYTES, NBYTES)])
    return read(region, NBYTES)


def test_a_value_evicted_before_its_checksum_is_published_again_readable(
        store: Any, mooncake_master: mooncake_servers.MooncakeMaster) -> None:  # noqa: F811
    moon, region = store
    fill(region, 1)
    assert moon.put_entry(NAMESPACE, "img", SHAPE, "float16", region, [(0, NBYTES)]) == "stored"
    with mooncake_servers.raw_client(mooncake_master) as other:
        # Mooncake evicts objects one by one: the value goes, its checksum stays.
        assert other.remove(value_key(NAMESPACE, "img"), True) == 0
    # Encoded again elsewhere (another GPU, another batch: not bit-identical).
    again = fill(region, 2)
    assert moon.put_entry(NAMESPACE, "img", SHAPE, "float16", region, [(0, NBYTES)]) == "stored"
    try:
        assert read_back(moon, region, "img") == again
    except values.BadValue as exc:
        pytest.fail(f"the key is unreadable for good: {exc}")


def test_an_item_named_after_anothers_checksum_key_does_not_poison_it(store: Any) -> None:  # noqa: F811
    moon, region = store
    fill(region, 3)
    moon.put_entry(NAMESPACE, "victim@ecd1", SHAPE, "float16", region, [(0, NBYTES)])
    data = fill(region, 4)
    assert moon.put_entry(NAMESPACE, "victim", SHAPE, "float16", region, [(0, NBYTES)]) == "stored"
    try:
        assert read_back(moon, region, "victim") == data
    except values.BadValue as exc:
        pytest.fail(f"'victim' is unreadable: {exc}")


DAEMON_NS = "model|float16|image=2048"  # a daemon namespace whose entries Mooncake carries
CHILD = r'''
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", sys.argv[1], 32 << 20, 8 << 20, "tcp", "", sys.argv[2]) == 0
held = int(time.time() * 1000 + 60000)
for key in sys.argv[3:]:
    assert s.put(key, f"dead-host {held}".encode()) == 0
print("ready", flush=True)
time.sleep(600)
'''


def test_a_promotion_the_regions_file_refuses_is_not_the_stores_failure(
        store: Any, tmp_path: Any) -> None:  # noqa: F811
    """(Before the dead host below: its segment would take the put.) A write
    into this host's region that fails (a full tmpfs, a closed store) is
    refused as a local error: the promotion fails, counted, but the
    store answered, and its circuit breaker (one failure opens it here) stays
    closed for every other key."""
    import os

    from ec_daemon.remote.common import Common
    from ec_daemon.remote.mooncake.backend import MooncakeBackend
    from ec_daemon.remote.tier import RemoteTier

    moon, region = store
    fill(region, 5)
    assert moon.put_entry(NAMESPACE, "local", SHAPE, "float16", region,
                          [(0, NBYTES)]) == "stored"
    common = Common(promotion_bytes=256 << 20, breaker_threshold=1)
    tier = RemoteTier(MooncakeBackend(common, moon, index_bytes=1 << 20),
                      publish_queue_bytes=1 << 20)
    tier.follow("ns", NAMESPACE)
    readonly = tmp_path / "region"
    readonly.write_bytes(bytes(4 * NBYTES))
    refusing = Region(readonly, 4 * NBYTES, 1, os.open(readonly, os.O_RDONLY))  # pwrite: EBADF
    try:
        value = tier.fetch("ns", "local", NBYTES)
        assert value is not None
        assert not tier.fetch_into("ns", "local", value, refusing, [(NBYTES, NBYTES)])
    finally:
        refusing.close(remove=False)
    assert tier.snapshot()["errors"] == 1
    assert set(tier.states().values()) == {"closed"}
    value = tier.fetch("ns", "local", NBYTES)
    assert value is not None and tier.fetch_into("ns", "local", value, region, [(NBYTES, NBYTES)])
    assert read(region, NBYTES) == read(region, 0)


def test_a_dead_hosts_claims_and_values_hold_up_only_their_own_keys(
        mooncake_master: mooncake_servers.MooncakeMaster) -> None:
    """A host killed with claims and values on its segment leaves objects the
    master still lists; each read of one fails only after about 1 s. Keys of
    such objects and new keys resolved in one round: every new key is claimed
    and told before any of the dead host's keys is, and each of those is told
    within its bound (FAILED: the engine encodes), not one after another
    (before: the whole round waited several seconds per dead key, read one at
    a time, and told every key at its end)."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from ec_daemon.core.events import Resolution
    from ec_daemon.remote.common import Common
    from ec_daemon.remote.mooncake.backend import MooncakeBackend
    from ec_daemon.remote.mooncake.codec import CLAIM
    from ec_daemon.remote.mooncake.store import MooncakeStore
    from ec_daemon.remote.mooncake.url import parse_url
    from ec_daemon.remote.tier import RemoteTier
    from tests.remote.conftest import wait_for

    claims = [f"claimed-{i}" for i in range(8)]
    held = [f"held-{i}" for i in range(4)]
    new = [f"new-{i}" for i in range(8)]
    orphans = [value_key(NAMESPACE, h) + CLAIM for h in claims] + \
        [value_key(NAMESPACE, h) for h in held]
    child = subprocess.Popen([sys.executable, "-c", CHILD, mooncake_master.metadata_url,
                              mooncake_master.rpc_address, *orphans], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().startswith("ready")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    moon = MooncakeStore(parse_url(mooncake_master.url_with(segment="32MiB", buffer="8MiB")))
    tier = RemoteTier(MooncakeBackend(Common(promotion_bytes=256 << 20), moon,
                                      index_bytes=1 << 20), publish_queue_bytes=1 << 20,
                      claim_s=30)
    tier.follow(DAEMON_NS, NAMESPACE)
    told: list[tuple[str, Resolution]] = []
    lock = threading.Lock()

    def teller(name: str) -> Any:
        def done(outcome: Resolution) -> None:
            with lock:
                told.append((name, outcome))
        return done

    try:
        assert wait_for(lambda: moon.connection.current[0] is not None, timeout_s=60), \
            moon.connection._last_error
        # Queued before the resolver threads start: one round holds them all.
        for names in zip(claims, new, held + [""] * 4, strict=True):
            for name in filter(None, names):
                assert tier.resolve(DAEMON_NS, name, teller(name))
        started = time.monotonic()
        tier.start()
        everyone = set(claims + held + new)
        # Generous: each dead key is told within 0.5 s of being asked (its
        # read ends about 1 s later); one at a time they took several seconds each.
        assert wait_for(lambda: {n for n, _ in told} >= everyone, timeout_s=8), told
        took = time.monotonic() - started
        order = [name for name, _ in told]
        outcome = dict(told)
        assert set(order[:len(new)]) == set(new), order  # the new keys first
        assert all(outcome[n] is Resolution.CLAIMED for n in new), told
        assert all(outcome[n] in (Resolution.FAILED, Resolution.CLAIMED)
                   for n in claims + held), told
        assert len(order) == len(everyone), told  # each told once
        assert tier.snapshot()["claims_taken"] >= len(new)
        assert took < 8, took
    finally:
        tier.stop()
