import pytest

from ec_protocol.sizes import format_size, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("512MiB", 512 << 20), ("64GiB", 64 << 30), ("1G", 10**9), ("4096", 4096),
    ("1.5KiB", 1536), ("2 tib", 2 << 40), ("64kb", 64000),
])
def test_parse_size_accepts_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-1GiB", "1.3B", "GiB"])
def test_parse_size_rejects_garbage_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_format_size_round_trips_common_sizes():
    assert format_size(64 << 30) == "64 GiB"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(10) == "10 B"
