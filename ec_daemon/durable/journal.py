"""The index's format: a header, then a journal of checksummed records.

```
 [ header: 4 KiB, checksummed; the id reservation at a fixed offset ][ records ... ]
 record = u32 body length | u32 crc32(body) | body
 body   = READY2 entry_id nbytes checksum ndim nruns len(dtype) len(namespace) len(mm_hash)
                 shape runs dtype namespace mm_hash
        | READY  (format 1: the same without the checksum; still read)
        | HIDDEN entry_id | GONE entry_id
        | VIEW_ON len(engine) len(namespace) engine namespace | VIEW_OFF (the same)
```

Format 2 added READY2, whose checksum (xxh3-64 of the entry's bytes, as its
writer reported it; 0: none) an adopted entry keeps, and the rule that the
daemon's liveness lock is on the index, not the region (`region`): a client
can open the region and lock it, never the index. A format-1 index is still
adopted (its READY records have no checksum; its header is rewritten to 2),
and a daemon that reads only format 1 refuses a format-2 index whole, saying
so, instead of stopping at its first READY2 record or taking a live daemon's
region for a dead one by its unlocked region file.

VIEW_ON and VIEW_OFF say which engine instances' views were attached: a
daemon that adopts the region awaits each of them (a ghost) until it comes
back, so an engine's loads in flight across the restart are protected
without holding every eviction for a whole lease.

Little-endian throughout. A reader stops at the first record that is torn
(its length runs past the end: a daemon killed mid-append) or fails its
checksum, and keeps what came before. `index` writes it; `adoption` reads it.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from ec_daemon.core.limits import MAX_RECORD_BYTES

MAGIC = b"ECDINDEX"
# Bump on any change of the header or record layout: a daemon never adopts
# a region whose index it does not understand (it starts fresh, saying why).
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
VERSION_AT = 8  # u32 after the magic: rewritten in place when a format-1 index is adopted
HEADER_BYTES = 4096
_HEAD = struct.Struct("<8sIIQQQQH")  # magic, format, crc, generation, size, page, data, socket
IDS_AT = 2048  # u64: every id below it may have been used
_IDS = struct.Struct("<Q")
MAX_SOCKET_BYTES = IDS_AT - _HEAD.size  # the socket's name ends before the reservation

_FRAME = struct.Struct("<II")  # body length, crc32(body)
# kind, entry_id, nbytes, then the counts and lengths of what follows: ndim,
# runs, and the bytes of dtype, namespace and mm_hash; then the shape and the
# runs (u64 each), then the three strings. One unpack reads the fixed part.
_READY = struct.Struct("<BQQBIBHH")
_READY2 = struct.Struct("<BQQQBIBHH")  # READY2: the checksum after nbytes
_REF = struct.Struct("<BQ")  # kind, entry_id
_VIEW = struct.Struct("<BHH")  # kind, len(engine), len(namespace)
REF_RECORD_BYTES = _FRAME.size + _REF.size  # a framed HIDDEN or GONE record
READY, HIDDEN, GONE, VIEW_ON, VIEW_OFF, READY2 = 1, 2, 3, 4, 5, 6


class IndexUnreadable(Exception):
    """The index cannot be read as one this daemon writes; the message says why."""


@dataclass(frozen=True)
class Header:
    generation: int
    region_size: int
    page_bytes: int
    data_offset: int
    socket: str
    ids_reserved: int = 0
    version: int = FORMAT_VERSION


@dataclass(slots=True)
class Record:
    """A READY record (with `hidden` set when a HIDDEN record followed it)."""

    entry_id: int
    namespace: str
    mm_hash: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    runs: list[tuple[int, int]]
    hidden: bool = False
    raw: bytes = b""  # the framed record as read (rewritten as it is)
    checksum: int = 0  # (format 1 records have none)


def encode_ready(entry_id: int, namespace: str, mm_hash: str, nbytes: int,
                 shape: tuple[int, ...], dtype: str, runs: Iterable[tuple[int, int]],
                 checksum: int = 0) -> bytes:
    """A framed READY2 record."""
    runs = list(runs)
    d, ns, h = dtype.encode(), namespace.encode(), mm_hash.encode()
    body = b"".join((
        _READY2.pack(READY2, entry_id, nbytes, checksum, len(shape), len(runs), len(d), len(ns),
                     len(h)),
        _numbers(len(shape), len(runs)).pack(*shape, *(n for run in runs for n in run)),
        d, ns, h))
    return _frame(body)


@functools.cache
def _numbers(ndim: int, runs: int) -> struct.Struct:
    """The shape and the runs' (first page, pages), u64 each."""
    return struct.Struct(f"<{ndim + 2 * runs}Q")


def encode_ref(kind: int, entry_id: int) -> bytes:
    """A framed HIDDEN or GONE record."""
    return _frame(_REF.pack(kind, entry_id))


def encode_view(kind: int, engine: str, namespace: str) -> bytes:
    """A framed VIEW_ON or VIEW_OFF record."""
    e, ns = engine.encode(), namespace.encode()
    return _frame(_VIEW.pack(kind, len(e), len(ns)) + e + ns)


