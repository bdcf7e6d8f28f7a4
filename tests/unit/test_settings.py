"""The connector's extra-config keys: declared once, documented as declared,
parsed with precise errors, and a misspelt key refused rather than ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from ec_client.common.settings import KEYS, ConnectorSettings, markdown_table
from ec_protocol.protocol import SOCKET_ENV

ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_guide_documents_every_key_with_its_default():
    assert markdown_table() in (ROOT / "docs" / "vllm.md").read_text(), \
        "docs/vllm.md's extra-config table differs: python -m ec_client.common.settings prints it"


def test_defaults_when_nothing_is_set(monkeypatch):
    monkeypatch.setenv(SOCKET_ENV, "unix:///run/ec/ec.sock")
    settings = ConnectorSettings.from_extra_config({})
    assert settings.socket == "unix:///run/ec/ec.sock"
    assert settings.answer_wait_seconds == 0.005 and settings.max_defer_seconds == 10.0
    assert settings.save_queue_bytes == 256 << 20 and settings.copy_backend == "auto"
    assert settings.token_file is None and settings.weights_id == ""
    assert settings.staging_bytes == 256 << 20 and settings.verify_checksum is False


def test_values_are_parsed_in_their_units():
    settings = ConnectorSettings.from_extra_config(
        {"ec_daemon_answer_wait_ms": "0", "ec_daemon_max_defer_s": 2.5,
         "ec_daemon_save_queue_bytes": "1048576", "ec_daemon_socket": "unix:///x.sock",
         "ec_daemon_verify_checksum": "true", "ec_daemon_staging_bytes": "65536"})
    assert settings.answer_wait_seconds == 0.0 and settings.max_defer_seconds == 2.5
    assert settings.save_queue_bytes == 1 << 20 and settings.socket == "unix:///x.sock"
    assert settings.verify_checksum is True and settings.staging_bytes == 65536
    assert ConnectorSettings.from_extra_config(
        {"ec_daemon_verify_checksum": False}).verify_checksum is False


@pytest.mark.parametrize("extra, message", [
    ({"ec_daemon_answer_wait": 5}, "unknown ec-daemon extra-config key(s) ec_daemon_answer_wait"),
    ({"ec_daemon_max_defer_s": -1}, "ec_daemon_max_defer_s must be a number >= 0"),
    ({"ec_daemon_answer_wait_ms": "nan"}, "ec_daemon_answer_wait_ms must be a number >= 0"),
    ({"ec_daemon_rpc_deadline_s": "soon"}, "ec_daemon_rpc_deadline_s: could not convert"),
    ({"ec_daemon_save_queue_bytes": "1GiB"}, "ec_daemon_save_queue_bytes: invalid literal"),
    ({"ec_daemon_verify_checksum": "maybe"}, "ec_daemon_verify_checksum must be true or false"),
])
def test_a_bad_or_misspelt_key_is_refused_by_name(extra, message):
    with pytest.raises(ValueError) as raised:
        ConnectorSettings.from_extra_config(extra)
    assert message in str(raised.value)


def test_other_connectors_keys_are_left_alone():
    assert ConnectorSettings.from_extra_config({"shared_storage_path": "/tmp/x"}).namespace == ""


def test_every_key_names_a_setting():
    fields = set(ConnectorSettings.__dataclass_fields__)
    assert sorted(k.attribute for k in KEYS) == sorted(fields)
