"""Docker helpers for tests/docker: every call bounded by a timeout, every
container started with --network none, and everything a test creates
(containers, volumes) named uniquely and removed at the end."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

DOCKER = os.environ.get("DOCKER", "docker")
# Set by `make docker-test`, which builds them from this checkout first; a
# plain `make test` does not run these tests against images built earlier.
DAEMON_IMAGE = os.environ.get("EC_DOCKER_DAEMON_IMAGE", "")
CLIENT_IMAGE = os.environ.get("EC_DOCKER_CLIENT_IMAGE", "")
REQUIRED = os.environ.get("EC_DOCKER_REQUIRED", "") not in ("", "0")

DAEMON_UID = 1000  # the daemon image's user (Dockerfile)
SOCKET_DIR = "/run/ec-daemon"
CPU_BYTES = "64MiB"
SHM_SIZE = "256m"
HEALTHY_TIMEOUT = 90.0
RUN_PREFIX = f"ecd-test-{os.getpid()}-"  # every container and volume of this run
CALL_TIMEOUT = 120.0


class DockerError(AssertionError):
    pass


def docker(*args: str, timeout: float = CALL_TIMEOUT, check: bool = True,
           input: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout,
                              input=input)
    except subprocess.TimeoutExpired as exc:
        raise DockerError(f"docker {' '.join(args)} ran past {timeout}s") from exc
    if check and done.returncode != 0:
        raise DockerError(f"docker {' '.join(args)} exited {done.returncode}:\n"
                          f"{done.stdout}\n{done.stderr}")
    return done


def engine_problem() -> str | None:
    """Why no Docker engine can run the tests here, or None."""
    if shutil.which(DOCKER) is None:
        return f"no {DOCKER} command"
    try:
        done = subprocess.run([DOCKER, "version", "--format", "{{.Server.Version}}"],
                              capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "the Docker engine did not answer in 20s"
    if done.returncode != 0:
        return f"no Docker engine reachable: {done.stderr.strip()}"
    if not (DAEMON_IMAGE and CLIENT_IMAGE):
        return ("no images named (EC_DOCKER_DAEMON_IMAGE, EC_DOCKER_CLIENT_IMAGE): "
                "`make docker-test` builds them from this checkout and runs these tests")
    missing = [image for image in (DAEMON_IMAGE, CLIENT_IMAGE)
               if docker("image", "inspect", image, check=False, timeout=20).returncode]
    if missing:
        return f"images {', '.join(missing)} not built (make docker-test builds them)"
    return None


class Resources:
    """Unique names for one test's containers and volumes; `cleanup`
    removes whatever was created (also after a failure)."""

    def __init__(self) -> None:
        self.prefix = f"{RUN_PREFIX}{uuid.uuid4().hex[:8]}"
        self.containers: list[str] = []
        self.volumes: list[str] = []

    def container(self, role: str) -> str:
        name = f"{self.prefix}-{role}-{len(self.containers)}"
        self.containers.append(name)
        return name

    def volume(self, role: str, *options: str) -> str:
        name = f"{self.prefix}-{role}"
        self.volumes.append(name)
        docker("volume", "create", *options, name)
        return name

    def logs(self) -> str:
        out = []
        for name in self.containers:
            done = docker("logs", "--tail", "60", name, check=False, timeout=30)
            if done.returncode == 0:
                out.append(f"--- {name}\n{done.stdout}{done.stderr}")
        return "\n".join(out)

    def cleanup(self) -> None:
        if self.containers:
            docker("rm", "--force", "--volumes", *self.containers, check=False, timeout=120)
        if self.volumes:
            docker("volume", "rm", "--force", *self.volumes, check=False, timeout=60)


# ------------------------------------------------------------- inspection


def state(name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(docker("inspect", "--format", "{{json .State}}",
                                            name).stdout)
    return out


def wait_healthy(name: str, timeout: float = HEALTHY_TIMEOUT) -> float:
    """Poll Docker's health status until `healthy`; the seconds it took.
    Fails at once when the container stops or turns unhealthy."""
    start = time.monotonic()
    while True:
        current = state(name)
        health = (current.get("Health") or {}).get("Status")
        if health == "healthy":
            return time.monotonic() - start
        if not current["Running"] or health == "unhealthy":
            logs = docker("logs", "--tail", "40", name, check=False).stderr
            raise DockerError(f"{name}: running={current['Running']} health={health} "
                              f"exit={current['ExitCode']}\n{logs}")
        if time.monotonic() - start > timeout:
            raise DockerError(f"{name} not healthy after {timeout}s (health {health})")
        time.sleep(0.5)


def wait_exited(name: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (current := state(name))["Running"]:
        if time.monotonic() > deadline:
            raise DockerError(f"{name} still running after {timeout}s")
        time.sleep(0.2)
    return current


def shell(name: str, script: str, *, user: str = "0") -> str:
    """Run `script` with sh in the running container `name`."""
    return docker("exec", "--user", user, name, "sh", "-c", script, timeout=60).stdout


def regions(name: str) -> list[str]:
    """Region files in the /dev/shm that container `name` sees."""
    return [f for f in daemon_files(name) if f.endswith(".region")]


def daemon_files(name: str) -> list[str]:
    """Every file of a daemon in the /dev/shm that container `name` sees:
    regions, their indexes (`ec-daemon-GENERATION.index`, kept beside a
    region for the next start to adopt) and hidden half-made ones."""
    out = shell(name, "ls -1A /dev/shm")
    return sorted(f for f in out.split() if f.lstrip(".").startswith("ec-daemon-"))


def region_files(generation: int) -> list[str]:
    """The names daemon_files lists for one region of `generation`: the
    region and its index."""
    return [f"ec-daemon-{generation:016x}.index", f"ec-daemon-{generation:016x}.region"]


def start_lines(name: str) -> list[str]:
    """The daemon container's log lines that say what each start did with
    the cache, oldest first: "adopted region ..." (a warm restart) or
    "starting with an empty cache: <why>"; one per start of the container."""
    done = docker("logs", name, timeout=30)
    return [line for line in (done.stdout + done.stderr).splitlines()
            if "adopted region " in line or "starting with an empty cache: " in line]


def stat(name: str, path: str) -> tuple[str, int, int, str]:
    """(octal mode, uid, gid, file type) of `path` inside container `name`."""
    mode, uid, gid, kind = shell(name, f"stat -c '%a %u %g %F' {path}").strip().split(" ", 3)
    return mode, int(uid), int(gid), kind


# ------------------------------------------------------------- containers


def network_args() -> list[str]:
    return ["--network", "none"]


def run_daemon(res: Resources, *, socket_volume: str, ipc: list[str],
               extra: tuple[str, ...] = (), extra_run: tuple[str, ...] = (),
               env: dict[str, str] | None = None, name: str | None = None) -> str:
    """Start the daemon image detached (its own ENTRYPOINT, CMD and
    HEALTHCHECK), with the cache size by environment. `extra`: daemon
    arguments (replacing the image's CMD); `extra_run`: `docker run` flags."""
    name = name or res.container("daemon")
    env_args = [f"--env=EC_DAEMON_CPU_BYTES={CPU_BYTES}"]
    env_args += [f"--env={k}={v}" for k, v in (env or {}).items()]
    docker("run", "--detach", "--name", name, *network_args(), *ipc,
           "--volume", f"{socket_volume}:{SOCKET_DIR}", *env_args, *extra_run, DAEMON_IMAGE,
           *extra)
    return name


def run_watcher(res: Resources, shared: list[str]) -> str:
    """A container that only sleeps with the clients' sharing flags: it keeps
    their /dev/shm (the daemon's IPC namespace, or the tmpfs volume: Docker
    unmounts a tmpfs volume, discarding its files, when the last running
    container using it stops) and lets a test look at it."""
    name = res.container("watcher")
    docker("run", "--detach", *network_args(), "--name", name, *shared, "--entrypoint", "sleep",
           CLIENT_IMAGE, "600")
    return name


def run_once(image: str, args: list[str], *,
             volumes: list[str]) -> subprocess.CompletedProcess[str]:
    """A one-off container of `image` (its own ENTRYPOINT; removed when
    done) with `volumes` (docker --volume values); its output."""
    mounts = [arg for volume in volumes for arg in ("--volume", volume)]
    name = f"{RUN_PREFIX}once-{uuid.uuid4().hex[:8]}"
    return docker("run", "--rm", *network_args(), "--name", name, *mounts, image, *args)


def client_args(socket_volume: str, shared: list[str], user: str) -> list[str]:
    return [*network_args(), *shared, "--volume", f"{socket_volume}:{SOCKET_DIR}",
            "--user", user]


def run_client(res: Resources, role: str, args: list[str], *, socket_volume: str,
               shared: list[str], user: str = f"{DAEMON_UID}:{DAEMON_UID}",
               timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
    """Run the client image once (`client.py ARGS`) and return its RESULT."""
    name = res.container(role)
    done = docker("run", "--name", name, *client_args(socket_volume, shared, user),
                  CLIENT_IMAGE, *args, timeout=timeout, check=False)
    return parse_result(name, done.returncode, done.stdout, done.stderr)


def parse_result(name: str, code: int, stdout: str, stderr: str) -> dict[str, Any]:
    results = [line[len("RESULT "):] for line in stdout.splitlines()
               if line.startswith("RESULT ")]
    if code != 0 or not results:
        raise DockerError(f"client {name} exited {code} without a result:\n{stdout}\n"
                          f"{stderr[-4000:]}")
    out: dict[str, Any] = json.loads(results[-1])
    return out


class LongClient:
    """The client image's `serve` mode in a container that outlives daemon
    restarts: one JSON command per line on its stdin, one RESULT back."""

    def __init__(self, res: Resources, *, socket_volume: str, shared: list[str],
                 user: str = f"{DAEMON_UID}:{DAEMON_UID}") -> None:
        self.name = res.container("long-client")
        self.process = subprocess.Popen(
            [DOCKER, "run", "--interactive", "--name", self.name,
             *client_args(socket_volume, shared, user), CLIENT_IMAGE, "serve", self.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr.append(line)

    def result(self, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DockerError(f"{self.name} answered nothing in {timeout}s:\n"
                                  f"{''.join(self.stderr[-60:])}") from None
            if line is None:
                raise DockerError(f"{self.name} ended (exit {self.process.wait(10)}):\n"
                                  f"{''.join(self.stderr[-60:])}")
            if line.startswith("RESULT "):
                out: dict[str, Any] = json.loads(line[len("RESULT "):])
                return out

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send a command; its answer is awaited its own `timeout` field
        (the client's bound on the command) plus CALL_TIMEOUT."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()
        return self.result(fields.get("timeout", 0) + CALL_TIMEOUT)

    def close(self) -> None:
        """Ask the client to detach and end (30 s at most), else kill our
        docker CLI (the container itself goes in Resources.cleanup)."""
        try:
            if self.process.poll() is None and self.process.stdin is not None:
                self.process.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.process.stdin.flush()
                self.result(30)
                self.process.wait(30)
        except (DockerError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(10)


@contextmanager
def long_client(res: Resources, **kwargs: Any) -> Iterator[LongClient]:
    client = LongClient(res, **kwargs)
    try:
        yield client
    finally:
        client.close()
