"""Real mooncake_master processes for tests, on 127.0.0.1 free ports: the
master's RPC port, its built-in HTTP metadata server and its metrics port.
Killing and restarting a master on the same ports; a raw Mooncake Store
client for writing and reading the store directly. Every master is stopped by
its pid when its context manager exits, and every wait is bounded by time.

Standard library only (mooncake.store is imported by raw_client alone): the
vLLM suites import this from their own virtual environment.

mooncake_master comes with the `mooncake-transfer-engine-non-cuda` wheel (a
console script that execs the binary, so the pid is the master's); its
mooncake.store needs Debian's libibverbs1 to import.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
# Mooncake's transfer engine advertises the host's first interface as its data
# address unless told otherwise: tests keep every byte on loopback (daemons
# started by tests inherit this; a daemon sets it from local_hostname itself).
os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
GLOBAL_SEGMENT_BYTES = 64 << 20
LOCAL_BUFFER_BYTES = 16 << 20


def find_master() -> str | None:
    """The mooncake_master executable: $MOONCAKE_MASTER, else the one beside
    this Python (a venv's console script), else the one on PATH."""
    env = os.environ.get("MOONCAKE_MASTER")
    if env:
        return env if os.access(env, os.X_OK) else None
    beside = Path(sys.executable).parent / "mooncake_master"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mooncake_master")


MOONCAKE_MASTER = find_master()


def available() -> bool:
    """Whether mooncake_master is installed (tests skip without it)."""
    return MOONCAKE_MASTER is not None


@functools.lru_cache(maxsize=1)
def skip_reason() -> str | None:
    """Why Mooncake tests cannot run here, or None: mooncake_master missing,
    or mooncake.store not importable (checked in a child Python, so this
    process does not load the library and its threads just to ask)."""
    if MOONCAKE_MASTER is None:
        return ("mooncake_master is not installed (pip install "
                "mooncake-transfer-engine-non-cuda, or set MOONCAKE_MASTER)")
    try:
        done = subprocess.run([sys.executable, "-c", "import mooncake.store"],
                              capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "import mooncake.store took over 60 s"
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    last = lines[-1] if lines else f"exit status {done.returncode}"
    hint = " (apt-get install libibverbs1)" if "libibverbs" in last else ""
    return f"mooncake.store does not import: {last}{hint}"


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


class MooncakeMaster:
    """One mooncake_master on 127.0.0.1: RPC on rpc_port, the HTTP metadata
    server (clients' transfer-engine metadata) on metadata_port, metrics and
    admin on metrics_port. Its log (stdout and stderr, glog to stderr) is
    appended to folder/master.log across restarts; it runs in `folder`."""

    def __init__(self, folder: str | Path, *, rpc_port: int | None = None,
                 metadata_port: int | None = None, metrics_port: int | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        if MOONCAKE_MASTER is None:
            raise RuntimeError("mooncake_master is not installed")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._chosen = rpc_port is None and metadata_port is None and metrics_port is None
        self.rpc_port = rpc_port or free_port()
        self.metadata_port = metadata_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.folder / "master.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def rpc_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{HOST}:{self.metadata_port}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/metrics"

    @property
    def url(self) -> str:
        """The daemon's --remote URL for this master."""
        return self.url_with()

    def url_with(self, **params: object) -> str:
        """`url` with further query parameters (e.g. a backend option)."""
        query = [("metadata", self.metadata_url)] + [(k, str(v)) for k, v in params.items()]
        return f"mooncake://{self.rpc_address}?" + urllib.parse.urlencode(
            query, safe=":/", quote_via=urllib.parse.quote)

    def _argv(self) -> list[str]:
        assert MOONCAKE_MASTER is not None
        return [MOONCAKE_MASTER,
                f"--rpc_address={HOST}", f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={HOST}",
                f"--http_metadata_server_port={self.metadata_port}",
                f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}",
                "--logtostderr=true", *self.extra]

    def start(self, timeout_s: float = 20.0) -> None:
        """Start and wait until the RPC port accepts and the metadata server
        answers HTTP. mooncake_master exits (status 1, often with no message)
        when a port is taken: then it is retried for a while, on the same
        ports (a restart needs them) or, when this object chose the ports and
        never ran, on fresh ones."""
        deadline = time.monotonic() + timeout_s
        while True:
            with open(self.log_path, "ab") as log:
                log.write(f"== {' '.join(self._argv())}\n".encode())
                log.flush()
                self.process = subprocess.Popen(self._argv(), stdout=log,
                                                stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, cwd=self.folder)
            if self._wait_ready(deadline):
                self._chosen = False  # from now on, these ports are the master's
                return
            status = self.process.poll()
            self.kill()
            taken = [p for p in (self.rpc_port, self.metadata_port, self.metrics_port)
                     if not _free(p)]
            if status is not None and taken and time.monotonic() < deadline:
                if self._chosen:
                    self.rpc_port, self.metadata_port, self.metrics_port = (
                        free_port(), free_port(), free_port())
                time.sleep(0.2)
                continue
            why = (f"exited with status {status}" if status is not None
                   else f"was not ready in {timeout_s:g} s")
            busy = f"; ports in use: {taken}" if taken else ""
            raise RuntimeError(f"mooncake_master (rpc {self.rpc_port}, metadata "
                               f"{self.metadata_port}, metrics {self.metrics_port}) "
                               f"{why}{busy}; log {self.log_path}:\n{self.log_tail()}")

    def _wait_ready(self, deadline: float) -> bool:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            if self._rpc_accepts() and self._metadata_answers():
                return True
            time.sleep(0.02)
        return False

    def _rpc_accepts(self) -> bool:
        try:
            with socket.create_connection((HOST, self.rpc_port), timeout=1):
                return True
        except OSError:
            return False

    def _metadata_answers(self) -> bool:
        """Any HTTP answer counts (a GET without a key is a 400)."""
        conn = http.client.HTTPConnection(HOST, self.metadata_port, timeout=1)
        try:
            conn.request("GET", "/metadata?key=ecd-ready-probe")
            conn.getresponse().read()
            return True
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        # glog's periodic metrics lines are a few KiB each: cut every line.
        return "\n".join(line[:400] for line in text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL, as a crash; waits for the process to be gone."""
        self._signal(signal.SIGKILL)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (it exits in about a second), then SIGKILL after timeout_s."""
        self._signal(signal.SIGTERM, timeout_s)

    def _signal(self, sig: int, timeout_s: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def restart(self, timeout_s: float = 20.0) -> None:
        """Start again on the same ports (after kill or stop; a running
        master is killed first). Its objects are gone: a master keeps them
        in memory only."""
        self.kill()
        self._chosen = False
        self.start(timeout_s)


@contextlib.contextmanager
def _folder(folder: str | Path | None) -> Iterator[Path]:
    if folder is not None:
        yield Path(folder)
        return
    with tempfile.TemporaryDirectory(prefix="ecd-mooncake-") as tmp:
        yield Path(tmp)


@contextlib.contextmanager
def master(*, extra: tuple[str, ...] = (), folder: str | Path | None = None,
           timeout_s: float = 20.0) -> Iterator[MooncakeMaster]:
    """A running mooncake_master; stopped (by pid) on exit. `extra`: more
    flags, e.g. ("--default_kv_lease_ttl=500",) (milliseconds)."""
    with _folder(folder) as where:
        server = MooncakeMaster(where, extra=extra)
        try:
            server.start(timeout_s)
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def raw_client(server: MooncakeMaster, *, global_segment_bytes: int = GLOBAL_SEGMENT_BYTES,
               local_buffer_bytes: int = LOCAL_BUFFER_BYTES,
               protocol: str = "tcp") -> Iterator[Any]:
    """A set-up mooncake.store.MooncakeDistributedStore on `server` (it
    mounts a global segment of global_segment_bytes: the store's memory),
    closed on exit. close() takes about 2 s (7 s when the master is gone)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    status = store.setup(HOST, server.metadata_url, global_segment_bytes, local_buffer_bytes,
                         protocol, "", server.rpc_address)
    if status != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup on {server.rpc_address} returned "
                           f"{status}; master log:\n{server.log_tail()}")
    try:
        yield store
    finally:
        store.close()
