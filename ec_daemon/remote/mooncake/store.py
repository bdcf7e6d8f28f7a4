"""The second tier on Mooncake Store: the store vLLM's own Mooncake EC
connector (`cross_encoder_cache`) and SGLang keep encoder outputs in, in
vLLM's key scheme and value format (`format`), so a fleet where some engines
use vLLM's connector and others sit behind ec-daemon shares one set of
entries. `MooncakeStore` is the calls its backend (`backend`) makes of it:
values read into and written from the daemon's region, claims (`claims`).

The store namespace is the engine's (`ec_client.identity`: model identity,
revision, the multimodal config's hash, dtype, key version). vLLM's reader
reads only the value; ec-daemon reads the value and, when it is there, the
checksum beside it, and serves nothing that fails either. A value vLLM wrote
has no checksum: it is checked for everything its format carries (magic,
dtype, shape against its size), which is all vLLM itself checks.

One copy, not zero: the transfer engine reads and writes only registered
memory, and every peer that reaches a transfer engine may read and write
every buffer registered with it, so the region is never registered and
bytes pass through private registered buffers (`buffers`). The region is
read and written as the rest of the daemon does it: pread and pwrite through
the daemon's own descriptor (`durable.region.Region`), never a mapping, so a
client that truncates the region cannot kill the daemon with SIGBUS. A
publication is read from its pages (pread, into memory of this process no
peer can reach), checksummed there, copied with vLLM's header into a buffer
and put; a promotion is read into a buffer, then copied chunk by chunk into a
private scratch, verified there and written from it into the pages allocated
for it (pwrite), before it is committed. (A mapping of the pages promoted
into cost a fault per page, about 0.6 ms per MiB, more than the read.)

A transfer from a host that died fails after about 1 s until the master
forgets its segment: RemotePeerError, which does not count against the
master's circuit breaker. Objects have no TTL in Mooncake (they stay until
evicted), so --remote-ttl-seconds does not apply.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ec_daemon.core.events import Fetched
from ec_daemon.core.limits import COPY_CHUNK, STORE_TIMEOUT_S
from ec_daemon.remote import values
from ec_daemon.remote.backend import Extent, Published, RegionPages
from ec_daemon.remote.budget import PromotionBudget
from ec_daemon.remote.common import LocalWriteError, RemoteError, RemotePeerError
from ec_daemon.remote.mooncake.buffers import TransferBuffers
from ec_daemon.remote.mooncake.claims import Claims
from ec_daemon.remote.mooncake.codec import (
    HEADER,
    ITEM_BYTES,
    SIDECAR,
    parse_header,
    storable,
    value_key,
    vllm_header,
)
from ec_daemon.remote.mooncake.connection import (
    INVALID_PARAMS,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    Connection,
    error,
    first,
)
from ec_daemon.remote.mooncake.url import MooncakeSpec, check_backend, parse_url


def open_store(url: str, *, token_file: str = "", timeout_s: float = STORE_TIMEOUT_S,
               budget: PromotionBudget | None = None) -> MooncakeStore:
    """A store for a mooncake:// `url`; connects in the background. Raises
    ValueError for a bad URL."""
    if token_file:
        raise ValueError("a Mooncake store takes no token file (--remote-token-file)")
    spec = parse_url(url)
    check_backend()
    return MooncakeStore(spec, timeout_s=timeout_s, budget=budget)


class _Scratch(threading.local):
    """Each thread's private chunk (`_write_region`): none until it needs one."""

    chunk = memoryview(b"")


