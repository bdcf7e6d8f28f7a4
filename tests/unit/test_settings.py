"""The connector's extra-config keys: declared once, documented as declared,
parsed with precise errors, and a misspelt key refused rather than ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from ec_client.common.settings import SETTINGS, ConnectorSettings, key_of, markdown_table
from ec_protocol import settings_table
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
        {"ec_daemon_answer_wait_seconds": "0", "ec_daemon_max_defer_seconds": 2.5,
         "ec_daemon_save_queue_bytes": "1048576", "ec_daemon_socket": "unix:///x.sock",
         "ec_daemon_verify_checksum": "true", "ec_daemon_staging_bytes": 65536,
         "ec_daemon_rpc_deadline_seconds": "1.5"})
    assert settings.answer_wait_seconds == 0.0 and settings.max_defer_seconds == 2.5
    assert settings.save_queue_bytes == 1 << 20 and settings.socket == "unix:///x.sock"
    assert settings.verify_checksum is True and settings.staging_bytes == 65536
    assert settings.deadline_seconds == 1.5
    assert ConnectorSettings.from_extra_config(
        {"ec_daemon_verify_checksum": False}).verify_checksum is False


@pytest.mark.parametrize("extra, message", [
    ({"ec_daemon_answer_wait": 5}, "unknown ec-daemon extra-config key(s) ec_daemon_answer_wait"),
    ({"ec_daemon_max_defer_seconds": -1}, "ec_daemon_max_defer_seconds must be a number >= 0"),
    ({"ec_daemon_max_defer_s": -1}, "ec_daemon_max_defer_s: ec_daemon_max_defer_seconds must"),
    ({"ec_daemon_answer_wait_ms": "nan"}, "ec_daemon_answer_wait_ms must be a number >= 0"),
    ({"ec_daemon_answer_wait_seconds": "nan"}, "ec_daemon_answer_wait_seconds must be a number"),
    ({"ec_daemon_rpc_deadline_seconds": "soon"},
     "ec_daemon_rpc_deadline_seconds: could not convert"),
    ({"ec_daemon_rpc_deadline_s": "soon"}, "ec_daemon_rpc_deadline_s: could not convert"),
    ({"ec_daemon_save_queue_bytes": "1 gallon"}, "ec_daemon_save_queue_bytes: invalid size"),
    ({"ec_daemon_staging_bytes": -1}, "ec_daemon_staging_bytes: invalid size"),
    ({"ec_daemon_max_defer_s": 1, "ec_daemon_max_defer_seconds": 2},
     "ec_daemon_max_defer_seconds and ec_daemon_max_defer_s are one setting"),
    ({"ec_daemon_verify_checksum": "maybe"}, "ec_daemon_verify_checksum must be true or false"),
])
def test_a_bad_or_misspelt_key_is_refused_by_name(extra, message):
    with pytest.raises(ValueError) as raised:
        ConnectorSettings.from_extra_config(extra)
    assert message in str(raised.value)


def test_other_connectors_keys_are_left_alone():
    assert ConnectorSettings.from_extra_config({"shared_storage_path": "/tmp/x"}).namespace == ""


def test_every_setting_is_one_field_of_the_settings_and_each_field_one_setting():
    assert settings_table.field_mismatches(SETTINGS, ConnectorSettings) == []


def test_sizes_take_units_as_the_daemons_flags_do():
    settings = ConnectorSettings.from_extra_config(
        {"ec_daemon_save_queue_bytes": "512MiB", "ec_daemon_staging_bytes": "1GiB"})
    assert settings.save_queue_bytes == 512 << 20 and settings.staging_bytes == 1 << 30


def test_every_time_key_is_in_seconds_and_says_so():
    times = [key_of(s) for s in SETTINGS if s.name.endswith("seconds")]
    assert times and all(key.endswith("_seconds") for key in times), times


# Each old key: its value as it was given, and the same setting under its new key.
OLD_KEYS = [
    ("ec_daemon_max_defer_s", 2.5, "max_defer_seconds", 2.5,
     "ec_daemon_max_defer_s is deprecated: it is read as ec_daemon_max_defer_seconds"),
    ("ec_daemon_answer_wait_ms", "20", "answer_wait_seconds", 0.02,
     "ec_daemon_answer_wait_ms is deprecated: it is read as ec_daemon_answer_wait_seconds"),
    ("ec_daemon_rpc_deadline_s", 7, "deadline_seconds", 7.0,
     "ec_daemon_rpc_deadline_s is deprecated: it is read as ec_daemon_rpc_deadline_seconds"),
]


@pytest.mark.parametrize("old, value, attribute, expected, warning", OLD_KEYS)
def test_an_old_key_still_works_with_one_warning_naming_the_new(
        old, value, attribute, expected, warning, caplog, monkeypatch):
    monkeypatch.setattr(settings_table, "_warned", set())
    with caplog.at_level("WARNING", logger="ec_protocol.settings"):
        first = ConnectorSettings.from_extra_config({old: value})
        again = ConnectorSettings.from_extra_config({old: value})
    assert getattr(first, attribute) == pytest.approx(expected) == getattr(again, attribute)
    assert [r.getMessage() for r in caplog.records if old in r.getMessage()] == [
        f"{warning}, its new name"]


def test_every_old_key_is_tested_and_documented():
    old = {alias.name for setting in SETTINGS for alias in setting.aliases}
    assert old == {case[0] for case in OLD_KEYS}
    assert all(f"(was `{name}`" in markdown_table() for name in old)
