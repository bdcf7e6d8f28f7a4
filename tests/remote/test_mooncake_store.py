"""MooncakeStore (the second tier's Mooncake backend) against a real
mooncake_master: publishing from the region's pages (read with pread, as
the daemon reads them), and what it leaves in the store when the region's
pages were reused during the send."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ec_daemon.durable.region import Region
from ec_daemon.remote.mooncake.codec import value_key
from ec_daemon.remote.mooncake.store import MooncakeStore
from ec_daemon.remote.mooncake.url import parse_url
from tests import mooncake_servers
from tests.remote.conftest import needs_mooncake, wait_for

pytestmark = needs_mooncake

NAMESPACE = "embedding@model:m#weights=w@revision:default@encoder:e@dtype:torch.float16" \
            "@protocol:v3"
REGION_BYTES = 1 << 20
SHAPE = (16, 128)
NBYTES = SHAPE[0] * SHAPE[1] * 2


@pytest.fixture
def store(mooncake_master: mooncake_servers.MooncakeMaster) -> Iterator[tuple[MooncakeStore,
                                                                             Region]]:
    """A connected MooncakeStore, and a 1 MiB region (a file in /dev/shm, as
    the daemon's) it publishes from and promotes into."""
    url = mooncake_master.url_with(segment="32MiB", buffer="8MiB")
    with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as file:
        file.truncate(REGION_BYTES)
        region = Region(Path(f"/proc/self/fd/{file.fileno()}"), REGION_BYTES, 1, file.fileno())
        moon = MooncakeStore(parse_url(url))
        try:
            assert wait_for(lambda: moon.connection.current[0] is not None, timeout_s=60), \
                moon.connection._last_error
            yield moon, region
        finally:
            moon.close()


def fill(region: Region, seed: int, at: int = 0) -> bytes:
    """An entry's bytes written into the region at `at` (as a worker's save does)."""
    data = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float16).tobytes()
    region.write([(at, NBYTES)], [data])
    return data


def clear(region: Region, at: int, nbytes: int = NBYTES) -> None:
    region.write([(at, nbytes)], [bytes(nbytes)])


def read(region: Region, at: int, nbytes: int = NBYTES) -> bytes:
    return region.read([(at, nbytes)])[0]


def test_a_published_entry_is_read_back(store: Any) -> None:
    moon, region = store
    data = fill(region, 1)
    assert moon.put_entry(NAMESPACE, "img", SHAPE, "float16", region,
                          [(0, NBYTES)]) == "stored"
    head = moon.head(NAMESPACE, "img")
    assert head is not None and head.header is not None
    clear(region, 0)
    assert moon.get_into(NAMESPACE, "img", head, region, [(0, NBYTES)])
    assert read(region, 0) == data


def test_an_entry_whose_pages_were_reused_before_it_was_sent_is_not_stored(
        store: Any, mooncake_master: mooncake_servers.MooncakeMaster) -> None:
    """The pages held the entry when its checksum was taken and were reused
    by the time they were copied out to be sent: the copy may hold another
    entry's bytes, and a value with no checksum beside it is what every
    reader (vLLM's connector too) serves as it is. Nothing is stored."""
    moon, region = store
    fill(region, 2)

    def current() -> bool:  # asked once the pages are copied out
        fill(region, 3)  # (another entry's bytes now)
        return False

    result = moon.put_entry(NAMESPACE, "reused", SHAPE, "float16", region, [(0, NBYTES)],
                            current)
    assert result == "rewritten"
    assert moon.head(NAMESPACE, "reused") is None
    assert moon.present([(NAMESPACE, "reused")]) == [False]
    with mooncake_servers.raw_client(mooncake_master) as other:
        assert other.is_exist(value_key(NAMESPACE, "reused")) == 0


def test_pages_reused_once_copied_out_do_not_change_what_is_stored(store: Any) -> None:
    """The value sent is the copy taken while the pages held the entry."""
    moon, region = store
    data = fill(region, 4)

    def current() -> bool:  # the stamp still holds the entry at the copy...
        return True

    assert moon.put_entry(NAMESPACE, "kept", SHAPE, "float16", region, [(0, NBYTES)],
                          current) == "stored"
    fill(region, 5)  # ...and the pages are reused right after
    head = moon.head(NAMESPACE, "kept")
    assert head is not None and head.header is not None
    clear(region, NBYTES)
    assert moon.get_into(NAMESPACE, "kept", head, region, [(NBYTES, NBYTES)])
    assert read(region, NBYTES) == data


def test_claims_in_a_batch_give_each_key_to_exactly_one_host(
        store: Any, mooncake_master: mooncake_servers.MooncakeMaster) -> None:
    """Two hosts claiming the same 50 new keys at once, in batches (a key the
    batch leaves unsettled, None, claimed alone as the tier does): every key
    has one claimant, and a host's claims hold against the other."""
    import threading

    moon, _ = store
    other = MooncakeStore(parse_url(mooncake_master.url_with(segment="32MiB", buffer="8MiB")))
    try:
        assert wait_for(lambda: other.connection.current[0] is not None, timeout_s=60), \
            other.connection._last_error
        keys = [(NAMESPACE, f"new-{i}") for i in range(50)]
        results: dict[str, list[bool]] = {}

        def settled(host: MooncakeStore, name: str) -> list[bool]:
            batch = host.claim_many(keys, name, 30.0)
            return [host.claim(*key, name, 30.0) if taken is None else taken
                    for key, taken in zip(keys, batch, strict=True)]

        def claim(name: str, host: MooncakeStore) -> None:
            results[name] = settled(host, name)

        threads = [threading.Thread(target=claim, args=(name, host))
                   for name, host in (("host-a", moon), ("host-b", other))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        both = [key[1] for key, a, b in zip(keys, results["host-a"], results["host-b"],
                                            strict=True) if a == b]
        assert not both, both
        # Every claim is there now: a batch leaves them all to `claim`, whose
        # answers change nothing.
        assert other.claim_many(keys, "host-b", 30.0) == [None] * len(keys)
        assert settled(other, "host-b") == results["host-b"]
        assert moon.claim_many([], "host-a", 30.0) == []
    finally:
        other.close()


def test_published_and_promoted_pages_leave_the_daemons_rss(store: Any) -> None:
    """The store reads and writes entries with pread and pwrite, never
    through a mapping of the region: the daemon's RSS, which the OOM killer
    reads, does not grow to the region's size with everything it ever
    published or promoted."""
    from tests.unit.test_region import rss_shmem_kib

    moon, region = store
    shape, half = (1024, 256), REGION_BYTES // 2  # 512 KiB of float16
    data = np.random.default_rng(9).standard_normal(shape).astype(np.float16).tobytes()
    region.write([(0, half)], [data])
    clear(region, half, half)
    before = rss_shmem_kib()
    assert moon.put_entry(NAMESPACE, "rss", shape, "float16", region, [(0, half)]) == "stored"
    head = moon.head(NAMESPACE, "rss")
    assert head is not None
    assert moon.get_into(NAMESPACE, "rss", head, region, [(half, half)])
    after = rss_shmem_kib()
    assert read(region, half, half) == data
    assert after - before < 128, (before, after)
