"""The Dockerfiles, compose file, systemd unit and Makefile's Docker targets
agree with the CLI and with each other (tests/docker runs the images)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from ec_daemon.serving import config

ROOT = Path(__file__).resolve().parents[2]


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    config.add_arguments(parser)
    return parser


def check_serve_args(args: list[str], env: dict[str, str] | None = None) -> None:
    args = [re.sub(r"\$\{(\w+)(:-([^}]*))?\}", lambda m: (env or {}).get(m.group(1))
                   or m.group(3) or "1GiB", a) for a in args]
    config.from_namespace(serve_parser().parse_args(args))


def test_systemd_unit_runs_a_valid_serve_command():
    unit = (ROOT / "deploy" / "ec-daemon.service").read_text()
    env = dict(re.findall(r"^Environment=(\w+)=(.*)$", unit, re.M))
    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit, re.M)
    argv = shlex.split(exec_start)
    assert argv[0].endswith("ec-daemon")
    check_serve_args(argv[1:], env)
    assert "RuntimeDirectory=ec-daemon" in unit and "Type=notify" in unit
    assert env["EC_DAEMON_SOCKET"].startswith("unix:///run/ec-daemon/")


def test_compose_wires_the_daemon_and_vllm_together():
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    daemon, vllm = compose["services"]["ec-daemon"], compose["services"]["vllm"]
    check_serve_args(daemon["command"])
    assert daemon["healthcheck"]["test"][1:3] == ["ec-daemon", "health"]
    assert vllm["depends_on"]["ec-daemon"]["condition"] == "service_healthy"
    socket_volume = "ec-socket:/run/ec-daemon"
    assert socket_volume in daemon["volumes"] and socket_volume in vllm["volumes"]
    # The region's tmpfs is a volume both mount, not the daemon's IPC namespace
    # (a restarted daemon container gets a new /dev/shm that a joined vLLM
    # never sees: tests/docker).
    # nocopy: a container created while the volume is empty must not copy its
    # image's /dev/shm mode (0755 root) onto it: the daemon could not write there.
    shm_volume = {"type": "volume", "source": "ec-shm", "target": "/dev/shm",
                  "volume": {"nocopy": True}}
    assert shm_volume in daemon["volumes"] and shm_volume in vllm["volumes"]
    assert "ipc" not in daemon and "ipc" not in vllm
    options = compose["volumes"]["ec-shm"]["driver_opts"]
    assert options["type"] == "tmpfs" and "mode=1777" in options["o"]
    args = vllm["command"]
    transfer = json.loads(args[args.index("--ec-transfer-config") + 1])
    assert transfer["ec_connector"] == "ECDaemonConnector"
    assert transfer["ec_connector_module_path"] == "ec_client.vllm_connector"
    socket = transfer["ec_connector_extra_config"]["ec_daemon_socket"]
    assert socket in daemon["command"]


def test_dockerfile_is_slim_non_root_and_health_checked():
    text = (ROOT / "Dockerfile").read_text()
    assert "torch" not in text.lower().replace("no torch", "")
    assert not re.search(r"^COPY ec_client", text, re.M)  # the daemon only
    assert re.search(r"^USER (?!root)\w+", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*ec-daemon\", \"health", text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    check_serve_args(cmd)


def _instructions(text: str) -> list[str]:
    """Dockerfile instructions with continuation lines joined, no comments."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [i.strip() for i in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if i.strip()]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "deploy/Dockerfile.client"])
def test_images_build_offline_from_a_base_argument_and_a_wheelhouse(dockerfile):
    text = (ROOT / dockerfile).read_text()
    steps = _instructions(text)
    # The base is a build argument defaulting to the public image (a plain
    # `docker build` works as before); every stage starts from it.
    assert steps[0] == "ARG BASE=python:3.11-slim"
    assert [s for s in steps if s.startswith("FROM")] \
        and all(s.split()[1] == "${BASE}" for s in steps if s.startswith("FROM"))
    # No `# syntax=` frontend: BuildKit would pull it from a registry.
    assert not re.search(r"^#\s*syntax=", text, re.M)
    # The optional ./wheels folder is copied, and with WHEELHOUSE set pip
    # installs from it only; a venv (Debian's python is externally managed).
    assert any(s.startswith("COPY ") and "wheel[s]" in s for s in steps)
    (install,) = [s for s in steps if s.startswith("RUN") and "pip install" in s]
    assert "--no-index --find-links /wheelhouse" in install and "$WHEELHOUSE" in install
    assert "python3 -m venv" in install
    assert "torch" not in install and "cupy" not in install


def test_dockerignore_keeps_the_context_small_and_the_wheelhouse_in():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".venv-*", ".git"} <= set(ignored)
    assert not any(p.strip("/").startswith("wheels") for p in ignored)
    # The client image copies its script from tests/docker.
    assert "!tests/docker/container_client.py" in ignored
    assert (ROOT / "tests" / "docker" / "container_client.py").is_file()


def test_make_docker_test_requires_docker_and_runs_every_container_offline():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^docker-test:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "EC_DOCKER_REQUIRED=1" in recipe and "tests/docker" in recipe
    # Offline builds have no network at all: the wheelhouse must be complete.
    build_args = re.search(r"^DOCKER_BUILD_ARGS := (.*\n(?:\t.*\n)*)", makefile, re.M).group(1)
    assert "--network none" in build_args and "WHEELHOUSE=1" in build_args
    assert re.search(r"^docker-gpu-test:\n\tbash deploy/docker-gpu-test.sh$", makefile, re.M)
    for name in ("harness.py", "test_containers.py"):  # every `docker run` of the suite
        text = (ROOT / "tests" / "docker" / name).read_text()
        runs = re.findall(r"docker\(\"run\",[^)]*\)|\[DOCKER, \"run\",[^]]*\]", text)
        assert runs and all("network_args()" in r or "client_args(" in r for r in runs), name
    harness = (ROOT / "tests" / "docker" / "harness.py").read_text()
    assert re.search(r"def network_args\(\).*\n.*return \[\"--network\", \"none\"\]", harness)
    assert re.search(r"def client_args\(.*\n.*return \[\*network_args\(\)", harness)


def test_the_mooncake_wheel_is_pinned_alike_for_users_dev_ci_and_vllm():
    tomllib = pytest.importorskip("tomllib")
    (dev,) = re.findall(r"^mooncake-transfer-engine\S*$",
                        (ROOT / "requirements-dev.txt").read_text(), re.M)
    assert "==" in dev
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["mooncake"] == [dev]
    makefile = (ROOT / "Makefile").read_text()
    # install-vllm installs the wheel that requirements-dev.txt pins.
    assert re.search(r"^MOONCAKE_WHEEL := \$\(shell grep -m1 '\^mooncake-transfer-engine' "
                     r"requirements-dev.txt\)$", makefile, re.M)
    recipe = re.search(r"^\$\(VLLM_STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "$(VLLM_BIN)/pip install --quiet $(MOONCAKE_WHEEL)" in recipe
    # mooncake.store needs libibverbs1; CI installs it and requires the tests to run.
    assert re.search(r"^mooncake-deps:\n(\t.*\n)*\t.*apt-get install -y -q libibverbs1", makefile,
                     re.M)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "tier_packages+=(libibverbs1)" in ci and "export EC_MOONCAKE_REQUIRED=1" in ci
