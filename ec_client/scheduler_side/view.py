"""The scheduler side's local view of its namespace's ready entries.

Fed by the session stream (ready and evicted events) on the link's thread,
read by the engine's scheduling thread. A hit is answered from here, and
the daemon reuses an evicted entry's pages only after this view
acknowledged the eviction. So the view acknowledges an eviction only when
(a) the entry can no longer be looked up, and (b) no load of it that this
engine dispatched is still in flight: that is what keeps the bytes under
a running copy, without any pin message.

- Hits: between the scheduler choosing an entry to load (`hit`, from
  `SchedulerDelegate.stage`) and the step's end, when the load goes out, an
  eviction must not be acknowledged. Entries hit since the last step
  boundary stay loadable; `end_step` turns the dispatched ones into loads in
  flight and releases the rest.
- Loads in flight: counted per (mm_hash, entry_id) from `end_step` until
  `finish` (every rank reported, through vLLM's worker metadata). An
  eviction of an entry in flight is withheld until its last load finished.
  They outlive a re-attach to the same region (a restarted daemon adopted
  it: same generation, same entry ids): `clear(keep_loads=True)` keeps them
  under the same `lineage`, and the new session is told (`holds`).

`hit` is on the engine's hot path and takes no lock. It marks the hash
hit, then reads the entry; `apply` hides an evicted entry, then checks
for a hit. Each of those is one dict or set operation, which CPython
performs atomically and in program order, so one of the two threads sees the
other's first write: either the hit misses, or the acknowledgement is
deferred to the step boundary. Everything else takes the view's lock.

A large daemon message (a snapshot after a warm restart, a burst of
evictions) is applied in slices of APPLY_SLICE entries, one lock hold each,
so the engine's step boundary (`end_step`, `finish`) waits for one slice,
not for the whole message (4,096 entries held the lock 17-48 ms). Each slice
leaves the view consistent: a ready entry is valid on its own, evictions
are applied after the message's ready events and only to the entry id they
name, and the acknowledgements and `synced` wait for the last slice.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ec_client.common.limits import APPLY_SLICE, MAX_PENDING_TOUCHES
from ec_client.common.wire import DaemonNews, EntryInfo, EntryRef
from ec_protocol.protocol import MAX_BATCH

Ref = tuple[str, int]  # (mm_hash, entry_id)
Refs = list[Ref]
# Send(acks) -> False when the link is down.
Send = Callable[[Refs], bool]


@dataclass(frozen=True, slots=True)
class ViewEntry:
    entry_id: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    extents: tuple[tuple[int, int], ...]
    checksum: int = 0  # its writer's xxh3-64 of the bytes (`ec_protocol.checksums`; 0: none)


class ReadyView:
    def __init__(self, lock: Any = None) -> None:
        """`lock`: a stand-in for the view's lock (a context manager; tests
        count what one hold does)."""
        self._entries: dict[str, ViewEntry] = {}
        self._hits: set[str] = set()  # written by the engine's thread only
        self._deferred: Refs = []  # evicted while hit: decided at end_step
        self._inflight: dict[Ref, int] = {}  # loads dispatched and not finished
        self._withheld: set[Ref] = set()  # evicted while in flight
        self._touches: dict[Ref, int] = {}  # loads dispatched since the last heartbeat
        self._lock = threading.Lock() if lock is None else lock
        self.epoch = 0  # bumped by `clear`: entries of an older epoch are void
        self.lineage = 0  # bumped when loads in flight are forgotten: their refs are void
        self.synced = False  # the initial snapshot has arrived
        # (lookups, hits) since start, replaced whole by the engine's thread
        # so a reader never sees one without the other.
        self._counts = (0, 0)

    # ------------------------------------------------- engine thread

    def hit(self, mm_hash: str, epoch: int | None = None,
              serve: bool = True) -> ViewEntry | None:
        """The entry if it is ready, `serve` and the view is still at `epoch`
        (None: any); it then stays loadable until `end_step`. Otherwise None
        (a ready entry not served: the ranks still map). Lock-free (see the
        module docstring); the epoch is read after the entry (see
        `SchedulerDelegate.stage`)."""
        self._hits.add(mm_hash)
        entry = self._entries.get(mm_hash)
        if entry is None or not serve or (epoch is not None and self.epoch != epoch):
            return None
        return entry

    def count(self, hit: bool) -> None:
        """One lookup by vLLM (`has_cache_item`), a hit or not: the daemon's
        hit counters follow these."""
        lookups, hits = self._counts
        self._counts = (lookups + 1, hits + hit)

    def end_step(self, dispatched: Sequence[Ref], lineage: int, send: Send,
                 loaded: Sequence[Ref] = ()) -> bool:
        """Step boundary: the loads `dispatched` from entries of `lineage` are
        in flight; `loaded` ones (copied by the scheduler's process) are done
        already; both are touched. Acknowledge the deferred evictions of the
        others. Returns False when the acknowledgements could not be sent."""
        if not self._hits and not dispatched and not loaded:
            return True  # nothing hit or dispatched since the last boundary
        with self._lock:
            self._hits.clear()
            if (dispatched or loaded) and lineage == self.lineage:
                inflight, touches = self._inflight, self._touches
                for ref in dispatched:
                    inflight[ref] = inflight.get(ref, 0) + 1
                for ref in (*dispatched, *loaded):
                    if ref in touches or len(touches) < MAX_PENDING_TOUCHES:
                        touches[ref] = touches.get(ref, 0) + 1
            if not self._deferred:
                return True
            deferred, self._deferred = self._deferred, []
            acks = []
            for ref in deferred:
                if ref in self._inflight:
                    self._withheld.add(ref)
                else:
                    acks.append(ref)
            return not acks or send(acks)

    def finish(self, refs: list[Ref], lineage: int, send: Send) -> None:
        """These loads of `lineage` landed on every rank (or failed):
        acknowledge evictions that waited for them."""
        if not refs:
            return
        with self._lock:
            if lineage != self.lineage:
                return  # forgotten: no session awaits anything of them
            acks = []
            for ref in refs:
                left = self._inflight.get(ref, 0) - 1
                if left > 0:
                    self._inflight[ref] = left
                    continue
                self._inflight.pop(ref, None)
                if ref in self._withheld:
                    self._withheld.discard(ref)
                    acks.append(ref)
            if acks:
                send(acks)

    # --------------------------------------------------- link thread

    def apply(self, message: DaemonNews, send: Send) -> None:
        """Apply a DaemonMessage, APPLY_SLICE events per lock hold: its ready
        events, then its evictions (an eviction names an entry id, so one of
        an entry the same message replaced leaves the newer entry). Evictions
        of entries neither hit nor in flight are acknowledged through
        `send` once the whole message is applied, under the lock."""
        acks: Refs = []
        ready, evicted = message.ready, message.evicted
        slices: list[tuple[Sequence[EntryInfo] | Sequence[EntryRef], int]] = [
            (ready, start) for start in range(0, len(ready), APPLY_SLICE)]
        slices += [(evicted, start) for start in range(0, len(evicted), APPLY_SLICE)]
        last = len(slices) - 1
        for n, (events, start) in enumerate(slices):
            if n:
                time.sleep(0)  # let a waiting engine thread take the lock
            with self._lock:
                chunk = events[start:start + APPLY_SLICE]
                if events is ready:
                    self._apply_ready(chunk)  # type: ignore[arg-type]
                else:
                    self._apply_evicted(chunk, acks)  # type: ignore[arg-type]
                if n == last:
                    self._applied(message, acks, send)
        if not slices and message.snapshot_done:  # (most messages carry no events)
            with self._lock:
                self._applied(message, acks, send)

    def _apply_ready(self, infos: Sequence[EntryInfo]) -> None:
        entries = self._entries
        for info in infos:
            entries[info.mm_hash] = ViewEntry(info.entry_id, info.nbytes, info.shape,
                                              info.dtype, info.extents, info.checksum)

    def _apply_evicted(self, refs: Sequence[EntryRef], acks: Refs) -> None:
        for ref in refs:
            key = (ref.mm_hash, ref.entry_id)
            entry = self._entries.get(ref.mm_hash)
            if entry is not None and entry.entry_id == ref.entry_id:
                del self._entries[ref.mm_hash]  # hidden first, then the hit check
            # Hit by mm_hash whatever the view holds now: a hit this
            # step may have read this entry id before a ready of the same
            # key (earlier in this message) replaced it.
            if ref.mm_hash in self._hits:
                self._deferred.append(key)
                continue
            if key in self._inflight:
                self._withheld.add(key)
                continue
            acks.append(key)

    def _applied(self, message: DaemonNews, acks: Refs, send: Send) -> None:
        """The whole of `message` is in (under the lock)."""
        if message.snapshot_done:
            self.synced = True
        if acks:
            send(acks)

    def has_touches(self) -> bool:
        """Whether loads were dispatched since the last `take_touches` (any
        thread; a read of one reference, no lock)."""
        return bool(self._touches)

    def take_touches(self, limit: int = MAX_BATCH) -> list[tuple[str, int, int]]:
        """(mm_hash, entry_id, loads) dispatched since the previous call, at
        most `limit` entries (the rest wait for the next heartbeat)."""
        with self._lock:
            touches = self._touches
            if len(touches) <= limit:
                self._touches = {}
                taken = list(touches.items())
            else:
                taken = [(ref, touches.pop(ref)) for ref in list(itertools.islice(touches, limit))]
        return [(h, e, n) for (h, e), n in taken]

    def counts(self) -> tuple[int, int]:
        """(lookups, hits) since the view was made (any thread)."""
        return self._counts

    def clear(self, *, keep_loads: bool = False) -> None:
        """Forget the entries (the session is gone: nothing here is valid).
        Loads in flight are forgotten too (the daemon's ghost of the session
        protects them), unless `keep_loads`: the next session may serve the
        same region, whose daemon must then hear of them (`loading`)."""
        with self._lock:
            self._entries.clear()
            self._hits.clear()
            self._deferred.clear()
            self._withheld.clear()  # owed to the old session only
            if not keep_loads:
                self._inflight.clear()
                self._touches.clear()
                self.lineage += 1
            self.synced = False
            self.epoch += 1

    def loading(self) -> Refs:
        """The entries with loads in flight (for the next session's `holds`)."""
        with self._lock:
            return list(self._inflight)

    # ------------------------------------------------------- any thread

    def get(self, mm_hash: str) -> ViewEntry | None:
        return self._entries.get(mm_hash)

    def inflight(self) -> int:
        with self._lock:
            return sum(self._inflight.values())

    def __len__(self) -> int:
        return len(self._entries)
