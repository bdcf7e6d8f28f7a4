import argparse

import pytest

from ec_daemon import config


@pytest.mark.parametrize(("text", "expected"), [
    ("512MiB", 512 << 20), ("64GiB", 64 << 30), ("1G", 10**9), ("4096", 4096),
    ("1.5KiB", 1536), ("2 tib", 2 << 40), ("64kb", 64000),
])
def test_parse_size_accepts_units(text, expected):
    assert config.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-1GiB", "1.3B", "GiB"])
def test_parse_size_rejects_garbage_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match="invalid size"):
        config.parse_size(text)


def test_format_size_round_trips_common_sizes():
    assert config.format_size(64 << 30) == "64 GiB"
    assert config.format_size(1536) == "1.50 KiB"
    assert config.format_size(10) == "10 B"


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
