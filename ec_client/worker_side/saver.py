"""The save rank's saver: a queue bounded in bytes and the thread that
empties it into the daemon's region.

`put` queues an output (kept alive until copied) and returns at once; a
queue that holds `queue_bytes` already refuses it (outputs held for saving
live outside vLLM's encoder budget), and the saves it refused are reported
to the daemon as given up (another engine may wait for one: it encodes it
itself). A saver started `held` keeps what it is given, within the same
bytes, until it is told the saves' namespace is the one its engine's
scheduler reads (`release_held`), or is not (`drop_held`). The thread takes
the saves queued at once, up to SAVE_BATCH:

- on the session stream, when the daemon takes saves there (`ec_client.worker_side.stream_saves`):
  the batch is asked for in one message, each save copied as its answer
  comes, and their reports held for the next batch's message (sent at once
  when nothing more is queued): one stream message per batch, no call;
- else (an older daemon, or `use_stream=False`) each save is an Allocate
  call, a copy and a Report call (`ec_client.worker_side.unary_saves`).

Either way the copy goes through `ec_client.worker_side.region_copy`: only
while the session is fresh and its pages carry its allocation's stamp (a
writer frozen past its lease never overwrites), then read back from the
region file for the checksum reported with `saved`, and given up
(`saves_region_cut`) when the file was cut under it. A key cached already or
being saved is dropped, a full cache (RESOURCE_EXHAUSTED)
just means the output is not cached, and a save whose answer never comes is
given up after the transport's deadline and counted (`saves_failed`,
`saves_lost`).

Every save that ends without its entry in the cache (skipped, refused,
failed, stale, lost; not one cached already by another engine) is also
listed for `take_dropped`: the vLLM connector hands the list to its
scheduler, whose producer then announces no metadata for those items (a
consumer would wait for an entry that never comes).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Hashable
from typing import Any

import grpc

from ec_client.common.limits import MAX_DROPPED_SAVES, PRUNE_SECONDS, SAVE_BATCH
from ec_client.common.session import Attachment, SessionLink
from ec_client.common.wire import AllocStatus, ReportStatus, SaveAllocation
from ec_client.copy import CopyBackend, describe, storage_of
from ec_client.worker_side.region_copy import RegionCopier
from ec_client.worker_side.regions import Regions
from ec_client.worker_side.stream_saves import Report, StreamSaves
from ec_client.worker_side.unary_saves import UnarySaves
from ec_protocol.protocol import MAX_BATCH
from ec_protocol.transport import Transport

log = logging.getLogger(__name__)

# On the save queue: report the saves skipped so far (the queue was too full).
_REPORT_SKIPS: Any = object()
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}

QueuedSave = tuple[str, Any, Any, Hashable]  # mm_hash, output, its ready event, its storage


class Saver:
    def __init__(self, *, link: SessionLink, transport: Transport, regions: Regions,
                 backend: CopyBackend, stats: Counter[str], queue_bytes: int,
                 use_stream: bool = True, name: str = "ec-saver", held: bool = False) -> None:
        """`stats` is the worker's counters; `use_stream=False`: Allocate and
        Report calls even where the daemon takes saves on the stream.
        `held`: saves wait (in the queue's bytes) until `release_held` or
        `drop_held`."""
        self.link = link
        self.transport = transport
        self.regions = regions
        self.backend = backend
        self.stats = stats
        self.queue_bytes = queue_bytes
        self.use_stream = use_stream
        self.stream = StreamSaves(link.send_on)
        self._queue: queue.Queue[QueuedSave | None] = queue.Queue()
        self._queued_bytes = 0  # the storages queued outputs hold, each once
        self._storages: dict[Hashable, list[int]] = {}  # key -> [bytes, queued outputs]
        self._unfinished = 0
        # Saves skipped for a full queue, told to the daemon by the saver
        # thread after its current batch.
        self._skipped: list[str] = []
        # Saves that ended without their entry in the cache, until taken.
        self._dropped: list[str] = []
        self._idle = threading.Condition()
        # The last batch's reports, sent with the next batch's allocations
        # when saves are queued already (else at once), for this attachment.
        self._held: tuple[Attachment, Report] | None = None
        # Saves waiting until the saves' namespace is confirmed (`held`);
        # None once released (later saves are queued at once).
        self._waiting: list[QueuedSave] | None = [] if held else None
        self._copier = RegionCopier(link=link, regions=regions, backend=backend, stats=stats)
        self._unary = UnarySaves(link=link, transport=transport, copier=self._copier,
                                 stats=stats, drop=self.drop)
        self._thread = threading.Thread(target=self._save_loop, name=name, daemon=True)
        self._thread.start()

    def put(self, mm_hash: str, output: Any) -> bool:
        """Queue `output` to be saved as `mm_hash`; False (not cached) when
        the queue holds `queue_bytes` already."""
        key, nbytes = storage_of(output)
        with self._idle:
            known = self._storages.get(key)  # a storage queued already adds nothing
            added = 0 if known is not None else nbytes
            if self._queued_bytes + added > self.queue_bytes:
                self.stats["saves_skipped_busy"] += 1
                self._drop_locked(mm_hash)
                if len(self._skipped) < MAX_BATCH:
                    self._skipped.append(mm_hash)
                    if len(self._skipped) == 1:  # reported by the saver at once, not
                        self._queue.put(_REPORT_SKIPS)  # after some later save
                return False
            self._queued_bytes += added
            self._storages.setdefault(key, [nbytes, 0])[1] += 1
            self._unfinished += 1
        try:
            ready = self.backend.prepare_save(output)
        except Exception:  # never the engine's error: this output is not cached
            self._finished([key])
            self.drop(mm_hash)
            self.stats["save_errors"] += 1
            log.exception("ec-daemon save of %s failed", mm_hash)
            return False
        save = (mm_hash, output, ready, key)
        with self._idle:
            if self._waiting is not None:
                self._waiting.append(save)
                self.stats["saves_held"] += 1
                return True
        self._queue.put(save)
        return True

    def release_held(self) -> None:
        """Saves go to the daemon from now on, those held first."""
        with self._idle:
            waiting, self._waiting = self._waiting, None
        for save in waiting or ():
            self._queue.put(save)

    def drop_held(self) -> int:
        """Drop the saves held (their outputs released), and hold none from
        now on; how many were dropped."""
        with self._idle:
            waiting, self._waiting = self._waiting or [], None
            for save in waiting:
                self._drop_locked(save[0])
        if waiting:
            self._finished([save[3] for save in waiting], len(waiting))
        return len(waiting)

    def drop(self, mm_hash: str) -> None:
        """The save of `mm_hash` ended without its entry in the cache."""
        with self._idle:
            self._drop_locked(mm_hash)

    def _drop_locked(self, mm_hash: str) -> None:
        if len(self._dropped) < MAX_DROPPED_SAVES:
            self._dropped.append(mm_hash)

    def take_dropped(self) -> list[str]:
        """The saves dropped since the last call (mm_hashes)."""
        with self._idle:
            taken, self._dropped = self._dropped, []
        return taken

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save landed or was dropped."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def close(self, timeout: float) -> None:
        """Drop what is held, flush (at most `timeout`), then stop the thread."""
        self.drop_held()
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout=2)

    def _save_loop(self) -> None:
        deadline = self.transport.deadline_seconds
        while True:
            try:
                item = self._queue.get(timeout=PRUNE_SECONDS)
            except queue.Empty:
                self.regions.prune()
                self.stream.expire(deadline)
                continue
            saves, stop = self._take_batch(item)
            del item  # the outputs are held by `saves` only, released as each is done
            attachment = self.link.attachment
            if saves and self._on_stream(attachment):
                assert attachment is not None
                self._save_on_stream(attachment, saves)
            else:
                self._flush_report()
            while saves:
                self._save_unary(*saves.pop(0))
            self.stream.expire(deadline)
            self._report_skipped()
            if stop or self._queue.empty():
                self._flush_report()
            if stop:
                return

    def _on_stream(self, attachment: Attachment | None) -> bool:
        """Do saves go on `attachment`'s stream?"""
        return attachment is not None and attachment.stream_saves and self.use_stream

    def _take_batch(self, first: QueuedSave | None) -> tuple[list[QueuedSave], bool]:
        """`first` and the saves queued behind it (up to SAVE_BATCH), and
        whether the saver stops after them."""
        saves: list[QueuedSave] = []
        item = first
        while True:
            if item is None:
                return saves, True
            if item is not _REPORT_SKIPS:
                saves.append(item)
            if len(saves) >= SAVE_BATCH:
                return saves, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return saves, False

    def _report_skipped(self) -> None:
        """Tell the daemon of the saves skipped for a full queue (with the
        held reports on the stream)."""
        with self._idle:
            skipped, self._skipped = self._skipped, []
        attachment = self.link.attachment
        if not skipped or attachment is None:
            return
        if self._on_stream(attachment):
            self._held_report(attachment).aborted.extend(skipped)
        else:
            self._unary.report(attachment, aborted=skipped)

    def _held_report(self, attachment: Attachment) -> Report:
        """The reports held for `attachment` (those held for another are sent)."""
        if self._held is not None and self._held[0] is not attachment:
            self._flush_report()
        if self._held is None:
            self._held = (attachment, Report(on_reported=self._reported))
        return self._held[1]

    def _flush_report(self) -> None:
        """Send the held reports now."""
        held, self._held = self._held, None
        if held is not None and held[1] and not self.stream.report(*held):
            for mm_hash in held[1].saved:  # the session ended: its pending saves are
                self._reported(mm_hash, None)  # quarantined

    def _finished(self, storages: list[Hashable], unfinished: int = 1) -> None:
        """Queued saves' outputs (of `storages`) are no longer held;
        `unfinished` of them are done."""
        with self._idle:
            for key in storages:
                entry = self._storages[key]
                entry[1] -= 1
                if entry[1] == 0:
                    self._queued_bytes -= entry[0]
                    del self._storages[key]
            self._unfinished -= unfinished
            self._idle.notify_all()

    def _reported(self, mm_hash: str, status: int | None) -> None:
        """A stream report's answer (None: none came): the save is done.
        Called on the link's thread as well as this one: counted under the lock."""
        with self._idle:
            self.stats["saves_done" if status == ReportStatus.ACCEPTED else "saves_lost"] += 1
            if status != ReportStatus.ACCEPTED:
                self._drop_locked(mm_hash)
            self._unfinished -= 1
            self._idle.notify_all()

    def _save_unary(self, mm_hash: str, output: Any, ready: Any, storage: Hashable) -> None:
        try:
            self._save_one(mm_hash, output, ready)
        except Exception:
            self.stats["save_errors"] += 1
            self.drop(mm_hash)
            log.exception("ec-daemon save of %s failed", mm_hash)
        finally:
            del output, ready  # release the tensor before waiting again
            self._finished([storage])

    def _save_one(self, mm_hash: str, output: Any, ready: Any) -> None:
        """One save by calls (`UnarySaves.save`)."""
        self._unary.save(mm_hash, output, ready)

    def _save_on_stream(self, attachment: Attachment, saves: list[QueuedSave]) -> None:
        """Ask for every save of `saves` in one message (with the held
        reports), copy each as its answer comes (releasing its output), and
        hold their reports. Empties `saves`."""
        reports = self._held_report(attachment)
        self._held = None
        asks = [(mm_hash, *describe(output)) for mm_hash, output, _, _ in saves]
        ids = self.stream.allocate(attachment, asks, reports)
        if ids is None:
            self.stats["saves_skipped_detached"] += len(saves)
            for save in saves:
                self.drop(save[0])
            self._finished([save[3] for save in saves], len(saves))
            saves.clear()
            for mm_hash in reports.saved:  # the session ended: quarantined
                self._reported(mm_hash, None)
            return
        reports = self._held_report(attachment)
        for request_id in ids:
            mm_hash, output, ready, storage = saves.pop(0)
            answer = self.stream.wait(request_id, self.transport.deadline_seconds)
            copied = False
            try:
                taken = self._take_answer(mm_hash, answer)
                if taken is not None:
                    sums = self._copier.copy(attachment, output, ready, taken.entry_id,
                                             list(taken.extents))
                    copied = sums is not None
                    (reports.saved if copied else reports.aborted).append(mm_hash)
                    if sums is not None:
                        reports.checksums[mm_hash] = sums
                    else:
                        self.drop(mm_hash)
            except Exception:
                self.stats["save_errors"] += 1
                reports.aborted.append(mm_hash)
                self.drop(mm_hash)
                log.exception("ec-daemon save of %s failed", mm_hash)
            finally:
                del output, ready
                self._finished([storage], 0 if copied else 1)  # a copy is done once reported

    def _take_answer(self, mm_hash: str,
                     answer: SaveAllocation | None) -> SaveAllocation | None:
        """The answer if it allocated pages to copy into; else None, counted
        (and listed as dropped unless the key is cached or being saved)."""
        if answer is None:  # the stream was lost, or the deadline passed
            self.stats["saves_failed"] += 1
            self.drop(mm_hash)
            return None
        if answer.error_code:
            code = _STATUS_CODES.get(answer.error_code)
            self.stats["saves_refused" if code == grpc.StatusCode.RESOURCE_EXHAUSTED
                       else "saves_failed"] += 1
            self.drop(mm_hash)
            log.debug("ec-daemon did not take %s: %s", mm_hash, answer.error)
            return None
        if answer.status != AllocStatus.ALLOCATED:
            self.stats["saves_already_cached"] += 1
            return None
        return answer
