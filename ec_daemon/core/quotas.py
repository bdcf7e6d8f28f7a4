"""Caps on pending saves: per session, per engine instance, for all tokenless
clients together, and in all.

A pending entry cannot be evicted, so a session that allocates and never
reports would otherwise take the whole cache: every ready entry evicted to
make room for it, every other engine's save refused. One more save past a
cap is refused with RESOURCE_EXHAUSTED naming the cap (distinct from "cache
full"), before anything is evicted:

- a session holds at most `PendingCaps.entries` saves pending;
- an engine instance (the engine id and token of its sessions,
  `Session.engine_key`: a worker that learns the token after Attach counts
  with its instance from then on) holds at most `PendingCaps.bytes`, pending
  in all its sessions and quarantined together;
- all clients together hold at most `PendingCaps.total_bytes` so, and all
  tokenless clients together (one bucket, whatever engine ids they name) a
  TOKENLESS_SHARE of it.

Why per instance and in all, not per session alone: two sessions under two
engine ids took 512 MiB each, the whole default cache, every ready entry
evicted and the victims refused "cache full", and after they detached the
gigabyte sat in quarantine for 300 s. The defaults scale with --cpu-bytes
(`serving.config`), so a larger cache leaves the same share to the engines.

Why the quarantine counts too: a session that ends with pending saves leaves
their pages quarantined (`--quarantine-seconds`), so ending and re-attaching
would give it a fresh allowance every time. The pages an instance's ended
sessions left in quarantine are charged to it, and to the totals, until they
are released. A client inventing tokens gets an instance's cap each time,
but never more than the total: the rest of the cache stays the ready
entries'. The daemon's own writer (promotions from the second tier) is not
capped here: its budget bounds it, and a client naming its engine id must
not starve it.

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ec_daemon.core.limits import TOKENLESS_SHARE
from ec_daemon.core.records import Session
from ec_daemon.core.sessions import tokenless
from ec_daemon.errors import ResourceExhausted


@dataclass(frozen=True)
class PendingCaps:
    """`--session-pending-bytes` (per engine instance), `--session-pending-entries`
    (per session), `--total-pending-bytes` (all clients; None: no total)."""

    bytes: int
    entries: int
    total_bytes: int | None = None


class PendingQuota:
    """Checks allocations against the caps; keeps what each instance holds."""

    def __init__(self, caps: PendingCaps | None, page_bytes: int) -> None:
        """`caps` None: no cap (a cache built without a daemon: unit tests)."""
        self.caps = caps
        self.page_bytes = page_bytes
        # engine instance (`Session.engine_key`) -> pages pending, and quarantined
        self._pending: dict[str, int] = {}
        self._charged: dict[str, int] = {}
        self._charges: deque[tuple[float, str, int]] = deque()  # (released at, engine, pages)
        self.held_pages = 0  # pending and charged, every instance
        self.tokenless_pages = 0  # of that, the tokenless bucket's

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
        pb, key = self.page_bytes, session.engine_key
        pending = self._pending.get(key, 0) * pb
        quarantined = self._charged.get(key, 0) * pb
        more = pages * pb
        if pending + quarantined + more > caps.bytes:
            raise ResourceExhausted(
                f"pending-save cap: session {session.index} of engine {session.engine_id!r}: "
                f"its engine instance holds {pending} bytes of saves allocated and not "
                f"reported, and its ended sessions {quarantined} bytes in quarantine; {more} "
                f"more would exceed --session-pending-bytes {caps.bytes}")
        total = caps.total_bytes
        if total is None:
            return
        if self.held_pages * pb + more > total:
            raise ResourceExhausted(
                f"pending-save total cap: all sessions hold {self.held_pages * pb} bytes of "
                f"saves allocated and not reported or in quarantine; {more} more would exceed "
                f"--total-pending-bytes {total}")
        if tokenless(key) and self.tokenless_pages * pb + more > total // TOKENLESS_SHARE:
            raise ResourceExhausted(
                f"pending-save cap of clients without an engine token: together they hold "
                f"{self.tokenless_pages * pb} bytes pending or in quarantine; {more} more "
                f"would exceed 1/{TOKENLESS_SHARE} of --total-pending-bytes {total}")

    def take(self, key: str, pages: int) -> None:
        """Engine instance `key` holds `pages` more pending pages."""
        self._add(self._pending, key, pages)

    def settle(self, key: str, pages: int) -> None:
        """`pages` pending pages of instance `key` were committed or dropped."""
        self._add(self._pending, key, -pages)

    def move(self, before: str, after: str, pages: int) -> None:
        """A worker holding `pages` pending pages joined instance `after`."""
        if pages and before != after:
            self._add(self._pending, before, -pages)
            self._add(self._pending, after, pages)

    def charge(self, key: str, pages: int, until: float) -> None:
        """Engine instance `key`'s ended session left `pages` quarantined until `until`
        (which never decreases from one call to the next)."""
        self._add(self._charged, key, pages)
        self._charges.append((until, key, pages))

    def release(self, now: float) -> None:
        """Forget the charges whose quarantine is over."""
        while self._charges and self._charges[0][0] <= now:
            _, key, pages = self._charges.popleft()
            self._add(self._charged, key, -pages)

    def charged_pages(self) -> int:
        """Quarantined pages charged to instances (the invariant checker)."""
        return sum(pages for _, _, pages in self._charges)

    def _add(self, table: dict[str, int], key: str, pages: int) -> None:
        left = table.get(key, 0) + pages
        if left:
            table[key] = left
        else:
            table.pop(key, None)
        self.held_pages += pages
        if tokenless(key):
            self.tokenless_pages += pages
