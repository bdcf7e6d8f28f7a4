"""Watchers: stored and evicted events for routers (the `Watch` RPC).

A watcher gets the ready entries of its namespace (or of all namespaces) as
a snapshot, a marker, then every entry that becomes READY (stored) or is
hidden by eviction (evicted), in the order the cache made those changes
(`CacheListener.entry_changed`, the data plane). See docs/events.md for the
message format.

Why a bounded buffer that drops its watcher, and no back pressure: a
router's view is advisory (a stale one costs a miss, never a wrong byte), so
the cache must never wait for one. Why one shared feed per namespace filter
with a cursor per watcher: publishing runs inside eviction and commit on the
daemon's event loop, so it must not cost O(watchers); it appends once to at
most two feeds, and the watchers read from their cursors. A watcher more than
`limit` events behind is dropped at the next check (one every `limit`/8
events) with the reason (RESOURCE_EXHAUSTED), and the feed is trimmed to the
slowest remaining one. Watchers are capped in number, in all and per peer
(a TCP address; every local client of the Unix socket is one peer), and a
dropped watcher keeps its place until its call ends (the service cuts a
call whose client stopped reading, `serving.streams`).

Engines first: every client of the Unix socket is one peer, so one local
client with 16 unread calls took every local slot. A watch presenting the
id and token of an engine instance that runs (a live session of it has its
stream open) counts in that instance's own bucket instead, of the same
size, and may use the last quarter of the slots (RUNNING_SHARE), which
watches of no running engine never take.

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

from ec_daemon.core.limits import (
    DEFAULT_MAX_WATCHERS,
    DEFAULT_MAX_WATCHERS_PER_PEER,
    MAX_MESSAGE_BYTES,
    MAX_NAMESPACE_BYTES,
    MAX_WATCH_EVENTS_PER_MESSAGE,
    RUNNING_SHARE,
    WATCH_BUFFER_EVENTS,
)
from ec_daemon.core.records import Entry, State
from ec_daemon.errors import CacheError, InvalidArgument, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)

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
    if len(namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise InvalidArgument(f"namespace is longer than {MAX_NAMESPACE_BYTES} bytes")
    if namespace and namespace.count("|") < 3:
        raise InvalidArgument(
            f"namespace {namespace[:100]!r} is not a namespace: use one as Attach returns it "
            "and `ec-daemon stats` lists it (model|dtype|row_bytes|variant), or none for all")
    return namespace


class Feed:
    """The live events of one namespace filter, shared by its watchers: each
    reads from its own cursor (a sequence number); the oldest kept event is
    the slowest watcher's next one."""

    def __init__(self, limit: int) -> None:
        self.events: list[Event] = []
        self.first = 0  # the sequence number of events[0]
        self.watchers: set[Watcher] = set()
        self.changed = asyncio.Event()  # set on every append; cleared by a reader at the end
        self._check_at = limit + 1  # the next length at which laggards are looked for

    @property
    def end(self) -> int:
        """The sequence number the next event will get."""
        return self.first + len(self.events)

    def append(self, event: Event, limit: int) -> list[Watcher]:
        """Add `event`; returns the watchers now more than `limit` behind, if
        it was time to look (they are no longer readers of this feed)."""
        self.events.append(event)
        self.changed.set()  # O(1) unless a reader waits: then it wakes once
        if len(self.events) < self._check_at:
            return []
        end = self.end
        behind = [w for w in self.watchers if end - w.cursor > limit]
        self.watchers.difference_update(behind)
        oldest = min((w.cursor for w in self.watchers), default=end)
        del self.events[:oldest - self.first]
        self.first = oldest
        self._check_at = len(self.events) + max(1, limit // 8)
        return behind


class Watcher:
    """One watch: its snapshot, then its live events, until it ends."""

    def __init__(self, index: int, namespace: str, snapshot: Iterable[Entry], now_ns: int,
                 feed: Feed, limit: int = WATCH_BUFFER_EVENTS, peer: str = "") -> None:
        self.index = index
        self.namespace = namespace
        self.peer = peer
        self.snapshot: deque[Entry] = deque(snapshot)
        self.snapshot_entries = len(self.snapshot)
        self.snapshot_ns = now_ns
        self.snapshot_sent = False  # the marker was taken
        self.feed = feed
        self.cursor = feed.end  # live events from here on
        self.limit = limit
        # Why it ended (its status), or None while it runs.
        self.error: CacheError | None = None

    def waiting(self) -> int:
        """Live events published and not yet taken (0 once it ended)."""
        return 0 if self.error is not None else self.feed.end - self.cursor

    def end(self, error: CacheError) -> None:
        """End the watch with `error`; what was waiting is discarded."""
        if self.error is None:
            self.error = error
            self.snapshot.clear()
            self.feed.watchers.discard(self)
            self.feed.changed.set()  # its reader, if waiting, looks again

    def take(self, max_events: int = MAX_WATCH_EVENTS_PER_MESSAGE,
             max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[list[Event], bool]:
        """The next message's events, and whether it completes the snapshot
        (such a message carries snapshot events only, maybe none)."""
        events: list[Event] = []
        if self.error is not None:
            return events, False
        size = 0
        if not self.snapshot_sent:
            snapshot = self.snapshot
            while snapshot and len(events) < max_events and size < max_bytes:
                events.append(Event(Kind.STORED, snapshot.popleft(), self.snapshot_ns))
                size += event_size(events[-1])
            self.snapshot_sent = not snapshot
            return events, self.snapshot_sent
        feed = self.feed
        at = self.cursor - feed.first
        kept = feed.events
        while at < len(kept) and len(events) < max_events and size < max_bytes:
            events.append(kept[at])
            size += event_size(kept[at])
            at += 1
        self.cursor = feed.first + at
        return events, False

    async def batches(self) -> AsyncIterator[tuple[list[Event], bool]]:
        """`take` until the watch ends, waiting while there is nothing."""
        while self.error is None:
            events, snapshot_done = self.take()
            if events or snapshot_done:
                yield events, snapshot_done
            else:
                # Nothing between this check and the wait: another reader's
                # clear cannot hide an event this one has not taken.
                self.feed.changed.clear()
                await self.feed.changed.wait()


class Watchers:
    """Every open watch, by namespace filter; `publish` is the cache's hook."""

    def __init__(self, *, limit: int | None = None, max_watchers: int = DEFAULT_MAX_WATCHERS,
                 max_per_peer: int = DEFAULT_MAX_WATCHERS_PER_PEER,
                 clock: Callable[[], int] = time.time_ns) -> None:
        """`limit`: live events a watcher may have waiting (WATCH_BUFFER_EVENTS);
        `max_watchers`, `max_per_peer`: watch calls at once."""
        self.limit = WATCH_BUFFER_EVENTS if limit is None else limit
        self.max_watchers = max_watchers
        self.max_per_peer = max_per_peer
        self.clock = clock
        self._feeds: dict[str, Feed] = {}
        self._calls: dict[Watcher, str] = {}  # every call not yet ended -> its peer
        self._per_peer: dict[str, int] = {}
        self.count = 0  # open watchers, not dropped
        self.dropped = 0  # watchers dropped for reading too slowly, ever
        self._opened = 0
        self._closing = False

    def open(self, namespace: str, entries: Iterable[Entry], peer: str = "",
             engine: str = "") -> Watcher:
        """A watcher of `namespace` (ALL: every one) whose snapshot is the
        ready entries among `entries` (the cache's, in any state), for a
        client at `peer` (`peer_of`), or of running engine instance `engine`
        (its `engine_key`: counted in its own bucket). Raises InvalidArgument,
        Unavailable (shutting down) or ResourceExhausted (too many watchers)."""
        validate_namespace(namespace)
        if self._closing:
            raise Unavailable("the daemon is shutting down")
        bucket = f"engine {engine.partition('/')[2]!r}" if engine else peer
        open_to_all = self.max_watchers - self.max_watchers // RUNNING_SHARE
        calls = len(self._calls)
        if calls >= self.max_watchers or (not engine and calls >= open_to_all):
            kept = "" if calls >= self.max_watchers else (
                f"; the last {self.max_watchers - open_to_all} are kept for running engines "
                "presenting their token")
            raise ResourceExhausted(
                f"too many watchers: {calls} watch calls are open (at most "
                f"{self.max_watchers}, --max-watchers{kept}; dropped watchers whose clients "
                "stopped reading count until they disconnect); close one, or share one watch "
                "between routers")
        if self._per_peer.get(bucket, 0) >= self.max_per_peer:
            per = "engine instance" if engine else "peer"
            raise ResourceExhausted(
                f"too many watchers from {bucket or 'this peer'}: {self._per_peer[bucket]} "
                f"watch calls are open (at most {self.max_per_peer} per {per}, "
                "--max-watchers-per-peer)")
        peer = bucket
        snapshot = [e for e in entries if e.state is State.READY
                    and (namespace == ALL or e.key[0] == namespace)]
        feed = self._feeds.get(namespace)
        if feed is None:
            feed = self._feeds[namespace] = Feed(self.limit)
        self._opened += 1
        watcher = Watcher(self._opened, namespace, snapshot, self.clock(), feed, self.limit,
                          peer)
        feed.watchers.add(watcher)
        self._calls[watcher] = peer
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self.count += 1
        log.info("watcher %d opened (%s, %s): a snapshot of %d ready entries", watcher.index,
                 _describe(namespace), peer or "local", len(snapshot))
        return watcher

    def close(self, watcher: Watcher) -> None:
        """`watcher`'s call ended (any way). Idempotent."""
        peer = self._calls.pop(watcher, None)
        if peer is None:
            return
        left = self._per_peer[peer] - 1
        if left:
            self._per_peer[peer] = left
        else:
            del self._per_peer[peer]
        if watcher.error is None:
            self.count -= 1
            watcher.end(Unavailable("the watch ended"))
        self._forget_feed(watcher.feed)

    def close_all(self) -> None:
        """Shutdown: end every watch (UNAVAILABLE) and refuse new ones."""
        self._closing = True
        for watcher in list(self._calls):
            if watcher.error is None:
                self.count -= 1
                watcher.end(Unavailable("the daemon is shutting down"))

    def publish(self, entry: Entry) -> None:
        """`entry` just became READY (stored) or HIDDEN (evicted): one append
        to its namespace's feed and to the feed of every namespace."""
        if not self._feeds:
            return
        event: Event | None = None
        for key in (entry.key[0], ALL):
            feed = self._feeds.get(key)
            if feed is None:
                continue
            if event is None:
                kind = Kind.STORED if entry.state is State.READY else Kind.EVICTED
                event = Event(kind, entry, self.clock())
            for watcher in feed.append(event, self.limit):
                self.drop(watcher)

    def drop(self, watcher: Watcher, *, stalled: bool = False) -> None:
        """A watcher that reads too slowly (`stalled`: whose client took no
        message for a while): ended at once, what it held freed. Its call
        keeps its place in the caps until it ends (the service cuts it)."""
        if watcher.error is not None:
            return
        waiting = watcher.waiting()
        self.count -= 1
        self.dropped += 1
        why = "its client stopped reading" if stalled else \
            f"more than {watcher.limit} events were waiting"
        watcher.end(ResourceExhausted(
            f"watch dropped: {why} (this watcher read too slowly); watch again for a fresh "
            "snapshot"))
        log.warning("watcher %d (%s, %s) dropped: it read events too slowly (%d waiting)",
                    watcher.index, _describe(watcher.namespace), watcher.peer or "local",
                    waiting)
        self._forget_feed(watcher.feed)

    def buffered(self) -> int:
        """Live events held for the watchers (each stored once per feed)."""
        return sum(len(feed.events) for feed in self._feeds.values())

    def _forget_feed(self, feed: Feed) -> None:
        """A feed nobody reads any more is dropped (its events with it)."""
        if not feed.watchers:
            for namespace, kept in list(self._feeds.items()):
                if kept is feed:
                    del self._feeds[namespace]


def peer_of(context_peer: str) -> str:
    """The peer a watcher counts against: a TCP client's address without its
    port (`ipv4:10.0.0.5:41234` -> `ipv4:10.0.0.5`); every client of the Unix
    socket is one peer, `unix`."""
    kind, _, address = context_peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = address.rpartition(":")[0]
        if host.lower().startswith("[::ffff:") and "." in host:  # an IPv4 client, mapped
            return f"ipv4:{host[8:-1]}"
        return f"{kind}:{host}"
    return "unix" if kind.startswith("unix") else context_peer


def _describe(namespace: str) -> str:
    return f"namespace {namespace!r}" if namespace else "all namespaces"
