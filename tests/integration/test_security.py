"""Who can reach the daemon: file modes and groups, TCP tokens, TLS."""

from __future__ import annotations

import grp
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_protocol.protocol import Layout, pb, rpc
from ec_protocol.transport import Transport
from tests.integration.daemon import Daemon, free_port, short_tmpdir

pytestmark = pytest.mark.integration
TOKEN = "s3cret-token-0123456789abcdef"
READ_TOKEN = "r3ad-only-token-0123456789abcdef"


def secret_file(path, token: str) -> str:
    """`token` in an owner-only file at `path`."""
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def token_file(tmp_path):
    return secret_file(tmp_path / "token", TOKEN)


@pytest.fixture
def read_token_file(tmp_path):
    return secret_file(tmp_path / "read-token", READ_TOKEN)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ec_daemon", *args], capture_output=True,
                          text=True, timeout=60)


def other_group() -> int:
    """A group other than ours when we may chown to it (root), else ours."""
    if os.getuid() == 0:
        for name in ("daemon", "nogroup", "users"):
            try:
                return grp.getgrnam(name).gr_gid
            except KeyError:
                continue
    return os.getgid()


def test_socket_mode_and_group_open_socket_region_and_folder_to_the_group(shm_folder):
    gid = other_group()
    d = Daemon(extra=("--socket-mode", "0660", "--group", str(gid)), shm_dir=str(shm_folder))
    d.start()
    try:
        (region,) = d.region_files()
        for path in (d.socket_path, region):
            info = path.stat()
            assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == gid, path
        folder = d.socket_path.parent.stat()
        assert stat.S_IMODE(folder.st_mode) == 0o710 and folder.st_gid == gid
    finally:
        d.cleanup()


