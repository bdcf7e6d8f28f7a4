"""The Dockerfile, compose file and systemd unit use flags the CLI has."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import yaml

from ec_daemon import config

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
    assert vllm["ipc"] == "service:ec-daemon" and daemon["ipc"] == "shareable"
    socket_volume = "ec-socket:/run/ec-daemon"
    assert socket_volume in daemon["volumes"] and socket_volume in vllm["volumes"]
    args = vllm["command"]
    transfer = json.loads(args[args.index("--ec-transfer-config") + 1])
    assert transfer["ec_connector"] == "ECDaemonConnector"
    assert transfer["ec_connector_module_path"] == "ec_client.vllm_connector"
    socket = transfer["ec_connector_extra_config"]["ec_daemon_socket"]
    assert socket in daemon["command"]


def test_dockerfile_is_slim_non_root_and_health_checked():
    text = (ROOT / "Dockerfile").read_text()
    assert "torch" not in text.lower().replace("no torch", "")
    assert re.search(r"^USER (?!root)\w+", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*ec-daemon\", \"health", text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    check_serve_args(cmd)
