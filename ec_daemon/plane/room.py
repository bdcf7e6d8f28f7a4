"""Room for a save: an allocation that waits for pages to come back, within
--alloc-wait-seconds, and the bounds on how many wait at once.

A worker's saves (`saves`, on the unary calls and the stream) and the
daemon's own promotions (`promotions`) allocate alike: when the cache hid
victims whose views have not acknowledged yet (`AllocOutcome.WAIT`), the
allocation waits for pages to come back (`pages_came_back`, which the cache
announces) and asks again, and it gives up at its deadline. It waits for
hidden pages only a part of the wait (HIDDEN_PATIENCE_FRACTION): pages held
back by a load in flight or a ghost then no longer count as coming back, and
one more round of ready entries is hidden instead.

Allocations waiting for pages are bounded per session (WAITING_PER_SESSION),
for all tokenless clients together and in all (`limits`); one more is refused
at once (RESOURCE_EXHAUSTED). Unbounded, 8,000 unary Allocate calls parked by
one client were each woken by every page that came back (763 ms of latency
for everyone). The daemon's own writer is bounded by its budget instead.

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ec_daemon.core.cache import Cache
from ec_daemon.core.events import AllocOutcome, AllocResult
from ec_daemon.core.limits import (
    HIDDEN_PATIENCE_FRACTION,
    MAX_WAITING_SAVES,
    MAX_WAITING_SAVES_TOKENLESS,
    WAITING_PER_SESSION,
)
from ec_daemon.core.records import Session
from ec_daemon.core.sessions import tokenless
from ec_daemon.errors import ResourceExhausted
from ec_daemon.plane.wakeups import Wakeups

SPACE = "space"  # the Wakeups key of pages coming back


class Room:
    def __init__(self, cache: Cache, alloc_wait_seconds: float) -> None:
        self.cache = cache
        self.alloc_wait_seconds = alloc_wait_seconds
        self.wakeups = Wakeups()
        # Allocations waiting for pages: by session id, the tokenless ones, all.
        self._waiting_of: dict[str, int] = {}
        self._waiting_tokenless = 0
        self._waiting_total = 0

    @property
    def waiting(self) -> int:
        """Allocations waiting for pages now (both paths, every session)."""
        return self._waiting_total

    def pages_came_back(self) -> None:
        """The cache reclaimed pages: every waiting allocation asks again."""
        self.wakeups.wake(SPACE)

    async def allocate(self, session_of: Callable[[], Session], mm_hash: str, nbytes: int,
                       shape: tuple[int, ...], dtype: str, *,
                       counted: bool = False) -> AllocResult:
        """Allocate for the session `session_of()` returns (it may end while
        this waits), waiting for hidden pages within --alloc-wait-seconds.
        Raises ResourceExhausted when no room came in time, or when it would
        wait past the bounds on waiting allocations (`counted`: the caller
        took its place already, `enter`)."""
        started = time.monotonic()
        deadline = started + self.alloc_wait_seconds
        # Past this, hidden pages held back (a load in flight, a ghost) no
        # longer count as coming back: more ready entries are evicted instead.
        patience = started + self.alloc_wait_seconds * HIDDEN_PATIENCE_FRACTION
        impatient = False  # once only: the victims it hides are then counted as coming
        waiting: Session | None = None  # the session whose place this wait holds
        try:
            while True:
                session = session_of()
                count_hidden = impatient or time.monotonic() < patience
                impatient = impatient or not count_hidden
                result = self.cache.allocate(session, mm_hash, nbytes, shape, dtype,
                                             count_hidden=count_hidden)
                if result.outcome is not AllocOutcome.WAIT:
                    return result
                if waiting is None and not counted and session.session_id:
                    self.enter(session)
                    waiting = session
                wake_by = deadline if impatient else patience
                if not await self.wakeups.wait((SPACE,), wake_by) \
                        and time.monotonic() >= deadline:
                    raise self.cache.refuse_waited_save(nbytes)
        finally:
            if waiting is not None:
                self.leave(waiting.session_id, waiting.engine_key)

    def enter(self, session: Session) -> None:
        """One more of `session`'s allocations waits for pages; raises
        ResourceExhausted (nothing counted) past a bound. `leave` ends it."""
        held = self._waiting_of.get(session.session_id, 0)
        if held >= WAITING_PER_SESSION:
            raise ResourceExhausted(f"{held} saves of this session already wait for pages")
        shared = tokenless(session.engine_key)
        if shared and self._waiting_tokenless >= MAX_WAITING_SAVES_TOKENLESS:
            raise ResourceExhausted(
                f"{self._waiting_tokenless} saves of clients without an engine token already "
                "wait for pages")
        if self._waiting_total >= MAX_WAITING_SAVES:
            raise ResourceExhausted(f"{self._waiting_total} saves already wait for pages")
        self._waiting_of[session.session_id] = held + 1
        self._waiting_tokenless += shared
        self._waiting_total += 1

    def leave(self, session_id: str, instance: str) -> None:
        """An allocation of session `session_id` (engine instance `instance`)
        no longer waits."""
        left = self._waiting_of.pop(session_id, 1) - 1
        if left:
            self._waiting_of[session_id] = left
        self._waiting_tokenless -= tokenless(instance)
        self._waiting_total -= 1
