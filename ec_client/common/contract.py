"""The scheduler-to-worker contract: what a scheduler step hands its workers
(`StepMetadata`: the loads to stage, the staged loads to adopt or drop, the
regions the loads name, the generations to keep mapped, the namespace) and
what a worker needs to map a region (`RegionInfo`). Plain values, cheap to
pickle (vLLM sends them to every rank each step), in a module of their own so
worker processes never import the scheduler's side.

A load lands one step before the step that uses it (docs/architecture.md,
"Staged loads"): a step's `loads` are copied by every rank into memory it
keeps aside and verified; each rank reports them in its worker metadata;
a later step that schedules a request needing one names it in `adopt`, and
the ranks move the staged output into vLLM's encoder cache without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class RegionInfo:
    """What a worker needs to map and check a region (from AttachReply.region)."""

    path: str
    size: int
    generation: int
    page_bytes: int
    data_offset: int
    # The file's canary when the daemon announced it (`ec_protocol.stamps`);
    # 0: a daemon that writes none.
    canary: int = 0


class LoadSpec(NamedTuple):
    """One load for the workers: copy `extents` of region `generation` into
    an output of `shape`/`dtype`, check the pages carry stamp `entry_id` and
    (unless 0) that the bytes hash to `checksum` (xxh3-64), then report
    `transfer_id`. (A NamedTuple: built once per hit on the scheduler's path,
    and cheap to pickle.)"""

    mm_hash: str
    transfer_id: int
    entry_id: int
    generation: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    extents: tuple[tuple[int, int], ...]
    checksum: int = 0


class Adopt(NamedTuple):
    """A staged load this step uses: move the output staged under
    `transfer_id` into vLLM's encoder cache as `mm_hash`."""

    mm_hash: str
    transfer_id: int


class InlineLoad(NamedTuple):
    """An output the scheduler's process staged and verified itself (a step
    its workers did not run: `StepMetadata.loads` would not have reached
    them), carried whole: the ranks put `payload` (row-major bytes) into the
    encoder cache as `mm_hash`, with `shape` and `dtype`."""

    mm_hash: str
    transfer_id: int
    shape: tuple[int, ...]
    dtype: str
    payload: bytes | bytearray


@dataclass
class StepMetadata:
    """Scheduler -> workers, once per step. Extents, never one id per row;
    the regions the loads name, by generation."""

    # Loads to stage: copy, verify, keep aside, report.
    loads: list[LoadSpec] = field(default_factory=list)
    # Staged loads this step's requests use, and ones no request will use.
    adopt: list[Adopt] = field(default_factory=list)
    drop: list[int] = field(default_factory=list)
    inline: list[InlineLoad] = field(default_factory=list)
    # Steps the workers run, counted by the scheduler (0: not counted). A
    # worker drops a staged output no step adopted within
    # ec_client.common.limits.STAGED_STEPS of its staging.
    step: int = 0
    regions: dict[int, RegionInfo] = field(default_factory=dict)
    # The region generations this scheduler may still have a rank load from:
    # its loads dispatched and not reported by every rank (these included),
    # and the region it answers hits for. A worker keeps them mapped while it
    # works on this step, however long a restarted daemon has been gone.
    keep: frozenset[int] = frozenset()
    # The namespace hits are answered from: a worker that attached with
    # another (it identified the weights differently) must not save.
    namespace: str = ""
    # The engine instance's token (`SchedulerDelegate.engine_token`): a
    # worker presents it to the daemon, which then counts it as one of this
    # engine's ranks. Never logged: it is what keeps other clients out.
    engine_token: str = ""



# Why a rank could not stage a load (`WorkerMetadata`): the entry's bytes are
# not what its writer saved (reported to the daemon, which checks and hides
# it), or anything else (the load's request only).
STAMP_MISMATCH = "stamp"
CHECKSUM_MISMATCH = "checksum"
UNUSABLE = "unusable"
