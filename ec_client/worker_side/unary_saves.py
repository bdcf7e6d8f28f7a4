"""Saves by calls: an Allocate call, a copy and a Report call each.

The saver (`ec_client.worker_side.saver`) saves this way against a daemon
that does not take saves on the session stream (protocol 3 before stream
saves: engines upgraded before their host's daemon), or when told
`use_stream=False` (the tests keep this fallback working, the save
benchmark has its baseline); it goes with the next protocol version
(`ec_protocol.protocol`). The saver also reports here the saves it skipped
for a full queue when it does not save on the stream.

A save is counted once: done, lost (its Report failed or was not accepted),
refused (RESOURCE_EXHAUSTED), failed, skipped (detached), stale or cut (the
copy, `ec_client.worker_side.region_copy`), or cached already. An
allocation whose call failed retryably, a copy given up and a saved report
that failed are aborted with a Report, so no entry stays pending for the
session's life. Called on the saver's thread only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc

from ec_client.common.session import Attachment, SessionLink
from ec_client.common.wire import (
    AllocStatus,
    ReportStatus,
    allocate_request,
    allocated,
    report_request,
    report_statuses,
)
from ec_client.copy import describe
from ec_client.worker_side.region_copy import RegionCopier
from ec_protocol.protocol import RETRYABLE
from ec_protocol.transport import Transport

# The saver's log: what became of a save is said under one logger name.
log = logging.getLogger("ec_client.worker_side.saver")


class UnarySaves:
    def __init__(self, *, link: SessionLink, transport: Transport, copier: RegionCopier,
                 stats: Counter[str], drop: Callable[[str], None]) -> None:
        """`stats` is the worker's counters; `drop(mm_hash)`: the save ended
        without its entry in the cache (the saver lists it, under its lock)."""
        self.link = link
        self.transport = transport
        self.copier = copier
        self.stats = stats
        self.drop = drop

    def save(self, mm_hash: str, output: Any, ready: Any) -> None:
        """Allocate, copy and report the save of `output` as `mm_hash`.
        Raises what the copy raised (the save aborted); the caller counts it."""
        attachment = self.link.attachment
        if attachment is None:
            self.stats["saves_skipped_detached"] += 1
            self.drop(mm_hash)
            return
        nbytes, shape, dtype = describe(output)
        request = allocate_request(attachment.session_id, mm_hash, nbytes, shape, dtype)
        try:
            reply = allocated(self.transport.call("Allocate", request))
        except grpc.RpcError as exc:
            self.stats["saves_refused" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                       else "saves_failed"] += 1
            log.debug("ec-daemon did not take %s: %s", mm_hash, exc.details())
            self.drop(mm_hash)
            if exc.code() in RETRYABLE:  # it may have been applied: do not leave it pending
                self.report(attachment, aborted=[mm_hash])
            return
        if reply.status != AllocStatus.ALLOCATED:
            self.stats["saves_already_cached"] += 1
            return
        extents = list(reply.extents)
        try:
            sums = self.copier.copy(attachment, output, ready, reply.entry_id, extents)
            if sums is None:
                self.report(attachment, aborted=[mm_hash])
                self.drop(mm_hash)
                return
        except Exception:
            self.report(attachment, aborted=[mm_hash])
            raise
        statuses = self.report(attachment, saved=[mm_hash], saved_checksums=[sums], retries=2)
        if statuses is None:  # the entry would stay pending for this session's life
            self.report(attachment, aborted=[mm_hash])
        accepted = statuses is not None and statuses[0] == ReportStatus.ACCEPTED
        self.stats["saves_done" if accepted else "saves_lost"] += 1
        if not accepted:
            self.drop(mm_hash)

    def report(self, attachment: Attachment, retries: int = 0,
               **lists: list[Any]) -> list[int] | None:
        """A Report call: the status of each `saved` key, None if it failed."""
        request = report_request(attachment.session_id, **lists)
        for attempt in range(retries + 1):
            try:
                return report_statuses(self.transport.call("Report", request))
            except grpc.RpcError as exc:
                if attempt == retries or exc.code() not in RETRYABLE:
                    log.warning("ec-daemon report failed: %s %s", exc.code().name,
                                exc.details())
                    return None
        return None
