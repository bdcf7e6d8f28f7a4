"""The Mooncake test fixture (tests/mooncake_servers.py) against real
mooncake_master processes: it serves clients, a kill is seen at once, a
restart serves again on the same ports, and a master that cannot start says
why."""

from __future__ import annotations

import time
import urllib.parse
from pathlib import Path

import pytest

from tests import mooncake_servers
from tests.remote.conftest import needs_mooncake, payload, wait_for

pytestmark = needs_mooncake

RPC_FAIL = -900


def test_addresses_and_url(mooncake_master: mooncake_servers.MooncakeMaster) -> None:
    server = mooncake_master
    assert server.rpc_address == f"127.0.0.1:{server.rpc_port}"
    assert server.metadata_url == f"http://127.0.0.1:{server.metadata_port}/metadata"
    assert server.url == (f"mooncake://127.0.0.1:{server.rpc_port}"
                          f"?metadata=http://127.0.0.1:{server.metadata_port}/metadata")
    parsed = urllib.parse.urlsplit(server.url_with(lease="1 s"))
    assert (parsed.scheme, parsed.hostname, parsed.port) == ("mooncake", "127.0.0.1",
                                                            server.rpc_port)
    assert urllib.parse.parse_qs(parsed.query) == {"metadata": [server.metadata_url],
                                                   "lease": ["1 s"]}
    assert len({server.rpc_port, server.metadata_port, server.metrics_port}) == 3


def test_two_clients_share_a_value(mooncake_master: mooncake_servers.MooncakeMaster) -> None:
    value = payload(1 << 20)
    with mooncake_servers.raw_client(mooncake_master) as writer, \
            mooncake_servers.raw_client(mooncake_master) as reader:
        assert writer.put("shared", value) == 0
        assert reader.is_exist("shared") == 1
        assert reader.get("shared") == value
        assert reader.is_exist("absent") == 0


def test_kill_fails_fast_and_restart_serves_on_the_same_ports(
        own_mooncake_master: mooncake_servers.MooncakeMaster) -> None:
    server = own_mooncake_master
    ports = (server.rpc_port, server.metadata_port, server.metrics_port)
    with mooncake_servers.raw_client(server) as client:
        assert client.put("before", b"x" * 1000) == 0
        old_pid = server.pid
        server.kill()
        assert server.pid is None

        started = time.monotonic()
        assert client.is_exist("before") == RPC_FAIL
        assert client.get("before") == b""  # get reports a failure as no value
        # Fast (milliseconds here), not Mooncake's 30 s RPC timeout: the bound
        # is loose so that a busy machine cannot fail it.
        assert time.monotonic() - started < 10
        started = time.monotonic()
        assert client.put("after", b"y") == RPC_FAIL  # put retries for about 4 s
        assert time.monotonic() - started < 15

        server.restart()
        assert server.pid not in (None, old_pid)
        assert (server.rpc_port, server.metadata_port, server.metrics_port) == ports
        with mooncake_servers.raw_client(server) as fresh:
            assert fresh.put("fresh", b"z" * 100) == 0
            assert fresh.get("fresh") == b"z" * 100
            # A master keeps objects in memory only: the restart lost them.
            assert fresh.is_exist("before") == 0
        # The old client mounts its segment again on its next heartbeat
        # (until then a put answers -200).
        assert wait_for(lambda: client.put("again", b"w") == 0, timeout_s=15, step_s=0.2)
        assert client.get("again") == b"w"


def test_extra_flags_reach_the_master() -> None:
    with mooncake_servers.master(extra=("--default_kv_lease_ttl=500",)) as server:
        assert "default_kv_lease_ttl=500," in server.log_tail(200)


def test_a_master_that_cannot_start_says_why(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with status") as failure, \
            mooncake_servers.master(extra=("--no_such_flag=1",), folder=tmp_path):
        pass
    assert "no_such_flag" in str(failure.value)
    assert time.monotonic() - started < 10
