"""The daemon image and ec_client in real containers (`make docker-test`).

Every container runs with --network none; clients reach the daemon through
a socket volume and its region through a shared /dev/shm, in one of the two
ways a deployment can share it:

- the daemon's IPC namespace (`--ipc shareable`, clients `--ipc
  container:DAEMON`): each client joins the /dev/shm tmpfs Docker mounted
  for the daemon container as it was when the client started. A restarted
  daemon container gets a new, empty tmpfs, which running clients never see,
  and finds no region there to adopt
  (test_ipc_namespace_clients_started_before_a_restart_cannot_load).
- a tmpfs volume mounted at /dev/shm in every container (deploy/compose.yaml):
  the tmpfs lives as long as any running container uses it, so the region a
  stopped or killed daemon left stays there, the restarted daemon adopts it
  (a warm restart: same file, generation, entries and ids) and clients keep
  working and hitting across daemon restarts. Docker unmounts the volume's
  tmpfs, discarding the region, when no running container uses it.

Clients (tests/docker/container_client.py in the client image) run as the
daemon's uid unless a test says otherwise.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.docker import harness
from tests.docker.harness import (
    DAEMON_IMAGE,
    DAEMON_UID,
    SHM_SIZE,
    SOCKET_DIR,
    Resources,
    docker,
)

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


def volume_daemon(res: Resources, **kwargs: Any) -> tuple[str, str, list[str]]:
    """A daemon container whose /dev/shm is a tmpfs volume that clients
    mount too, healthy. Returns (daemon, socket volume, the clients' flags)."""
    socket_volume = res.volume("socket")
    shm = res.volume("shm", "--driver", "local", "--opt", "type=tmpfs", "--opt", "device=tmpfs",
                     "--opt", f"o=size={SHM_SIZE},mode=1777")
    shared = ["--volume", f"{shm}:/dev/shm:nocopy"]
    daemon = harness.run_daemon(res, socket_volume=socket_volume, ipc=shared, **kwargs)
    harness.wait_healthy(daemon)
    return daemon, socket_volume, shared


def generation_of(region: str) -> int:
    """The generation in a region file's name (ec-daemon-GENERATION.region)."""
    return int(region.removeprefix("ec-daemon-").removesuffix(".region"), 16)


def socket_files(socket_volume: str) -> list[str]:
    """What the socket volume holds, seen from a one-off container."""
    return docker("run", "--rm", *harness.network_args(), "--volume",
                  f"{socket_volume}:{SOCKET_DIR}", "--entrypoint", "ls", harness.CLIENT_IMAGE,
                  "-A", SOCKET_DIR).stdout.split()


def stop(daemon: str) -> str:
    """`docker stop` (SIGTERM, then SIGKILL after 30 s): the daemon exits 0,
    on SIGTERM, with no traceback. Returns its log."""
    started = time.monotonic()
    docker("stop", "--time", "30", daemon, timeout=90)
    stopped = harness.wait_exited(daemon)
    assert stopped["ExitCode"] == 0 and not stopped["OOMKilled"], stopped
    assert time.monotonic() - started < 25, "the daemon did not stop on SIGTERM"
    logs = docker("logs", daemon)
    assert "Traceback" not in logs.stderr + logs.stdout, logs.stderr
    return logs.stdout + logs.stderr


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
    # docs/security.md: the socket and the region are owner-only, the
    # socket's folder too.
    (region,) = harness.regions(daemon)
    assert harness.stat(daemon, f"/dev/shm/{region}") == (
        "600", DAEMON_UID, DAEMON_UID, "regular file")
    # The region's index (kept beside it for a warm restart) is the daemon's alone.
    index, _ = harness.region_files(generation_of(region))
    assert harness.daemon_files(daemon) == [index, region]
    assert harness.stat(daemon, f"/dev/shm/{index}") == (
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
    """With the tmpfs volume (deploy/compose.yaml), which the running client's
    container keeps mounted as a vLLM container does, the restarted daemon
    adopts the region the previous one left (`docker stop` keeps it; `docker
    kill` cannot remove it): the same file and generation, the same entries
    under the same ids. The client re-attaches by itself and hits at once:
    a producer container's entries and its own load bit-exact in it and in
    new consumer containers, with no save in between. Nothing stale: the
    same keys saved again with other bytes are refused as cached already and
    still load as the first bytes."""
    daemon, socket_volume, shared = volume_daemon(res)
    keys: list[dict[str, Any]] = [{"prefix": "img", "count": COUNT},
                                  {"prefix": "own", "count": COUNT}]
    with harness.long_client(res, socket_volume=socket_volume, shared=shared) as engine:
        ready = engine.result()
        assert ready["ready"] and ready["scheduler_generation"] == ready["worker_generation"]
        generation = ready["scheduler_generation"]
        first = produce(res, "img", 1, socket_volume, shared)
        assert_loaded(engine.call("load", **keys[0]), first["digests"])
        own = engine.call("save", prefix="own", seed=7, count=COUNT)
        assert own["flushed"] and own["stats"].get("saves_done") == COUNT, own
        # (A load steps until its view has every entry: then the lookups see all.)
        assert_loaded(engine.call("load", **keys[1]), own["digests"])
        before = [engine.call("lookup", **k) for k in keys]
        assert all(b["hits"] == [True] * COUNT for b in before), before
        sessions = [before[0]["scheduler_session"], before[0]["worker_session"]]
        assert harness.daemon_files(daemon) == harness.region_files(generation)
        used = stats(daemon)["used_bytes"]

        restart(daemon, how)

        # The new daemon's first word on the cache: it adopted every entry.
        first_start, second_start = harness.start_lines(daemon)
        assert "starting with an empty cache: no region of a previous daemon" in first_start
        assert (f"adopted region /dev/shm/ec-daemon-{generation:016x}.region (generation "
                f"{generation:016x}): {2 * COUNT} entries (") in second_start, second_start
        assert "quarantined" not in second_start and "not adopted" not in second_start
        if how == "restart":  # SIGTERM: the stopping daemon said it kept the region
            assert (f"region /dev/shm/ec-daemon-{generation:016x}.region kept for the next "
                    "start") in docker("logs", daemon).stderr
        state = engine.call("reattached", sessions=sessions, timeout=60)
        assert state["scheduler_generation"] == state["worker_generation"] == generation, state
        assert not {state["scheduler_session"], state["worker_session"]} & {None, *sessions}
        assert state["synced"] and state["fresh"] and state["entries"] == 2 * COUNT, state
        # Exactly one region, the same file (and its index).
        assert harness.daemon_files(daemon) == harness.region_files(generation)
        adopted = stats(daemon)
        assert adopted["entries"] == 2 * COUNT and adopted["used_bytes"] == used, adopted
        # Hits at once, under the same entry ids, and bit-exact loads.
        after = [engine.call("lookup", **k) for k in keys]
        assert [a["hits"] for a in after] == [[True] * COUNT] * 2, after
        assert [a["entry_ids"] for a in after] == [b["entry_ids"] for b in before]
        for k, saved in zip(keys, (first, own), strict=True):
            assert_loaded(engine.call("load", **k), saved["digests"])
            consumed = harness.run_client(res, "consumer", ["consume", k["prefix"], str(COUNT)],
                                          socket_volume=socket_volume, shared=shared)
            assert_loaded(consumed, saved["digests"])
            assert consumed["generation"] == generation
        assert stats(daemon)["saves"] == 0  # nothing was saved again to get those hits
        # Nothing stale: the same keys with other bytes are cached already...
        again = harness.run_client(res, "producer", ["produce", "img", "2", str(COUNT)],
                                   socket_volume=socket_volume, shared=shared)
        assert again["flushed"] and again["stats"] == {"saves_already_cached": COUNT}, again
        assert {d[0] for d in again["digests"].values()}.isdisjoint(
            d[0] for d in first["digests"].values())
        again = engine.call("save", prefix="own", seed=8, count=COUNT)
        assert again["flushed"] and again["stats"] == {"saves_already_cached": COUNT}, again
        # ...and load as the bytes saved before the restart.
        for k, saved in zip(keys, (first, own), strict=True):
            assert_loaded(engine.call("load", **k), saved["digests"])
        final = stats(daemon)
        assert final["saves"] == 0 and final["entries"] == 2 * COUNT, final
        worker = engine.call("state")["worker_stats"]
        assert worker.get("loads_failed", 0) == 0 == worker.get("loads_stamp_mismatch", 0)
    assert harness.daemon_files(daemon) == harness.region_files(generation)


def test_ipc_namespace_clients_started_before_a_restart_cannot_load(res: Resources) -> None:
    """Docker gives a restarted container a new, empty /dev/shm: the region
    the stopped daemon kept stays in the old one, which only the clients that
    joined the old IPC namespace still see (it is freed with the last of
    them), so the new daemon has nothing to adopt and starts with an empty
    cache in a new region. A client that joined the old namespace never maps
    the new region: its worker stays detached, naming the missing file, and
    nothing wrong is read, while clients started after the restart work.
    (Hence the tmpfs volume in deploy/compose.yaml rather than a shared IPC
    namespace.)"""
    daemon, socket_volume, shared = ipc_daemon(res)
    with harness.long_client(res, socket_volume=socket_volume, shared=shared) as engine:
        old = engine.result()["scheduler_generation"]
        restart(daemon, "restart")
        assert "starting with an empty cache: no region of a previous daemon" in \
            harness.start_lines(daemon)[-1]
        # The kept region is in the old /dev/shm only, which this client still has.
        assert harness.daemon_files(engine.name) == harness.region_files(old)
        (region,) = harness.regions(daemon)
        assert generation_of(region) != old
        produced = produce(res, "img", 3, socket_volume, shared)  # a new client: works
        assert produced["generation"] == generation_of(region)
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


def test_stop_exits_zero_keeps_region_and_index_and_removes_socket(res: Resources) -> None:
    """`docker stop` drains the daemon (SIGTERM): it exits 0 in time, removes
    its socket and keeps its region and the region's index in the tmpfs
    volume for the next start, which adopts them: same generation, the
    entries load bit-exact. The volume keeps them while a running container
    uses it: here a watcher, in deploy/compose.yaml the vLLM container."""
    daemon, socket_volume, shared = volume_daemon(res)
    watcher = harness.run_watcher(res, shared)
    (region,) = harness.regions(watcher)
    generation = generation_of(region)
    produced = produce(res, "img", 4, socket_volume, shared)
    logs = stop(daemon)
    assert f"stopped; region /dev/shm/{region} kept for the next start" in logs
    assert harness.daemon_files(watcher) == harness.region_files(generation)
    for name in harness.region_files(generation):  # still the daemon's alone
        assert harness.stat(watcher, f"/dev/shm/{name}")[:3] == ("600", DAEMON_UID, DAEMON_UID)
    assert socket_files(socket_volume) == []
    docker("start", daemon)
    harness.wait_healthy(daemon)
    assert (f"adopted region /dev/shm/{region} (generation {generation:016x}): {COUNT} "
            "entries (") in harness.start_lines(daemon)[-1]
    consumed = harness.run_client(res, "consumer", ["consume", "img", str(COUNT)],
                                  socket_volume=socket_volume, shared=shared)
    assert_loaded(consumed, produced["digests"])
    assert consumed["generation"] == generation
    assert harness.daemon_files(watcher) == harness.region_files(generation)


def test_stop_with_on_exit_remove_removes_region_index_and_socket(res: Resources) -> None:
    """A daemon container started with EC_DAEMON_ON_EXIT=remove frees its
    region at `docker stop`: region, index and socket are gone, though a
    running container still mounts the tmpfs volume."""
    daemon, socket_volume, shared = volume_daemon(res, env={"EC_DAEMON_ON_EXIT": "remove"})
    watcher = harness.run_watcher(res, shared)
    (region,) = harness.regions(watcher)
    assert harness.daemon_files(watcher) == harness.region_files(generation_of(region))
    produce(res, "img", 5, socket_volume, shared)
    logs = stop(daemon)
    assert f"stopped; region /dev/shm/{region} removed" in logs
    assert harness.daemon_files(watcher) == []
    assert socket_files(socket_volume) == []


def test_clean_and_an_unused_volume_free_a_stopped_daemons_region(res: Resources) -> None:
    """What else frees the region a stopped daemon kept: `ec-daemon clean`,
    run in a one-off container of the daemon image on the same volumes,
    removes it and its index; and Docker itself unmounts a tmpfs volume that
    no running container uses, so a daemon alone on the volume restarts with
    an empty cache (in deploy/compose.yaml the vLLM container keeps it)."""
    daemon, socket_volume, shared = volume_daemon(res)
    watcher = harness.run_watcher(res, shared)
    (region,) = harness.regions(watcher)
    produce(res, "img", 6, socket_volume, shared)
    stop(daemon)
    assert harness.daemon_files(watcher) == harness.region_files(generation_of(region))
    cleaned = harness.run_once(DAEMON_IMAGE, ["clean"],
                               volumes=[shared[1], f"{socket_volume}:{SOCKET_DIR}"]).stdout
    assert cleaned.splitlines() == [f"removed /dev/shm/{region}"], cleaned
    assert harness.daemon_files(watcher) == []

    docker("rm", "--force", watcher)  # now nothing keeps the volume mounted...
    docker("start", daemon)
    harness.wait_healthy(daemon)
    produce(res, "img", 7, socket_volume, shared)
    restart(daemon, "restart")  # ...while the daemon restarts: its tmpfs is a new one
    assert "starting with an empty cache: no region of a previous daemon" in \
        harness.start_lines(daemon)[-1]
    assert len(harness.regions(daemon)) == 1
    assert stats(daemon)["entries"] == 0


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
