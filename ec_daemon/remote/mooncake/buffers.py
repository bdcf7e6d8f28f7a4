"""Mooncake's transfer buffers: registered memory each call reads into or
writes from, pooled, and counted against the promotion budget.

The transfer engine reads and writes only registered memory, and every peer
that reaches a transfer engine may read and write every buffer registered
with it (a peer's `transfer_sync_write` rewrote one in our test), so the
region is never registered: bytes pass through these buffers instead (one
copy), and nothing read from one is trusted before it is verified where no
peer can reach (`store`).

Every buffer, in use or pooled, holds a reservation of its capacity in the
promotion budget (a promotion's own reservation covers the buffer it reads
into until the buffer is pooled): sized to the next power of two and pooled
up to POOL_BYTES, they held about twice --remote-promotion-bytes plus the
pool. A buffer is never freed while registered (the next registration at
that address would fail), and one registered with an older client
(`Connection.generation`) is dropped.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ec_daemon.core.limits import MAX_BOUNCE_BYTES, POOL_BYTES, SMALL_BUFFER_BYTES
from ec_daemon.remote.budget import PromotionBudget, Reservation
from ec_daemon.remote.common import RemoteError, RemotePeerError
from ec_daemon.remote.mooncake.codec import HEADER
from ec_daemon.remote.mooncake.connection import Connection, error


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


class TransferBuffers:
    """The registered buffers of one client (`Connection`). Thread-safe."""

    def __init__(self, connection: Connection, budget: PromotionBudget | None) -> None:
        """`budget`: the tier's promotion budget every buffer counts against
        (None: none counted)."""
        self.connection = connection
        self._lock = threading.Lock()
        self._pool: list[_Transfer] = []
        self._pool_generation = -1
        self._budget = budget
        self._buffers_bytes = 0  # capacity of the buffers that exist, pooled or in use
        self._buffers_peak = 0

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
        client, now = self.connection.current
        for transfer in pooled:
            self._free(transfer, client if now == generation else None)
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
    def buffer(self, client: Any, generation: int, size: int,
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
                raise RemoteError(f"registering a transfer buffer failed: {error(code)}")
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
