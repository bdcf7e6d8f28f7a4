"""Watchers: stored and evicted events for routers (the `Watch` RPC).

A watcher gets the ready entries of its namespace (or of all namespaces) as
a snapshot, a marker, then every entry that becomes READY (stored) or is
hidden by eviction (evicted), in the order the cache made those changes
(`Cache.on_entry_change`). See docs/events.md for the message format.

Why a bounded buffer that drops its watcher, and no back pressure: a
router's view is advisory (a stale one costs a miss, never a wrong byte), so
the cache must never wait for one. Publishing is therefore one append per
watcher, and a watcher whose buffer is full is ended at once with the reason
(RESOURCE_EXHAUSTED), freeing what it held; it watches again for a fresh
snapshot.

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import NamedTuple

from ec_daemon.errors import CacheError, InvalidArgument, ResourceExhausted, Unavailable
from ec_daemon.records import Entry, State

log = logging.getLogger(__name__)

# Events a watcher may have waiting past its snapshot; one more drops it.
BUFFER_EVENTS = 1 << 16
MAX_EVENTS_PER_MESSAGE = 1024
# Well under gRPC's default 4 MiB receive limit, whatever the events hold.
MAX_MESSAGE_BYTES = 1 << 20
# Longer than any namespace a layout can make (wire.namespace_of).
MAX_NAMESPACE_CHARS = 8192
ALL = ""  # the namespace filter of a watcher of every namespace


class Kind(enum.Enum):
    STORED = "stored"  # became READY (or was ready when the snapshot was taken)
    EVICTED = "evicted"  # chosen by eviction: no view offers it from now on


class Event(NamedTuple):
    kind: Kind
    entry: Entry  # its key, id, size, shape and dtype never change
    time_ns: int  # wall clock; for snapshot events, when the snapshot was taken


def event_size(event: Event) -> int:
    """An upper estimate of an event's encoded size, to cap messages (4 bytes
    a character: the namespace and key may be any UTF-8)."""
    entry = event.entry
    return 48 + 4 * (len(entry.key[0]) + len(entry.key[1])) + len(entry.dtype) \
        + 11 * len(entry.shape)


def validate_namespace(namespace: str) -> str:
    """A watch's namespace filter: ALL (empty), or a namespace as Attach
    returns it and Stats lists it (model|dtype|row_bytes|variant)."""
    if len(namespace) > MAX_NAMESPACE_CHARS:
        raise InvalidArgument(f"namespace is longer than {MAX_NAMESPACE_CHARS} characters")
    if namespace and namespace.count("|") < 3:
        raise InvalidArgument(
            f"namespace {namespace[:100]!r} is not a namespace: use one as Attach returns it "
            "and `ec-daemon stats` lists it (model|dtype|row_bytes|variant), or none for all")
    return namespace


class Watcher:
    """One watch: its snapshot, then its live events, until it ends."""

    def __init__(self, index: int, namespace: str, snapshot: Iterable[Entry], now_ns: int,
                 limit: int = BUFFER_EVENTS) -> None:
        self.index = index
        self.namespace = namespace
        self.snapshot: deque[Entry] = deque(snapshot)
        self.snapshot_entries = len(self.snapshot)
        self.snapshot_ns = now_ns
        self.snapshot_sent = False  # the marker was taken
        self.live: deque[Event] = deque()
        self.limit = limit
        # Why it ended (its status), or None while it runs.
        self.error: CacheError | None = None
        self._wake = asyncio.Event()

    def push(self, event: Event) -> bool:
        """Queue a live event; False when the buffer is full (drop it)."""
        if self.error is not None:
            return True
        if len(self.live) >= self.limit:
            return False
        self.live.append(event)
        self._wake.set()
        return True

    def end(self, error: CacheError) -> None:
        """End the watch with `error`; what was waiting is discarded."""
        if self.error is None:
            self.error = error
            self.snapshot.clear()
            self.live.clear()
            self._wake.set()

    def take(self, max_events: int = MAX_EVENTS_PER_MESSAGE,
             max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[list[Event], bool]:
        """The next message's events, and whether it completes the snapshot
        (such a message carries snapshot events only, maybe none)."""
        events: list[Event] = []
        size = 0
        if not self.snapshot_sent:
            snapshot = self.snapshot
            while snapshot and len(events) < max_events and size < max_bytes:
                events.append(Event(Kind.STORED, snapshot.popleft(), self.snapshot_ns))
                size += event_size(events[-1])
            self.snapshot_sent = not snapshot
            return events, self.snapshot_sent
        live = self.live
        while live and len(events) < max_events and size < max_bytes:
            events.append(live.popleft())
            size += event_size(events[-1])
        return events, False

    async def batches(self) -> AsyncIterator[tuple[list[Event], bool]]:
        """`take` until the watch ends, waiting while there is nothing."""
        while self.error is None:
            events, snapshot_done = self.take()
            if events or snapshot_done:
                yield events, snapshot_done
            else:
                self._wake.clear()
                await self._wake.wait()


class Watchers:
    """Every open watch, by namespace filter; `publish` is the cache's hook."""

    def __init__(self, *, limit: int | None = None,
                 clock: Callable[[], int] = time.time_ns) -> None:
        """`limit`: live events a watcher may have waiting (BUFFER_EVENTS)."""
        self.limit = BUFFER_EVENTS if limit is None else limit
        self.clock = clock
        self._by_namespace: dict[str, set[Watcher]] = {}
        self.count = 0  # open watchers
        self.dropped = 0  # watchers dropped for reading too slowly, ever
        self._opened = 0
        self._closing = False

    def open(self, namespace: str, entries: Iterable[Entry]) -> Watcher:
        """A watcher of `namespace` (ALL: every one) whose snapshot is the
        ready entries among `entries` (the cache's, in any state)."""
        validate_namespace(namespace)
        if self._closing:
            raise Unavailable("the daemon is shutting down")
        snapshot = [e for e in entries if e.state is State.READY
                    and (namespace == ALL or e.key[0] == namespace)]
        self._opened += 1
        watcher = Watcher(self._opened, namespace, snapshot, self.clock(), self.limit)
        self._by_namespace.setdefault(namespace, set()).add(watcher)
        self.count += 1
        log.info("watcher %d opened (%s): a snapshot of %d ready entries", watcher.index,
                 _describe(namespace), len(snapshot))
        return watcher

    def close(self, watcher: Watcher) -> None:
        """Forget `watcher` (its call ended). Idempotent."""
        watchers = self._by_namespace.get(watcher.namespace)
        if watchers is None or watcher not in watchers:
            return
        watchers.discard(watcher)
        if not watchers:
            del self._by_namespace[watcher.namespace]
        self.count -= 1

    def close_all(self) -> None:
        """Shutdown: end every watch (UNAVAILABLE) and refuse new ones."""
        self._closing = True
        for watchers in list(self._by_namespace.values()):
            for watcher in list(watchers):
                self.close(watcher)
                watcher.end(Unavailable("the daemon is shutting down"))

    def publish(self, entry: Entry) -> None:
        """`entry` just became READY (stored) or HIDDEN (evicted)."""
        if not self.count:
            return
        targets = (self._by_namespace.get(entry.key[0]), self._by_namespace.get(ALL))
        event: Event | None = None
        full: list[Watcher] = []
        for watchers in targets:
            if not watchers:
                continue
            if event is None:
                kind = Kind.STORED if entry.state is State.READY else Kind.EVICTED
                event = Event(kind, entry, self.clock())
            full.extend(w for w in watchers if not w.push(event))
        for watcher in full:
            self.drop(watcher)

    def drop(self, watcher: Watcher) -> None:
        """A watcher that reads too slowly: ended at once, what it held freed."""
        self.close(watcher)
        self.dropped += 1
        log.warning("watcher %d (%s) dropped: it read events too slowly (%d waiting)",
                    watcher.index, _describe(watcher.namespace), len(watcher.live))
        watcher.end(ResourceExhausted(
            f"watch dropped: more than {watcher.limit} events were waiting (this watcher "
            "read too slowly); watch again for a fresh snapshot"))


def _describe(namespace: str) -> str:
    return f"namespace {namespace!r}" if namespace else "all namespaces"
