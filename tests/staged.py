"""The vLLM connector's load path on the client delegates, for tests that
play vLLM's part between an engine's scheduler side and its worker ranks.

A load is staged a step before its use (`ec_client.scheduler_side.staging`):
the step that asks about an item the cache holds sends its load to the
workers, which copy and verify it and report; the step that uses it then
adopts what they staged. Tests of the daemon's protocol care about the first
half (the load in flight, its reports, the acknowledgements they hold
back): `plan` asks about items as a new request would, each step, and ends
the requests once the step's metadata is built, so each step that finds an
item in the cache sends a load of it, as vLLM's steps did before loads were
staged.
"""

from __future__ import annotations

from typing import Any

from ec_client.common.contract import StepMetadata
from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.scheduler_side.staging import Stage


def plan(scheduler: SchedulerDelegate, hashes: list[str], request: str = "req",
         finish: bool = True) -> tuple[list[bool], StepMetadata]:
    """One step in which requests need `hashes`: those the cache holds have
    their loads sent in the step's metadata. Returns whether each did, and
    the metadata. The requests end with the step unless not `finish`: then
    `use` is the step that schedules them."""
    for mm_hash in hashes:
        scheduler.stage(mm_hash, f"{request}-{mm_hash}")
    metadata = scheduler.build_step_metadata()
    if finish:
        for mm_hash in hashes:  # (a load still staging is dropped once reported)
            scheduler.request_finished(f"{request}-{mm_hash}", [mm_hash])
    sent = {spec.mm_hash for spec in metadata.loads}
    return [mm_hash in sent for mm_hash in hashes], metadata


def use(scheduler: SchedulerDelegate, hashes: list[str],
        request: str = "req") -> tuple[list[bool], StepMetadata]:
    """The step that schedules `plan`'s requests (not finished): vLLM's
    lookups (`has_item`: staged on every rank, a hit; the daemon's hit
    counters follow them) and allocations; then the requests end. Returns
    the lookups' answers and the metadata (which adopts the hits)."""
    hits = [scheduler.has_item(mm_hash) for mm_hash in hashes]
    for mm_hash in hashes:
        scheduler.after_alloc(f"{request}-{mm_hash}", mm_hash)
    metadata = scheduler.build_step_metadata()
    for mm_hash in hashes:
        scheduler.request_finished(f"{request}-{mm_hash}", [mm_hash])
    return hits, metadata


def report(scheduler: SchedulerDelegate, result: Any, ranks: int = 1) -> None:
    """A worker's `LoadResult` as vLLM hands it to the scheduler (from
    `ranks` ranks that did alike)."""
    scheduler.apply_worker_output(list(result.done) * ranks,
                                  [(t, result.kinds[t]) for t in result.failed] * ranks)


def load(scheduler: SchedulerDelegate, worker: Any, hashes: list[str]) -> Any:
    """`plan`, the worker's copies, and its report: the worker's `LoadResult`."""
    _, metadata = plan(scheduler, hashes)
    worker.regions.step(metadata.keep)  # as the connector does each step
    try:
        result = worker.load(metadata.loads, metadata.regions)
    finally:
        worker.regions.step_done()
    report(scheduler, result)
    return result


def servable(scheduler: SchedulerDelegate, mm_hash: str) -> bool:
    """Would a request for `mm_hash` have its load staged now (it is in the
    view, and the view serves)? Asks without staging anything."""
    return scheduler.serving() and scheduler.can_load and scheduler.view.get(mm_hash) is not None


def staged(scheduler: SchedulerDelegate, mm_hash: str, request: str) -> bool:
    """Is `mm_hash` staged on every rank for `request` (a hit when vLLM asks)?"""
    return scheduler.stage(mm_hash, request) is Stage.STAGED
