"""Eviction policy: chooses victims, never frees them.

The cache tells the policy when an entry becomes evictable (ready), when
it is used, and when it stops being evictable; `choose`
answers which evictable keys would free a number of pages, or nothing at all
when even every evictable entry would not (so a refusal changes nothing).
Swappable: anything with this interface works.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Protocol


class EvictionPolicy(Protocol):
    def add(self, key: Hashable, pages: int) -> None: ...
    def touch(self, key: Hashable) -> None: ...
    def remove(self, key: Hashable) -> None: ...
    def choose(self, pages: int) -> list[Hashable]: ...
    def order(self) -> Iterable[Hashable]: ...
    @property
    def evictable_pages(self) -> int: ...


class LRUPolicy:
    """Least recently used first. O(1) add/touch/remove."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, int] = OrderedDict()  # oldest first
        self._pages = 0

    def add(self, key: Hashable, pages: int) -> None:
        """`key` became evictable (counts as a use)."""
        if key in self._order:
            self._order.move_to_end(key)
            return
        self._order[key] = pages
        self._pages += pages

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        """`key` is no longer evictable (hidden or gone); no-op if unknown."""
        pages = self._order.pop(key, None)
        if pages is not None:
            self._pages -= pages

    def choose(self, pages: int) -> list[Hashable]:
        """Oldest keys whose pages sum to at least `pages`; [] if impossible."""
        if pages > self._pages:
            return []
        chosen: list[Hashable] = []
        total = 0
        for key, size in self._order.items():
            if total >= pages:
                break
            chosen.append(key)
            total += size
        return chosen

    def order(self) -> Iterable[Hashable]:
        """Evictable keys, the first to go first (what a restarted daemon
        adopts in this order keeps its place)."""
        return iter(self._order)

    @property
    def evictable_pages(self) -> int:
        return self._pages

    def __len__(self) -> int:
        return len(self._order)
