"""The README's quick start, pasted in order: the daemon `make run` starts
and a connector configured as its `vllm serve` block says meet, and so does
one configured as the daemon's start-up log says. (The same with a real
engine: tests/vllm/test_readme_e2e.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from ec_client.common.session import LinkListener, SessionLink
from ec_client.common.settings import ConnectorSettings
from ec_protocol.protocol import Layout
from ec_protocol.transport import Transport
from tests.readme import (
    command,
    quick_start_commands,
    quick_start_daemon,
    transfer_config,
)

pytestmark = pytest.mark.integration
ATTACH_TIMEOUT = 30.0


def settings_of(config: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                env: dict[str, str]) -> ConnectorSettings:
    """The connector's settings from a transfer config, parsed in the
    user's environment (where the default socket comes from)."""
    monkeypatch.delenv("EC_DAEMON_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])
    assert config["ec_connector"] == "ECDaemonConnector"
    return ConnectorSettings.from_extra_config(config.get("ec_connector_extra_config") or {})


def attaches(socket: str) -> bool:
    link = SessionLink(Transport(socket), engine_id="readme", role="both",
                       layout=Layout("m", "float32", {"embeds": 4096}), listener=LinkListener())
    link.start()
    try:
        return link.wait_attached(ATTACH_TIMEOUT) is not None
    finally:
        link.stop()


def test_the_quick_start_has_the_commands_a_user_pastes():
    commands = quick_start_commands()
    assert command(commands, "make", "run") and command(commands, "make", "test")
    assert transfer_config(command(commands, "vllm", "serve"))["ec_connector"] == \
        "ECDaemonConnector"


def test_the_readmes_vllm_command_reaches_the_daemon_make_run_starts(monkeypatch):
    vllm_serve = command(quick_start_commands(), "vllm", "serve")
    with quick_start_daemon() as daemon:
        settings = settings_of(transfer_config(vllm_serve), monkeypatch, daemon.env)
        assert settings.socket == daemon.socket, (
            f"the README's vllm block connects to {settings.socket}, `make run` serves "
            f"{daemon.socket}")
        assert attaches(settings.socket), daemon.log()


def test_the_config_the_daemon_prints_reaches_it(monkeypatch):
    with quick_start_daemon() as daemon:
        printed = daemon.printed_config()
        settings = settings_of(printed, monkeypatch, daemon.env)
        assert settings.socket == daemon.socket
        assert attaches(settings.socket), daemon.log()


def test_a_vllm_block_naming_another_socket_would_be_caught(monkeypatch):
    """The guard itself: a README pointing vLLM at the systemd path while
    `make run` serves the default (the mistake this test exists for) fails."""
    readme = ("## Quick start\n\n```sh\nmake run\n```\n\n```sh\nvllm serve M "
              "--ec-transfer-config '{\"ec_connector\": \"ECDaemonConnector\",\n"
              "  \"ec_connector_extra_config\": "
              "{\"ec_daemon_socket\": \"unix:///run/ec-daemon/ec.sock\"}}'\n```\n")
    vllm_serve = command(quick_start_commands(readme), "vllm", "serve")
    with quick_start_daemon(readme) as daemon:
        settings = settings_of(transfer_config(vllm_serve), monkeypatch, daemon.env)
        assert settings.socket != daemon.socket
