import argparse

import pytest

from ec_daemon.serving import config


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
