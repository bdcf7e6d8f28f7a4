"""The Mooncake Store backend (ec_daemon/remote/mooncake/) against a real
mooncake_master: URLs, two hosts (two clients, each with its own region)
sharing one master, values in vLLM's exact format both ways, values that
must be refused, claims, a master that is not there yet, dies and comes back,
and the second tier (RemoteTier) on it.

A Mooncake client's close() takes about 2 s: the module's two hosts and its
raw client are shared by the tests that do not kill their master, and closed
together."""

from __future__ import annotations

import argparse
import itertools
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ec_daemon.core.events import Fetched, Resolution
from ec_daemon.durable.region import Region
from ec_daemon.remote import values
from ec_daemon.remote.common import Common, RemoteError
from ec_daemon.remote.mooncake import claims, connection
from ec_daemon.remote.mooncake.backend import MooncakeBackend
from ec_daemon.remote.mooncake.codec import (
    CLAIM,
    DTYPE_CODES,
    HEADER,
    ITEM_BYTES,
    MAGIC,
    SIDECAR,
    value_key,
)
from ec_daemon.remote.mooncake.store import MooncakeStore, open_store
from ec_daemon.remote.mooncake.url import parse_url
from ec_daemon.remote.tier import RemoteTier
from ec_daemon.serving import cli, config
from tests import mooncake_servers
from tests.remote.conftest import NAMESPACE, needs_mooncake, payload, wait_for

REGION_BYTES = 8 << 20
SEGMENT = "32MiB"  # each host's share of the store (the default 1 GiB is for daemons)
BUFFER = "16MiB"
STORE_NS = "Qwen/Qwen2.5-VL-3B-Instruct@rev|mm=0f3a|bfloat16|v3"  # an engine's store namespace
# Where host 1 writes an entry and host 2 reads it: scattered, unaligned, in
# a different order of sizes.
WRITE_AT = [(4096 + 13, 1000), (1 << 20, 3000), (5 << 20, 2000)]
READ_AT = [(8192 + 7, 3500), (3 << 20, 2500)]
ACCEPTED = "accepted: mooncake://MASTER_HOST:PORT?metadata="

_keys = itertools.count()


def fresh(prefix: str = "h") -> str:
    """An mm_hash no other test (or run) has used."""
    return f"{prefix}-{os.getpid()}-{time.monotonic_ns()}-{next(_keys)}"


# ------------------------------------------------------------------ hosts


class Host:
    """One daemon's view: a MooncakeStore and its own region file in /dev/shm
    (a `Region`, read and written with pread and pwrite as the daemon does)."""

    def __init__(self, url: str) -> None:
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="ecd-mctest-")
        try:
            os.ftruncate(fd, REGION_BYTES)
            self.store = MooncakeStore(parse_url(url))
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self.region = Region(Path(path), REGION_BYTES, 1, fd)

    def write(self, extents: list[tuple[int, int]], data: bytes) -> None:
        """Write into the region's file (as a worker's save does)."""
        self.region.write(extents, [data])

    def read(self, extents: list[tuple[int, int]]) -> bytes:
        return b"".join(self.region.read(extents))

    def fill(self, extents: list[tuple[int, int]], byte: int = 0xEE) -> None:
        self.write(extents, bytes([byte]) * sum(length for _, length in extents))

    def connected(self, timeout_s: float = 20.0) -> None:
        assert wait_for(lambda: _pings(self.store), timeout_s), \
            self.store.connection._last_error

    def close(self) -> None:
        try:
            self.store.close()
        finally:
            self.region.close()


def _pings(store: MooncakeStore) -> bool:
    try:
        store.ping()
    except RemoteError:
        return False
    return True


