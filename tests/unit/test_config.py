import argparse

import pytest

from ec_daemon.serving import config
from ec_protocol import settings_table


def _parse(argv, env=None, monkeypatch=None):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_namespace(parser.parse_args(argv))


def test_flags_default_from_environment(monkeypatch):
    monkeypatch.setenv("EC_DAEMON_CPU_BYTES", "2GiB")
    monkeypatch.setenv("EC_DAEMON_SOCKET", "unix:///tmp/x.sock")
    settings = _parse([])
    assert settings.cpu_bytes == 2 << 30
    assert settings.socket == "unix:///tmp/x.sock"
    assert settings.page_bytes == 64 << 10
    assert _parse(["--cpu-bytes", "3GiB"]).cpu_bytes == 3 << 30


def test_errors_name_the_flag():
    with pytest.raises(ValueError, match="--page-bytes"):
        _parse(["--page-bytes", "0"])
    with pytest.raises(ValueError, match="smaller than one page"):
        _parse(["--cpu-bytes", "1KiB"])
    with pytest.raises(ValueError, match="--lease-seconds"):
        _parse(["--lease-seconds", "-3"])


def test_every_setting_is_one_field_of_the_config_and_each_field_one_setting():
    assert settings_table.field_mismatches(config.SETTINGS, config.DaemonConfig) == []


def test_the_field_check_sees_a_setting_without_its_field():
    extra = (*config.SETTINGS, config.Setting("spare", str, lambda: "", "unused"))
    assert settings_table.field_mismatches(extra, config.DaemonConfig) == [
        "spare: in the table, not a field of DaemonConfig"]


def test_every_time_flag_is_in_seconds_and_says_so():
    times = [s for s in config.SETTINGS if s.metavar == "S"]
    assert times and all(s.name.endswith("_seconds") for s in times), \
        [config.flag(s) for s in times]


# Each old flag: the setting it is now, and its old environment variable.
OLD_FLAGS = [("--remote-ttl", "remote_ttl_seconds", "EC_DAEMON_REMOTE_TTL")]


@pytest.mark.parametrize("old, attribute, variable", OLD_FLAGS)
def test_an_old_flag_still_works_with_one_warning_naming_the_new(
        old, attribute, variable, caplog, monkeypatch):
    monkeypatch.setattr(settings_table, "_warned", set())
    new = config.flag(next(s for s in config.SETTINGS if s.name == attribute))
    with caplog.at_level("WARNING", logger="ec_protocol.settings"):
        assert getattr(_parse([old, "120"]), attribute) == 120.0
        assert getattr(_parse([old, "90"]), attribute) == 90.0
    assert [r.getMessage() for r in caplog.records] == [
        f"{old} is deprecated: it is read as {new}, its new name"]
    assert getattr(_parse([new, "60"]), attribute) == 60.0
    caplog.clear()
    monkeypatch.setenv(variable, "30")
    with caplog.at_level("WARNING", logger="ec_protocol.settings"):
        assert getattr(_parse([]), attribute) == 30.0
    assert [r.getMessage() for r in caplog.records] == [
        f"{variable} is deprecated: it is read as {variable}_SECONDS, its new name"]


def test_every_old_flag_is_tested_and_documented():
    old = {config.flag(s, a.name) for s in config.SETTINGS for a in s.aliases}
    assert old == {case[0] for case in OLD_FLAGS}
    assert all(f"(was `{name}`" in config.markdown_table() for name in old)
