"""The value format of the second tier: a header, then the payload, verified
before anything is served.

A value in the store may be stale, torn, truncated, written by another model
or another version of this code, or simply not ours; `decode` refuses every
such value with a precise reason (`BadValue`) and only then hands out the
payload. The header binds the value to its key (the full namespace string and
mm_hash), describes the tensor (shape, dtype, size) and ends with one 64-bit
xxh3 checksum over the header and the payload: xxh3 runs at 10-35 GB/s where
zlib.crc32 runs at 2.5 GB/s, which is what lets a verified fetch keep up with
a raw GET (docs/performance.md, benchmarks/remote.py).

Layout (little-endian)::

    0   magic       4s   b"ECDV"
    4   version     u8   FORMAT_VERSION
    5   algorithm   u8   1 = xxh3-64 of header[:-8] + payload
    6   ndim        u8   0..MAX_DIMS (a save's shape: `core.limits`)
    7   dtype_len   u8   1..MAX_DTYPE_BYTES
    8   ns_len      u16  namespace, UTF-8 bytes, 1..MAX_NAMESPACE_BYTES
    10  hash_len    u16  mm_hash, UTF-8 bytes, 1..MAX_KEY_BYTES
    12  header_len  u32  bytes before the payload (this header, checksum included)
    16  nbytes      u64  payload bytes
    24  shape       ndim x u64
        namespace, mm_hash, dtype (ASCII)
        checksum    u64
        payload     nbytes
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import xxhash

from ec_daemon.core.limits import MAX_DIMS, MAX_DTYPE_BYTES, MAX_KEY_BYTES, MAX_NAMESPACE_BYTES

FORMAT_VERSION = 1
MAGIC = b"ECDV"
ALGORITHM_XXH3_64 = 1

_FIXED = struct.Struct("<4sBBBBHHIQ")
_CHECKSUM = struct.Struct("<Q")
FIXED_BYTES = _FIXED.size  # 24
MAX_HEADER_BYTES = (FIXED_BYTES + 8 * MAX_DIMS + MAX_NAMESPACE_BYTES + MAX_KEY_BYTES
                    + MAX_DTYPE_BYTES + _CHECKSUM.size)

Buffer = bytes | bytearray | memoryview


class BadValue(Exception):
    """A value that must not be served; str() is the precise reason."""


@dataclass(frozen=True)
class Value:
    """A verified value. Its payload may arrive in several parts (a chunked
    read): `parts` are views of them in order, without a copy (written into
    the region as they are: pwritev); `payload` joins them (a copy) when
    there is more than one."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    parts: tuple[memoryview, ...]

    @cached_property
    def payload(self) -> memoryview:
        """The payload as one contiguous view (joined once when in parts)."""
        if len(self.parts) == 1:
            return self.parts[0]
        return memoryview(b"".join(self.parts))