def close_together(*hosts: Host) -> None:
    """Close clients at once (each close() takes about 2 s)."""
    threads = [threading.Thread(target=host.close) for host in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


@pytest.fixture(scope="module")
def hosts(mooncake_master: mooncake_servers.MooncakeMaster) -> Iterator[tuple[Host, Host]]:
    url = mooncake_master.url_with(segment=SEGMENT, buffer=BUFFER)
    pair = (Host(url), Host(url))
    try:
        for host in pair:
            host.connected()
        yield pair
    finally:
        close_together(*pair)


@pytest.fixture(scope="module")
def raw(mooncake_master: mooncake_servers.MooncakeMaster) -> Iterator[Any]:
    """A plain client: what vLLM's own connector (or anything else) writes."""
    with mooncake_servers.raw_client(mooncake_master, global_segment_bytes=16 << 20) as client:
        yield client


def entry(shape: tuple[int, int], dtype: str) -> bytes:
    return payload(shape[0] * shape[1] * ITEM_BYTES[dtype])


def vllm_value(shape: tuple[int, int], dtype: str, data: bytes, code: int | None = None,
               magic: int = MAGIC) -> bytes:
    """A value as vLLM's mooncake_store_embedding writes it."""
    code = DTYPE_CODES[dtype] if code is None else code
    return HEADER.pack(magic, code, shape[0], shape[1]) + data


def sidecar(mm_hash: str, shape: tuple[int, ...], dtype: str, data: bytes,
            namespace: str = NAMESPACE) -> bytes:
    return bytes(values.encode(namespace, mm_hash, shape, dtype, data)[0])


def extents_of(nbytes: int, base: int, pieces: int = 2) -> list[tuple[int, int]]:
    """`pieces` extents holding nbytes, 64 KiB apart from `base`."""
    step = -(-nbytes // pieces)
    out, left, at = [], nbytes, base
    while left:
        out.append((at, min(step, left)))
        left -= out[-1][1]
        at += 64 << 10
    return out


# ------------------------------------------------------------------ URLs


def test_parse_url_accepted_forms() -> None:
    spec = parse_url("mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata")
    assert (spec.host, spec.port, spec.metadata) == ("127.0.0.1", 50051,
                                                     "http://127.0.0.1:8080/metadata")
    assert (spec.protocol, spec.device) == ("tcp", "")
    assert (spec.segment_bytes, spec.buffer_bytes) == (1 << 30, 64 << 20)
    assert spec.local_hostname == "127.0.0.1"  # a loopback master: reached from loopback
    assert spec.master == "127.0.0.1:50051" and spec.display == "mooncake://127.0.0.1:50051"

    quoted = parse_url("mooncake://127.0.0.1:50051/?metadata=http%3A%2F%2F127.0.0.1%3A8080"
                       "%2Fmetadata")
    assert quoted == spec
    assert parse_url("MOONCAKE://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata") \
        == spec

    p2p = parse_url("mooncake://localhost:7000?metadata=P2PHANDSHAKE&protocol=RDMA"
                    "&device=mlx5_0,mlx5_1&segment=2GiB&buffer=128MiB")
    assert (p2p.host, p2p.port, p2p.metadata) == ("localhost", 7000, "P2PHANDSHAKE")
    assert (p2p.protocol, p2p.device) == ("rdma", "mlx5_0,mlx5_1")
    assert (p2p.segment_bytes, p2p.buffer_bytes) == (2 << 30, 128 << 20)
    assert p2p.local_hostname == "127.0.0.1"

    named = parse_url("mooncake://10.1.2.3:50051?metadata=etcd://10.1.2.3:2379"
                      "&local_hostname=10.1.2.4&segment=1000000")
    assert (named.local_hostname, named.segment_bytes, named.metadata) == (
        "10.1.2.4", 1_000_000, "etcd://10.1.2.3:2379")

    v6 = parse_url("mooncake://[::1]:50051?metadata=P2PHANDSHAKE&local_hostname=::1")
    assert (v6.host, v6.master, v6.display) == ("::1", "[::1]:50051", "mooncake://[::1]:50051")


def test_parse_url_of_a_test_master(mooncake_master: mooncake_servers.MooncakeMaster) -> None:
    spec = parse_url(mooncake_master.url_with(segment=SEGMENT, buffer=BUFFER))
    assert spec.master == mooncake_master.rpc_address
    assert spec.metadata == mooncake_master.metadata_url
    assert (spec.segment_bytes, spec.buffer_bytes) == (32 << 20, 16 << 20)


META = "metadata=http://127.0.0.1:8080/metadata"


@pytest.mark.parametrize(("url", "reason"), [
    ("redis://127.0.0.1:6379", "not a mooncake:// URL"),
    ("mooncake:127.0.0.1:50051?" + META, "not a mooncake:// URL"),
    ("mooncake://127.0.0.1:50051", "metadata= is required: the metadata server's URL"),
    ("mooncake://127.0.0.1:50051?metadata=", "metadata= is required"),
    ("mooncake://127.0.0.1:50051?protocol=tcp", "metadata= is required"),
    (f"mooncake://127.0.0.1:50051?{META}&protocol=udp", "protocol must be tcp or rdma, got 'udp'"),
    (f"mooncake://127.0.0.1:50051?{META}&zeta=1&lease=2", "unknown option(s) lease, zeta"),
    (f"mooncake://user:secret@127.0.0.1:50051?{META}", "no credentials go in the URL"),
    (f"mooncake://:secret@127.0.0.1:50051?{META}", "no credentials go in the URL"),
    (f"mooncake://127.0.0.1?{META}", "the master's HOST:PORT is required"),
    (f"mooncake://:50051?{META}", "the master's HOST:PORT is required"),
    (f"mooncake://127.0.0.1:99999?{META}", "Port out of range"),
    (f"mooncake://127.0.0.1:port?{META}", "Port could not be cast"),
    (f"mooncake://127.0.0.1:50051/store?{META}", "no path is accepted"),
    (f"mooncake://127.0.0.1:50051?{META}&segment=lots", "invalid size 'lots'"),
    (f"mooncake://127.0.0.1:50051?{META}&buffer=1.5", "not a whole number of bytes"),
    (f"mooncake://127.0.0.1:50051?{META}&segment=0", "segment and buffer must be positive"),
    (f"mooncake://127.0.0.1:50051?{META}&buffer=0B", "segment and buffer must be positive"),
])
def test_parse_url_refuses(url: str, reason: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_url(url)
    text = str(refused.value)
    assert text.startswith(f"invalid remote store URL {url!r}: ")
    assert reason in text and ACCEPTED in text


def test_open_store_takes_no_token_file() -> None:
    with pytest.raises(ValueError, match="takes no token file"):
        open_store(f"mooncake://127.0.0.1:50051?{META}", token_file="/etc/token")
    with pytest.raises(ValueError, match="metadata= is required"):
        open_store("mooncake://127.0.0.1:50051")


def test_a_daemon_without_the_mooncake_backend_stops_at_start_and_says_how_to_install_it(
        tmp_path: Path) -> None:
    """A mooncake.store that cannot load (no wheel, no libibverbs1): the
    daemon exits non-zero at start with one message, not a retry loop."""
    import subprocess
    import sys

    fake = tmp_path / "mooncake"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "store.py").write_text(
        "raise ImportError('libibverbs.so.1: cannot open shared object file')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "ec_daemon", "--cpu-bytes", "8MiB", "--socket",
         f"unix://{tmp_path}/ec.sock", "--remote", f"mooncake://127.0.0.1:50051?{META}"],
        capture_output=True, text=True, timeout=60, env=env, cwd=os.getcwd())
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("ec-daemon: error: --remote: the Mooncake backend cannot load")
    assert "apt-get install libibverbs1" in done.stderr
    assert "pip install 'ec-daemon[mooncake]'" in done.stderr


def _settings(argv: list[str]) -> config.DaemonConfig:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_namespace(parser.parse_args(argv))


@needs_mooncake
def test_the_remote_flag_accepts_a_mooncake_url() -> None:
    url = f"mooncake://127.0.0.1:50051?{META}&protocol=tcp&segment=4GiB"
    assert _settings(["--remote", url]).remote == url  # checked, not connected


def test_the_remote_flag_checks_mooncake_urls(capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed URL is refused for what it is before the backend loads:
    the same answer with or without libibverbs1."""
    with pytest.raises(ValueError, match=r"^--remote: invalid remote store URL .*protocol "
                                         r"must be tcp or rdma"):
        _settings(["--remote", f"mooncake://127.0.0.1:50051?{META}&protocol=ib"])
    # The command line: one line on stderr, exit status 2, nothing started.
    assert cli.main(["--remote", "mooncake://127.0.0.1:50051"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ec-daemon: error: --remote: invalid remote store URL")
    assert "metadata= is required" in err and err.count("\n") == 1


# ------------------------------------------------------------------ two hosts


@pytest.mark.parametrize(("shape", "dtype"), [((3, 1000), "bfloat16"), ((6, 500), "float16"),
                                              ((2, 750), "float32")])
def test_one_host_publishes_from_extents_and_another_reads_into_its_own(
        hosts: tuple[Host, Host], raw: Any, shape: tuple[int, int], dtype: str) -> None:
    one, two = hosts
    data = entry(shape, dtype)
    assert len(data) == 6000 == sum(n for _, n in WRITE_AT) == sum(n for _, n in READ_AT)
    mm_hash = fresh()
    one.write(WRITE_AT, data)
    assert one.store.present([(NAMESPACE, mm_hash)]) == [False]
    assert two.store.head(NAMESPACE, mm_hash) is None
    assert one.store.put_entry(NAMESPACE, mm_hash, shape, dtype, one.region, WRITE_AT) == "stored"

    assert two.store.present([(NAMESPACE, mm_hash)]) == [True]
    head = two.store.head(NAMESPACE, mm_hash)
    assert head is not None
    assert (head.shape, head.dtype, head.nbytes) == (shape, dtype, len(data))
    assert head.header == sidecar(mm_hash, shape, dtype, data)
    two.fill(READ_AT)
    assert two.store.get_into(NAMESPACE, mm_hash, head, two.region, READ_AT) is True
    assert two.read(READ_AT) == data
    # What any other reader (vLLM's connector) reads: its exact format, and
    # ec-daemon's checksum beside it under its own key.
    key = value_key(NAMESPACE, mm_hash)
    assert key == f"{NAMESPACE}@id:{mm_hash}"
    assert raw.get(key) == vllm_value(shape, dtype, data)
    assert raw.get(key + SIDECAR) == head.header
    # The writer reads its own value back too.
    assert one.store.get_into(NAMESPACE, mm_hash, head, one.region, [(6 << 20, len(data))]) is True
    assert one.read([(6 << 20, len(data))]) == data


def test_a_value_is_written_once(hosts: tuple[Host, Host], raw: Any) -> None:
    one, two = hosts
    mm_hash, shape = fresh(), (4, 256)
    first, second = entry(shape, "float16"), entry(shape, "float16")
    at = extents_of(len(first), 100_000, 3)
    one.write(at, first)
    two.write(at, second)
    assert one.store.put_entry(NAMESPACE, mm_hash, shape, "float16", one.region, at) == "stored"
    asked: list[int] = []

    def current() -> bool:
        asked.append(1)
        return True

    assert two.store.put_entry(NAMESPACE, mm_hash, shape, "float16", two.region, at,
                               current=current) == "exists"
    assert asked == []  # (found before its pages were even checksummed)
    assert raw.get(value_key(NAMESPACE, mm_hash)) == vllm_value(shape, "float16", first)
    assert raw.get(value_key(NAMESPACE, mm_hash) + SIDECAR) == sidecar(mm_hash, shape,
                                                                       "float16", first)
    head = two.store.head(NAMESPACE, mm_hash)
    assert head is not None
    assert two.store.get_into(NAMESPACE, mm_hash, head, two.region, [(7 << 20, len(first))]) is True
    assert two.read([(7 << 20, len(first))]) == first


def test_pages_reused_before_the_send_publish_nothing(hosts: tuple[Host, Host],
                                                      raw: Any) -> None:
    one, two = hosts
    mm_hash, shape = fresh(), (2, 1500)
    one.write(WRITE_AT, entry(shape, "float16"))
    assert one.store.put_entry(NAMESPACE, mm_hash, shape, "float16", one.region, WRITE_AT,
                               current=lambda: False) == "rewritten"
    key = value_key(NAMESPACE, mm_hash)
    assert raw.is_exist(key) == 0 and raw.is_exist(key + SIDECAR) == 0
    assert two.store.present([(NAMESPACE, mm_hash)]) == [False]
    assert two.store.head(NAMESPACE, mm_hash) is None


def test_pages_reused_during_the_send_are_never_served(hosts: tuple[Host, Host],
                                                       raw: Any) -> None:
    """The pages change after their checksum was taken, while they are copied
    out to be sent (the entry was evicted and its pages reused; their stamp
    says so): nothing reaches the store that a reader could take for the
    entry."""
    one, two = hosts
    mm_hash, shape = fresh(), (2, 1500)
    data = entry(shape, "float16")
    one.write(WRITE_AT, data)
    calls: list[int] = []

    def current() -> bool:  # asked once the pages are copied out
        calls.append(1)
        one.write(WRITE_AT, b"\x5a" * len(data))  # reused meanwhile
        return False

    assert one.store.put_entry(NAMESPACE, mm_hash, shape, "float16", one.region, WRITE_AT,
                               current=current) == "rewritten"
    assert len(calls) == 1
    assert two.store.head(NAMESPACE, mm_hash) is None
    assert raw.is_exist(value_key(NAMESPACE, mm_hash)) == 0
    # The key can be published again (by this host or another), and then served.
    one.write(WRITE_AT, data)
    assert wait_for(lambda: one.store.put_entry(NAMESPACE, mm_hash, shape, "float16", one.region,
                                                WRITE_AT) == "stored", 3.0, 0.1)
    head = two.store.head(NAMESPACE, mm_hash)
    assert head is not None and head.header == sidecar(mm_hash, shape, "float16", data)
    assert two.store.get_into(NAMESPACE, mm_hash, head, two.region, READ_AT)
    assert two.read(READ_AT) == data
    assert raw.get(value_key(NAMESPACE, mm_hash)) == vllm_value(shape, "float16", data)


@pytest.mark.parametrize(("shape", "dtype", "nbytes", "reason"), [
    ((2, 3, 4), "float16", 48, "carries 2-D float32/float16/bfloat16 tensors, not float16"),
    ((24,), "float32", 96, "not float32 (24,)"),
    ((4, 6), "uint8", 24, "not uint8 (4, 6)"),
    ((4, 6), "float64", 192, "not float64"),
    ((4, 6), "float16", 40, "40 bytes do not make a float16 (4, 6) tensor"),
])
def test_entries_the_format_cannot_carry(hosts: tuple[Host, Host], raw: Any,
                                         shape: tuple[int, ...], dtype: str, nbytes: int,
                                         reason: str) -> None:
    mm_hash = fresh()
    with pytest.raises(ValueError, match=re.escape(reason)):
        hosts[0].store.put_entry(NAMESPACE, mm_hash, shape, dtype, hosts[0].region, [(0, nbytes)])
    assert raw.is_exist(value_key(NAMESPACE, mm_hash)) == 0


def test_extents_outside_the_region(hosts: tuple[Host, Host], raw: Any) -> None:
    mm_hash = fresh()
    with pytest.raises(ValueError, match="outside the region"):
        hosts[0].store.put_entry(NAMESPACE, mm_hash, (1, 8), "float32", hosts[0].region,
                                 [(REGION_BYTES - 16, 32)])
    assert raw.is_exist(value_key(NAMESPACE, mm_hash)) == 0


# ------------------------------------------------------------------ vLLM's values


@pytest.mark.parametrize(("shape", "dtype"), [((5, 600), "bfloat16"), ((3, 500), "float16"),
                                              ((1, 1500), "float32")])
def test_a_value_vllm_wrote_is_read(hosts: tuple[Host, Host], raw: Any,
                                    shape: tuple[int, int], dtype: str) -> None:
    mm_hash = fresh("vllm")
    data = entry(shape, dtype)
    assert raw.put(value_key(NAMESPACE, mm_hash), vllm_value(shape, dtype, data)) == 0
    for host in hosts:
        assert host.store.present([(NAMESPACE, mm_hash)]) == [True]
        head = host.store.head(NAMESPACE, mm_hash)
        assert head is not None
        assert (head.shape, head.dtype, head.nbytes, head.header) == (shape, dtype,
                                                                       len(data), None)
        at = extents_of(len(data), 2 << 20, 3)
        host.fill(at)
        assert host.store.get_into(NAMESPACE, mm_hash, head, host.region, at) is True
        assert host.read(at) == data
    # Published again by a host: left as vLLM wrote it.
    hosts[0].write(WRITE_AT[:1], b"\0" * 1000)
    assert hosts[0].store.put_entry(NAMESPACE, mm_hash, (1, 500), "float16", hosts[0].region,
                                    WRITE_AT[:1]) == "exists"
    assert raw.get(value_key(NAMESPACE, mm_hash)) == vllm_value(shape, dtype, data)


SHAPE = (4, 100)  # float16: 800 bytes


def _bad_values(mm_hash: str) -> dict[str, tuple[bytes, bytes | None, str, str]]:
    """name: (value, sidecar, which call refuses it, the reason)."""
    data = payload(800)
    good = vllm_value(SHAPE, "float16", data)
    flipped = bytearray(good)
    flipped[HEADER.size + 123] ^= 0x01
    return {
        "wrong magic": (vllm_value(SHAPE, "float16", data, magic=0x4D4F4F4F), None, "head",
                        "not vLLM's embedding format (magic 0x4d4f4f4f)"),
        "unknown dtype code": (vllm_value(SHAPE, "float16", data, code=5), None, "head",
                               "unknown dtype code 5"),
        "no tokens": (HEADER.pack(MAGIC, 11, 0, 100) + data, None, "head",
                      "implausible shape (0, 100)"),
        "shorter than vLLM's header": (good[:HEADER.size - 4], None, "head",
                                       "shorter than vLLM's header"),
        "longer than its header says": (good + b"\0" * 16, None, "get_into",
                                        "not the value whose header was read"),
        "shorter than its header says": (good[:-2], None, "get_into",
                                         "not the value whose header was read"),
        "payload corrupted after the checksum": (
            bytes(flipped), sidecar(mm_hash, SHAPE, "float16", data), "get_into",
            "checksum mismatch"),
        "checksum of another key": (good, sidecar("another", SHAPE, "float16", data), "head",
                                    "beside the value: stored for mm_hash 'another'"),
        "checksum of another namespace": (
            good, sidecar(mm_hash, SHAPE, "float16", data, namespace="other|model"), "head",
            "beside the value: stored for namespace 'other|model'"),
        # (A checksum is read first, alone: the value's header is checked
        # against it once the value is read.)
        "checksum of another shape": (good, sidecar(mm_hash, (8, 50), "float16", data),
                                      "get_into", "not the one its head described"),
        "checksum of another dtype": (good, sidecar(mm_hash, (2, 100), "float32", data),
                                      "get_into", "not the one its head described"),
        "checksum of no vLLM value": (good, sidecar(mm_hash, (4, 50, 2), "float16", data),
                                      "head", "no value of vLLM's format"),
        "malformed checksum": (good, b"ECDV" + b"\0" * 40, "head", "format version 0"),
        "truncated checksum": (good, sidecar(mm_hash, SHAPE, "float16", data)[:20], "head",
                               "truncated"),
    }


@pytest.mark.parametrize("case", list(_bad_values("x")))
def test_values_that_are_refused(hosts: tuple[Host, Host], raw: Any, case: str) -> None:
    mm_hash = fresh("bad")
    value, side, refuses, reason = _bad_values(mm_hash)[case]
    key = value_key(NAMESPACE, mm_hash)
    assert raw.put(key, value) == 0
    if side is not None:
        assert raw.put(key + SIDECAR, side) == 0
    store, region = hosts[1].store, hosts[1].region
    at = [(1 << 20, 300), (4 << 20, 500)]
    if refuses == "head":
        with pytest.raises(values.BadValue, match=_escaped(reason)):
            store.head(NAMESPACE, mm_hash)
        return
    head = store.head(NAMESPACE, mm_hash)
    assert head is not None and head.nbytes == 800
    hosts[1].fill(at)
    with pytest.raises(values.BadValue, match=_escaped(reason)):
        store.get_into(NAMESPACE, mm_hash, head, region, at)
    # Nothing to serve: the caller aborts the pages (they hold unverified bytes).


def _escaped(text: str) -> str:
    return re.escape(text)


def test_a_value_replaced_between_head_and_read(hosts: tuple[Host, Host], raw: Any) -> None:
    """get_into reads the header again: a value of another dtype that came
    between (removed and written again) is refused."""
    mm_hash = fresh()
    key = value_key(NAMESPACE, mm_hash)
    data = payload(800)
    assert raw.put(key, vllm_value(SHAPE, "float16", data)) == 0
    head = hosts[1].store.head(NAMESPACE, mm_hash)
    assert head is not None
    assert raw.remove(key, True) == 0
    assert raw.put(key, vllm_value(SHAPE, "bfloat16", data)) == 0
    with pytest.raises(values.BadValue, match="rewritten between its header and its read"):
        hosts[1].store.get_into(NAMESPACE, mm_hash, head, hosts[1].region, [(0, 800)])
    assert raw.remove(key, True) == 0
    assert hosts[1].store.get_into(NAMESPACE, mm_hash, head, hosts[1].region, [(0, 800)]) is False


def test_a_failed_checksum_read_is_not_taken_for_no_checksum(
        hosts: tuple[Host, Host], monkeypatch: pytest.MonkeyPatch) -> None:
    """A checksum that is there but could not be read must not make the
    value pass as vLLM's (unchecked): the read's error is an error, not "no
    checksum" (the binding's get() answers b"" for both: head reads the
    checksum with get_into, which says which)."""
    one, two = hosts
    mm_hash, shape = fresh(), (2, 1500)
    one.write(WRITE_AT, entry(shape, "bfloat16"))
    assert one.store.put_entry(NAMESPACE, mm_hash, shape, "bfloat16", one.region,
                               WRITE_AT) == "stored"

    class FailingReads:
        def __init__(self, client: Any) -> None:
            self._client = client

        def get_into(self, key: str, address: int, size: int) -> int:
            if key.endswith(SIDECAR):
                return -900  # RPC_FAIL
            return int(self._client.get_into(key, address, size))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._client, name)

    monkeypatch.setattr(two.store.connection, "_client",
                        FailingReads(two.store.connection._client))
    with pytest.raises(RemoteError, match="@ecd1"):
        two.store.head(NAMESPACE, mm_hash)
    monkeypatch.undo()
    head = two.store.head(NAMESPACE, mm_hash)
    assert head is not None and head.header is not None


def test_header_buffers_of_threads_that_ended(hosts: tuple[Host, Host]) -> None:
    """Headers are read through registered buffers: threads that come and
    go (a pool resized, a helper thread) must not leave registrations behind
    that the next thread's buffer collides with."""
    one, two = hosts
    mm_hash, shape = fresh(), (2, 1500)
    data = entry(shape, "float16")
    one.write(WRITE_AT, data)
    assert one.store.put_entry(NAMESPACE, mm_hash, shape, "float16", one.region,
                               WRITE_AT) == "stored"
    failures: list[str] = []

    def read(i: int) -> None:
        try:
            head = two.store.head(NAMESPACE, mm_hash)
            assert head is not None
            at = [(i * 8192, len(data))]
            assert two.store.get_into(NAMESPACE, mm_hash, head, two.region, at)
            assert two.read(at) == data
        except Exception as exc:  # (reported below)
            failures.append(f"thread {i}: {exc!r}")

    started = time.monotonic()
    for i in range(40):
        thread = threading.Thread(target=read, args=(i,))
        thread.start()
        thread.join(10)
    assert not failures, failures[:3]
    assert time.monotonic() - started < 10


# ------------------------------------------------------------------ present and claims


def test_present_in_one_batch(hosts: tuple[Host, Host], raw: Any) -> None:
    one, two = hosts
    a, b, c = fresh("a"), fresh("b"), fresh("c")
    one.write(WRITE_AT, entry((3, 1000), "bfloat16"))
    assert one.store.put_entry(NAMESPACE, a, (3, 1000), "bfloat16", one.region,
                               WRITE_AT) == "stored"
    assert raw.put(value_key(STORE_NS, c), vllm_value((1, 4), "float32", b"\1" * 16)) == 0
    assert raw.put(value_key(NAMESPACE, b) + SIDECAR, b"a checksum without its value") == 0
    keys = [(NAMESPACE, a), (NAMESPACE, b), (STORE_NS, c), (NAMESPACE, c), (STORE_NS, a)]
    assert two.store.present(keys) == [True, False, True, False, False]
    assert two.store.present([]) == []
    assert two.store.head(NAMESPACE, b) is None


def test_claims_between_hosts(hosts: tuple[Host, Host], raw: Any) -> None:
    one, two = hosts
    mm_hash = fresh("claim")
    assert one.store.claim(NAMESPACE, mm_hash, "host-1", 30.0) is True
    assert two.store.claim(NAMESPACE, mm_hash, "host-2", 30.0) is False
    assert one.store.claim(NAMESPACE, mm_hash, "host-1", 30.0) is True  # the holder, again
    holder, stamp = raw.get(value_key(NAMESPACE, mm_hash) + CLAIM).decode().split(" ")
    assert holder == "host-1"
    assert abs(int(stamp) - (time.time() + 30) * 1000) < 5000
    two.store.release(NAMESPACE, mm_hash, "host-2")  # not the holder: nothing changes
    assert two.store.claim(NAMESPACE, mm_hash, "host-2", 30.0) is False
    one.store.release(NAMESPACE, mm_hash, "host-1")
    assert raw.is_exist(value_key(NAMESPACE, mm_hash) + CLAIM) == 0
    assert two.store.claim(NAMESPACE, mm_hash, "host-2", 30.0) is True
    assert one.store.claim(NAMESPACE, mm_hash, "host-1", 30.0) is False
    one.store.release(NAMESPACE, mm_hash, "host-3")  # (nobody's token)
    two.store.release(NAMESPACE, mm_hash, "host-2")
    two.store.release(NAMESPACE, mm_hash, "host-2")  # (released twice: harmless)
    # A claim is not a value.
    assert one.store.present([(NAMESPACE, mm_hash)]) == [False]


def test_an_expired_claim_is_taken_over(hosts: tuple[Host, Host],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claims, "CLAIM_SLACK_MS", 0)
    one, two = hosts
    mm_hash = fresh("expiring")
    taken = time.monotonic()
    assert one.store.claim(NAMESPACE, mm_hash, "host-1", 0.6) is True
    assert two.store.claim(NAMESPACE, mm_hash, "host-2", 5.0) is False
    assert wait_for(lambda: time.monotonic() - taken > 0.65, 2.0)
    assert two.store.claim(NAMESPACE, mm_hash, "host-2", 5.0) is True  # host 1 is gone
    assert one.store.claim(NAMESPACE, mm_hash, "host-1", 5.0) is False
    one.store.release(NAMESPACE, mm_hash, "host-1")  # (too late: not its claim any more)
    assert one.store.claim(NAMESPACE, mm_hash, "host-1", 5.0) is False
    two.store.release(NAMESPACE, mm_hash, "host-2")


def test_an_unreadable_claim_is_taken_over(hosts: tuple[Host, Host], raw: Any) -> None:
    mm_hash = fresh("garbage")
    assert raw.put(value_key(NAMESPACE, mm_hash) + CLAIM, b"no-expiry-here") == 0
    assert hosts[0].store.claim(NAMESPACE, mm_hash, "host-1", 5.0) is True
    hosts[0].store.release(NAMESPACE, mm_hash, "host-1")


def test_racing_claims_have_one_winner(hosts: tuple[Host, Host]) -> None:
    one, two = hosts
    stores = [one.store, two.store, one.store, two.store]
    for _round in range(5):
        mm_hash = fresh("race")
        barrier = threading.Barrier(len(stores))
        won: list[bool | None] = [None] * len(stores)

        def claim(i: int, key: str = mm_hash, gate: threading.Barrier = barrier,
                  results: list[bool | None] = won) -> None:
            gate.wait(5)
            results[i] = stores[i].claim(NAMESPACE, key, f"token-{i}", 30.0)

        threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(stores))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert None not in won, won
        assert won.count(True) == 1, won
        winner = won.index(True)
        # Every loser sees the winner's claim, and the winner still holds it.
        assert stores[winner].claim(NAMESPACE, mm_hash, f"token-{winner}", 30.0) is True
        loser = (winner + 1) % len(stores)
        assert stores[loser].claim(NAMESPACE, mm_hash, f"token-{loser}", 30.0) is False


