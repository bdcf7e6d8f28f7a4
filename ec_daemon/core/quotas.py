"""Caps on what one session may hold as pending saves.

A pending entry cannot be evicted, so a session that allocates and never
reports would otherwise take the whole cache: every ready entry evicted to
make room for it, every other engine's save refused. Each session may hold
at most `PendingCaps.bytes` and `PendingCaps.entries` of pending saves; one
more is refused with RESOURCE_EXHAUSTED naming the cap (distinct from
"cache full"), before anything is evicted.

Why the quarantine counts too: a session that ends with pending saves leaves
their pages quarantined (`--quarantine-seconds`), so ending and re-attaching
would give it a fresh allowance every time. The pages an engine's ended
sessions left in quarantine are charged to that engine instance (the engine
id and token of its sessions, `Session.engine_key`: a worker that learns the
token after Attach counts with its instance from then on) until they are
released, and count against each of its sessions' byte cap: one
engine instance cannot hold more than one cap of the cache pending and
quarantined together, and another client of the socket naming its engine id
without its token is charged in a bucket of its own, never the engine's. A
client rotating engine ids or tokens is bounded per session by these caps
and in number by the session caps (`sessions`). The daemon's own writer (promotions
from the second tier) is not capped here: its budget bounds it, and a client
naming its engine id must not starve it.

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ec_daemon.core.records import Session
from ec_daemon.errors import ResourceExhausted


@dataclass(frozen=True)
class PendingCaps:
    """Per session (`--session-pending-bytes`, `--session-pending-entries`)."""

    bytes: int
    entries: int


class PendingQuota:
    """Checks allocations against the caps; keeps the quarantine charged to engines."""

    def __init__(self, caps: PendingCaps | None, page_bytes: int) -> None:
        """`caps` None: no cap (a cache built without a daemon: unit tests)."""
        self.caps = caps
        self.page_bytes = page_bytes
        # engine instance (`Session.engine_key`) -> quarantined pages
        self._charged: dict[str, int] = {}
        self._charges: deque[tuple[float, str, int]] = deque()  # (released at, engine, pages)

    def check(self, session: Session, pages: int) -> None:
        """Raise ResourceExhausted if `session` may not hold `pages` more
        pending pages (one more entry); changes nothing."""
        caps = self.caps
        if caps is None or not session.session_id:
            # No caps, or the daemon's own writer (promotions, which no client
            # can name: bounded by --remote-promotion-bytes), whatever its engine id.
            return
        held = len(session.pending)
        if held + 1 > caps.entries:
            raise ResourceExhausted(
                f"pending-save cap: session {session.index} of engine {session.engine_id!r} "
                f"holds {held} saves allocated and not reported (--session-pending-entries "
                f"{caps.entries}); report them first")
        pb = self.page_bytes
        quarantined = self._charged.get(session.engine_key, 0) * pb
        pending = session.pending_pages * pb
        if pending + quarantined + pages * pb > caps.bytes:
            raise ResourceExhausted(
                f"pending-save cap: session {session.index} of engine {session.engine_id!r} "
                f"holds {pending} bytes of saves allocated and not reported, and its engine's "
                f"ended sessions {quarantined} bytes in quarantine; {pages * pb} more would "
                f"exceed --session-pending-bytes {caps.bytes}")

    def charge(self, key: str, pages: int, until: float) -> None:
        """Engine instance `key`'s ended session left `pages` quarantined until `until`
        (which never decreases from one call to the next)."""
        self._charged[key] = self._charged.get(key, 0) + pages
        self._charges.append((until, key, pages))

    def release(self, now: float) -> None:
        """Forget the charges whose quarantine is over."""
        while self._charges and self._charges[0][0] <= now:
            _, key, pages = self._charges.popleft()
            left = self._charged[key] - pages
            if left:
                self._charged[key] = left
            else:
                del self._charged[key]
