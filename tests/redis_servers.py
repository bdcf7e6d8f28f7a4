"""Real redis-server processes for tests, on 127.0.0.1 free ports: a single
node (optionally with a password or TLS), a cluster of masters, and killing
or restarting a node on its port. Every server is stopped by its pid when its
context manager exits, and every wait is bounded by time.

Standard library and redis-py only: the vLLM suites import this from their
own virtual environment. redis-py is imported where a server is talked to,
not at import: tests/groups.py imports this module for every suite, the GPU
suite on a machine without redis-py included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

REDIS_SERVER = shutil.which("redis-server")
OPENSSL = shutil.which("openssl")
HOST = "127.0.0.1"
SLOTS = 16384


def available() -> bool:
    """Whether redis-server is installed (tests skip without it)."""
    return REDIS_SERVER is not None


def free_port(*, cluster_bus: bool = False) -> int:
    """A port free on 127.0.0.1 now (and port + 10000, a cluster's bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if not cluster_bus:
            return port
        if port + 10000 < 65536 and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str
    ca: str


def make_tls_files(folder: str | Path) -> TlsFiles | None:
    """A self-signed certificate for 127.0.0.1 (its own CA), or None when
    openssl is not installed."""
    if OPENSSL is None:
        return None
    folder = Path(folder)
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return TlsFiles(cert=str(cert), key=str(key), ca=str(cert))


class RedisServer:
    """One redis-server process on 127.0.0.1:port, in its own folder (kept
    across restarts: a cluster node finds its nodes.conf again)."""

    def __init__(self, folder: str | Path, *, port: int | None = None,
                 password: str | None = None, cluster: bool = False,
                 tls: TlsFiles | None = None, tls_auth_clients: bool = False,
                 extra: tuple[str, ...] = ()) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(cluster_bus=cluster)
        self.password = password
        self.cluster = cluster
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.folder / "redis.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        if self.tls is None:
            return f"redis://{self.address}"
        return f"rediss://{self.address}?ca_certs={self.tls.ca}"

    def _argv(self) -> list[str]:
        assert REDIS_SERVER is not None
        argv = [REDIS_SERVER, "--bind", HOST, "--dir", str(self.folder),
                "--logfile", str(self.log_path), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--enable-debug-command", "local"]
        if self.tls is None:
            argv += ["--port", str(self.port)]
        else:
            argv += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", self.tls.cert, "--tls-key-file", self.tls.key,
                     "--tls-ca-cert-file", self.tls.ca,
                     "--tls-auth-clients", "yes" if self.tls_auth_clients else "no"]
            if self.cluster:
                argv += ["--tls-cluster", "yes"]
        if self.password is not None:
            argv += ["--requirepass", self.password, "--masterauth", self.password]
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "1000",
                     "--cluster-require-full-coverage", "no"]
        return argv + list(self.extra)

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain redis-py client to this node (a cluster node too)."""
        options: dict[str, object] = {"host": HOST, "port": self.port,
                                      "password": self.password, "socket_timeout": 5,
                                      "socket_connect_timeout": 5}
        if self.tls is not None:
            options.update(ssl=True, ssl_ca_certs=self.tls.ca)
            if self.tls_auth_clients:
                options.update(ssl_certfile=self.tls.cert, ssl_keyfile=self.tls.key)
        options.update(kwargs)
        import redis

        return redis.Redis(**options)  # type: ignore[arg-type]

    def start(self, timeout_s: float = 15.0) -> None:
        """Start on self.port and wait until it answers PING (a port taken
        meanwhile is retried for a while, as a restart needs the same port)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(self._argv(), stdout=log,
                                                stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)
            if self._wait_ready(deadline):
                return
            tail = self.log_tail()
            self.kill()
            if "Address already in use" in tail and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")

    def _wait_ready(self, deadline: float) -> bool:
        import redis

        assert self.process is not None
        client = self.client(socket_timeout=1, socket_connect_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    pass
                time.sleep(0.02)
            return False
        finally:
            client.close()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash; waits for the process to be gone."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=5)

    def restart(self, timeout_s: float = 15.0) -> None:
        """Start again on the same port and folder (after kill or stop)."""
        self.kill()
        self.start(timeout_s)


@contextlib.contextmanager
def _folder(folder: str | Path | None) -> Iterator[Path]:
    if folder is not None:
        yield Path(folder)
        return
    with tempfile.TemporaryDirectory(prefix="ecd-redis-") as tmp:
        yield Path(tmp)


@contextlib.contextmanager
def single_node(*, password: str | None = None, tls: TlsFiles | None = None,
                tls_auth_clients: bool = False, extra: tuple[str, ...] = (),
                folder: str | Path | None = None) -> Iterator[RedisServer]:
    """A running single-node redis-server; stopped (by pid) on exit."""
    with _folder(folder) as where:
        server = RedisServer(where / "node", password=password, tls=tls,
                             tls_auth_clients=tls_auth_clients, extra=extra)
        try:
            server.start()
            yield server
        finally:
            server.stop()


class Cluster:
    """Masters of one Redis Cluster, each a RedisServer."""

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes

    @property
    def url(self) -> str:
        scheme = "rediss+cluster" if self.nodes[0].tls is not None else "redis+cluster"
        url = f"{scheme}://" + ",".join(n.address for n in self.nodes)
        if self.nodes[0].tls is not None:
            url += f"?ca_certs={self.nodes[0].tls.ca}"
        return url

    def slot_of(self, key: str | bytes) -> int:
        from redis.crc import key_slot

        return int(key_slot(key.encode() if isinstance(key, str) else key))

    def node_of(self, key: str | bytes) -> RedisServer:
        """The master serving `key` (slots split evenly in node order)."""
        return self.nodes[_owner(self.slot_of(key), len(self.nodes))]

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Until every running node says cluster_state:ok and knows every node."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(_cluster_ok(n, len(self.nodes)) for n in self.nodes if n.process):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not become ok in time: " + "; ".join(
                    f"{n.address}: {_cluster_info(n) or 'unreachable'}" for n in self.nodes))
            time.sleep(0.05)


