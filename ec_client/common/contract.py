"""The scheduler-to-worker contract: what a scheduler step hands its workers
(`StepMetadata`: the loads, the regions they name, the generations to keep
mapped, the namespace) and what a worker needs to map a region
(`RegionInfo`). Plain values, cheap to pickle (vLLM sends them to every rank
each step), in a module of their own so worker processes never import the
scheduler's side.
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
    an output of `shape`/`dtype`, check the pages carry stamp `entry_id`
    (and, where the loader checks it, that the bytes have `checksum`, their
    writer's xxh3-64; 0: none), then report `transfer_id`. (A NamedTuple:
    built once per hit on the scheduler's path, and cheap to pickle.)"""

    mm_hash: str
    transfer_id: int
    entry_id: int
    generation: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    extents: tuple[tuple[int, int], ...]
    checksum: int = 0


@dataclass
class StepMetadata:
    """Scheduler -> workers, once per step. Extents, never one id per row;
    the regions the loads name, by generation."""

    loads: list[LoadSpec] = field(default_factory=list)
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
