"""The ec-daemon command line against real daemon processes."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from tests.integration.daemon import Daemon, short_tmpdir

pytestmark = pytest.mark.integration
REQUIRED_STATS = ("capacity_bytes", "used_bytes", "pending_bytes", "hidden_bytes",
                  "quarantined_bytes", "entries", "sessions", "ghost_sessions", "hits", "misses",
                  "evictions", "loads")


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ec_daemon", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_health_is_zero_only_while_serving(daemon):
    ok = cli("health", "--socket", daemon.socket)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    daemon.stop()
    down = cli("health", "--socket", daemon.socket, "--timeout", "1")
    assert down.returncode == 1
    assert down.stderr.startswith("ec-daemon: error:") and "not reachable" in down.stderr


def test_stats_json_and_table(daemon):
    result = cli("stats", "--socket", daemon.socket, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for name in REQUIRED_STATS:
        assert isinstance(data[name], int), name
    assert data["capacity_bytes"] == 64 << 20 and data["used_bytes"] == 0
    table = cli("stats", "--socket", daemon.socket)
    assert table.returncode == 0 and "capacity   64 MiB" in table.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--cpu-bytes", "12XB"], "--cpu-bytes: invalid size '12XB'"),
    (["--cpu-bytes", "0"], "must be greater than zero"),
    (["--page-bytes", "1MiB", "--cpu-bytes", "64KiB"], "smaller than one page"),
    (["--cpu-bytes", "64TiB"], "does not fit in"),
    (["--socket", "nonsense"], "invalid socket 'nonsense'"),
    (["--shm-dir", "/nonexistent/dir"], "does not exist"),
])
def test_bad_start_fails_with_one_line(args, message, tmp_path):
    folder = short_tmpdir()
    try:
        base = ["--socket", f"unix://{folder}/ec.sock", "--cpu-bytes", "8MiB"]
        result = cli(*base, *args)
        assert result.returncode == 2
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], result.stderr
        assert not (folder / "ec.sock").exists()
    finally:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


def test_unusable_socket_paths_are_refused(tmp_path):
    not_a_socket = short_tmpdir()
    (not_a_socket / "ec.sock").write_text("precious")
    try:
        result = cli("--cpu-bytes", "8MiB", "--socket", f"unix://{not_a_socket}/ec.sock")
        assert result.returncode == 2 and "is not a socket" in result.stderr
        assert (not_a_socket / "ec.sock").read_text() == "precious"
        long_path = "/tmp/" + "x" * 120 + "/ec.sock"
        result = cli("--cpu-bytes", "8MiB", "--socket", f"unix://{long_path}")
        assert result.returncode == 2 and "too long" in result.stderr
    finally:
        (not_a_socket / "ec.sock").unlink()
        not_a_socket.rmdir()


def test_one_daemon_per_socket(daemon):
    result = cli("--cpu-bytes", "8MiB", "--socket", daemon.socket)
    assert result.returncode == 2 and "another daemon is serving" in result.stderr
    assert daemon.serving()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_cleanly_remove_the_socket_and_keep_the_region(sig, shm_folder):
    d = Daemon(shm_dir=str(shm_folder)).start()
    try:
        (region,) = d.region_files()
        assert d.stop(sig) == 0
        assert not d.socket_path.exists()
        # Kept for the next start on this socket to adopt (a warm restart).
        assert region.exists() and region.with_suffix(".index").exists()
        assert "kept for the next start" in d.log()
    finally:
        d.cleanup()


def test_on_exit_remove_deletes_the_region_and_its_index(shm_folder):
    d = Daemon(shm_dir=str(shm_folder), extra=("--on-exit", "remove")).start()
    try:
        assert len(d.region_files()) == 1
        assert d.stop() == 0
        assert list(shm_folder.iterdir()) == [] and not d.socket_path.exists()
        assert "stopped; region" in d.log() and "removed" in d.log()
    finally:
        d.cleanup()


def test_socket_and_region_are_owner_only(shm_folder):
    d = Daemon(shm_dir=str(shm_folder)).start()
    try:
        (region,) = d.region_files()
        assert stat.S_IMODE(region.stat().st_mode) == 0o600
        assert stat.S_IMODE(d.socket_path.stat().st_mode) == 0o600
        assert region.stat().st_uid == os.getuid()
    finally:
        d.cleanup()


def test_a_killed_daemons_region_is_adopted_and_its_socket_replaced(shm_folder):
    folder = short_tmpdir()
    first = Daemon(shm_dir=str(shm_folder), folder=folder).start()
    (old_region,) = first.region_files()
    first.kill()
    assert old_region.exists() and first.socket_path.exists()  # what SIGKILL leaves
    second = Daemon(shm_dir=str(shm_folder), folder=folder).start()
    try:
        assert second.region_files() == [old_region]  # the same file, the same generation
        assert "adopted region" in second.log() and "removed stale socket" in second.log()
        assert second.stats()["generation"] == int(old_region.name[10:26], 16)
    finally:
        second.cleanup()


def test_fresh_start_replaces_a_killed_daemons_region(shm_folder):
    folder = short_tmpdir()
    first = Daemon(shm_dir=str(shm_folder), folder=folder).start()
    (old_region,) = first.region_files()
    first.kill()
    second = Daemon(shm_dir=str(shm_folder), folder=folder, extra=("--fresh-start",)).start()
    try:
        (new_region,) = second.region_files()
        assert new_region != old_region and not old_region.exists()
        assert not old_region.with_suffix(".index").exists()
        assert "--fresh-start" in second.log()
    finally:
        second.cleanup()


def test_a_live_daemons_region_is_left_alone(shm_folder):
    a = Daemon(shm_dir=str(shm_folder)).start()
    b = Daemon(shm_dir=str(shm_folder)).start()
    try:
        assert len(a.region_files()) == 2
        assert a.serving() and b.serving()
    finally:
        a.cleanup()
        b.cleanup()


def test_systemd_is_notified_when_serving_and_stopping(tmp_path):
    import socket as socketlib

    folder = short_tmpdir()
    notify_path = folder / "notify"
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(30)
    d = Daemon(folder=folder)
    try:
        os.environ["NOTIFY_SOCKET"] = str(notify_path)
        try:
            d.start()
        finally:
            del os.environ["NOTIFY_SOCKET"]
        ready = listener.recv(4096).decode()
        assert ready.startswith("READY=1") and "serving 64 MiB" in ready
        assert d.stop() == 0
        assert listener.recv(4096).decode() == "STOPPING=1"
    finally:
        listener.close()
        d.cleanup()


# Protects: any local user can plant a FIFO under a region's name in a
# mode-1777 /dev/shm; the daemon's scan of dead regions must not block on it.
def test_a_fifo_under_a_region_name_does_not_hang_the_start(shm_folder):
    fifo = shm_folder / "ec-daemon-00000000000000aa.region"
    os.mkfifo(fifo)
    os.mkfifo(shm_folder / "ec-daemon-00000000000000aa.index")
    d = Daemon(shm_dir=str(shm_folder))
    try:
        d.start()  # bounded by the harness: serving within its start timeout
        assert d.serving() and fifo.exists()
    finally:
        d.cleanup()
        fifo.unlink()
        (shm_folder / "ec-daemon-00000000000000aa.index").unlink()
