"""The scheduler side's local view of its namespace's ready entries.

Fed by the session stream (ready and evicted events) on the link's thread,
read by the engine's scheduling thread. A hit is answered from here, so the
view must never show an entry whose pages may already be reused: an evicted
entry leaves the view before it is acknowledged, and the acknowledgement is
what lets the daemon reuse its pages.

One subtlety: between `has_item` saying yes and the engine dispatching that
load later in the same step, an eviction must not slip in. Entries looked up
since the last step boundary are "claimed": their evictions are deferred to
`end_step`, which runs after the step's pins were queued, so each pin still
precedes its acknowledgement on the stream.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ViewEntry:
    entry_id: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    extents: tuple[tuple[int, int], ...]


class ReadyView:
    def __init__(self) -> None:
        self._entries: dict[str, ViewEntry] = {}
        self._claimed: set[str] = set()
        self._deferred: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self.synced = False  # the initial snapshot has arrived
        self._lookups = self._hits = 0  # since the last take_counts

    def claim(self, mm_hash: str) -> ViewEntry | None:
        """The entry if ready; it then stays in the view until `end_step`."""
        with self._lock:
            entry = self._entries.get(mm_hash)
            self._lookups += 1
            if entry is not None:
                self._claimed.add(mm_hash)
                self._hits += 1
            return entry

    def take_counts(self) -> tuple[int, int]:
        """(lookups, hits) since the previous call, read consistently."""
        with self._lock:
            counts = (self._lookups, self._hits)
            self._lookups = self._hits = 0
            return counts

    def get(self, mm_hash: str) -> ViewEntry | None:
        return self._entries.get(mm_hash)

    def apply(self, message: Any) -> list[tuple[str, int]]:
        """Apply a DaemonMessage; returns the (mm_hash, entry_id) to acknowledge now."""
        acks = []
        with self._lock:
            for info in message.ready:
                self._entries[info.mm_hash] = ViewEntry(
                    info.entry_id, info.nbytes, tuple(info.shape), info.dtype,
                    tuple((e.offset, e.length) for e in info.extents))
            for ref in message.evicted:
                if ref.mm_hash in self._claimed:
                    self._deferred.append((ref.mm_hash, ref.entry_id))
                else:
                    self._drop(ref.mm_hash, ref.entry_id)
                    acks.append((ref.mm_hash, ref.entry_id))
            if message.snapshot_done:
                self.synced = True
        return acks

    def end_step(self) -> list[tuple[str, int]]:
        """Step boundary: release claims, apply deferred evictions; returns
        the (mm_hash, entry_id) to acknowledge (after this step's pins)."""
        with self._lock:
            if self._claimed:
                self._claimed.clear()
            if not self._deferred:
                return []
            deferred, self._deferred = self._deferred, []
            for mm_hash, entry_id in deferred:
                self._drop(mm_hash, entry_id)
            return deferred

    def clear(self) -> None:
        """Forget everything (the session is gone: nothing here is valid)."""
        with self._lock:
            self._entries.clear()
            self._claimed.clear()
            self._deferred.clear()
            self.synced = False

    def _drop(self, mm_hash: str, entry_id: int) -> None:
        # An unknown ref is acknowledged all the same: the daemon awaits it.
        entry = self._entries.get(mm_hash)
        if entry is not None and entry.entry_id == entry_id:
            del self._entries[mm_hash]

    def __len__(self) -> int:
        return len(self._entries)
