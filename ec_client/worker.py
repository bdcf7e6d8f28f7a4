"""Worker delegate: one engine rank's data plane, on plain values.

It attaches as "worker rank k of n", maps the region of the attached
generation, and copies with a backend from `ec_client.copy`.

- `save` is off the critical path: it queues the output (keeping it alive)
  for a background thread that allocates extents, copies, and reports the
  save; an entry another engine is already writing is dropped, and a full
  cache (RESOURCE_EXHAUSTED) just means this output is not cached. Only the
  `save_rank` writes (all TP ranks hold identical outputs).
- `load` copies each dispatched entry, then reports the transfer ids in one
  call whose verdicts decide: only copies the daemon confirms were covered by
  their pin (HELD) are returned; the rest are failed, so a load either yields
  exactly the saved bytes or fails. A load of another region generation
  (the daemon restarted) fails without being read.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from ec_client.copy import CopyBackend, describe, empty_host, get_backend
from ec_client.mapping import RegionMapping
from ec_client.scheduler import LoadSpec
from ec_client.session import Attachment, SessionLink
from ec_protocol.protocol import RETRYABLE, Layout, pb
from ec_protocol.transport import DEFAULT_DEADLINE_SECONDS, Transport

log = logging.getLogger(__name__)

MAX_QUEUED_SAVES = 1024
# Transfer ids kept for a later report when the daemon could not be told.
MAX_UNREPORTED = 4096


@dataclass
class LoadResult:
    loaded: dict[str, Any] = field(default_factory=dict)  # mm_hash -> array
    done: list[int] = field(default_factory=list)  # transfer ids served
    failed: list[int] = field(default_factory=list)  # transfer ids that must fail


class WorkerDelegate:
    def __init__(self, socket: str, *, engine_id: str, layout: Layout, rank: int = 0,
                 world_size: int = 1, role: str = "both", backend: str | CopyBackend = "cpu",
                 save_rank: int = 0, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
                 client_name: str = "",
                 allocate_out: Callable[[tuple[int, ...], str], Any] = empty_host,
                 token_file: str | None = None, tls_ca: str | None = None,
                 start: bool = True) -> None:
        self.rank = rank
        self.saves_enabled = role in ("producer", "both") and rank == save_rank
        self.transport = Transport(socket, deadline_seconds, token_file=token_file,
                                   tls_ca=tls_ca)
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.allocate_out = allocate_out
        self.stats: Counter[str] = Counter()
        self._mapping: RegionMapping | None = None
        self._saves: queue.Queue[tuple[str, Any, Any] | None] = queue.Queue(MAX_QUEUED_SAVES)
        self._unfinished = 0
        self._idle = threading.Condition()
        self._unreported: list[int] = []
        self._unreported_lock = threading.Lock()
        self.link = SessionLink(
            self.transport, engine_id=engine_id, role=role, layout=layout, rank=rank,
            world_size=world_size, client_name=client_name, on_attached=self._on_attached,
            on_detached=self._on_detached)
        self._saver = threading.Thread(target=self._save_loop, name=f"ec-saver-{rank}",
                                       daemon=True)
        self._saver.start()
        if start:
            self.link.start()

    # ------------------------------------------------------------- saves

    def save(self, mm_hash: str, output: Any) -> bool:
        """Queue `output` (kept alive until copied) to be saved as `mm_hash`.
        Returns False when this rank does not save, the daemon is detached,
        or the queue is full (the output is then simply not cached)."""
        if not self.saves_enabled:
            return False
        if self.link.attachment is None:
            self.stats["saves_skipped_detached"] += 1
            return False
        with self._idle:
            self._unfinished += 1
        try:
            self._saves.put_nowait((mm_hash, output, self.backend.prepare_save(output)))
        except queue.Full:
            self._finish_one()
            self.stats["saves_skipped_busy"] += 1
            return False
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save landed or was dropped."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout)

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            if item is None:
                return
            try:
                self._save_one(*item)
            except Exception:
                self.stats["save_errors"] += 1
                log.exception("ec-daemon save of %s failed", item[0])
            finally:
                self._finish_one()

    def _finish_one(self) -> None:
        with self._idle:
            self._unfinished -= 1
            self._idle.notify_all()

    def _save_one(self, mm_hash: str, output: Any, ready: Any) -> None:
        attachment, mapping = self.link.attachment, self._mapping
        if attachment is None or mapping is None or mapping.generation != attachment.generation:
            self.stats["saves_skipped_detached"] += 1
            return
        nbytes, shape, dtype = describe(output)
        request = pb.AllocateRequest(session_id=attachment.session_id, mm_hash=mm_hash,
                                     nbytes=nbytes, shape=shape, dtype=dtype)
        try:
            reply = self.transport.call("Allocate", request)
        except grpc.RpcError as exc:
            self.stats["saves_refused" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                       else "saves_failed"] += 1
            log.debug("ec-daemon did not take %s: %s", mm_hash, exc.details())
            return
        if reply.status != pb.ALLOCATED:
            self.stats["saves_already_cached"] += 1
            return
        extents = [(e.offset, e.length) for e in reply.extents]
        try:
            self.backend.save(output, mapping, extents, ready)
        except Exception:
            self._report(attachment, aborted=[mm_hash])
            raise
        reply = self._report(attachment, saved=[mm_hash], retries=2)
        if reply is None:  # the entry would stay pending for this session's life
            self._report(attachment, aborted=[mm_hash])
        accepted = reply is not None and reply.saved[0] == pb.ACCEPTED
        self.stats["saves_done" if accepted else "saves_lost"] += 1

    # ------------------------------------------------------------- loads

    def load(self, specs: Sequence[LoadSpec]) -> LoadResult:
        """Copy each dispatched entry out of the region, then confirm with
        the daemon; returns what was served and which transfers failed."""
        result = LoadResult()
        attachment, mapping = self.link.attachment, self._mapping
        copied: list[tuple[LoadSpec, Any]] = []
        for spec in specs:
            if mapping is None or spec.generation != mapping.generation:
                result.failed.append(spec.transfer_id)
                self.stats["loads_wrong_generation"] += 1
                continue
            try:
                out = self.allocate_out(spec.shape, spec.dtype)
                copied.append((spec, self.backend.load(mapping, spec.extents, out)))
            except Exception as exc:
                log.warning("ec-daemon load of %s failed: %s", spec.mm_hash, exc)
                result.failed.append(spec.transfer_id)
                self.stats["loads_failed"] += 1
        reported = [spec.transfer_id for spec in specs]
        verdicts = self._report_loads(attachment, reported)
        for spec, out in copied:
            if verdicts.get(spec.transfer_id) == pb.HELD:
                result.loaded[spec.mm_hash] = out
                result.done.append(spec.transfer_id)
                self.stats["loads_done"] += 1
            else:
                result.failed.append(spec.transfer_id)
                self.stats["loads_not_held"] += 1
        return result

    def _report_loads(self, attachment: Attachment | None,
                      transfer_ids: list[int]) -> dict[int, Any]:
        """Report this rank done with `transfer_ids`, and with any transfers it
        could not report before (a pin waits for every expected rank: an
        unreported one would hold its entry until the scheduler's session
        ends). Returns the verdicts of `transfer_ids`."""
        with self._unreported_lock:
            backlog, self._unreported = self._unreported, []
        everything = backlog + transfer_ids
        if not everything:
            return {}
        reply = self._report(attachment, loaded=everything)
        if reply is None:
            with self._unreported_lock:
                self._unreported = (everything + self._unreported)[-MAX_UNREPORTED:]
            return {}
        return dict(zip(everything, reply.loaded, strict=True))

    # ------------------------------------------------------------ common

    def _report(self, attachment: Attachment | None, retries: int = 0,
                **lists: list[Any]) -> Any:
        if attachment is None:
            return None
        request = pb.ReportRequest(session_id=attachment.session_id, **lists)
        for attempt in range(retries + 1):
            try:
                return self.transport.call("Report", request)
            except grpc.RpcError as exc:
                if attempt == retries or exc.code() not in RETRYABLE:
                    log.warning("ec-daemon report failed: %s %s", exc.code().name,
                                exc.details())
                    return None
        return None

    def _on_attached(self, attachment: Attachment) -> None:
        old = self._mapping
        if old is None or old.generation != attachment.generation:
            mapping = RegionMapping(attachment.region_path, attachment.region_size,
                                    attachment.generation)
            self.backend.attach(mapping)
            self._mapping = mapping
            if old is not None:
                self._unmap(old)
        log.info("ec-daemon worker rank %d session %d attached (generation %016x)", self.rank,
                 attachment.index, attachment.generation)
        self._report_loads(attachment, [])  # what could not be reported while detached

    def _on_detached(self) -> None:
        # The daemon may be gone for good: do not pin its memory by mapping it.
        old, self._mapping = self._mapping, None
        if old is not None:
            self._unmap(old)

    def _unmap(self, mapping: RegionMapping) -> None:
        self.backend.detach(mapping)
        mapping.close()

    def close(self) -> None:
        self.flush(timeout=self.transport.deadline_seconds)
        self._saves.put(None)
        self._saver.join(timeout=2)
        self.link.stop()
        self._on_detached()
        self.transport.close()