# ------------------------------------------------------------------ failures


def _gil_gaps(since: float, seconds: float) -> float:
    """The longest this thread waited (for a 10 ms sleep) from `since` for
    `seconds`: a thread holding the interpreter (a C call that keeps the
    GIL) shows."""
    worst, last = 0.0, since
    end = time.monotonic() + seconds
    while last < end:
        time.sleep(0.01)
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    return worst


def _every_call_refused(host: Host, match: str) -> None:
    store, head, region = host.store, Fetched((1, 2), "float32", 8), host.region
    calls: dict[str, Callable[[], object]] = {
        "ping": store.ping,
        "present": lambda: store.present([(NAMESPACE, "k")]),
        "head": lambda: store.head(NAMESPACE, "k"),
        "get_into": lambda: store.get_into(NAMESPACE, "k", head, region, [(0, 8)]),
        "put_entry": lambda: store.put_entry(NAMESPACE, "k", (1, 2), "float32", region, [(0, 8)]),
        "claim": lambda: store.claim(NAMESPACE, "k", "t", 1.0),
        "release": lambda: store.release(NAMESPACE, "k", "t"),
    }
    for name, call in calls.items():
        started = time.monotonic()
        with pytest.raises(RemoteError, match=match):
            call()
        assert time.monotonic() - started < 0.5, name


