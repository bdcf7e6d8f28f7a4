"""What other hosts announced in the Redis store's index (`shards`), for the
namespaces this host follows: what the store holds, answered from memory.

Bounded in bytes (`max_bytes`, the oldest announcements dropped first), since
what an entry costs depends on its key. Each namespace's entries sit in their
own table under one namespace string, each entry one int packing its expiry
and its payload size: at most ENTRY_BYTES plus the mm_hash's characters (215
to 249 bytes with a 64-character mm_hash, by how full the tables are, where
one table keyed by (namespace, mm_hash), each key with its own copy of the
namespace, took 517 to 528 with an 85-character namespace; docs/performance.md).

Time is the server's. An entry expires at its stream entry ID (the store
node's clock at the XADD, in ms) plus its TTL, and `ServerClock` learns the
server's "now" from the IDs read: the newest one seen, carried forward by
this host's monotonic clock. A host whose wall clock runs ahead or behind
neither drops nor keeps entries wrongly. A daemon that has not yet read to
the end of the index lags behind the server's time, so it may take an expired
entry as present: that costs one miss, never a wrong hit (values are verified).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ec_daemon.core.limits import MAX_FORGOTTEN


@dataclass(frozen=True)
class Announcement:
    """Another daemon (or this one) published (namespace, mm_hash) of nbytes
    payload bytes at stamp_ms (the server's clock: its stream entry's ID), for
    ttl_ms (None: a daemon that predates `t`; the reader assumes its own)."""

    namespace: str
    mm_hash: str
    nbytes: int
    stamp_ms: int
    ttl_ms: int | None


# The most an entry takes beside its mm_hash's characters: the table's slot
# and link, the key string's header, the packed int (CPython 3.11, with the
# tables as empty as they get, just grown; tests/remote/test_announcements.py).
ENTRY_BYTES = 185
_SIZE_BITS = 41  # the payload size's bits in an entry (limits.MAX_VALUE_BYTES is 2**40)
_SIZE_MASK = (1 << _SIZE_BITS) - 1


class ServerClock:
    """The store's time in ms: every stream ID read is a lower bound of it,
    the largest one so far is kept as an offset from the monotonic clock."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._offset_ms = -math.inf  # nothing read yet: nothing has expired

    def observe(self, stamp_ms: int) -> None:
        self._offset_ms = max(self._offset_ms, stamp_ms - self._monotonic() * 1000)

    def now_ms(self) -> float:
        return self._monotonic() * 1000 + self._offset_ms


def entry_bytes(mm_hash: str) -> int:
    """What one entry is counted as against max_bytes."""
    return ENTRY_BYTES + (len(mm_hash) if mm_hash.isascii() else 4 * len(mm_hash))


