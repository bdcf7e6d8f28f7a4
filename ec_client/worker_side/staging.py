"""The staging area of one worker rank: loads copied and verified, kept aside
until the step that uses them.

A load that cannot return the saved bytes (its pages reused or rewritten by
another process of the region, a bogus entry) must cost its request only.
vLLM offers no way to fail one request from the worker once its step runs,
and whatever a worker puts in vLLM's encoder cache stays there (and the KV
computed from it in the prefix cache), so a load is copied and verified a
step before the step that uses it: every rank stages it here and reports it,
and only a load every rank staged is a hit when vLLM next asks
(docs/architecture.md, "Staged loads"). Then the step's metadata names it in
`adopt` and the output moves into the encoder cache without a copy.

Outputs live outside vLLM's encoder budget (on the worker's device), so the
area is bounded in bytes (`ec_daemon_staging_bytes`); the scheduler keeps the
same bound over what it stages, and a load that finds no room here fails
(its request encodes the item instead). An output no step adopted
`STAGED_STEPS` steps after it was staged is dropped (its request was
aborted or finished meanwhile and the scheduler's drop was not seen).

Not thread-safe: vLLM's engine thread stages, adopts and drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ec_client.common.limits import STAGED_STEPS


@dataclass(slots=True)
class _Staged:
    mm_hash: str
    output: Any
    nbytes: int
    step: int


class StagingArea:
    def __init__(self, limit_bytes: int, steps: int = STAGED_STEPS) -> None:
        self.limit_bytes = limit_bytes
        self.steps = steps
        self.bytes = 0
        self._staged: dict[int, _Staged] = {}  # transfer id ->

    def __len__(self) -> int:
        return len(self._staged)

    def room(self, nbytes: int) -> bool:
        """Would `nbytes` more fit within the bound?"""
        return self.bytes + nbytes <= self.limit_bytes

    def put(self, transfer_id: int, mm_hash: str, output: Any, nbytes: int,
            step: int) -> None:
        """Keep `output` (verified) until a step adopts or drops it."""
        old = self._staged.pop(transfer_id, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._staged[transfer_id] = _Staged(mm_hash, output, nbytes, step)
        self.bytes += nbytes

    def take(self, transfer_id: int) -> tuple[str, Any] | None:
        """The staged (mm_hash, output), out of the area; None if absent."""
        staged = self._staged.pop(transfer_id, None)
        if staged is None:
            return None
        self.bytes -= staged.nbytes
        return staged.mm_hash, staged.output

    def drop(self, transfer_ids: list[int]) -> int:
        """Forget these outputs (none of them is used); returns how many were here."""
        return sum(self.take(t) is not None for t in transfer_ids)

    def expire(self, step: int) -> int:
        """Drop what no step adopted within `steps` steps; returns how many."""
        old = [t for t, s in self._staged.items() if step - s.step >= self.steps]
        return self.drop(old)

    def clear(self) -> None:
        self._staged.clear()
        self.bytes = 0
