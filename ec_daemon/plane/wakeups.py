"""Wake-ups by key: how a call on the event loop waits for something the
cache will announce (pages coming back, for a save that waits for room)
without polling and without outliving its deadline.

Why one-shot futures under keys, and not a condition variable: a waiter
names what it waits for, one wake settles exactly those waiters, and a wait
that ends any way (woken, at its deadline, cancelled with its call) leaves
nothing registered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Iterable


class Wakeups:
    """One-shot wakeups by key, each wait bounded by a deadline."""

    def __init__(self) -> None:
        self._waiters: dict[Hashable, set[asyncio.Future[bool]]] = {}

    async def wait(self, keys: Iterable[Hashable], deadline: float) -> bool:
        """Until `wake` of any of `keys` or `wake_all()`: True; False at the deadline."""
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            return False
        keys = tuple(keys)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        expiry = loop.call_later(timeout, _settle, future, False)
        sets = [self._waiters.setdefault(key, set()) for key in keys]
        for waiters in sets:
            waiters.add(future)
        try:
            return await future
        finally:
            expiry.cancel()
            for key, waiters in zip(keys, sets, strict=True):
                waiters.discard(future)
                if not waiters and self._waiters.get(key) is waiters:
                    del self._waiters[key]

    def wake(self, key: Hashable) -> None:
        for future in self._waiters.pop(key, ()):
            _settle(future, True)

    def wake_all(self) -> None:
        for key in list(self._waiters):
            self.wake(key)


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)
