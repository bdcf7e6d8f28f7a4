"""Entries this engine does not stage again, and the wrong bytes it found.

A load that failed on a rank is a miss for its requests (`staging`), and
its entry is refused here, so later requests encode the item rather than
meet the same failure: for good when its bytes were wrong (a stamp or
checksum mismatch, reported to the daemon, which checks the pages and hides
the entry; a new save of the key is another entry), for UNUSABLE_SECONDS
after any other failure. At most MAX_REFUSED are remembered, the oldest
forgotten first.

Not thread-safe: vLLM's scheduling thread calls everything here.
"""

from __future__ import annotations

from ec_client.common.contract import CHECKSUM_MISMATCH, STAMP_MISMATCH
from ec_client.common.limits import MAX_REFUSED, UNUSABLE_SECONDS
from ec_client.scheduler_side.view import Ref, Refs


class Refusals:
    def __init__(self) -> None:
        self._refused: dict[Ref, tuple[str, float]] = {}  # ref -> (failure kind, until when)
        self._mismatches: Refs = []  # to report

    def refused(self, mm_hash: str, entry_id: int, now: float) -> bool:
        """Is this entry one this engine must not stage (it failed before)?"""
        refusal = self._refused.get((mm_hash, entry_id))
        if refusal is None:
            return False
        if refusal[1] > now:
            return True
        del self._refused[(mm_hash, entry_id)]
        return False

    def failed(self, ref: Ref, kind: str, now: float) -> None:
        """A load of `ref` failed with `kind` (`ec_client.common.contract`) at `now`."""
        mismatch = kind in (STAMP_MISMATCH, CHECKSUM_MISMATCH)
        if mismatch:
            self._mismatches.append(ref)
        refused = self._refused
        if len(refused) >= MAX_REFUSED:
            refused.pop(next(iter(refused)))
        refused[ref] = (kind, float("inf") if mismatch else now + UNUSABLE_SECONDS)

    def take_mismatches(self) -> Refs:
        """Entries whose bytes a load found wrong, since the previous call
        (for the daemon, which checks and hides them)."""
        taken, self._mismatches = self._mismatches, []
        return taken