def _owner(slot: int, masters: int) -> int:
    return min(masters - 1, slot * masters // SLOTS)


def _ranges(masters: int) -> list[tuple[int, int]]:
    bounds = [-(-i * SLOTS // masters) for i in range(masters + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(masters)]


def _cluster_info(node: RedisServer) -> dict[str, str]:
    """CLUSTER INFO as a dict ({} when the node does not answer)."""
    import redis

    try:
        client = node.client(socket_timeout=1, socket_connect_timeout=1)
        try:
            info = client.execute_command("CLUSTER INFO")
        finally:
            client.close()
    except redis.RedisError:
        return {}
    if isinstance(info, dict):
        return {str(k): str(v) for k, v in info.items()}
    text = info.decode() if isinstance(info, bytes) else str(info)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _cluster_ok(node: RedisServer, masters: int) -> bool:
    info = _cluster_info(node)
    return (info.get("cluster_state") == "ok"
            and info.get("cluster_known_nodes") == str(masters)
            and info.get("cluster_slots_ok") == str(SLOTS))


@contextlib.contextmanager
def cluster(masters: int = 3, *, password: str | None = None, tls: TlsFiles | None = None,
            folder: str | Path | None = None) -> Iterator[Cluster]:
    """A running cluster of `masters` masters (no replicas), slots split
    evenly in node order, `cluster-require-full-coverage no` (a dead master
    costs only its slots); every node stopped by pid on exit."""
    with _folder(folder) as where:
        nodes = [RedisServer(where / f"node{i}", password=password, cluster=True, tls=tls)
                 for i in range(masters)]
        try:
            for node in nodes:
                node.start()
            for node, (low, high) in zip(nodes, _ranges(masters), strict=True):
                client = node.client()
                try:
                    client.execute_command("CLUSTER ADDSLOTSRANGE", low, high)
                finally:
                    client.close()
            first = nodes[0].client()
            try:
                for node in nodes[1:]:
                    first.execute_command("CLUSTER MEET", HOST, node.port)
            finally:
                first.close()
            group = Cluster(nodes)
            group.wait_ok()
            yield group
        finally:
            for node in nodes:
                node.stop()
