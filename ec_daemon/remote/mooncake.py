"""The second tier on Mooncake Store: the store vLLM's own Mooncake EC
connector (`cross_encoder_cache`) and SGLang keep encoder outputs in, moving
bytes straight between the daemon's region and the store.

Keys and values are vLLM's (`mooncake_store_embedding`, key scheme v3), so a
fleet where some engines use vLLM's connector and others sit behind ec-daemon
shares one set of entries::

    <store namespace>@id:<mm_hash>          the value: vLLM's 24-byte header
                                            (<IIQQ: magic, dtype code, tokens,
                                            hidden) then the payload
    <store namespace>@id:<mm_hash>@ecd1     beside it, ec-daemon's own header
                                            (values.py: the key, shape, dtype,
                                            size and an xxh3 checksum of the
                                            header and payload), no payload
    <store namespace>@id:<mm_hash>@ecd1-claim
                                            a claim: "<token> <expiry ms>"

The store namespace is the engine's (`ec_client.storekeys`: model identity,
revision, the multimodal config's hash, dtype, key version). vLLM's reader
reads only the value; ec-daemon reads the value and, when it is there, the
checksum beside it, and serves nothing that fails either. A value vLLM wrote
has no checksum: it is checked for everything its format carries (magic,
dtype, shape against its size), which is all vLLM itself checks.

One copy, not zero: the transfer engine reads and writes only registered
memory, and every peer that reaches a transfer engine may read and write every
buffer registered with it (a peer's `transfer_sync_write` rewrote one in our
test). Registering the region would let any host on the fabric rewrite entries
this host serves, past every check. So bytes pass through private
registered buffers: a publication is checksummed in the region's pages (a
read-only mapping), copied out and put; a promotion is read into a buffer,
then copied chunk by chunk into a private scratch, verified there (where no
peer can reach) and written from it into the pages allocated for it with
pwrite, before it is committed. The daemon never maps the pages it promotes
into: a fault per page (about 0.6 ms per MiB here) cost more than the read
(docs/performance.md: what the copy costs).

Mooncake has no atomic "set if absent": a put on an existing key succeeds
without writing. A claim is therefore taken by a put and confirmed by reading
the claim back (the master orders the puts: one token wins); it carries its
expiry by the claimant's clock, so a claim whose host died is taken over
once it expired (clocks off by more than the slack cost an extra encode or a
bounded wait, never a wrong hit). A claim is put on the claimant's own
segment: the master would place it on any, a dead host's among them until
it forgets that host, and the put then fails after about 1 s. Objects have
no TTL in Mooncake (they stay until evicted), so --remote-ttl does not apply.

Every transfer buffer, in use or pooled, counts against the promotion
budget (`use_budget`): sized to the next power of two and pooled up to
POOL_BYTES, they held about twice --remote-promotion-bytes plus the pool.

`setup` blocks for up to 90 s when the master is unreachable, and holds the
interpreter's lock while it does (every thread of the daemon stops), so the
store connects on its own thread, calls `setup` only once the master and the
metadata server accept a connection, and keeps trying; until it is connected,
every call raises RemoteError (misses, dropped publications). Calls to a
master that does not answer end after MC_RPC_TIMEOUT_MS (set from the store's
timeout, unless set), not Mooncake's 30 s. A transfer from a host that died
fails after about 1 s until the master forgets its segment: RemotePeerError,
which does not count against the master's circuit breaker.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from ec_daemon.remote import values
from ec_daemon.remote.backend import (
    Head,
    LocalWriteError,
    ProbedStore,
    Published,
    RemoteError,
    RemotePeerError,
)
from ec_daemon.remote.budget import PromotionBudget, Reservation
from ec_daemon.sizes import parse_size
from ec_protocol.dtypes import ELEMENT_BYTES

log = logging.getLogger("ec_daemon.remote")

ACCEPTED_URLS = ("mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata"
                 "|P2PHANDSHAKE&protocol=tcp|rdma&device=NAME&segment=SIZE&buffer=SIZE"
                 "&local_hostname=HOST")
KEY_VERSION = "v3"  # vLLM's EMBEDDING_CACHE_KEY_VERSION: the value format below
MAGIC = 0x4D4F4F4E
HEADER = struct.Struct("<IIQQ")  # magic, dtype code, tokens, hidden
DTYPE_CODES = {"float32": 0, "float16": 11, "bfloat16": 12}
CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}
ITEM_BYTES = {name: ELEMENT_BYTES[name] for name in DTYPE_CODES}
SIDECAR = "@ecd1"
CLAIM = "@ecd1-claim"
CLAIM_SLACK_MS = 2000  # a claim past its expiry by this much (by our clock) is taken over
CLAIM_READ_S = 1.0  # a claim put but read as nothing this long: its host is gone, or the put failed
UNREACHABLE_READ_S = 0.5  # a read of a listed object that fails after this long: its host is gone
DEFAULT_SEGMENT = "1GiB"  # the daemon's share of the store's memory
DEFAULT_BUFFER = "64MiB"  # the client's buffer for small values (claims, checksums)
SETUP_RETRY_S = 2.0
SMALL_BUFFER_BYTES = 64 << 10  # the smallest transfer buffer
POOL_BYTES = 128 << 20  # transfer buffers kept for the next call, at most this in all
# (each counted against --remote-promotion-bytes: `MooncakeStore.use_budget`)
MAX_BOUNCE_BYTES = 1 << 30  # a value larger than this (header and payload) is not moved
COPY_CHUNK = 1 << 20  # a promotion's bytes are verified and written this much at a time
# Mooncake's error codes (types.h), as the binding returns them.
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
ERROR_NAMES = {
    -1: "failed", -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS",
    -702: "INVALID_REPLICA", -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
    -1700: "TENANT_QUOTA_EXCEEDED",
}


def storable(shape: Sequence[int], dtype: str) -> bool:
    """Whether vLLM's value format can carry an entry: a 2-D tensor of
    float32, float16 or bfloat16 (every encoder output vLLM makes)."""
    return len(shape) == 2 and dtype in DTYPE_CODES


def value_key(store_namespace: str, mm_hash: str) -> str:
    return f"{store_namespace}@id:{mm_hash}"


def vllm_header(shape: Sequence[int], dtype: str) -> bytes:
    return HEADER.pack(MAGIC, DTYPE_CODES[dtype], int(shape[0]), int(shape[1]))


@dataclass(frozen=True)
class MooncakeSpec:
    """A parsed mooncake:// URL."""

    host: str
    port: int
    metadata: str
    protocol: str
    device: str
    segment_bytes: int
    buffer_bytes: int
    local_hostname: str

    @property
    def master(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def display(self) -> str:
        return f"mooncake://{self.master}"


def open_store(url: str, *, token_file: str = "", timeout_s: float = 2.0) -> MooncakeStore:
    """A store for a mooncake:// `url`; connects in the background. Raises
    ValueError for a bad URL."""
    if token_file:
        raise ValueError("a Mooncake store takes no token file (--remote-token-file)")
    spec = parse_url(url)
    check_backend()
    return MooncakeStore(spec, timeout_s=timeout_s)


def check_backend() -> None:
    """Raise ValueError, saying how to install it, unless Mooncake's binding
    loads (at start: not on the connecting thread later)."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        hint = " (apt-get install libibverbs1)" if "ibverbs" in str(exc) else ""
        raise ValueError(f"the Mooncake backend cannot load: {exc}{hint}; install it with "
                         f"pip install 'ec-daemon[mooncake]'") from None


def parse_url(url: str) -> MooncakeSpec:
    """Parse a mooncake:// --remote URL; ValueError naming the accepted form."""

    def bad(reason: str) -> ValueError:
        return ValueError(f"invalid remote store URL {url!r}: {reason}; accepted: "
                          f"{ACCEPTED_URLS}")

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "mooncake":
        raise bad("not a mooncake:// URL")
    netloc, _, query = rest.partition("?")
    netloc, slash, path = netloc.partition("/")
    if slash and path:
        raise bad("no path is accepted")
    if "@" in netloc:
        raise bad("no credentials go in the URL")
    try:
        parts = urlsplit("//" + netloc)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise bad(str(exc)) from None
    if not host or port is None:
        raise bad("the master's HOST:PORT is required")
    options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    known = {"metadata", "protocol", "device", "segment", "buffer", "local_hostname"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise bad(f"unknown option(s) {', '.join(unknown)}")
    metadata = unquote(options.get("metadata", ""))
    if not metadata:
        raise bad("metadata= is required: the metadata server's URL "
                  "(http://HOST:PORT/metadata, etcd://HOST:PORT) or P2PHANDSHAKE")
    protocol = options.get("protocol", "tcp").lower()
    if protocol not in ("tcp", "rdma"):
        raise bad(f"protocol must be tcp or rdma, got {protocol!r}")
    try:
        segment = parse_size(options.get("segment", DEFAULT_SEGMENT))
        buffer = parse_size(options.get("buffer", DEFAULT_BUFFER))
    except ValueError as exc:
        raise bad(str(exc)) from None
    if segment <= 0 or buffer <= 0:
        raise bad("segment and buffer must be positive sizes")
    return MooncakeSpec(host=host, port=port, metadata=metadata, protocol=protocol,
                        device=options.get("device", ""), segment_bytes=segment,
                        buffer_bytes=buffer,
                        local_hostname=options.get("local_hostname", "") or _local_ip(host))


def _local_ip(master_host: str) -> str:
    """The address this host reaches the master from (a UDP socket's
    route: nothing is sent); loopback for a master on loopback."""
    if master_host in ("localhost",) or master_host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _servers(spec: MooncakeSpec) -> list[tuple[str, tuple[str, int]]]:
    """The servers `setup` talks to: the master, and the metadata server when
    it has an address (not P2PHANDSHAKE)."""
    servers = [("master", (spec.host, spec.port))]
    try:
        parts = urlsplit(spec.metadata)
        host, port = parts.hostname, parts.port
    except ValueError:
        return servers
    default = {"http": 80, "https": 443, "etcd": 2379}.get(parts.scheme.lower())
    if host and default is not None:
        servers.append(("metadata server", (host, port or default)))
    return servers


def _error(code: Any) -> str:
    return f"{code} ({ERROR_NAMES.get(code, 'unknown')})" if isinstance(code, int) else repr(code)


def buffer_bytes(size: int) -> int:
    """The capacity of the transfer buffer a call of `size` bytes gets: a
    multiple of SMALL_BUFFER_BYTES, rounded up to an eighth of its power of
    two (a pooled buffer then serves calls of nearby sizes, and wastes less
    than 1/8 or 64 KiB; a power of two wasted up to half, uncounted)."""
    if size <= SMALL_BUFFER_BYTES:
        return SMALL_BUFFER_BYTES
    step = max(SMALL_BUFFER_BYTES, 1 << max(0, (size - 1).bit_length() - 4))
    return -(-size // step) * step


class BuffersSpent(RemotePeerError):
    """No transfer buffer fits --remote-promotion-bytes now: nothing was
    asked of the store, so this does not count against its breaker."""


@dataclass
class _Transfer:
    """A registered transfer buffer and the budget it holds (None: covered
    by the reservation of the promotion using it)."""

    buffer: ctypes.Array[ctypes.c_char]
    held: Reservation | None


class _Scratch(threading.local):
    """Each thread's private chunk (`_write_region`): none until it needs one."""

    chunk = memoryview(b"")


class MooncakeStore(ProbedStore):
    """One MooncakeDistributedStore client. Thread-safe (the binding is; our
    own state sits behind `_lock`)."""

    def __init__(self, spec: MooncakeSpec, *, timeout_s: float = 2.0,
                 client_factory: Any = None) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self._factory = client_factory
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._client: Any = None
        self._generation = 0  # bumped on every (re)connection: registrations redone
        self._last_error = "not connected yet"
        self._region: mmap.mmap | None = None  # read-only: publications read from it
        self._region_file: Any = None  # promotions write into it (pwrite)
        self._region_size = 0
        self._region_view: memoryview | None = None
        self._scratch = _Scratch()  # a private chunk per thread (promotions)
        # Registered transfer buffers free for the next call (never freed while
        # registered: the next registration at that address would fail).
        self._pool: list[_Transfer] = []
        self._pool_generation = -1
        self._budget: PromotionBudget | None = None  # (`use_budget`)
        self._buffers_bytes = 0  # capacity of the buffers that exist, pooled or in use
        self._buffers_peak = 0
        self._placement: tuple[int, Any] | None = None  # (generation, claims' ReplicateConfig)
        self._thread = threading.Thread(target=self._connect_loop, name="ec-mooncake-setup",
                                        daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"MooncakeStore({self.spec.display})"

    # -- connection

    def _new_client(self) -> Any:
        if self._factory is not None:
            return self._factory()
        if self.spec.protocol == "tcp":
            # The transfer engine advertises its data address from this (else
            # the host's first interface, whatever local_hostname says).
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.spec.local_hostname)
        # A master that does not answer: calls end after this, not 30 s.
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(100, int(self.timeout_s * 1000))))
        from mooncake.store import MooncakeDistributedStore
        return MooncakeDistributedStore()

    def _connect_loop(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                if self._client is not None:
                    return
            unreachable = self._unreachable()
            if unreachable:
                if unreachable != self._last_error:
                    log.warning("Mooncake store %s: %s; trying again", self.spec.display,
                                unreachable)
                self._last_error = unreachable
                self._closed.wait(SETUP_RETRY_S)
                continue
            try:
                client = self._new_client()
                started = time.monotonic()
                code = client.setup(self.spec.local_hostname, self.spec.metadata,
                                    self.spec.segment_bytes, self.spec.buffer_bytes,
                                    self.spec.protocol, self.spec.device, self.spec.master)
            except Exception as exc:  # (an import error, a bad argument)
                self._last_error = f"setup: {type(exc).__name__}: {exc}"
                log.warning("Mooncake store %s: %s", self.spec.display, self._last_error)
                self._closed.wait(SETUP_RETRY_S)
                continue
            if code != 0:
                self._last_error = f"setup returned {_error(code)} after " \
                                   f"{time.monotonic() - started:.1f}s (master unreachable?)"
                log.warning("Mooncake store %s: %s; trying again", self.spec.display,
                            self._last_error)
                self._closed.wait(SETUP_RETRY_S)
                continue
            with self._lock:
                if self._closed.is_set():
                    _close_quietly(client)
                    return
                self._client = client
                self._generation += 1
            log.info("Mooncake store %s: connected (metadata %s, %s, segment %d bytes)",
                     self.spec.display, self.spec.metadata, self.spec.protocol,
                     self.spec.segment_bytes)
            return

    def _unreachable(self) -> str:
        """Why `setup` would block now (a server that does not accept a
        connection), or "" (it holds the interpreter's lock while it blocks)."""
        for what, address in _servers(self.spec):
            try:
                with socket.create_connection(address, timeout=self.timeout_s):
                    pass
            except OSError as exc:
                return f"{what} {address[0]}:{address[1]} unreachable ({exc})"
        return ""

    def _ready(self) -> tuple[Any, int]:
        if self._closed.is_set():
            raise RemoteError(f"{self.spec.display}: store closed")
        client = self._client
        if client is None:
            raise RemoteError(f"{self.spec.display}: not connected ({self._last_error})")
        return client, self._generation

    def ping(self) -> None:
        client, _ = self._ready()
        code = client.health_check()
        if code != 0:
            raise RemoteError(f"{self.spec.display}: health check {code} "
                              "(1: closed, 2: master unreachable)")

    def domain(self, namespace: str, mm_hash: str) -> str:
        """One failure domain: the master (values sit on many hosts' segments,
        but every call goes through it)."""
        return self.spec.master

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)
        # (A call still running holds its own references: the file is closed,
        # and the mapping unmapped, when the last one lets go.)
        self._region_view = self._region = self._region_file = None

    # -- the region

    def use_region(self, fd: int, size: int) -> None:
        """Publish from the region (`fd`, of `size` bytes) and promote into it:
        it is mapped read-only to publish from, and a duplicate of `fd` is
        written to promote. Neither is ever registered with the transfer
        engine: any peer that reaches a transfer engine may read and write
        every buffer registered with it (tested: a peer's
        `transfer_sync_write` rewrote one), and the region's entries are
        served as they are. Bytes pass through private registered buffers
        instead (one copy). Call it once, before the first publication."""
        self._region = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self._region_file = os.fdopen(os.dup(fd), "r+b", buffering=0)
        self._region_size = size
        self._region_view = memoryview(self._region)

    @property
    def mapped(self) -> bool:
        return self._region is not None

    def use_budget(self, budget: PromotionBudget) -> None:
        """Count every transfer buffer against `budget` (the tier's
        --remote-promotion-bytes): a buffer pooled or in use holds a
        reservation of its capacity, except one made for a promotion, whose
        own reservation (`promotion_bytes`) covers it until it is pooled.
        Call it once, before the first call that moves bytes."""
        self._budget = budget

    @staticmethod
    def promotion_bytes(nbytes: int) -> int:
        """What a promotion of a payload of `nbytes` reserves: the capacity
        of the transfer buffer its value is read into."""
        return buffer_bytes(HEADER.size + nbytes)

    @property
    def buffers_bytes(self) -> int:
        """Capacity of the transfer buffers that exist now (pooled or in use)."""
        return self._buffers_bytes

    @property
    def buffers_bytes_peak(self) -> int:
        return self._buffers_peak

    def trim(self) -> int:
        """Free the pooled buffers (unregistered; their reservations
        returned); the bytes freed."""
        with self._lock:
            pooled, self._pool = self._pool, []
            generation = self._pool_generation
        client = self._client
        for transfer in pooled:
            self._free(transfer, client if self._generation == generation else None)
        return sum(len(t.buffer) for t in pooled)

    def _free(self, transfer: _Transfer, client: Any) -> None:
        if client is not None:
            with contextlib.suppress(Exception):
                client.unregister_buffer(ctypes.addressof(transfer.buffer))
        if transfer.held is not None:
            transfer.held.release()
        with self._lock:
            self._buffers_bytes -= len(transfer.buffer)

    def _reserve(self, capacity: int) -> Reservation | None:
        """A reservation of `capacity` bytes for a buffer (None without a
        budget); the pool is trimmed when it does not fit. Raises
        BuffersSpent when it still does not."""
        budget = self._budget
        if budget is None:
            return None
        held = budget.reserve(capacity, capacity)
        if held is None and self.trim():
            held = budget.reserve(capacity, capacity)
        if held is None:
            raise BuffersSpent(f"no room for a {capacity}-byte transfer buffer in "
                               f"--remote-promotion-bytes ({budget.held} of {budget.limit} "
                               f"bytes held)")
        return held

    @contextmanager
    def _buffer(self, client: Any, generation: int, size: int,
                covered: bool = False) -> Iterator[tuple[memoryview, int]]:
        """A registered transfer buffer of at least `size` bytes for one call
        (a view of it and its address): the smallest pooled one that fits,
        else a new one of `buffer_bytes(size)`, given back to the pool after
        the call while the pool holds less than POOL_BYTES and the budget
        has room for it (else unregistered and freed). `covered`: the caller
        holds a reservation of `buffer_bytes(size)` (a promotion's); else a
        new buffer reserves its capacity (BuffersSpent when it cannot)."""
        if size > MAX_BOUNCE_BYTES:
            raise ValueError(f"a value of {size} bytes is larger than the largest transfer "
                             f"buffer ({MAX_BOUNCE_BYTES} bytes)")
        transfer = None
        with self._lock:
            if self._pool_generation != generation:
                stale, self._pool, self._pool_generation = self._pool, [], generation
            else:
                stale = []
            fits = [t for t in self._pool if len(t.buffer) >= size]
            if fits:
                transfer = min(fits, key=lambda t: len(t.buffer))
                self._pool.remove(transfer)
        for old in stale:  # (registered with a client that is gone)
            self._free(old, None)
        if transfer is None:
            capacity = buffer_bytes(size)
            held = None if covered else self._reserve(capacity)
            buffer = ctypes.create_string_buffer(capacity)
            code = client.register_buffer(ctypes.addressof(buffer), capacity)
            if code != 0:
                if held is not None:
                    held.release()
                raise RemoteError(f"registering a transfer buffer failed: {_error(code)}")
            transfer = _Transfer(buffer, held)
            with self._lock:
                self._buffers_bytes += capacity
                self._buffers_peak = max(self._buffers_peak, self._buffers_bytes)
        try:
            yield memoryview(transfer.buffer).cast("B"), ctypes.addressof(transfer.buffer)
        finally:
            self._give_back(transfer, client, generation)

    def _give_back(self, transfer: _Transfer, client: Any, generation: int) -> None:
        """Pool `transfer` after a call, or free it."""
        capacity = len(transfer.buffer)
        with self._lock:
            keep = self._pool_generation == generation and \
                sum(len(t.buffer) for t in self._pool) + capacity <= POOL_BYTES
        if keep and transfer.held is None and self._budget is not None:
            # (made under a promotion's reservation, released after the call)
            transfer.held = self._budget.reserve(capacity, capacity)
            keep = transfer.held is not None
        if keep:
            with self._lock:
                if self._pool_generation == generation:
                    self._pool.append(transfer)
                    return
        self._free(transfer, client if self._pool_generation == generation else None)

    def _drop(self, extents: Sequence[tuple[int, int]]) -> None:
        """Drop the pages under `extents` from the store's mapping once used
        (MADV_DONTNEED: the shared pages stay in the region): else every
        page ever published or promoted counts in the daemon's RSS, which the
        OOM killer reads, up to the whole region."""
        region = self._region
        if region is None:
            return
        page = mmap.PAGESIZE
        for offset, length in extents:
            start = offset - offset % page
            if start >= 0 and offset + length <= self._region_size and length > 0:
                with contextlib.suppress(ValueError, OSError):
                    region.madvise(mmap.MADV_DONTNEED, start, length + offset - start)

    def region_views(self, extents: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Read-only views of the region's bytes under `extents` (checked to
        lie in it)."""
        view = self._region_view
        if view is None:
            raise RemoteError("the store was given no region to read from or write into")
        self._inside(extents)
        return [view[offset:offset + length] for offset, length in extents]

    def _inside(self, extents: Sequence[tuple[int, int]]) -> None:
        for offset, length in extents:
            if offset < 0 or length < 0 or offset + length > self._region_size:
                raise ValueError(f"extent ({offset}, {length}) is outside the region")

    def _write_region(self, source: memoryview, extents: Sequence[tuple[int, int]],
                      check: values.Check | None) -> None:
        """Write `source` (a registered buffer's bytes: any peer may change
        them meanwhile) across `extents` with pwrite. With `check`, each chunk
        is first copied into this thread's private scratch, checked there and
        written from there: what is verified is what the pages receive, in
        one pass. (Without one there is nothing to verify: a value vLLM
        wrote is checked for its format only.) Raises LocalWriteError when the
        region's file refuses a write (the pages then hold unverified bytes)."""
        region = self._region_file  # (held: a close meanwhile leaves the file open)
        if region is None:
            raise LocalWriteError("the store was given no region to write into, or was closed")
        self._inside(extents)
        if sum(length for _, length in extents) != len(source):
            raise ValueError(f"{len(source)} bytes do not fill the extents")
        chunk = COPY_CHUNK
        scratch = self._scratch.chunk
        if check is not None and len(scratch) < chunk:
            scratch = self._scratch.chunk = memoryview(bytearray(chunk))
        fd = region.fileno()
        at = 0
        try:
            for offset, length in extents:
                end = offset + length
                while offset < end:
                    size = min(chunk, end - offset)
                    piece = source[at:at + size]
                    if check is not None:
                        scratch[:size] = piece
                        piece = scratch[:size]
                        check.update(piece)
                    while piece:
                        wrote = os.pwrite(fd, piece, offset)
                        if wrote <= 0:
                            raise OSError(f"pwrite at {offset} wrote nothing")
                        piece, offset, at = piece[wrote:], offset + wrote, at + wrote
        except OSError as exc:
            raise LocalWriteError(f"writing into the region failed: {exc}") from exc

    # -- values

    def present(self, keys: Sequence[tuple[str, str]]) -> list[bool]:
        """Whether each (store namespace, mm_hash) value exists now."""
        if not keys:
            return []
        client, _ = self._ready()
        states = client.batch_is_exist([value_key(ns, h) for ns, h in keys])
        if not isinstance(states, list) or len(states) != len(keys) or \
                any(s not in (0, 1) for s in states):
            raise RemoteError(f"batch_is_exist failed: {states!r}"[:200])
        return [s == 1 for s in states]

    def put_entry(self, store_namespace: str, mm_hash: str, shape: tuple[int, ...],
                  dtype: str, extents: Sequence[tuple[int, int]],
                  current: Callable[[], bool] | None = None) -> Published:
        """`_put_entry`, then the pages dropped from the store's mapping."""
        try:
            return self._put_entry(store_namespace, mm_hash, shape, dtype, extents, current)
        finally:
            self._drop(extents)

    def _put_entry(self, store_namespace: str, mm_hash: str, shape: tuple[int, ...],
                   dtype: str, extents: Sequence[tuple[int, int]],
                   current: Callable[[], bool] | None = None) -> Published:
        """Publish an entry from its pages: checksummed in place, copied with
        vLLM's header into this thread's transfer buffer, the pages' stamp
        checked (`current()`: they still hold the entry, so the copy is the
        checksummed bytes), put, then ec-daemon's checksum beside it. Returns
        "stored", "exists" (another writer's value: left alone, values are
        write-once) or "rewritten" (the pages were reused: nothing written).
        Raises RemoteError, ValueError for an entry the format cannot carry."""
        if not storable(shape, dtype):
            raise ValueError(f"vLLM's value format carries 2-D float32/float16/bfloat16 "
                             f"tensors, not {dtype} {tuple(shape)}")
        nbytes = sum(length for _, length in extents)
        if nbytes != shape[0] * shape[1] * ITEM_BYTES[dtype]:
            raise ValueError(f"{nbytes} bytes do not make a {dtype} {tuple(shape)} tensor")
        key = value_key(store_namespace, mm_hash)
        client, generation = self._ready()
        pages = self.region_views(extents)
        if client.is_exist(key) == 1:
            return "exists"  # (vLLM's writers skip existing keys too)
        sidecar = values.encode(store_namespace, mm_hash, shape, dtype, pages)[0]
        with self._buffer(client, generation, HEADER.size + nbytes) as (buffer, address):
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
            raise RemotePeerError(f"put {key}: {_error(code)} (placed on a host that is gone)")
        if code != 0:
            raise RemoteError(f"put {key}: {_error(code)}")
        # A checksum already there is stale (its value was evicted, ours is new)
        # or squatted (an item named "<hash>@ecd1"): ours replaces it.
        client.remove(key + SIDECAR, True)
        code = client.put(key + SIDECAR, bytes(sidecar))
        if code not in (0, OBJECT_ALREADY_EXISTS):
            raise RemoteError(f"put {key}{SIDECAR}: {_error(code)}")
        return "stored"

    def head(self, store_namespace: str, mm_hash: str) -> Head | None:
        """The value's shape, dtype and size, and ec-daemon's checksum beside
        it; None when absent. A value ec-daemon published is described by
        its checksum's header, read alone (one store read: the value's own
        header is checked against it when the value is read, `get_into`);
        one vLLM wrote, by its header. (A checksum whose value was evicted
        reads as a head; the value's read then finds nothing: a miss.)
        Raises values.BadValue for a header that is not vLLM's format, or a
        checksum beside a value that describes no value of that format or
        names another key."""
        key = value_key(store_namespace, mm_hash)
        client, generation = self._ready()
        with self._buffer(client, generation, values.MAX_HEADER_BYTES) as (buffer, address):
            code = client.get_into(key + SIDECAR, address, values.MAX_HEADER_BYTES)
            sidecar = bytes(buffer[:code]) if isinstance(code, int) and code >= 0 else None
        refused: values.BadValue | None = None
        if sidecar is None and code != OBJECT_NOT_FOUND:
            size = client.get_size(key + SIDECAR) if code == -600 else None
            if not (isinstance(size, int) and size > values.MAX_HEADER_BYTES):
                if code == TRANSFER_FAIL:
                    raise RemotePeerError(f"get {key}{SIDECAR}: {_error(code)}")
                raise RemoteError(f"get {key}{SIDECAR}: {_error(code)}")
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
                    return Head((int(stated[0]), int(stated[1])), dtype, nbytes, sidecar)
                refused = values.BadValue(f"ec-daemon's header says {dtype} {stated}, "
                                          f"{nbytes} bytes: no value of vLLM's format")
        with self._buffer(client, generation, HEADER.size) as (buffer, address):
            result = client.get_into_ranges([address], [[key]], [[[0]]], [[[0]]],
                                            [[[HEADER.size]]])
            code = _first(result)
            header = bytes(buffer[:HEADER.size])
        if code == OBJECT_NOT_FOUND:
            return None
        if code != HEADER.size:
            size = client.get_size(key) if code == -600 else code
            if isinstance(size, int) and 0 <= size < HEADER.size:
                raise values.BadValue(f"value of {size} bytes, shorter than vLLM's header")
            if code == TRANSFER_FAIL:
                raise RemotePeerError(f"get {key} (header): {_error(code)}")
            raise RemoteError(f"get {key} (header): {_error(code)}")
        shape, dtype = _parse_header(header)
        if refused is not None:
            raise refused
        return Head(shape, dtype, shape[0] * shape[1] * ITEM_BYTES[dtype], None)

    def get_into(self, store_namespace: str, mm_hash: str, head: Head,
                 extents: Sequence[tuple[int, int]]) -> bool:
        """Read the value and write its payload into `extents` (the region),
        verified on its way in where no peer can change it (`_write_region`):
        its header against the head, then ec-daemon's checksum when one is
        beside it. False when the value is gone; raises values.BadValue (the
        pages may hold unverified bytes: the caller aborts them) or
        RemoteError."""
        if sum(length for _, length in extents) != head.nbytes:
            raise ValueError("the extents do not hold the value's payload")
        key = value_key(store_namespace, mm_hash)
        client, generation = self._ready()
        self._inside(extents)
        check = None if head.sidecar is None else \
            values.Check(head.sidecar, namespace=store_namespace, mm_hash=mm_hash)
        size = HEADER.size + head.nbytes
        with self._buffer(client, generation, size, covered=True) as (buffer, address):
            code = client.get_into(key, address, size)
            if code == size:
                header = bytes(buffer[:HEADER.size])
                if _parse_header(header) != (head.shape, head.dtype):
                    raise values.BadValue(
                        "the value's header is not the one its head described (the value "
                        "was rewritten between its header and its read, or is not the "
                        "value its checksum is of)")
                self._write_region(buffer[HEADER.size:size], extents, check)
        if code == OBJECT_NOT_FOUND:
            return False
        if code != size:
            if code == -600 or (isinstance(code, int) and code >= 0):
                raise values.BadValue(f"not the value whose header was read ({_error(code)})")
            if code == TRANSFER_FAIL:
                raise RemotePeerError(f"get {key}: {_error(code)}")
            raise RemoteError(f"get {key}: {_error(code)}")
        if check is not None:
            check.done()
        return True

    # -- claims

    def claim(self, store_namespace: str, mm_hash: str, token: str, ttl_s: float,
              deadline: float | None = None) -> bool:
        """Take the key's claim for ttl_s unless another live token holds it
        (a put, then the claim read back: the master keeps the first put).
        `deadline` (monotonic): no store read starts after it (one already
        running may end up to about 1 s later, a host that is gone), and the
        claim counts as taken, unconfirmed. Default: CLAIM_READ_S from now."""
        key = value_key(store_namespace, mm_hash) + CLAIM
        client, generation = self._ready()
        if deadline is None:
            deadline = time.monotonic() + CLAIM_READ_S
        for _attempt in range(2):
            expires = int(time.time() * 1000 + ttl_s * 1000)
            code = client.put(key, f"{token} {expires}".encode(),
                              self._claim_placement(client, generation))
            if code == TRANSFER_FAIL:
                break  # (placed on a host that is gone: not confirmed)
            if code not in (0, OBJECT_ALREADY_EXISTS):
                raise RemoteError(f"put {key}: {_error(code)}")
            raw = self._read_claim(client, key, deadline)
            if not raw:
                if client.is_exist(key) == 1:
                    # There but unreadable for a while (a claim being written
                    # is readable within milliseconds): its bytes sit on a
                    # host that is gone (the master forgets its segment only
                    # later). Taken over.
                    client.remove(key, True)
                if time.monotonic() >= deadline:
                    break
                continue  # (or released meanwhile: once more)
            holder, _, stamp = bytes(raw).decode(errors="replace").partition(" ")
            if holder == token:
                return True
            try:
                held_until = int(stamp)
            except ValueError:
                held_until = 0  # (not a claim we wrote: taken over)
            if time.time() * 1000 < held_until + CLAIM_SLACK_MS:
                return False
            if time.monotonic() >= deadline:
                break
            if bytes(client.get(key) or b"") == bytes(raw):  # (not taken over meanwhile)
                client.remove(key, True)  # its host died or gave up: take it over
        # Not confirmed either way (a claim that cannot be written or read back,
        # a holder that keeps vanishing, the deadline): encoding here costs at
        # most a duplicate encode, waiting could cost the engine its bound.
        return True

    def _claim_placement(self, client: Any, generation: int) -> Any:
        """Where this host's claims are put: its own segment. Placed by the
        master, a claim lands on any mounted segment, a dead host's among
        them until the master forgets it (client_ttl), and its put then fails
        after about 1 s; on our own segment it lives exactly as long as its
        claimant. (Default placement for a host that mounts no segment.)"""
        with self._lock:
            if self._placement is not None and self._placement[0] == generation:
                return self._placement[1]
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        if self.spec.segment_bytes > 0:
            with contextlib.suppress(Exception):  # (a client without it: the default)
                config.preferred_segment = str(client.get_hostname())
        with self._lock:
            self._placement = (generation, config)
        return config

    @staticmethod
    def _read_claim(client: Any, key: str, deadline: float) -> bytes:
        """The claim's bytes, read right after a put of it; b"" when it is
        listed but unreadable (its host is gone), or reads as nothing, until
        `deadline`. A claim another host is writing at the same moment reads
        as nothing, and is not even listed, until its put completes (our own
        put of it then returned 0 without writing)."""
        while True:
            started = time.monotonic()
            raw = client.get(key)
            now = time.monotonic()
            if raw or now >= deadline:
                return bytes(raw) if raw else b""
            if client.is_exist(key) == 1:
                # Listed but unreadable: a put completing right now (readable
                # within milliseconds), or a host that is gone (a read of it
                # then fails after about 1 s: given up on at once).
                if now - started >= UNREACHABLE_READ_S:
                    return b""
                time.sleep(0.02)
                continue
            time.sleep(0.005)

    def claim_many(self, keys: Sequence[tuple[str, str]], token: str,
                   ttl_s: float) -> list[bool | None]:
        """`claim` for many keys at once: True (taken), False (another live
        token holds it), None (not settled here: claim it alone, `claim`).
        Keys whose claim is already there are not read in the batch (a dead
        host's claim would hold the whole batch's read for about 1 s): None.
        The others: one batched put on this host's segment and one batched
        read back; a claim unreadable or expired there is None too."""
        if not keys:
            return []
        client, generation = self._ready()
        names = [value_key(ns, h) + CLAIM for ns, h in keys]
        there = client.batch_is_exist(names)
        if not isinstance(there, list) or len(there) != len(names):
            raise RemoteError(f"batch_is_exist of {len(names)} claims failed: {there!r}"[:200])
        out: list[bool | None] = [None] * len(keys)
        fresh = [i for i, state in enumerate(there) if state == 0]
        if not fresh:
            return out
        expires = int(time.time() * 1000 + ttl_s * 1000)
        mine = f"{token} {expires}".encode()
        code = client.put_batch([names[i] for i in fresh], [mine] * len(fresh),
                                self._claim_placement(client, generation))
        if code not in (0, OBJECT_ALREADY_EXISTS):
            return out
        raws = client.get_batch([names[i] for i in fresh])
        if not isinstance(raws, list) or len(raws) != len(fresh):
            raise RemoteError(f"get_batch of {len(fresh)} claims failed: {raws!r}"[:200])
        now_ms = time.time() * 1000
        for i, raw in zip(fresh, raws, strict=True):
            holder, _, stamp = bytes(raw).decode(errors="replace").partition(" ") if raw \
                else ("", "", "")
            if holder == token:
                out[i] = True
            elif holder and stamp.isdigit() and now_ms < int(stamp) + CLAIM_SLACK_MS:
                out[i] = False
        return out

    def forget(self, store_namespace: str, mm_hash: str) -> None:
        """Remove a value whose checksum does not match it, and the checksum
        (a publication racing another writer's, or a stale checksum): the
        key is published again, whole, by the next host that encodes it."""
        key = value_key(store_namespace, mm_hash)
        client, _ = self._ready()
        client.remove(key, True)
        client.remove(key + SIDECAR, True)

    @staticmethod
    def claimable(namespace: str) -> bool:
        """Whether entries of a daemon namespace ("model|dtype|widths|variant")
        can be published here: its dtype is one vLLM's format carries."""
        parts = namespace.split("|")
        return len(parts) > 1 and parts[1] in DTYPE_CODES

    @staticmethod
    def accepts(mm_hash: str) -> bool:
        """Whether an item can be keyed here: a name with "@" could be
        another item's checksum or claim ("<hash>@ecd1")."""
        return "@" not in mm_hash

    def release(self, store_namespace: str, mm_hash: str, token: str) -> None:
        """Drop the claim if `token` holds it."""
        key = value_key(store_namespace, mm_hash) + CLAIM
        client, _ = self._ready()
        raw = client.get(key)
        if raw and bytes(raw).decode(errors="replace").partition(" ")[0] == token:
            client.remove(key, True)


def _first(result: Any) -> Any:
    while isinstance(result, list) and result:
        result = result[0]
    return result


def _parse_header(raw: bytes) -> tuple[tuple[int, int], str]:
    magic, code, tokens, hidden = HEADER.unpack(raw)
    if magic != MAGIC:
        raise values.BadValue(f"not vLLM's embedding format (magic {magic:#x})")
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise values.BadValue(f"unknown dtype code {code} in vLLM's header")
    if not 0 < tokens < 1 << 32 or not 0 < hidden < 1 << 32:
        raise values.BadValue(f"implausible shape ({tokens}, {hidden}) in vLLM's header")
    return (tokens, hidden), dtype


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:
        log.debug("closing a Mooncake client failed", exc_info=True)

