"""The promotion budget: the bytes of fetched values a daemon may hold
between a promotion's fetch and its write into the region.

A promotion reserves the most its value can take (the announced payload and
the largest header its key allows) before it fetches, and releases that once
the value is written or dropped, so fetched values never hold more than the
budget however many promotions run and however long their allocations wait
(--alloc-wait-seconds); the store refuses to hand over more than was reserved.
When the budget is spent a promotion does not start and its waiting engine is
told to encode at once: waiting for room would make that engine wait on other
fetches and allocations, while encoding is always possible and costs it no
more than the miss it had anyway.
"""

from __future__ import annotations

import threading


class Reservation:
    """Bytes held for one promotion. `release()` returns them; it is
    idempotent and thread-safe, so a `finally` may always call it."""

    __slots__ = ("_budget", "bytes", "nbytes")

    def __init__(self, budget: PromotionBudget, nbytes: int, reserved: int) -> None:
        self._budget: PromotionBudget | None = budget
        self.nbytes = nbytes  # the announced payload
        self.bytes = reserved  # what is held: the most the whole value can take

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._release(self.bytes)

    def __repr__(self) -> str:
        return f"Reservation({self.bytes} bytes, {'held' if self._budget else 'released'})"


class PromotionBudget:
    """At most `limit` bytes reserved at once; thread-safe, never blocks."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("the promotion budget must be positive")
        self.limit = limit
        self._lock = threading.Lock()
        self._held = 0
        self._peak = 0

    def reserve(self, nbytes: int, reserved: int) -> Reservation | None:
        """A reservation of `reserved` bytes for a payload of `nbytes`, or
        None (nothing held) when it does not fit now."""
        with self._lock:
            if self._held + reserved > self.limit:
                return None
            self._held += reserved
            self._peak = max(self._peak, self._held)
        return Reservation(self, nbytes, reserved)

    def _release(self, reserved: int) -> None:
        with self._lock:
            self._held -= reserved

    @property
    def held(self) -> int:
        return self._held

    @property
    def peak(self) -> int:
        """The most held at once since start (the high-water mark)."""
        return self._peak
