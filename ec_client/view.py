"""The scheduler side's local view of its namespace's ready entries.

Fed by the session stream (ready and evicted events) on the link's thread,
read by the engine's scheduling thread. A hit is answered from here, so the
view must never show an entry whose pages may already be reused: an evicted
entry leaves the view before it is acknowledged, and the acknowledgement is
what lets the daemon reuse its pages.

One subtlety: between `has_item` saying yes and the engine dispatching that
load later in the same step, an eviction must not slip in. Entries looked up
since the last step boundary are "claimed": their evictions are deferred to
`end_step`, which queues the step's pins before those acknowledgements.

`claim` is on the engine's hot path and takes no lock. It marks the hash
claimed, then reads the entry; `apply` hides an evicted entry, then checks
for a claim. Each of those is one dict or set operation, which CPython
performs atomically and in program order, so one of the two threads sees the
other's first write: either the claim misses, or the eviction is deferred.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Refs = list[tuple[str, int]]  # (mm_hash, entry_id)


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
        self._claimed: set[str] = set()  # written by the engine's thread only
        self._deferred: Refs = []
        self._lock = threading.Lock()  # apply / end_step / clear, and what they send
        self.synced = False  # the initial snapshot has arrived
        # (lookups, hits) since start, replaced whole by the engine's thread
        # so a reader never sees one without the other.
        self._counts = (0, 0)
        self._taken = (0, 0)

    def claim(self, mm_hash: str) -> ViewEntry | None:
        """The entry if ready; it then stays loadable until `end_step`.
        Engine thread only; lock-free (see the module docstring)."""
        self._claimed.add(mm_hash)
        entry = self._entries.get(mm_hash)
        lookups, hits = self._counts
        self._counts = (lookups + 1, hits + (entry is not None))
        return entry

    def take_counts(self) -> tuple[int, int]:
        """(lookups, hits) since the previous call (heartbeats: any thread)."""
        with self._lock:
            counts, taken = self._counts, self._taken
            self._taken = counts
        return counts[0] - taken[0], counts[1] - taken[1]

    def get(self, mm_hash: str) -> ViewEntry | None:
        return self._entries.get(mm_hash)

    def apply(self, message: Any, send_acks: Callable[[Refs], Any]) -> None:
        """Apply a DaemonMessage; evictions of unclaimed entries are
        acknowledged at once through `send_acks`, under the view's lock."""
        acks: Refs = []
        with self._lock:
            for info in message.ready:
                self._entries[info.mm_hash] = ViewEntry(
                    info.entry_id, info.nbytes, tuple(info.shape), info.dtype,
                    tuple((e.offset, e.length) for e in info.extents))
            for ref in message.evicted:
                mm_hash = ref.mm_hash
                entry = self._entries.get(mm_hash)
                if entry is not None and entry.entry_id == ref.entry_id:
                    del self._entries[mm_hash]  # hidden first, then the claim check
                    if mm_hash in self._claimed:
                        self._deferred.append((mm_hash, ref.entry_id))
                        continue
                # Unclaimed, or not the entry the view shows (the daemon
                # still awaits the acknowledgement).
                acks.append((mm_hash, ref.entry_id))
            if message.snapshot_done:
                self.synced = True
            if acks:
                send_acks(acks)

    def end_step(self, send: Callable[[Refs], bool]) -> bool:
        """Step boundary (engine thread): release the claims and call
        `send(acks)` with the deferred evictions' acknowledgements, under
        the view's lock so no eviction is acknowledged in between. Returns
        what `send` returned (True when it was not needed)."""
        if not self._claimed:
            # Nothing claimed since the last boundary, so nothing deferred.
            return send([])
        with self._lock:
            self._claimed.clear()
            deferred, self._deferred = self._deferred, []
            return send(deferred)

    def clear(self) -> None:
        """Forget everything (the session is gone: nothing here is valid)."""
        with self._lock:
            self._entries.clear()
            self._claimed.clear()
            self._deferred.clear()
            self.synced = False

    def __len__(self) -> int:
        return len(self._entries)
