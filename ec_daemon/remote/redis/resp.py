"""The Redis protocol where redis-py's costs a copy: commands whose large
arguments go to the socket as they are, and a bulk reply read straight into
a buffer of its own (`store` uses both for values).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from redis._parsers import BaseParser
from redis.connection import Connection, PythonRespSerializer, SSLConnection
from redis.exceptions import InvalidResponse

from ec_daemon.core.limits import REPLY_SLACK_BYTES, SMALL_PART_BYTES


class FastConnection(Connection):
    """Sends large arguments to the socket as they are. With hiredis installed
    redis-py packs every command through hiredis, which copies a payload
    twice (10x the CPU of a 32 MiB put); reads still use the hiredis parser."""

    def _construct_command_packer(self, packer: Any) -> Any:
        return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


class FastSSLConnection(SSLConnection):
    __doc__ = FastConnection.__doc__

    def _construct_command_packer(self, packer: Any) -> Any:
        return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


def command(*args: bytes) -> bytes:
    """A command of small arguments in RESP."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


def read_bulk(connection: Any, most: int) -> memoryview | None:
    """The reply to the one command in flight on `connection`, a bulk string
    of at most `most` bytes, read from its socket straight into a buffer of
    its own (hiredis copies a reply twice on its way to a bytes object, and
    a promotion copies it once more: a 1 MiB promotion took 1.0-1.4x the
    time of a plain GET). None for a nil reply; an error reply raises its ResponseError; a
    longer string or any other reply raises InvalidResponse. Reads nothing
    past the reply (the server sends nothing else meanwhile)."""
    sock = connection._sock
    buffer = bytearray(most + REPLY_SLACK_BYTES)
    view = memoryview(buffer)
    got = 0
    while (end := buffer.find(b"\r\n", 0, got)) < 0:
        if got == len(buffer):
            raise InvalidResponse("a reply line longer than the buffer")
        got += _received(sock, view[got:])
    kind, line = buffer[:1], bytes(buffer[1:end])
    if kind == b"-":
        raise BaseParser.parse_error(line.decode(errors="replace"))
    if kind != b"$" or not re.fullmatch(rb"-?[0-9]{1,20}", line):
        raise InvalidResponse(f"expected a bulk string, got {bytes(buffer[:end][:40])!r}")
    length = int(line)
    if length < 0:
        return None
    start = end + 2
    if length > most or start + length + 2 > len(buffer):
        raise InvalidResponse(f"a bulk string of {length} bytes, more than the {most} asked")
    while got < start + length + 2:
        got += _received(sock, view[got:start + length + 2])
    if buffer[start + length:start + length + 2] != b"\r\n":
        raise InvalidResponse("a bulk string not ended by CRLF")
    return view[start:start + length]


def _received(sock: Any, into: memoryview) -> int:
    count = int(sock.recv_into(into))
    if not count:
        raise ConnectionError("the store closed the connection")
    return count


def set_command(key: str, parts: Sequence[bytes | memoryview], ttl_ms: int
                 ) -> list[bytes | memoryview]:
    """SET key value PX ttl_ms in RESP, the value being the concatenation of
    `parts`, sent as they are: redis-py needs a value in one buffer (a copy of
    the payload), or a MULTI, SET, APPEND and EXEC (4 commands, 0.1 ms more
    CPU per MiB). Parts under SMALL_PART_BYTES are joined to their neighbours
    (fewer sends)."""
    name = key.encode()
    views = [memoryview(part).cast("B") for part in parts]
    ttl = b"%d" % ttl_ms
    pieces: list[bytes | memoryview] = [
        b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(name), name, sum(map(len, views)))]
    for view in [*views, memoryview(b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(ttl), ttl))]:
        if len(view) < SMALL_PART_BYTES and isinstance(pieces[-1], bytes):
            pieces[-1] += view
        else:
            pieces.append(view if len(view) >= SMALL_PART_BYTES else bytes(view))
    return pieces