class Announcements:
    """(namespace, mm_hash) -> payload size, for followed namespaces, until
    the entry expires by the server's clock. Not thread-safe: its backend
    (`backend.RedisBackend`) holds its lock around every call."""

    def __init__(self, *, max_bytes: int, ttl_ms: int, clock: ServerClock | None = None) -> None:
        """`ttl_ms` caps every announcement's TTL (an entry never outlives
        this daemon's --remote-ttl-seconds) and stands in for one that carries none."""
        if max_bytes <= 0 or ttl_ms <= 0:
            raise ValueError("max_bytes and ttl_ms must be positive")
        self.max_bytes = max_bytes
        self.ttl_ms = ttl_ms
        self.clock = clock or ServerClock()
        # namespace -> mm_hash -> expires_ms << _SIZE_BITS | nbytes, in the
        # order announced (the namespace string is the table's key, held once).
        self._tables: dict[str, OrderedDict[str, int]] = {}
        self.bytes = 0
        # (namespace, mm_hash) -> the forgotten entry's expiry (ms): an
        # announcement that expires no later is the one forgotten, read again.
        self._forgotten: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._rescan = False  # a namespace was followed since `take_rescan`

    @property
    def entries(self) -> int:
        return sum(len(table) for table in self._tables.values())

    @property
    def namespaces(self) -> int:
        return len(self._tables)

    def follow(self, namespace: str) -> bool:
        """Keep entries of `namespace` from now on; True when it is new."""
        if namespace in self._tables:
            return False
        self._tables[namespace] = OrderedDict()
        self._rescan = True
        return True

    def take_rescan(self) -> bool:
        """Whether the index must be read again from their start (a
        namespace was followed since the last call, whose entries announced
        before were skipped): said once."""
        rescan, self._rescan = self._rescan, False
        return rescan

    def unfollow(self, namespace: str) -> None:
        """Forget `namespace` and its entries."""
        table = self._tables.pop(namespace, None)
        if table:
            self.bytes -= sum(entry_bytes(mm_hash) for mm_hash in table)

    def get(self, namespace: str, mm_hash: str) -> int | None:
        """The payload size, or None when absent or expired."""
        table = self._tables.get(namespace)
        packed = table.get(mm_hash) if table is not None else None
        if packed is None or packed >> _SIZE_BITS <= self.clock.now_ms():
            return None
        return packed & _SIZE_MASK

    def forget(self, namespace: str, mm_hash: str) -> None:
        """Drop an entry (its value could not be promoted). Reading its
        announcement again (a rescan) does not bring it back; a later
        announcement (published again) does."""
        table = self._tables.get(namespace)
        packed = table.pop(mm_hash, None) if table is not None else None
        if packed is None:
            return
        self.bytes -= entry_bytes(mm_hash)
        self._forgotten[(namespace, mm_hash)] = packed >> _SIZE_BITS
        self._forgotten.move_to_end((namespace, mm_hash))
        while len(self._forgotten) > MAX_FORGOTTEN:
            self._forgotten.popitem(last=False)

    def absorb(self, found: Sequence[Announcement]) -> int:
        """Take announcements read from the index (those of namespaces not
        followed, or already expired, are skipped); returns how many entries
        were dropped, oldest first, to stay within max_bytes."""
        if not found:
            return 0
        self.clock.observe(max(a.stamp_ms for a in found))
        now = self.clock.now_ms()
        for a in found:
            table = self._tables.get(a.namespace)
            if table is None:
                continue
            ttl_ms = self.ttl_ms if a.ttl_ms is None else min(a.ttl_ms, self.ttl_ms)
            expires = a.stamp_ms + ttl_ms
            if expires <= now:
                continue
            forgotten = self._forgotten.get((a.namespace, a.mm_hash))
            if forgotten is not None:
                if expires <= forgotten:
                    continue  # (the forgotten announcement, read again)
                del self._forgotten[(a.namespace, a.mm_hash)]
            old = table.pop(a.mm_hash, None)  # announced again: to the end
            if old is None:
                self.bytes += entry_bytes(a.mm_hash)
            else:
                expires = max(expires, old >> _SIZE_BITS)
            table[a.mm_hash] = expires << _SIZE_BITS | a.nbytes
        evicted = 0
        while self.bytes > self.max_bytes and self._drop_oldest():
            evicted += 1
        return evicted

    def sweep(self) -> None:
        """Drop expired entries from the front of each table (entries arrive
        roughly in expiry order; any left behind `get` refuses)."""
        now = self.clock.now_ms()
        for key in [k for k, expires in self._forgotten.items() if expires <= now]:
            del self._forgotten[key]
        for table in self._tables.values():
            while table:
                mm_hash, packed = next(iter(table.items()))
                if packed >> _SIZE_BITS > now:
                    break
                del table[mm_hash]
                self.bytes -= entry_bytes(mm_hash)

    def _drop_oldest(self) -> bool:
        """Drop the entry that expires first among the tables' oldest."""
        oldest: tuple[OrderedDict[str, int], str, int] | None = None
        for table in self._tables.values():
            if table:
                mm_hash, packed = next(iter(table.items()))
                if oldest is None or packed < oldest[2]:
                    oldest = (table, mm_hash, packed)
        if oldest is None:
            return False
        del oldest[0][oldest[1]]
        self.bytes -= entry_bytes(oldest[1])
        return True
