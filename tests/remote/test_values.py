"""The value format: round trips and every refusal, no server needed."""

from __future__ import annotations

import array
import itertools
import struct

import pytest

from ec_daemon.remote.values import (
    FORMAT_VERSION,
    BadValue,
    Check,
    decode,
    encode,
    parse_header,
)

NS = "model|bfloat16|image=2304|variant"
HASH = "a" * 64


def whole(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


def value(payload: bytes = b"0123456789abcdef" * 64, ns: str = NS, mm_hash: str = HASH,
          shape: tuple[int, ...] = (64, 16), dtype: str = "uint8") -> bytes:
    return whole(encode(ns, mm_hash, shape, dtype, payload))


def refused(raw: bytes | list[bytes], match: str, ns: str = NS, mm_hash: str = HASH) -> None:
    with pytest.raises(BadValue, match=match):
        decode(raw, namespace=ns, mm_hash=mm_hash)


def test_round_trip() -> None:
    data = bytes(range(256)) * 40
    got = decode(value(data, shape=(40, 256)), namespace=NS, mm_hash=HASH)
    assert (got.shape, got.dtype, got.nbytes) == ((40, 256), "uint8", len(data))
    assert bytes(got.payload) == data


def test_encode_does_not_copy_the_payload() -> None:
    data = bytearray(b"x" * 4096)
    parts = encode(NS, HASH, (4096,), "uint8", data)
    assert len(parts) == 2 and isinstance(parts[1], memoryview)
    assert parts[1].obj is data


def test_a_payload_in_parts_is_checksummed_in_place() -> None:
    """The region's extents: one value, its parts sent as they are."""
    first, second = bytearray(b"a" * 3000), memoryview(b"b" * 1096)
    parts = encode(NS, HASH, (4096,), "uint8", [first, second])
    assert len(parts) == 3 and parts[1].obj is first and parts[2].obj is second.obj
    got = decode(whole(parts), namespace=NS, mm_hash=HASH)
    assert bytes(got.payload) == bytes(first) + bytes(second) and got.nbytes == 4096
    assert whole(parts) == whole(encode(NS, HASH, (4096,), "uint8", bytes(first) + bytes(second)))


def test_any_contiguous_buffer_and_empty_shapes() -> None:
    floats = array.array("f", [1.5] * 100)
    got = decode(whole(encode(NS, HASH, (100,), "float32", floats)), namespace=NS, mm_hash=HASH)
    assert bytes(got.payload) == floats.tobytes() and got.nbytes == 400
    empty = decode(whole(encode(NS, HASH, (), "uint8", b"")), namespace=NS, mm_hash=HASH)
    assert empty.nbytes == 0 and bytes(empty.payload) == b"" and empty.shape == ()


@pytest.mark.parametrize("cuts", [[1], [10, 30], [50, 51, 52, 200], [100, 1000, 2000]])
def test_decode_in_parts_any_boundaries(cuts: list[int]) -> None:
    """A chunked read hands over consecutive parts; the header may straddle them."""
    data = bytes(range(256)) * 16
    raw = value(data, shape=(16, 256))
    bounds = [0, *cuts, len(raw)]
    parts = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    got = decode(parts, namespace=NS, mm_hash=HASH)
    assert bytes(got.payload) == data
    # The payload's parts are views of what was read, in order, no copy.
    assert b"".join(bytes(part) for part in got.parts) == data
    assert all(isinstance(part, memoryview) for part in got.parts)


def test_refuses_a_corrupt_payload_byte() -> None:
    raw = bytearray(value())
    raw[-100] ^= 0x01
    refused(bytes(raw), "checksum mismatch")


def test_refuses_a_corrupt_shape() -> None:
    raw = bytearray(value())
    raw[24] ^= 0x01  # the first dim
    refused(bytes(raw), "checksum mismatch")


def test_refuses_truncated_and_trailing() -> None:
    raw = value()
    refused(raw[:-1], "truncated: payload of 1023 bytes, the header says 1024")
    refused(raw[:40], "truncated: 40 bytes, shorter than its header")
    refused(raw[:10], "truncated: 10 bytes, shorter than the fixed header")
    refused(raw + b"\0", "trailing bytes")


def test_refuses_a_foreign_namespace_and_another_mm_hash() -> None:
    refused(value(ns="other-model|float16|image=1024|"), "stored for namespace 'other-model")
    refused(value(mm_hash="b" * 64), "stored for mm_hash 'bbbb")


def test_refuses_another_format_version() -> None:
    raw = bytearray(value())
    raw[4] = FORMAT_VERSION + 1
    refused(bytes(raw), f"format version {FORMAT_VERSION + 1}; this daemon reads version 1")


def test_refuses_garbage() -> None:
    refused(b"hello world, not a value at all", "not an ec-daemon value")
    refused(b"", "not an ec-daemon value")
    refused([b"", b""], "not an ec-daemon value")


def test_refuses_a_malformed_header() -> None:
    raw = bytearray(value())
    struct.pack_into("<I", raw, 12, 9999)  # the header length
    refused(bytes(raw), "malformed header: length field 9999")
    raw = bytearray(value())
    raw[5] = 7  # the checksum algorithm
    refused(bytes(raw), "unknown checksum algorithm 7")


def test_encode_refuses_what_the_format_cannot_carry() -> None:
    with pytest.raises(ValueError, match="namespace"):
        encode("", HASH, (1,), "uint8", b"x")
    with pytest.raises(ValueError, match="mm_hash"):
        encode(NS, "h" * 5000, (1,), "uint8", b"x")
    with pytest.raises(ValueError, match="dtype"):
        encode(NS, HASH, (1,), "", b"x")
    with pytest.raises(ValueError, match="shape"):
        encode(NS, HASH, (1,) * 17, "uint8", b"x")
    with pytest.raises(ValueError, match="C-contiguous"):
        encode(NS, HASH, (2,), "uint8", memoryview(b"abcd")[::2])


def test_a_payload_checked_piece_by_piece_against_its_header_alone() -> None:
    """A header read apart from its payload (Mooncake's checksum beside a
    value) checks the payload as it streams past, in pieces of any size; a
    flipped byte, a missing or an extra byte is refused at `done`."""
    data = bytes(range(256)) * 40
    header = bytes(encode(NS, HASH, (40, 256), "uint8", data)[0])
    assert parse_header(header, namespace=NS, mm_hash=HASH)[:3] == ((40, 256), "uint8",
                                                                     len(data))
    for step in (1000, 4096, len(data)):
        check = Check(header, namespace=NS, mm_hash=HASH)
        for at in range(0, len(data), step):
            check.update(data[at:at + step])
        check.done()
    flipped = bytearray(data)
    flipped[5000] ^= 0x10
    for payload, match in ((flipped, "checksum mismatch"), (data[:-1], "payload of 10239"),
                           (data + b"x", "payload of 10241")):
        check = Check(header, namespace=NS, mm_hash=HASH)
        check.update(payload)
        with pytest.raises(BadValue, match=match):
            check.done()


@pytest.mark.parametrize(("header", "ns", "mm_hash", "match"), [
    (lambda h: h, "other|ns", HASH, "stored for namespace"),
    (lambda h: h, NS, "b" * 64, "stored for mm_hash"),
    (lambda h: h[:20], NS, HASH, "truncated: 20 bytes"),
    (lambda h: h + b"\0", NS, HASH, "length field"),  # a value, not a header alone
    (lambda h: b"XXXX" + h[4:], NS, HASH, "not an ec-daemon header"),
])
def test_a_header_alone_is_refused_when_it_is_not_this_keys(header, ns, mm_hash,
                                                            match) -> None:
    good = bytes(encode(NS, HASH, (4, 4), "uint8", b"x" * 16)[0])
    with pytest.raises(BadValue, match=match):
        parse_header(header(good), namespace=ns, mm_hash=mm_hash)
    with pytest.raises(BadValue, match=match):
        Check(header(good), namespace=ns, mm_hash=mm_hash)
