"""Worker delegate: one engine rank's data plane, on plain values.

It attaches as "worker rank k of n" (a session for saves only) and copies
with a backend from `ec_client.copy`.

- `save` is off the critical path: it queues the output (keeping it alive)
  for a background thread that allocates extents, copies, and reports the
  save. The queue is bounded in bytes (`save_queue_bytes`): outputs held for
  saving live outside vLLM's encoder budget, so a full queue drops the save.
  An entry another engine is already writing is dropped, and a full cache
  (RESOURCE_EXHAUSTED) just means this output is not cached. Only the
  `save_rank` writes (all TP ranks hold identical outputs).
- `load` makes no call to the daemon: it maps the region generation the
  load names (`regions`), copies, then checks the pages' stamps against
  the entry_id. A load either returns exactly the saved bytes or is listed
  as failed with the reason; the scheduler's view kept the pages from reuse
  until this rank's report reaches it through vLLM's worker metadata.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from ec_client.contract import LoadSpec, RegionInfo
from ec_client.copy import CopyBackend, describe, empty_host, get_backend
from ec_client.mapping import RegionMapping
from ec_client.regions import Regions
from ec_client.session import Attachment, LinkListener, SessionLink
from ec_client.settings import DEFAULT_SAVE_QUEUE_BYTES
from ec_client.trust import attached_socket_owner
from ec_protocol.protocol import BOTH, MAX_BATCH, RETRYABLE, SAVING_ROLES, Layout, Role, pb
from ec_protocol.stamps import FREE
from ec_protocol.transport import DEFAULT_DEADLINE_SECONDS, Transport

log = logging.getLogger(__name__)

# How often the idle saver thread unmaps retired regions.
PRUNE_SECONDS = 1.0
# On the save queue: report the saves skipped so far (the queue was too full).
_REPORT_SKIPS: Any = object()


@dataclass
class LoadResult:
    loaded: dict[str, Any] = field(default_factory=dict)  # mm_hash -> array
    done: list[int] = field(default_factory=list)  # transfer ids served
    failed: dict[int, str] = field(default_factory=dict)  # transfer id -> why it failed


class WorkerDelegate(LinkListener):
    def __init__(self, socket: str, *, engine_id: str, layout: Layout, rank: int = 0,
                 world_size: int = 1, role: Role = BOTH, backend: str | CopyBackend = "cpu",
                 save_rank: int = 0, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
                 client_name: str = "",
                 allocate_out: Callable[[tuple[int, ...], str], Any] = empty_host,
                 save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES,
                 token_file: str | None = None, tls_ca: str | None = None,
                 start: bool = True) -> None:
        self.rank = rank
        self.saves_enabled = role in SAVING_ROLES and rank == save_rank
        self.transport = Transport(socket, deadline_seconds, token_file=token_file,
                                   tls_ca=tls_ca)
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.allocate_out = allocate_out
        self.stats: Counter[str] = Counter()
        self._stats_taken: Counter[str] = Counter()
        self.regions = Regions(on_map=self.backend.attach, on_unmap=self.backend.detach,
                               open_mapping=self._open_region)
        self.save_queue_bytes = save_queue_bytes
        self._saves: queue.Queue[tuple[str, Any, Any, int] | None] = queue.Queue()
        self._queued_bytes = 0
        self._region_owner: int | None = None  # the socket's owner at the last attach
        self._unfinished = 0
        # Saves skipped for a full queue, told to the daemon by the saver
        # thread after its current save (another engine may be waiting for
        # this one's: it then encodes the item itself).
        self._skipped: list[str] = []
        self._idle = threading.Condition()
        self.link = SessionLink(
            self.transport, engine_id=engine_id, role=role, layout=layout, rank=rank,
            world_size=world_size, client_name=client_name, listener=self)
        self._saver = threading.Thread(target=self._save_loop, name=f"ec-saver-{rank}",
                                       daemon=True)
        self._saver.start()
        if start:
            self.link.start()

    # ------------------------------------------------------------- saves

    def save(self, mm_hash: str, output: Any) -> bool:
        """Queue `output` (kept alive until copied) to be saved as `mm_hash`.
        Returns False when this rank does not save, the daemon is detached,
        or the queue holds `save_queue_bytes` already (not cached then)."""
        if not self.saves_enabled:
            return False
        if self.link.attachment is None:
            self.stats["saves_skipped_detached"] += 1
            return False
        nbytes = describe(output)[0]
        with self._idle:
            if self._queued_bytes + nbytes > self.save_queue_bytes:
                self.stats["saves_skipped_busy"] += 1
                if len(self._skipped) < MAX_BATCH:
                    self._skipped.append(mm_hash)
                    if len(self._skipped) == 1:  # reported by the saver at once, not
                        self._saves.put(_REPORT_SKIPS)  # after some later save
                return False
            self._queued_bytes += nbytes
            self._unfinished += 1
        self._saves.put((mm_hash, output, self.backend.prepare_save(output), nbytes))
        return True

    def follow_scheduler(self, namespace: str) -> None:
        """The engine's scheduler answers hits from `namespace` (each step's
        metadata). A worker attached with another namespace identified the
        weights differently (for instance before a download moved a hub
        model's ref): its saves would land where engines on other weights
        read, so it stops saving, for good, and says so. Loads are unaffected."""
        attachment = self.link.attachment
        if not namespace or attachment is None or attachment.namespace == namespace \
                or not self.saves_enabled:
            return
        self.saves_enabled = False
        self.stats["saves_off_namespace"] += 1
        log.error("ec-daemon worker rank %d: its namespace %r differs from its scheduler's %r "
                  "(the weights were identified differently in the two processes): this "
                  "worker saves nothing. Pin the model's revision to a commit, or set "
                  "ec_daemon_weights_id.", self.rank, attachment.namespace, namespace)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save landed or was dropped."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def _save_loop(self) -> None:
        while True:
            try:
                item = self._saves.get(timeout=PRUNE_SECONDS)
            except queue.Empty:
                self.regions.prune()
                continue
            if item is None:
                return
            if item is _REPORT_SKIPS:
                with self._idle:
                    skipped, self._skipped = self._skipped, []
                attachment = self.link.attachment
                if skipped and attachment is not None:
                    self._report(attachment, aborted=skipped)
                continue
            mm_hash, output, ready, nbytes = item
            try:
                self._save_one(mm_hash, output, ready)
            except Exception:
                self.stats["save_errors"] += 1
                log.exception("ec-daemon save of %s failed", mm_hash)
            finally:
                del output, ready, item  # release the tensor before waiting again
                with self._idle:
                    self._queued_bytes -= nbytes
                    self._unfinished -= 1
                    skipped, self._skipped = self._skipped, []
                    self._idle.notify_all()
            attachment = self.link.attachment
            if skipped and attachment is not None:
                self._report(attachment, aborted=skipped)

    def _save_one(self, mm_hash: str, output: Any, ready: Any) -> None:
        attachment = self.link.attachment
        if attachment is None:
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
            if exc.code() in RETRYABLE:  # it may have been applied: do not leave it pending
                self._report(attachment, aborted=[mm_hash])
            return
        if reply.status != pb.ALLOCATED:
            self.stats["saves_already_cached"] += 1
            return
        extents = [(e.offset, e.length) for e in reply.extents]
        try:
            with self.regions.use(attachment.region) as (mapping, stamps):
                # A writer frozen past its lease and its quarantine must not
                # copy into pages reused since: copy only while the session is
                # known alive and the pages still carry this allocation's stamp.
                if not self.link.fresh() or not stamps.holds(extents, reply.entry_id):
                    self.stats["saves_stale"] += 1
                    self._report(attachment, aborted=[mm_hash])
                    return
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

    def load(self, specs: Sequence[LoadSpec], regions: Mapping[int, RegionInfo]) -> LoadResult:
        """Copy each dispatched entry out of the region generation it names
        (`regions` by generation) and verify its stamps. No daemon call."""
        result = LoadResult()
        for spec in specs:
            reason = self._load_one(spec, regions.get(spec.generation), result)
            if reason is None:
                result.done.append(spec.transfer_id)
                self.stats["loads_done"] += 1
            else:
                log.error("ec-daemon load of %s (entry %d) failed: %s", spec.mm_hash,
                          spec.entry_id, reason)
                result.failed[spec.transfer_id] = reason
                self.stats["loads_failed"] += 1
        return result

    def _load_one(self, spec: LoadSpec, info: RegionInfo | None, result: LoadResult) -> str | None:
        if info is None:
            return f"no region of generation {spec.generation:016x} came with the load"
        if spec.entry_id == FREE:
            return "entry id 0 names no entry (it is the stamp of free pages)"
        try:
            with self.regions.use(info) as (mapping, stamps):
                out = self.allocate_out(spec.shape, spec.dtype)
                self.backend.load(mapping, spec.extents, out)
                if not stamps.holds(spec.extents, spec.entry_id):  # after the copy landed
                    self.stats["loads_stamp_mismatch"] += 1
                    return "its pages were reused (stamp mismatch): the bytes are not the entry's"
        except (OSError, ValueError, TypeError, RuntimeError, AttributeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        result.loaded[spec.mm_hash] = out
        return None

    def take_stats(self, load_seconds: list[float] | None = None) -> dict[str, Any]:
        """Counters that moved since the previous call, plus `load_seconds`
        (for vLLM's connector stats; `stats` itself keeps the totals)."""
        now = Counter(self.stats)
        moved: dict[str, Any] = {k: v for k, v in (now - self._stats_taken).items() if v}
        self._stats_taken = now
        if load_seconds:
            moved["load_seconds"] = list(load_seconds)
        return moved

    # ------------------------------------------------------------ common

    def _report(self, attachment: Attachment, retries: int = 0, **lists: list[Any]) -> Any:
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

    def _open_region(self, info: RegionInfo) -> RegionMapping:
        """Map a region the daemon named, only if its file belongs to the user
        serving the socket (or root): raises UntrustedError otherwise. With
        the socket gone (a restart) the owner seen at the last attach counts,
        and without one, only this user's or root's files are mapped."""
        owner = self._region_owner
        if owner is None:
            owner = attached_socket_owner(self.transport.uri)
        return RegionMapping(info.path, info.size, info.generation,
                             expected_uid=os.getuid() if owner is None else owner)

    def on_attached(self, attachment: Attachment) -> None:
        self._region_owner = attached_socket_owner(self.transport.uri)  # raises if untrusted
        self.regions.make_current(attachment.region)
        log.info("ec-daemon worker rank %d session %d attached (generation %016x)", self.rank,
                 attachment.index, attachment.region.generation)

    def on_detached(self) -> None:
        self.regions.make_current(None)

    def close(self) -> None:
        self.flush(timeout=self.transport.deadline_seconds)
        self._saves.put(None)
        self._saver.join(timeout=2)
        self.link.stop()
        self.regions.close()
        self.transport.close()
