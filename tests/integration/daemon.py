"""Start the real daemon as a subprocess on a real Unix socket."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ec_daemon.cli import stats_dict
from ec_daemon.region import PREFIX, SUFFIX, clean_stale
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
        return sorted(Path(self.shm_dir).glob(f"{PREFIX}*{SUFFIX}"))

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
        """Stop the daemon; if it was killed, remove what it left, as the
        next daemon's start would (its region and socket)."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        clean_stale(self.shm_dir)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


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