@needs_mooncake
def test_before_the_master_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call fails at once (not connected) and nothing blocks the
    process (the client's setup would hold the interpreter for 90 s); the
    store connects by itself once the master is there."""
    monkeypatch.setattr(connection, "SETUP_RETRY_S", 0.2)
    rpc_port, metadata_port = mooncake_servers.free_port(), mooncake_servers.free_port()
    server = mooncake_servers.MooncakeMaster(tmp_path, rpc_port=rpc_port,
                                             metadata_port=metadata_port)
    started = time.monotonic()
    host = Host(server.url_with(segment=SEGMENT, buffer=BUFFER))
    try:
        _every_call_refused(host, r"not connected \(")
        assert _gil_gaps(started, 1.0) < 1.0
        _every_call_refused(host, r"not connected \(master 127.0.0.1:\d+ unreachable")

        server.start()
        started = time.monotonic()
        host.connected(timeout_s=15)
        assert time.monotonic() - started < 5
        data = entry((3, 1000), "float16")
        host.write(WRITE_AT, data)
        assert host.store.put_entry(NAMESPACE, "k", (3, 1000), "float16", host.region,
                                    WRITE_AT) == "stored"
        head = host.store.head(NAMESPACE, "k")
        assert head is not None and host.store.get_into(NAMESPACE, "k", head, host.region, READ_AT)
        assert host.read(READ_AT) == data
    finally:
        host.close()
        server.stop()


def test_an_unreachable_metadata_server(mooncake_master: mooncake_servers.MooncakeMaster,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The master answers, its metadata server does not: not connected, and
    no setup that holds the interpreter for seconds at every retry."""
    monkeypatch.setattr(connection, "SETUP_RETRY_S", 0.2)
    dead = f"http://127.0.0.1:{mooncake_servers.free_port()}/metadata"
    url = (f"mooncake://{mooncake_master.rpc_address}?metadata={dead}"
           f"&segment={SEGMENT}&buffer={BUFFER}")
    started = time.monotonic()
    host = Host(url)
    try:
        assert _gil_gaps(started, 1.0) < 1.0
        _every_call_refused(host, r"not connected \(metadata server 127.0.0.1:\d+ unreachable")
    finally:
        host.close()


def _refused_within(call: Callable[[], object], bound_s: float) -> float:
    started = time.monotonic()
    with pytest.raises(RemoteError):
        call()
    took = time.monotonic() - started
    assert took < bound_s
    return took


def test_a_killed_master_fails_calls_and_a_restarted_one_serves(
        own_mooncake_master: mooncake_servers.MooncakeMaster) -> None:
    server = own_mooncake_master
    host = Host(server.url_with(segment=SEGMENT, buffer=BUFFER))
    try:
        host.connected()
        data = entry((3, 1000), "bfloat16")
        host.write(WRITE_AT, data)
        assert host.store.put_entry(NAMESPACE, "before", (3, 1000), "bfloat16", host.region,
                                    WRITE_AT) == "stored"
        server.kill()
        # The first calls fail at once (measured: 1 ms); later ones after the
        # client tried the master again (measured: 4.3 s).
        _refused_within(lambda: host.store.present([(NAMESPACE, "before")]), 5.0)
        _refused_within(lambda: host.store.head(NAMESPACE, "before"), 5.0)
        _refused_within(lambda: host.store.present([(NAMESPACE, "before")]), 5.0)

        server.restart()

        def serves() -> bool:
            try:
                return host.store.present([(NAMESPACE, "before")]) == [False] and \
                    host.store.put_entry(NAMESPACE, "after", (3, 1000), "bfloat16", host.region,
                                         WRITE_AT) == "stored"
            except RemoteError:
                return False

        assert wait_for(serves, 20.0, 0.2)
        # The restart lost every object; the region is still registered.
        assert host.store.head(NAMESPACE, "before") is None
        head = host.store.head(NAMESPACE, "after")
        assert head is not None and host.store.get_into(NAMESPACE, "after", head, host.region,
                                                        READ_AT)
        assert host.read(READ_AT) == data
    finally:
        host.close()


# ------------------------------------------------------------------ the second tier


@pytest.fixture()
def tiers(hosts: tuple[Host, Host], monkeypatch: pytest.MonkeyPatch
          ) -> Iterator[tuple[RemoteTier, RemoteTier]]:
    """A tier on each host's store (kept open when the tiers stop: the
    module closes the stores)."""
    made = []
    for host in hosts:
        monkeypatch.setattr(host.store, "close", lambda: None)
        common = Common(promotion_bytes=256 << 20, breaker_base_s=0.2, breaker_max_s=1.0)
        made.append(RemoteTier(MooncakeBackend(common, host.store, index_bytes=64 << 20),
                               publish_queue_bytes=16 << 20, claim_s=5.0))
    for tier in made:
        tier.start()
        tier.follow(NAMESPACE, STORE_NS)
    try:
        yield made[0], made[1]
    finally:
        for tier in made:
            tier.stop()


class Outcomes:
    def __init__(self) -> None:
        self.seen: list[Resolution] = []

    def __call__(self, outcome: Resolution) -> None:
        self.seen.append(outcome)

    def became(self, outcome: Resolution, timeout_s: float = 5.0) -> bool:
        return wait_for(lambda: bool(self.seen) and self.seen[-1] is outcome, timeout_s)


def test_tiers_claim_wait_and_promote(hosts: tuple[Host, Host], raw: Any,
                                      tiers: tuple[RemoteTier, RemoteTier]) -> None:
    one, two = hosts
    tier1, tier2 = tiers
    mm_hash, shape = fresh("tier"), (3, 1000)
    data = entry(shape, "bfloat16")

    first, second = Outcomes(), Outcomes()
    assert tier1.resolve(NAMESPACE, mm_hash, first)
    assert first.became(Resolution.CLAIMED)
    assert raw.get(value_key(STORE_NS, mm_hash) + CLAIM).decode().startswith(tier1.token + " ")
    assert tier2.resolve(NAMESPACE, mm_hash, second)
    assert second.became(Resolution.ELSEWHERE)
    assert tier2.available(NAMESPACE, mm_hash) is None

    one.write(WRITE_AT, data)
    assert tier1.publish(NAMESPACE, mm_hash, shape, "bfloat16", one.region, WRITE_AT,
                         lambda: True)
    assert second.became(Resolution.FOUND)
    assert second.seen == [Resolution.ELSEWHERE, Resolution.FOUND]
    assert first.seen == [Resolution.CLAIMED]
    assert tier2.available(NAMESPACE, mm_hash) == len(data)
    # Under the engine's store namespace (vLLM's key), and the claim released.
    assert raw.get(value_key(STORE_NS, mm_hash)) == vllm_value(shape, "bfloat16", data)
    # (released once published: perhaps just after the other host found the value)
    assert wait_for(lambda: raw.is_exist(value_key(STORE_NS, mm_hash) + CLAIM) == 0, 5.0)

    found = tier2.fetch(NAMESPACE, mm_hash, len(data))
    assert found is not None
    assert (found.shape, found.dtype, found.nbytes) == (shape, "bfloat16", len(data))
    two.fill(READ_AT)
    assert tier2.fetch_into(NAMESPACE, mm_hash, found, two.region, READ_AT) is True
    assert two.read(READ_AT) == data

    s1, s2 = tier1.snapshot(), tier2.snapshot()
    assert (s1["claims_taken"], s1["publishes"], s1["publish_bytes"]) == (1, 1, len(data))
    assert (s2["claims_elsewhere"], s2["lookup_hits"], s2["remote_hits"]) == (1, 1, 1)
    assert s2["fetch_bytes"] == len(data) and s2["errors"] == 0 and s2["reachable"] is True
    # Published once: the other host's publication is skipped.
    two.write(READ_AT, data)
    assert tier2.publish(NAMESPACE, mm_hash, shape, "bfloat16", two.region, READ_AT,
                         lambda: True)
    assert wait_for(lambda: tier2.snapshot()["publish_exists"] == 1, 5.0)


def test_a_tier_refuses_bad_values_without_blaming_the_store(
        hosts: tuple[Host, Host], raw: Any, tiers: tuple[RemoteTier, RemoteTier]) -> None:
    tier = tiers[1]
    short, corrupt = fresh("short"), fresh("corrupt")
    assert raw.put(value_key(STORE_NS, short), b"\x4e\x4f\x4f\x4d" * 3) == 0
    data = payload(800)
    flipped = bytearray(vllm_value(SHAPE, "float16", data))
    flipped[-1] ^= 0x80
    assert raw.put(value_key(STORE_NS, corrupt), bytes(flipped)) == 0
    assert raw.put(value_key(STORE_NS, corrupt) + SIDECAR,
                   sidecar(corrupt, SHAPE, "float16", data, namespace=STORE_NS)) == 0

    assert tier.fetch(NAMESPACE, short, 800) is None
    found = tier.fetch(NAMESPACE, corrupt, 800)
    assert found is not None and found.nbytes == 800
    at = [(1 << 20, 800)]
    assert tier.fetch_into(NAMESPACE, corrupt, found, hosts[1].region, at) is False
    snap = tier.snapshot()
    assert (snap["bad_values"], snap["remote_hits"], snap["errors"]) == (2, 0, 0)
    assert snap["reachable"] is True and snap["breakers_open"] == 0
    assert tier.fetch(NAMESPACE, fresh("absent"), 800) is None
    assert tier.snapshot()["remote_misses"] == 1
