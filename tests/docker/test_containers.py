"""The daemon image and ec_client in real containers (`make docker-test`).

Every container runs with --network none; clients reach the daemon through
a socket volume and its region through a shared /dev/shm, in one of the two
ways a deployment can share it:

- the daemon's IPC namespace (`--ipc shareable`, clients `--ipc
  container:DAEMON`): each client joins the /dev/shm tmpfs Docker mounted
  for the daemon container as it was when the client started. A restarted
  daemon container gets a new tmpfs, which running clients never see
  (test_ipc_namespace_clients_started_before_a_restart_cannot_load).
- a tmpfs volume mounted at /dev/shm in every container (deploy/compose.yaml):
  the tmpfs lives as long as any container uses it, so clients keep working
  across daemon restarts.

Clients (tests/docker/container_client.py in the client image) run as the
daemon's uid unless a test says otherwise.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.docker import harness
from tests.docker.harness import DAEMON_UID, SHM_SIZE, SOCKET_DIR, Resources, docker

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]

COUNT = 8  # arrays per save: every shape of the client once


def ipc_daemon(res: Resources, **kwargs: Any) -> tuple[str, str, list[str]]:
    """A daemon container owning a shareable IPC namespace (its /dev/shm
    sized by --shm-size), healthy. Returns (daemon, socket volume, the
    clients' sharing flags)."""
    socket_volume = res.volume("socket")
    daemon = harness.run_daemon(res, socket_volume=socket_volume,
                                ipc=["--ipc", "shareable", "--shm-size", SHM_SIZE], **kwargs)
    harness.wait_healthy(daemon)
    return daemon, socket_volume, ["--ipc", f"container:{daemon}"]


def volume_daemon(res: Resources) -> tuple[str, str, list[str]]:
    """A daemon container whose /dev/shm is a tmpfs volume that clients
    mount too, healthy. Returns (daemon, socket volume, the clients' flags)."""
    socket_volume = res.volume("socket")
    shm = res.volume("shm", "--driver", "local", "--opt", "type=tmpfs", "--opt", "device=tmpfs",
                     "--opt", f"o=size={SHM_SIZE},mode=1777")
    shared = ["--volume", f"{shm}:/dev/shm"]
    daemon = harness.run_daemon(res, socket_volume=socket_volume, ipc=shared)
    harness.wait_healthy(daemon)
    return daemon, socket_volume, shared


def stats(daemon: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(docker("exec", daemon, "ec-daemon", "stats",
                                            "--json").stdout)
    return out


def produce(res: Resources, prefix: str, seed: int, socket_volume: str,
            shared: list[str]) -> dict[str, Any]:
    """A producer container saves COUNT arrays; asserts every save landed."""
    out = harness.run_client(res, "producer", ["produce", prefix, str(seed), str(COUNT)],
                             socket_volume=socket_volume, shared=shared)
    assert out["flushed"] and out["stats"].get("saves_done") == COUNT, out
    return out


def assert_loaded(out: dict[str, Any], expected: dict[str, Any]) -> None:
    assert not out["failed"] and not out["missing"], out
    assert out["loaded"] == expected  # sha256, dtype and shape of every entry


def restart(daemon: str, how: str) -> None:
    if how == "restart":
        docker("restart", "--time", "30", daemon, timeout=90)
    else:
        docker("kill", "--signal", "KILL", daemon)
        assert harness.wait_exited(daemon)["ExitCode"] == 137
        docker("start", daemon)
    harness.wait_healthy(daemon)


# ----------------------------------------------------------------- tests


def test_daemon_container_is_healthy_non_root_and_owner_only(res: Resources) -> None:
    daemon, socket_volume, shared = ipc_daemon(res)  # healthy per its HEALTHCHECK
    health = harness.state(daemon)["Health"]
    assert health["Status"] == "healthy" and health["Log"][-1]["ExitCode"] == 0
    # The daemon process (pid 1) runs as the image's user, not root.
    uids = harness.shell(daemon, "grep '^Uid:' /proc/1/status").split()[1:]
    assert uids and all(int(u) == DAEMON_UID for u in uids), uids
    # Slim: the daemon only.
    probe = harness.shell(daemon, "python3 -c 'import ec_daemon, ec_protocol' && "
                                  "! python3 -c 'import torch' 2>/dev/null && "
                                  "! python3 -c 'import ec_client' 2>/dev/null && echo slim")
    assert probe.strip() == "slim"
    # README, Security: the socket and the region are owner-only, the
    # socket's folder too.
    (region,) = harness.regions(daemon)
    assert harness.stat(daemon, f"/dev/shm/{region}") == (
        "600", DAEMON_UID, DAEMON_UID, "regular file")
    assert harness.stat(daemon, f"{SOCKET_DIR}/ec.sock") == ("600", DAEMON_UID, DAEMON_UID,
                                                            "socket")
    assert harness.stat(daemon, SOCKET_DIR)[:2] == ("700", DAEMON_UID)
    # Another uid, without the daemon's group, is refused with the reason.
    stranger = harness.run_client(res, "stranger", ["attach"], socket_volume=socket_volume,
                                  shared=shared, user="2000:2000")
    assert not stranger["attached"], stranger
    assert "Permission denied" in stranger["error"], stranger
    # The daemon's own user is served.
    member = harness.run_client(res, "same-uid", ["attach"], socket_volume=socket_volume,
                                shared=shared)
    assert member["attached"] and not member["error"], member


def test_producer_and_consumer_containers_share_the_cache(res: Resources) -> None:
    daemon, socket_volume, shared = ipc_daemon(res)
    produced = produce(res, "img", 1, socket_volume, shared)
    consumed = harness.run_client(res, "consumer", ["consume", "img", str(COUNT)],
                                  socket_volume=socket_volume, shared=shared)
    assert_loaded(consumed, produced["digests"])
    assert consumed["generation"] == produced["generation"]
    after = stats(daemon)
    assert after["entries"] == COUNT and after["loads"] >= COUNT and after["hits"] >= COUNT


@pytest.mark.parametrize("how", ["restart", "kill-start"])
def test_a_running_client_reattaches_across_daemon_restarts(res: Resources, how: str) -> None:
    daemon, socket_volume, shared = volume_daemon(res)
    with harness.long_client(res, socket_volume=socket_volume, shared=shared) as engine:
        ready = engine.result()
        assert ready["ready"] and ready["scheduler_generation"] == ready["worker_generation"]
        old = ready["scheduler_generation"]
        first = produce(res, "img", 1, socket_volume, shared)
        assert_loaded(engine.call("load", prefix="img", count=COUNT), first["digests"])
        saved = engine.call("save", prefix="own", seed=7, count=COUNT)
        assert saved["stats"].get("saves_done") == COUNT, saved

        restart(daemon, how)

        state = engine.call("reattached", old=old, timeout=60)
        new = state["scheduler_generation"]
        assert new not in (None, old) and state["worker_generation"] == new, state
        assert state["synced"] and state["fresh"], state
        # Exactly one region: the new daemon's (a killed one's was removed).
        assert harness.regions(daemon) == [f"ec-daemon-{new:016x}.region"]
        # Nothing stale: the old entries are gone from the view...
        lookup = engine.call("lookup", prefix="img", count=COUNT)
        assert lookup["hits"] == [False] * COUNT and lookup["entries"] == 0, lookup
        # ...and the same keys saved again with other bytes load as the new bytes.
        second = produce(res, "img", 2, socket_volume, shared)
        assert second["generation"] == new
        assert {d[0] for d in second["digests"].values()}.isdisjoint(
            d[0] for d in first["digests"].values())
        assert_loaded(engine.call("load", prefix="img", count=COUNT), second["digests"])
        # The running client's worker saves again, for a fresh consumer.
        saved = engine.call("save", prefix="own", seed=8, count=COUNT)
        assert saved["stats"].get("saves_done") == COUNT, saved
        consumed = harness.run_client(res, "consumer", ["consume", "own", str(COUNT)],
                                      socket_volume=socket_volume, shared=shared)
        assert_loaded(consumed, saved["digests"])
        assert engine.call("state")["worker_stats"].get("loads_failed", 0) == 0
    assert harness.regions(daemon) == [f"ec-daemon-{new:016x}.region"]


def test_ipc_namespace_clients_started_before_a_restart_cannot_load(res: Resources) -> None:
    """Docker gives a restarted container a new /dev/shm; a client that
    joined the old IPC namespace keeps the old one, so it never maps the new
    region: its worker stays detached, naming the missing file, and nothing
    wrong is read, while clients started after the restart work. (Hence the
    tmpfs volume in deploy/compose.yaml rather than a shared IPC namespace.)"""
    daemon, socket_volume, shared = ipc_daemon(res)
    with harness.long_client(res, socket_volume=socket_volume, shared=shared) as engine:
        old = engine.result()["scheduler_generation"]
        restart(daemon, "restart")
        produced = produce(res, "img", 3, socket_volume, shared)  # a new client: works
        state = engine.call("reattached", old=old, timeout=10)
        assert state["worker_generation"] is None, state  # the region is not in its /dev/shm
        assert "No such file or directory" in state["worker_error"], state
        # Its scheduler refuses the new attachment too (the region is not in
        # its /dev/shm), so it answers no hit its worker could not load.
        assert state["scheduler_generation"] is None, state
        out = engine.call("load", prefix="img", count=1, timeout=5)
        assert not out["loaded"], out
        assert all("No such file or directory" in f for f in out["failed"]), out
        consumed = harness.run_client(res, "consumer", ["consume", "img", str(COUNT)],
                                      socket_volume=socket_volume, shared=shared)
        assert_loaded(consumed, produced["digests"])


def test_stop_exits_zero_and_removes_region_and_socket(res: Resources) -> None:
    daemon, socket_volume, shared = ipc_daemon(res)
    # A container in the daemon's IPC namespace keeps its /dev/shm to look at.
    watcher = res.container("watcher")
    docker("run", "--detach", "--name", watcher, *harness.network_args(), *shared,
           "--entrypoint", "sleep", harness.CLIENT_IMAGE, "600")
    assert len(harness.regions(watcher)) == 1
    started = time.monotonic()
    docker("stop", "--time", "30", daemon, timeout=90)
    stopped = harness.wait_exited(daemon)
    assert stopped["ExitCode"] == 0 and not stopped["OOMKilled"], stopped
    assert time.monotonic() - started < 25, "the daemon did not stop on SIGTERM"
    assert harness.regions(watcher) == []
    left = docker("run", "--rm", *harness.network_args(), "--volume",
                  f"{socket_volume}:{SOCKET_DIR}", "--entrypoint", "ls", harness.CLIENT_IMAGE,
                  "-A", SOCKET_DIR).stdout
    assert left.split() == []
    logs = docker("logs", daemon).stderr
    assert "Traceback" not in logs, logs


def test_group_members_are_served_and_other_uids_refused(res: Resources) -> None:
    group = 3000
    # The daemon's user must be in the group to give it the socket and region.
    daemon, socket_volume, shared = ipc_daemon(
        res, env={"EC_DAEMON_SOCKET_MODE": "0660", "EC_DAEMON_GROUP": str(group)},
        extra_run=("--group-add", str(group)))
    (region,) = harness.regions(daemon)
    assert harness.stat(daemon, f"/dev/shm/{region}") == ("660", DAEMON_UID, group,
                                                          "regular file")
    assert harness.stat(daemon, f"{SOCKET_DIR}/ec.sock") == ("660", DAEMON_UID, group,
                                                            "socket")
    assert harness.stat(daemon, SOCKET_DIR) == ("710", DAEMON_UID, group, "directory")
    member = ["--group-add", str(group)]
    produced = harness.run_client(res, "member", ["produce", "grp", "5", str(COUNT)],
                                  socket_volume=socket_volume, shared=[*shared, *member],
                                  user="2000:2000")
    assert produced["stats"].get("saves_done") == COUNT, produced
    consumed = harness.run_client(res, "member", ["consume", "grp", str(COUNT)],
                                  socket_volume=socket_volume, shared=[*shared, *member],
                                  user="2001:2001")
    assert_loaded(consumed, produced["digests"])
    stranger = harness.run_client(res, "stranger", ["attach"], socket_volume=socket_volume,
                                  shared=shared, user="2002:2002")
    assert not stranger["attached"] and "Permission denied" in stranger["error"], stranger
