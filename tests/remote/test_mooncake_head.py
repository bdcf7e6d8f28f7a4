"""`MooncakeStore.head` against a real mooncake_master, counting the store
calls it makes: a value ec-daemon published is described by the checksum
beside it, read in one call (benchmarks/mooncake_tier.py: a promotion's head
went from two reads to one); a value vLLM wrote (no checksum) by its own
header, as before. What a head refuses: tests/remote/test_mooncake.py."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ec_daemon.durable.region import Region
from ec_daemon.remote.mooncake.codec import value_key, vllm_header
from ec_daemon.remote.mooncake.store import MooncakeStore
from ec_daemon.remote.mooncake.url import parse_url
from tests import mooncake_servers
from tests.remote.conftest import needs_mooncake, payload, wait_for

pytestmark = needs_mooncake
STORE_NS = ("embedding@model:test#weights=x@revision:default@encoder:e"
            "@dtype:torch.float16@protocol:v3")
REGION = 4 << 20
SHAPE = (4, 100)  # float16: 800 bytes


class Counting:
    """A MooncakeDistributedStore whose calls are counted by name."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attribute(*args, **kwargs)
        return call


@pytest.fixture(scope="module")
def stores(mooncake_master: mooncake_servers.MooncakeMaster
           ) -> Iterator[tuple[Any, Any, Region]]:
    """(a MooncakeStore over a counting client; a raw client lending the
    store its memory; a region the store reads and writes)."""
    from mooncake.store import MooncakeDistributedStore

    with mooncake_servers.raw_client(mooncake_master) as raw:
        counting = Counting(MooncakeDistributedStore())
        spec = replace(parse_url(mooncake_master.url), segment_bytes=0)
        store = MooncakeStore(spec, client_factory=lambda: counting)
        fd = os.memfd_create("region")
        region = Region(Path("/proc/self/fd") / str(fd), REGION, 1, fd)
        try:
            os.ftruncate(fd, REGION)
            assert wait_for(lambda: store.connection.current[0] is not None, 60)
            yield store, raw, region
        finally:
            store.close()
            os.close(fd)


def _reads(store: MooncakeStore) -> int:
    calls = store.connection.current[0].calls
    return int(sum(n for name, n in calls.items() if "get" in name or "exist" in name))


def test_a_published_value_is_described_by_its_checksum_in_one_read(stores):
    store, _raw, region = stores
    data = payload(800)
    region.write([(0, 800)], [data])
    assert store.put_entry(STORE_NS, "one-read", SHAPE, "float16", region,
                           [(0, 800)]) == "stored"
    before = _reads(store)
    head = store.head(STORE_NS, "one-read")
    assert _reads(store) - before == 1
    assert head is not None and (head.shape, head.dtype, head.nbytes) == (SHAPE, "float16", 800)
    assert head.header is not None
    assert store.get_into(STORE_NS, "one-read", head, region, [(4096, 300), (8192, 500)])
    assert b"".join(region.read([(4096, 300), (8192, 500)])) == data


def test_a_value_vllm_wrote_is_described_by_its_header(stores):
    store, raw, region = stores
    data = payload(800)
    assert raw.put(value_key(STORE_NS, "vllm"), vllm_header(SHAPE, "float16") + data) == 0
    before = _reads(store)
    head = store.head(STORE_NS, "vllm")
    assert _reads(store) - before == 2  # no checksum (said absent, not failed), the header
    assert head is not None and head.header is None
    assert (head.shape, head.dtype, head.nbytes) == (SHAPE, "float16", 800)
    assert store.get_into(STORE_NS, "vllm", head, region, [(0, 800)])
    assert region.read([(0, 800)])[0] == data
    assert store.head(STORE_NS, "absent") is None


def test_bytes_a_peer_rewrites_after_they_were_checked_never_reach_the_pages(
        stores, monkeypatch):
    """The transfer buffer a promotion reads into is open to every peer of
    the transfer engine. Each chunk is copied out of it, checked, and written
    into the pages from that private copy: a peer rewriting the chunk just
    after it was checked changes nothing served (checked one place, written
    from another, its bytes would reach the pages behind a passing check)."""
    from ec_daemon.remote import values
    from ec_daemon.remote.mooncake import store as store_module

    store, _raw, region = stores
    fd = region.fileno()
    data = payload(800)
    os.pwrite(fd, data, 0)
    assert store.put_entry(STORE_NS, "peer", SHAPE, "float16", region, [(0, 800)]) == "stored"
    head = store.head(STORE_NS, "peer")
    assert head is not None and head.header is not None
    buffers: list[memoryview] = []
    taken = store.buffers.buffer

    def capture(*args: Any, **kwargs: Any) -> Any:
        context = taken(*args, **kwargs)
        buffer, address = context.__enter__()
        buffers.append(buffer)

        class Held:
            def __enter__(self) -> Any:
                return buffer, address

            def __exit__(self, *exc: Any) -> Any:
                return context.__exit__(*exc)
        return Held()

    class Scribbled(values.Check):
        seen = 0

        def update(self, piece: Any) -> None:
            super().update(piece)
            at = 24 + self.seen  # (vLLM's header, then the payload)
            buffers[-1][at:at + len(piece)] = bytes(len(piece))  # the peer's write
            self.seen += len(piece)

    monkeypatch.setattr(store.buffers, "buffer", capture)
    monkeypatch.setattr(store_module, "COPY_CHUNK", 256)
    monkeypatch.setattr(values, "Check", Scribbled)
    os.pwrite(fd, b"\xee" * 800, 4096)
    assert store.get_into(STORE_NS, "peer", head, region, [(4096, 300), (8192, 500)])
    assert os.pread(fd, 300, 4096) + os.pread(fd, 500, 8192) == data
    assert bytes(buffers[-1][24:824]) == bytes(800)  # (the peer did write)