class MooncakeStore:
    """One Mooncake client (`connection`), its transfer buffers (`buffers`)
    and claims (`claims`). Keys are (store namespace, mm_hash). Thread-safe."""

    def __init__(self, spec: MooncakeSpec, *, timeout_s: float = STORE_TIMEOUT_S,
                 client_factory: Any = None, budget: PromotionBudget | None = None) -> None:
        """`budget`: the promotion budget every transfer buffer counts against."""
        self.spec = spec
        self.timeout_s = timeout_s
        self.connection = Connection(spec, timeout_s=timeout_s, client_factory=client_factory)
        self.buffers = TransferBuffers(self.connection, budget)
        self.claims = Claims(self.connection)
        self._scratch = _Scratch()  # a private chunk per thread (promotions)

    def __repr__(self) -> str:
        return f"MooncakeStore({self.spec.display})"

    def domain(self, namespace: str, mm_hash: str) -> str:
        """One failure domain: the master (values sit on many hosts' segments,
        but every call goes through it)."""
        return self.spec.master

    def ping(self) -> None:
        self.connection.ping()

    def close(self) -> None:
        self.connection.close()

    # -- claims

    def claim(self, store_namespace: str, mm_hash: str, token: str, ttl_s: float,
              deadline: float | None = None) -> bool:
        """`Claims.claim`."""
        return self.claims.claim(store_namespace, mm_hash, token, ttl_s, deadline)

    def claim_many(self, keys: Sequence[tuple[str, str]], token: str,
                   ttl_s: float) -> list[bool | None]:
        """`Claims.claim_many`."""
        return self.claims.claim_many(keys, token, ttl_s)

    def release(self, store_namespace: str, mm_hash: str, token: str) -> None:
        """`Claims.release`."""
        self.claims.release(store_namespace, mm_hash, token)

    # -- values

    def present(self, keys: Sequence[tuple[str, str]]) -> list[bool]:
        """Whether each (store namespace, mm_hash) value exists now."""
        if not keys:
            return []
        client, _ = self.connection.ready()
        states = client.batch_is_exist([value_key(ns, h) for ns, h in keys])
        if not isinstance(states, list) or len(states) != len(keys) or \
                any(s not in (0, 1) for s in states):
            raise RemoteError(f"batch_is_exist failed: {states!r}"[:200])
        return [s == 1 for s in states]

    def put_entry(self, store_namespace: str, mm_hash: str, shape: tuple[int, ...],
                  dtype: str, region: RegionPages, extents: Sequence[Extent],
                  current: Callable[[], bool] | None = None) -> Published:
        """Publish an entry from its pages: read (pread) and checksummed in
        this process's memory, copied with vLLM's header into a transfer
        buffer, the pages' stamp checked (`current()`: they still held the
        entry when read, so the copy is the checksummed bytes), put, then
        ec-daemon's checksum beside it. Returns "stored", "exists" (another
        writer's value: left alone, values are write-once) or "rewritten"
        (the pages were reused: nothing written). Raises RemoteError,
        ValueError for an entry the format cannot carry."""
        if not storable(shape, dtype):
            raise ValueError(f"vLLM's value format carries 2-D float32/float16/bfloat16 "
                             f"tensors, not {dtype} {tuple(shape)}")
        nbytes = sum(length for _, length in extents)
        if nbytes != shape[0] * shape[1] * ITEM_BYTES[dtype]:
            raise ValueError(f"{nbytes} bytes do not make a {dtype} {tuple(shape)} tensor")
        key = value_key(store_namespace, mm_hash)
        client, generation = self.connection.ready()
        _inside(region, extents)
        if client.is_exist(key) == 1:
            return "exists"  # (vLLM's writers skip existing keys too)
        pages = region.read(extents)
        sidecar = values.encode(store_namespace, mm_hash, shape, dtype, pages)[0]
        with self.buffers.buffer(client, generation, HEADER.size + nbytes) as (buffer, address):
            buffer[:HEADER.size] = vllm_header(shape, dtype)
            at = HEADER.size
            for page in pages:
                buffer[at:at + len(page)] = page
                at += len(page)
            if current is not None and not current():
                return "rewritten"
            code = client.put_from(key, address, HEADER.size + nbytes)
        if code == OBJECT_ALREADY_EXISTS:
            return "exists"
        if code == TRANSFER_FAIL:
            raise RemotePeerError(f"put {key}: {error(code)} (placed on a host that is gone)")
        if code != 0:
            raise RemoteError(f"put {key}: {error(code)}")
        # A checksum already there is stale (its value was evicted, ours is new)
        # or squatted (an item named "<hash>@ecd1"): ours replaces it.
        client.remove(key + SIDECAR, True)
        code = client.put(key + SIDECAR, bytes(sidecar))
        if code not in (0, OBJECT_ALREADY_EXISTS):
            raise RemoteError(f"put {key}{SIDECAR}: {error(code)}")
        return "stored"

    def head(self, store_namespace: str, mm_hash: str) -> Fetched | None:
        """The value's shape, dtype and size, and ec-daemon's checksum header
        beside it (`Fetched.header`); None when absent. A value ec-daemon
        published is described by its checksum's header, read alone (one
        store read: the value's own header is checked against it when the
        value is read, `get_into`); one vLLM wrote, by its header. (A
        checksum whose value was evicted reads as found; the value's read
        then finds nothing: a miss.) Raises values.BadValue for a header that
        is not vLLM's format, or a checksum beside a value that describes no
        value of that format or names another key."""
        key = value_key(store_namespace, mm_hash)
        client, generation = self.connection.ready()
        with self.buffers.buffer(client, generation, values.MAX_HEADER_BYTES) as (buffer,
                                                                                  address):
            code = client.get_into(key + SIDECAR, address, values.MAX_HEADER_BYTES)
            sidecar = bytes(buffer[:code]) if isinstance(code, int) and code >= 0 else None
        refused: values.BadValue | None = None
        if sidecar is None and code != OBJECT_NOT_FOUND:
            size = client.get_size(key + SIDECAR) if code == INVALID_PARAMS else None
            if not (isinstance(size, int) and size > values.MAX_HEADER_BYTES):
                if code == TRANSFER_FAIL:
                    raise RemotePeerError(f"get {key}{SIDECAR}: {error(code)}")
                raise RemoteError(f"get {key}{SIDECAR}: {error(code)}")
            refused = values.BadValue(f"ec-daemon's header beside the value is {size} bytes: "
                                      "malformed")
        if sidecar is not None:
            try:
                stated, dtype, nbytes = values.parse_header(
                    sidecar, namespace=store_namespace, mm_hash=mm_hash)[:3]
            except values.BadValue as exc:  # (once the value is known to be there: else a miss)
                refused = values.BadValue(f"ec-daemon's header beside the value: {exc}")
            else:
                if storable(stated, dtype) and all(0 < d < 1 << 32 for d in stated) \
                        and nbytes == stated[0] * stated[1] * ITEM_BYTES[dtype]:
                    return Fetched((int(stated[0]), int(stated[1])), dtype, nbytes,
                                 header=sidecar)
                refused = values.BadValue(f"ec-daemon's header says {dtype} {stated}, "
                                          f"{nbytes} bytes: no value of vLLM's format")
        with self.buffers.buffer(client, generation, HEADER.size) as (buffer, address):
            result = client.get_into_ranges([address], [[key]], [[[0]]], [[[0]]],
                                            [[[HEADER.size]]])
            code = first(result)
            header = bytes(buffer[:HEADER.size])
        if code == OBJECT_NOT_FOUND:
            return None
        if code != HEADER.size:
            size = client.get_size(key) if code == INVALID_PARAMS else code
            if isinstance(size, int) and 0 <= size < HEADER.size:
                raise values.BadValue(f"value of {size} bytes, shorter than vLLM's header")
            if code == TRANSFER_FAIL:
                raise RemotePeerError(f"get {key} (header): {error(code)}")
            raise RemoteError(f"get {key} (header): {error(code)}")
        shape, dtype = parse_header(header)
        if refused is not None:
            raise refused
        return Fetched(shape, dtype, shape[0] * shape[1] * ITEM_BYTES[dtype])

    def get_into(self, store_namespace: str, mm_hash: str, found: Fetched, region: RegionPages,
                 extents: Sequence[Extent]) -> bool:
        """Read the value and write its payload into `extents` of `region`,
        verified on its way in where no peer can change it (`_write_region`):
        its header against what `head` found, then ec-daemon's checksum when
        one is beside it. False when the value is gone; raises
        values.BadValue (the pages may hold unverified bytes: the caller
        aborts them), LocalWriteError or RemoteError."""
        if sum(length for _, length in extents) != found.nbytes:
            raise ValueError("the extents do not hold the value's payload")
        key = value_key(store_namespace, mm_hash)
        client, generation = self.connection.ready()
        _inside(region, extents)
        check = None if found.header is None else \
            values.Check(found.header, namespace=store_namespace, mm_hash=mm_hash)
        size = HEADER.size + found.nbytes
        with self.buffers.buffer(client, generation, size, covered=True) as (buffer, address):
            code = client.get_into(key, address, size)
            if code == size:
                header = bytes(buffer[:HEADER.size])
                if parse_header(header) != (found.shape, found.dtype):
                    raise values.BadValue(
                        "the value's header is not the one its head described (the value "
                        "was rewritten between its header and its read, or is not the "
                        "value its checksum is of)")
                self._write_region(region, buffer[HEADER.size:size], extents, check)
        if code == OBJECT_NOT_FOUND:
            return False
        if code != size:
            if code == INVALID_PARAMS or (isinstance(code, int) and code >= 0):
                raise values.BadValue(f"not the value whose header was read ({error(code)})")
            if code == TRANSFER_FAIL:
                raise RemotePeerError(f"get {key}: {error(code)}")
            raise RemoteError(f"get {key}: {error(code)}")
        if check is not None:
            check.done()
        return True

    def forget(self, store_namespace: str, mm_hash: str) -> None:
        """Remove a value whose checksum does not match it, and the checksum
        (a publication racing another writer's, or a stale checksum): the
        key is published again, whole, by the next host that encodes it."""
        key = value_key(store_namespace, mm_hash)
        client, _ = self.connection.ready()
        client.remove(key, True)
        client.remove(key + SIDECAR, True)

    def _write_region(self, region: RegionPages, source: memoryview,
                      extents: Sequence[Extent], check: values.Check | None) -> None:
        """Write `source` (a registered buffer's bytes: any peer may change
        them meanwhile) across `extents` of `region`, a chunk at a time. With
        `check`, each chunk is first copied into this thread's private
        scratch, checked there and written from there: what is verified is
        what the pages receive, in one pass. (Without one there is nothing to
        verify: a value vLLM wrote is checked for its format only.) Raises
        LocalWriteError when the region's file refuses a write (the pages
        then hold unverified bytes)."""
        if sum(length for _, length in extents) != len(source):
            raise ValueError(f"{len(source)} bytes do not fill the extents")
        scratch = self._scratch.chunk
        if check is not None and len(scratch) < COPY_CHUNK:
            scratch = self._scratch.chunk = memoryview(bytearray(COPY_CHUNK))
        at = 0
        try:
            for offset, length in extents:
                end = offset + length
                while offset < end:
                    size = min(COPY_CHUNK, end - offset)
                    piece = source[at:at + size]
                    if check is not None:
                        scratch[:size] = piece
                        piece = scratch[:size]
                        check.update(piece)
                    region.write([(offset, size)], [piece])
                    offset, at = offset + size, at + size
        except OSError as exc:
            raise LocalWriteError(f"writing into the region failed: {exc}") from exc


def _inside(region: RegionPages, extents: Sequence[Extent]) -> None:
    for offset, length in extents:
        if offset < 0 or length < 0 or offset + length > region.size:
            raise ValueError(f"extent ({offset}, {length}) is outside the region")