def _frame(body: bytes) -> bytes:
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def encode_header(header: Header) -> bytes:
    socket = header.socket.encode()
    if len(socket) > MAX_SOCKET_BYTES:
        raise ValueError(f"socket name longer than {MAX_SOCKET_BYTES} bytes")
    fields = (header.generation, header.region_size, header.page_bytes, header.data_offset)
    crc = zlib.crc32(struct.pack("<QQQQ", *fields) + socket)
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, crc, *fields, len(socket)) + socket
    out = bytearray(HEADER_BYTES)
    out[:len(head)] = head
    out[IDS_AT:IDS_AT + _IDS.size] = _IDS.pack(header.ids_reserved)
    return bytes(out)


def decode_header(data: bytes) -> Header:
    """Raises IndexUnreadable naming what does not match."""
    if len(data) < HEADER_BYTES or data[:len(MAGIC)] != MAGIC:
        raise IndexUnreadable("not an ec-daemon index (no header)")
    _, version, crc, gen, size, page, offset, socket_len = _HEAD.unpack_from(data)
    if version not in READABLE_VERSIONS:
        raise IndexUnreadable(f"index format version {version}, this daemon reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    socket = data[_HEAD.size:_HEAD.size + min(socket_len, MAX_SOCKET_BYTES)]
    if zlib.crc32(struct.pack("<QQQQ", gen, size, page, offset) + socket) != crc:
        raise IndexUnreadable("the index header fails its checksum")
    (ids,) = _IDS.unpack_from(data, IDS_AT)
    return Header(gen, size, page, offset, socket.decode(errors="replace"), ids, version)


@dataclass
class Journal:
    """What a journal says: the live READY records (by entry id, in journal
    order), the engines whose views were attached, the highest entry id
    named, and where the readable journal ends."""

    records: dict[int, Record]
    views: set[tuple[str, str]]  # (engine, namespace)
    highest: int
    end: int


def decode_records(data: bytes | memoryview, start: int = HEADER_BYTES) -> Journal:
    """Read a journal up to its end or its first torn or corrupt record."""
    view = memoryview(data)
    records: dict[int, Record] = {}
    views: set[tuple[str, str]] = set()
    highest = 0
    at = start
    end = len(view)
    unpack_frame, crc32 = _FRAME.unpack_from, zlib.crc32
    texts: dict[bytes, str] = {}
    while at + _FRAME.size <= end:
        length, crc = unpack_frame(view, at)
        body_at = at + _FRAME.size
        if length == 0 or length > MAX_RECORD_BYTES or body_at + length > end:
            break  # torn (the daemon died mid-append) or garbage
        body = bytes(view[body_at:body_at + length])
        if crc32(body) != crc:
            break
        try:
            kind = body[0]
            entry_id = 0
            if kind in (READY, READY2):
                record = _decode_ready(body, texts)
                record.raw = bytes(view[at:body_at + length])
                records.pop(record.entry_id, None)  # a repeated id: the later one counts
                records[record.entry_id] = record
                entry_id = record.entry_id
            elif kind in (HIDDEN, GONE):
                _, entry_id = _REF.unpack_from(body)
                if kind == GONE:
                    records.pop(entry_id, None)
                elif entry_id in records:
                    records[entry_id].hidden = True
            elif kind in (VIEW_ON, VIEW_OFF):
                _, elen, nslen = _VIEW.unpack_from(body)
                if _VIEW.size + elen + nslen != len(body):
                    raise ValueError("a record's lengths do not add up")
                key = (body[_VIEW.size:_VIEW.size + elen].decode(),
                       body[_VIEW.size + elen:].decode())
                (views.add if kind == VIEW_ON else views.discard)(key)
            else:
                break
        except (struct.error, UnicodeDecodeError, IndexError, ValueError):
            break
        highest = max(highest, entry_id)
        at = body_at + length
    return Journal(records, views, highest, at)


def _decode_ready(body: bytes, texts: dict[bytes, str]) -> Record:
    """A READY or READY2 record; `texts` shares the strings of namespaces and
    dtypes between records."""
    if body[0] == READY2:
        _, entry_id, nbytes, checksum, ndim, count, dlen, nslen, hlen = _READY2.unpack_from(body)
        fixed = _READY2.size
    else:
        _, entry_id, nbytes, ndim, count, dlen, nslen, hlen = _READY.unpack_from(body)
        checksum, fixed = 0, _READY.size
    numbers = _numbers(ndim, count)
    values = numbers.unpack_from(body, fixed)
    at = fixed + numbers.size
    if at + dlen + nslen + hlen != len(body):
        raise ValueError("a record's lengths do not add up")
    dtype, namespace, mm_hash = (body[at:at + dlen], body[at + dlen:at + dlen + nslen],
                                 body[at + dlen + nslen:])
    runs = [(values[ndim], values[ndim + 1])] if count == 1 else list(
        zip(values[ndim::2], values[ndim + 1::2], strict=True))
    return Record(entry_id, texts.get(namespace) or texts.setdefault(namespace, namespace.decode()),
                  mm_hash.decode(), nbytes, values[:ndim],
                  texts.get(dtype) or texts.setdefault(dtype, dtype.decode()), runs,
                  checksum=checksum)


def encode_version() -> bytes:
    """The format this daemon writes (at VERSION_AT): an adopted format-1
    index becomes a format-2 one (its READY records stay readable)."""
    return struct.pack("<I", FORMAT_VERSION)


def encode_ids(below: int) -> bytes:
    """The id reservation (written at IDS_AT): ids below `below` may be in use."""
    return _IDS.pack(below)