@pytest.mark.parametrize(("args", "message"), [
    (["--socket-mode", "0777"], "only read/write bits"),
    (["--socket-mode", "0060"], "owner needs read and write"),
    (["--group", "no-such-group-xyz"], "unknown group"),
    (["--tls-cert", "/tmp/x.pem"], "go together"),
])
def test_bad_access_settings_fail_at_start(args, message):
    folder = short_tmpdir()
    try:
        result = cli("--cpu-bytes", "8MiB", "--socket", f"unix://{folder}/ec.sock", *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
    finally:
        folder.rmdir()


def test_a_socket_folder_anyone_can_write_is_refused_at_start():
    folder = short_tmpdir()
    try:
        folder.chmod(0o777)  # as a squatter leaves /tmp/ec-daemon-$UID
        result = cli("--cpu-bytes", "8MiB", "--socket", f"unix://{folder}/ec.sock")
        assert result.returncode == 2, result.stderr
        assert f"refusing socket folder {folder}: it is writable by every user" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    finally:
        folder.rmdir()


def test_tcp_is_refused_without_a_token():
    result = cli("--cpu-bytes", "8MiB", "--socket", f"127.0.0.1:{free_port()}")
    assert result.returncode == 2 and "without --token-file" in result.stderr


def test_tcp_calls_need_the_token(token_file):
    d = tcp_daemon("--token-file", token_file)
    try:
        anonymous = Transport(d.socket)
        authorised = Transport(d.socket, token_file=token_file)
        try:
            wait_ready(authorised, d)
            with pytest.raises(grpc.RpcError) as info:
                anonymous.call("Stats", pb.StatsRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                anonymous.call("Attach", pb.AttachRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            anonymous.close()
            authorised.close()
        assert cli("health", "--socket", d.socket).returncode == 1
        assert cli("health", "--socket", d.socket, "--token-file", token_file).returncode == 0
        scheduler = SchedulerDelegate(d.socket, engine_id="E", token_file=token_file,
                                      layout=Layout("m", "float16", {"image": 2}))
        try:
            assert scheduler.link.wait_attached(10) is not None
        finally:
            scheduler.close()
    finally:
        d.cleanup()


def test_the_read_only_token_reads_but_cannot_attach_allocate_or_report(token_file,
                                                                         read_token_file):
    d = tcp_daemon("--token-file", token_file, "--read-token-file", read_token_file)
    try:
        router = Transport(d.socket, token_file=read_token_file)
        try:
            wait_ready(router, d)
            assert "read-only token for Watch, Stats, Lookup, health" in d.log()
            reply = router.call("Lookup", pb.LookupRequest(namespace="m|float16|image=2|",
                                                           mm_hashes=["h"]))
            assert reply.results[0].state == pb.ABSENT
            watch = rpc.ECDaemonStub(router.channel).Watch(
                pb.WatchRequest(), metadata=router.metadata, timeout=30)
            assert next(watch).snapshot_done
            watch.cancel()
            for name, request in (("Attach", pb.AttachRequest(engine_id="R")),
                                  ("Detach", pb.DetachRequest()),
                                  ("Allocate", pb.AllocateRequest()),
                                  ("Report", pb.ReportRequest())):
                with pytest.raises(grpc.RpcError) as info:
                    router.call(name, request)
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
                assert info.value.details() == (
                    f"ec_daemon.v1.ECDaemon/{name} needs the full token: the read-only token "
                    "only reads (Watch, Stats, Lookup, health)")
            with pytest.raises(grpc.RpcError) as info:
                next(router.stream(iter([pb.ClientMessage(open_session_id="s")])))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert router.call("Stats", pb.StatsRequest()).sessions == 0  # nothing attached
            for command in ("health", "stats"):
                done = cli(command, "--socket", d.socket, "--token-file", read_token_file)
                assert done.returncode == 0, done.stderr
            scheduler = SchedulerDelegate(d.socket, engine_id="E", token_file=token_file,
                                          layout=Layout("m", "float16", {"image": 2}))
            try:  # the full token still allows everything
                assert scheduler.link.wait_attached(10) is not None
                assert router.call("Stats", pb.StatsRequest()).sessions == 1
            finally:
                scheduler.close()
        finally:
            router.close()
    finally:
        d.cleanup()


def test_read_only_token_settings_that_restrict_nothing_fail_at_start(token_file,
                                                                      read_token_file):
    tcp = f"127.0.0.1:{free_port()}"
    alone = cli("--cpu-bytes", "8MiB", "--socket", tcp, "--read-token-file", read_token_file)
    assert alone.returncode == 2, alone.stderr
    assert "--read-token-file needs --token-file" in alone.stderr
    same = cli("--cpu-bytes", "8MiB", "--socket", tcp, "--token-file", token_file,
               "--read-token-file", token_file)
    assert same.returncode == 2, same.stderr
    assert (f"ec-daemon: error: the read-only token in {token_file} is the full token of "
            f"{token_file}: give routers a different token") in same.stderr


def tcp_daemon(*extra: str) -> Daemon:
    d = Daemon(extra=extra)
    d.socket = f"127.0.0.1:{free_port()}"
    d.args[d.args.index("--socket") + 1] = d.socket
    return d.start(wait=False)


def wait_ready(transport: Transport, daemon: Daemon) -> pb.StatsReply:
    """The first Stats that answers (the daemon is still starting)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return transport.call("Stats", pb.StatsRequest(), timeout=1)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise AssertionError(daemon.log()) from exc
            time.sleep(0.05)


def make_certificate(folder: Path) -> tuple[str, str]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


@pytest.mark.skipif(not Path("/usr/bin/openssl").exists(), reason="openssl is not installed")
def test_tls_with_token(tmp_path, token_file):
    cert, key = make_certificate(tmp_path)
    d = tcp_daemon("--token-file", token_file, "--tls-cert", cert, "--tls-key", key)
    try:
        secure = Transport(d.socket, token_file=token_file, tls_ca=cert)
        plain = Transport(d.socket, token_file=token_file)
        try:
            reply = wait_ready(secure, d)
            assert reply.capacity_bytes == 64 << 20
            with pytest.raises(grpc.RpcError) as info:
                plain.call("Stats", pb.StatsRequest(), timeout=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            secure.close()
            plain.close()
        ok = cli("stats", "--socket", d.socket, "--token-file", token_file, "--tls-ca", cert,
                 "--json")
        assert ok.returncode == 0, ok.stderr
    finally:
        d.cleanup()
