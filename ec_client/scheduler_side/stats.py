"""The scheduler's counters, for their two readers: the heartbeat (the
daemon's hit counters follow vLLM's lookups) and vLLM's connector stats.

The view counts lookups and hits, staging its loads, wants its waits and
answers; each keeps its own. Lookups are counted once, in the view, and
each reader takes what came since it last asked, so both see every lookup
once. The heartbeat asks on the link's thread, vLLM's stats on the
engine's: each reads its own mark, and the view's counts are one tuple
replaced whole.
"""

from __future__ import annotations

from collections import Counter

from ec_client.scheduler_side.staging import Staging
from ec_client.scheduler_side.view import ReadyView
from ec_client.scheduler_side.wants import Wants


class SchedulerStats:
    def __init__(self, view: ReadyView, staging: Staging, wants: Wants) -> None:
        self.view = view
        self.staging = staging
        self.wants = wants
        self._taken: dict[str, tuple[int, int]] = {}  # reader -> the counts it last took

    def lookups_since(self, reader: str) -> tuple[int, int]:
        """(lookups, hits) since `reader` last asked; each reader (the
        heartbeat, vLLM's stats) sees every lookup once."""
        counts = self.view.counts()
        taken = self._taken.get(reader, (0, 0))
        self._taken[reader] = counts
        return counts[0] - taken[0], counts[1] - taken[1]

    def take(self) -> Counter[str]:
        """Counters since the previous call (vLLM's connector stats)."""
        lookups, hits = self.lookups_since("stats")
        counts = self.staging.counts
        stats = Counter(lookups=lookups, hits=hits, loads=counts.loads,
                        load_bytes=counts.load_bytes, load_failures=counts.load_failures,
                        loads_inline=counts.inline, **self.wants.take_stats())
        counts.loads = counts.load_bytes = counts.load_failures = counts.inline = 0
        return +stats  # without zero counts
