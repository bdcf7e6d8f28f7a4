"""Start the real daemon as a subprocess on a real Unix socket.

Cleaning up removes only what this daemon made: its folder (socket, log) and
the regions whose index names its socket (each test's socket is in a folder
of its own). Never every stopped daemon's region: on a host where a real
daemon keeps its region for a warm restart, the tests must not throw it away.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ec_daemon.durable.index import index_path, open_own_file, read_header
from ec_daemon.durable.journal import IndexUnreadable
from ec_daemon.durable.region import PREFIX, SUFFIX
from ec_daemon.serving.cli import stats_dict
from ec_daemon.serving.server import socket_identity
from ec_protocol.protocol import Layout, pb, rpc

START_TIMEOUT = 30.0


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def short_tmpdir() -> Path:
    """Unix socket paths are limited to 107 bytes: keep them short."""
    return Path(tempfile.mkdtemp(prefix="ecd-", dir="/tmp"))


class Daemon:
    def __init__(self, *, cpu_bytes: str = "64MiB", page_bytes: str = "64KiB",
                 extra: tuple[str, ...] = (), folder: Path | None = None,
                 shm_dir: str = "/dev/shm", check_invariants: bool = True) -> None:
        self.folder = folder or short_tmpdir()
        self.socket = f"unix://{self.folder}/ec.sock"
        self.socket_path = self.folder / "ec.sock"
        self.shm_dir = shm_dir
        self.args = [sys.executable, "-m", "ec_daemon", "--cpu-bytes", cpu_bytes,
                     "--page-bytes", page_bytes, "--socket", self.socket, "--shm-dir", shm_dir,
                     "--check-invariants", str(check_invariants).lower(), *extra]
        self.log_path = self.folder / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._channel: grpc.Channel | None = None

    def start(self, wait: bool = True) -> Daemon:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_serving()
        return self

    def wait_serving(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            if self.serving():
                return
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not serve within {timeout}s:\n{self.log()}")

    def serving(self) -> bool:
        try:
            with grpc.insecure_channel(self.socket) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    @property
    def stub(self) -> Any:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.socket)
        return rpc.ECDaemonStub(self._channel)

    def stats(self) -> dict[str, Any]:
        return stats_dict(self.stub.Stats(pb.StatsRequest(), timeout=5))

    def components(self, engine_id: str) -> list[str]:
        """The components ("scheduler", "worker 0/2"...) of `engine_id`'s live sessions."""
        return sorted(s["component"] for s in self.stats()["session_list"]
                      if s["engine_id"] == engine_id)

    def lookup(self, layout: Layout, *hashes: str) -> list[Any]:
        namespace = "|".join((layout.model, layout.dtype, ",".join(
            f"{k}={v}" for k, v in sorted(layout.row_bytes.items())), layout.variant))
        return list(self.stub.Lookup(pb.LookupRequest(namespace=namespace, mm_hashes=hashes),
                                     timeout=5).results)

    def wait_for(self, predicate: Any, timeout: float = 10.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; stats: {self.stats()}")
            time.sleep(0.02)

    def region_files(self) -> list[Path]:
        """Every region file in shm_dir (tests give the daemon a folder of their own)."""
        return sorted(Path(self.shm_dir).glob(f"{PREFIX}*{SUFFIX}"))

    def own_regions(self) -> list[Path]:
        """The region files in shm_dir whose index names this daemon's socket."""
        return regions_of(self.shm_dir, self.socket)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def cleanup(self) -> None:
        """Stop the daemon; remove what it left (its region kept for the
        next start or left by a kill, its socket and folder), by its socket."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        remove_regions_of(self.shm_dir, self.socket)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def regions_of(shm_dir: str | Path, socket: str) -> list[Path]:
    """This user's region files in `shm_dir` whose index names `socket` (as
    the daemon records it). A region without a readable index is nobody's
    that we can tell: it is left alone."""
    identity = socket_identity(socket)
    found = []
    for path in sorted(Path(shm_dir).glob(f"{PREFIX}*{SUFFIX}")):
        try:
            header = read_header(index_path(path))
        except (OSError, IndexUnreadable):
            continue
        if header.socket == identity:
            found.append(path)
    return found


def remove_regions_of(shm_dir: str | Path, socket: str) -> list[Path]:
    """Remove the stopped regions of `socket` (region and index), those no
    live daemon holds locked; returns them."""
    removed = []
    for path in regions_of(shm_dir, socket):
        try:  # its daemon's liveness lock is on the index (a client may lock the region)
            fd = open_own_file(index_path(path))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live daemon holds it
        else:
            for name in (index_path(path), path):
                with contextlib.suppress(FileNotFoundError):
                    name.unlink()
            removed.append(path)
        finally:
            os.close(fd)
    return removed


@dataclass(frozen=True)
class KeptRegion:
    """The files of a region that a stopped daemon kept for its next start."""

    region: Path
    index: Path
    inode: int

    def intact(self) -> bool:
        """Both files still there: the same region, not a new one by its name."""
        try:
            return self.index.is_file() and os.stat(self.region).st_ino == self.inode
        except FileNotFoundError:
            return False

    def __str__(self) -> str:
        return str(self.region)


@contextlib.contextmanager
def kept_region(shm_dir: str = "/dev/shm") -> Iterator[KeptRegion]:
    """A daemon started and stopped (SIGTERM: it keeps its region for the
    next start on its socket), as one outside the tests leaves it; its
    region is removed at the end, by its socket."""
    other = Daemon(cpu_bytes="4MiB", shm_dir=shm_dir).start()
    try:
        assert other.stop() == 0, other.log()
        (region,) = other.own_regions()
        yield KeptRegion(region, index_path(region), os.stat(region).st_ino)
    finally:
        other.cleanup()


@contextlib.contextmanager
def env(**values: str) -> Any:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