def _bytes_of(payload: Any) -> memoryview:
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("payload must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _text(value: str, what: str, limit: int) -> bytes:
    raw = value.encode()
    if not 0 < len(raw) <= limit:
        raise ValueError(f"{what} must be 1..{limit} bytes of UTF-8, got {len(raw)}")
    return raw


def encode(namespace: str, mm_hash: str, shape: tuple[int, ...], dtype: str,
           payload: Any) -> list[bytes | memoryview]:
    """The value for (namespace, mm_hash) as [header, *payload views]: the
    payload (a C-contiguous buffer, or a list of them: its parts in order) is
    not copied, only checksummed. Raises ValueError for arguments the format
    cannot carry."""
    ns = _text(namespace, "namespace", MAX_NAMESPACE_BYTES)
    key = _text(mm_hash, "mm_hash", MAX_KEY_BYTES)
    try:
        kind = dtype.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError(f"dtype must be ASCII, got {dtype!r}") from None
    if not 0 < len(kind) <= MAX_DTYPE_BYTES:
        raise ValueError(f"dtype must be 1..{MAX_DTYPE_BYTES} characters, got {dtype!r}")
    dims = tuple(int(d) for d in shape)
    if len(dims) > MAX_DIMS or any(not 0 <= d < 1 << 64 for d in dims):
        raise ValueError(f"shape must have at most {MAX_DIMS} dims in 0..2**64, got {shape}")
    body = [_bytes_of(part) for part in payload] if isinstance(payload, list) \
        else [_bytes_of(payload)]
    header_len = FIXED_BYTES + 8 * len(dims) + len(ns) + len(key) + len(kind) + _CHECKSUM.size
    head = b"".join((
        _FIXED.pack(MAGIC, FORMAT_VERSION, ALGORITHM_XXH3_64, len(dims), len(kind), len(ns),
                    len(key), header_len, sum(len(part) for part in body)),
        struct.pack(f"<{len(dims)}Q", *dims), ns, key, kind))
    digest = xxhash.xxh3_64(head)
    for part in body:
        digest.update(part)
    return [head + _CHECKSUM.pack(digest.intdigest()), *body]


def size_bounds(namespace: str, mm_hash: str, nbytes: int) -> tuple[int, int]:
    """The fewest and the most bytes a value of (namespace, mm_hash) with an
    nbytes payload can take: its header grows with the shape's dims and the
    dtype's name, which an announcement does not carry. A stored value outside
    these bounds is not the announced one, whatever it holds."""
    known = FIXED_BYTES + len(namespace.encode()) + len(mm_hash.encode()) + _CHECKSUM.size
    return nbytes + known + 1, nbytes + known + 8 * MAX_DIMS + MAX_DTYPE_BYTES


def _shown(raw: bytes) -> str:
    text = raw.decode(errors="replace")
    return repr(text if len(text) <= 120 else text[:117] + "...")


def _head(parts: Sequence[memoryview], size: int) -> bytes:
    """The first `size` bytes of the value (fewer if it is shorter)."""
    if len(parts[0]) >= size:
        return bytes(parts[0][:size])
    out = bytearray()
    for part in parts:
        out += part[:size - len(out)]
        if len(out) >= size:
            break
    return bytes(out)


class ValueHeader(NamedTuple):
    """A value's header, checked to name the key it was read for."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int  # the payload's
    length: int  # the header's, its checksum included
    checksum: int


def _fields(fixed: bytes) -> tuple[int, int, int, int, int, int]:
    """(ndim, dtype_len, ns_len, hash_len, header_len, nbytes) of the fixed
    part, past its magic, checked to describe a header this code reads."""
    (_magic, version, algorithm, ndim, dtype_len, ns_len, hash_len, header_len,
     nbytes) = _FIXED.unpack(fixed)
    if version != FORMAT_VERSION:
        raise BadValue(f"format version {version}; this daemon reads version {FORMAT_VERSION}")
    if algorithm != ALGORITHM_XXH3_64:
        raise BadValue(f"unknown checksum algorithm {algorithm}")
    if ndim > MAX_DIMS or not 0 < dtype_len <= MAX_DTYPE_BYTES:
        raise BadValue(f"malformed header: {ndim} dims, {dtype_len}-byte dtype")
    expected_len = FIXED_BYTES + 8 * ndim + ns_len + hash_len + dtype_len + _CHECKSUM.size
    if header_len != expected_len:
        raise BadValue(f"malformed header: length field {header_len}, fields add up to "
                       f"{expected_len}")
    return ndim, dtype_len, ns_len, hash_len, header_len, nbytes


def _named(head: bytes, fields: tuple[int, int, int, int, int, int], namespace: str,
           mm_hash: str) -> ValueHeader:
    """The header in `head` (its first header_len bytes), checked to name the key."""
    ndim, dtype_len, ns_len, hash_len, header_len, nbytes = fields
    at = FIXED_BYTES
    shape = struct.unpack_from(f"<{ndim}Q", head, at)
    at += 8 * ndim
    stored_ns = head[at:at + ns_len]
    at += ns_len
    stored_hash = head[at:at + hash_len]
    at += hash_len
    stored_dtype = head[at:at + dtype_len]
    if stored_ns != namespace.encode():
        raise BadValue(f"stored for namespace {_shown(stored_ns)}, expected "
                       f"{_shown(namespace.encode())}")
    if stored_hash != mm_hash.encode():
        raise BadValue(f"stored for mm_hash {_shown(stored_hash)}, expected "
                       f"{_shown(mm_hash.encode())}")
    try:
        dtype = stored_dtype.decode("ascii")
    except UnicodeDecodeError:
        raise BadValue(f"malformed header: dtype {stored_dtype!r} is not ASCII") from None
    (stored_sum,) = _CHECKSUM.unpack_from(head, header_len - _CHECKSUM.size)
    return ValueHeader(tuple(shape), dtype, nbytes, header_len, stored_sum)


def parse_header(header: Buffer, *, namespace: str, mm_hash: str) -> ValueHeader:
    """A header read alone (no payload after it: its length is the whole
    buffer), checked as `decode` checks it; raises BadValue with the reason."""
    head = bytes(header)
    if head[:4] != MAGIC:
        raise BadValue(f"not an ec-daemon header (starts with {head[:8]!r}, {len(head)} bytes)")
    if len(head) < FIXED_BYTES:
        raise BadValue(f"truncated: {len(head)} bytes, shorter than the fixed header "
                       f"({FIXED_BYTES} bytes)")
    fields = _fields(head[:FIXED_BYTES])
    if fields[4] != len(head):
        raise BadValue(f"malformed header: length field {fields[4]}, {len(head)} bytes read")
    return _named(head, fields, namespace, mm_hash)


class Check:
    """A payload verified piece by piece against its header, read alone:
    `update` with each piece in order (as it is written where no one else can
    change it: one pass over the bytes, no second read), then `done`."""

    def __init__(self, header: Buffer, *, namespace: str, mm_hash: str) -> None:
        self._start(parse_header(header, namespace=namespace, mm_hash=mm_hash), bytes(header))

    @classmethod
    def _parsed(cls, header: ValueHeader, head: bytes) -> Check:
        """A check of a header already parsed (`head`: its bytes, and maybe more)."""
        check = cls.__new__(cls)
        check._start(header, head)
        return check

    def _start(self, header: ValueHeader, head: bytes) -> None:
        self.header = header
        self._digest = xxhash.xxh3_64(head[:header.length - _CHECKSUM.size])
        self._seen = 0

    def update(self, piece: Buffer) -> None:
        self._digest.update(piece)
        self._seen += len(piece)

    def done(self) -> None:
        """Raises BadValue unless the pieces were the header's payload."""
        if self._seen != self.header.nbytes:
            raise BadValue(f"payload of {self._seen} bytes, the header says "
                           f"{self.header.nbytes}")
        if self._digest.intdigest() != self.header.checksum:
            raise BadValue(f"checksum mismatch: header or payload corrupted (stored "
                           f"{self.header.checksum:016x}, computed "
                           f"{self._digest.intdigest():016x})")


def decode(value: Buffer | Sequence[Buffer], *, namespace: str, mm_hash: str) -> Value:
    """Verify a value read for (namespace, mm_hash): the whole value, or its
    bytes in consecutive parts (a chunked read). Returns the payload as views
    of the given buffers (no copy); raises BadValue with the reason."""
    if isinstance(value, bytes | bytearray | memoryview):
        parts = [memoryview(value).cast("B")]
    else:
        parts = [memoryview(p).cast("B") for p in value]
    parts = [p for p in parts if len(p)] or [memoryview(b"")]
    total = sum(len(p) for p in parts)
    fixed = _head(parts, FIXED_BYTES)
    if fixed[:4] != MAGIC[:len(fixed[:4])] or total == 0:
        raise BadValue(f"not an ec-daemon value (starts with {fixed[:8]!r}, {total} bytes)")
    if total < FIXED_BYTES:
        raise BadValue(f"truncated: {total} bytes, shorter than the fixed header "
                       f"({FIXED_BYTES} bytes)")
    fields = _fields(fixed)
    header_len, nbytes = fields[4], fields[5]
    if total < header_len:
        raise BadValue(f"truncated: {total} bytes, shorter than its header ({header_len} bytes)")
    if total != header_len + nbytes:
        what = "truncated" if total < header_len + nbytes else "trailing bytes"
        raise BadValue(f"{what}: payload of {total - header_len} bytes, the header says "
                       f"{nbytes}")
    head = _head(parts, header_len)
    header = _named(head, fields, namespace, mm_hash)
    payload = _split(parts, header_len)
    check = Check._parsed(header, head)
    for part in payload:
        check.update(part)
    check.done()  # (the sizes agree, checked above: the checksum alone can fail here)
    return Value(shape=header.shape, dtype=header.dtype, nbytes=nbytes, parts=tuple(payload))


def _split(parts: Sequence[memoryview], skip: int) -> list[memoryview]:
    """Views of the parts past the first `skip` bytes (no copy)."""
    out = []
    for part in parts:
        if skip >= len(part):
            skip -= len(part)
            continue
        out.append(part[skip:])
        skip = 0
    return out or [memoryview(b"")]
