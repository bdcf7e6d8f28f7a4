"""The cache's books: its entries, any state, by namespace and key, and what
they add up to (the pages pending and hidden, the entries ready and hidden;
each namespace's visible entries and their bytes, its hits, misses and
loads). `invariants` checks them from scratch.

The table only keeps the books: every state change of an entry, and when it
happens, is the cache's (`cache`), which tells the table what changed.

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ec_daemon.core.records import Entry, State

_NONE: Mapping[str, Entry] = {}


class EntryTable:
    def __init__(self) -> None:
        self._namespaces: dict[str, dict[str, Entry]] = {}
        self.pending_pages = 0
        self.hidden_pages = 0
        self.ready_entries = 0
        self.hidden_entries = 0
        # namespace -> [visible (ready or hidden) entries, their bytes]
        self.usage: dict[str, list[int]] = {}
        # namespace -> its views' hits and misses, and its loads
        self.counters: dict[str, dict[str, int]] = {}

    def __iter__(self) -> Iterator[Entry]:
        return (e for es in self._namespaces.values() for e in es.values())

    def __bool__(self) -> bool:
        return bool(self._namespaces)

    def get(self, namespace: str, mm_hash: str) -> Entry | None:
        return self._namespaces.get(namespace, _NONE).get(mm_hash)

    def of(self, namespace: str) -> Mapping[str, Entry]:
        """`namespace`'s entries by mm_hash, any state (read them only)."""
        return self._namespaces.get(namespace, _NONE)

    def holds(self, namespace: str) -> bool:
        """Is any entry of `namespace` in the cache?"""
        return namespace in self._namespaces

    def counted(self, namespace: str) -> dict[str, int]:
        """`namespace`'s counters, made when a session of it attaches."""
        return self.counters.setdefault(namespace, {"hits": 0, "misses": 0, "loads": 0})

    # ------------------------------------------------ what the cache tells it

    def pending(self, entry: Entry) -> None:
        """A pending entry, just allocated."""
        self._namespaces.setdefault(entry.key[0], {})[entry.key[1]] = entry
        self.pending_pages += entry.pages

    def ready(self, entry: Entry) -> None:
        """A pending entry that became ready (committed)."""
        self.pending_pages -= entry.pages
        self.ready_entries += 1
        self._show(entry, 1)

    def adopted(self, entry: Entry) -> None:
        """An entry of an adopted region, ready or hidden (`Cache.restore`)."""
        self._namespaces.setdefault(entry.key[0], {})[entry.key[1]] = entry
        self._show(entry, 1)
        if entry.state is State.HIDDEN:
            self.hidden_pages += entry.pages
            self.hidden_entries += 1
        else:
            self.ready_entries += 1

    def hidden(self, entry: Entry) -> None:
        """A ready entry that was hidden (evicted, withdrawn, cut off)."""
        self.hidden_pages += entry.pages
        self.ready_entries -= 1
        self.hidden_entries += 1

    def discarded(self, entry: Entry) -> bool:
        """A pending entry that was dropped: forgotten. True if its namespace
        holds no entry any more."""
        self.pending_pages -= entry.pages
        return self._forget(entry)

    def reclaimed(self, entry: Entry) -> bool:
        """A hidden entry whose pages came back: forgotten. True if its
        namespace holds no entry any more."""
        self.hidden_pages -= entry.pages
        self.hidden_entries -= 1
        self._show(entry, -1)
        return self._forget(entry)

    def prune(self, namespace: str) -> None:
        """Forget the counters of `namespace`, which nobody uses any more,
        and its usage if nothing is in it (the caller checked the first)."""
        if namespace in self._namespaces:
            return
        self.counters.pop(namespace, None)
        usage = self.usage.get(namespace)
        if usage is not None and usage == [0, 0]:
            del self.usage[namespace]

    def _show(self, entry: Entry, sign: int) -> None:
        usage = self.usage.setdefault(entry.key[0], [0, 0])
        usage[0] += sign
        usage[1] += sign * entry.nbytes

    def _forget(self, entry: Entry) -> bool:
        namespace = self._namespaces[entry.key[0]]
        del namespace[entry.key[1]]
        if namespace:
            return False
        del self._namespaces[entry.key[0]]
        return True
