"""Worker delegate: one engine rank's data plane, on plain values.

It attaches as "worker rank k of n" (a session for saves only) and copies
with a backend from `ec_client.copy`. It counts toward its scheduler's view
as a rank that mapped the region once it presented the engine's token (at
Attach when it could derive it, else `join` from its step metadata), so no
other client of the socket, nor another engine configured with the same
engine id, can count as its ranks.

- `save` is off the critical path: it queues the output (keeping it alive)
  for the saver's thread (`ec_client.worker_side.saver`), which allocates extents,
  copies, and reports the save, on the session stream where the daemon
  takes saves there (no call per save). The queue is bounded in bytes
  (`save_queue_bytes`): outputs held for saving live outside vLLM's encoder
  budget, so a full queue drops the save. An entry another engine is
  already writing is dropped, and a full cache (RESOURCE_EXHAUSTED) just
  means this output is not cached. Only the `save_rank` writes (all TP
  ranks hold identical outputs).
- `load` makes no call to the daemon: it maps the region generation each
  load names (`regions`), copies the step's loads together (one host wait
  for all of them, `CopyBackend.load_all`), then checks each one's pages'
  stamps against its entry_id. A load either returns exactly the saved bytes or is listed
  as failed with the reason; the scheduler's view kept the pages from reuse
  until this rank's report reaches it through vLLM's worker metadata.
- With `verify_checksum`, a load whose entry carries its writer's checksum
  is checked against it after its copy landed
  (`ec_client.worker_side.load_checksums`): a process that rewrote the
  entry's bytes in the region (any worker of any engine maps it read-write)
  fails the load instead of feeding the model.
- `stage` is `load` into the rank's staging area (`ec_client.worker_side.staging`):
  the vLLM connector stages every load a step before the step that uses
  it, and `adopt` hands the staged output over when that step comes, so a
  load that fails costs its request, never the engine.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from ec_client.common.contract import (
    CHECKSUM_MISMATCH,
    STAMP_MISMATCH,
    UNUSABLE,
    LoadSpec,
    RegionInfo,
)
from ec_client.common.limits import (
    DEFAULT_SAVE_QUEUE_BYTES,
    DEFAULT_STAGING_BYTES,
    DEFAULT_VERIFY_CHECKSUM,
)
from ec_client.common.session import Attachment, LinkListener, SessionLink
from ec_client.common.trust import attached_socket_owner
from ec_client.common.wire import DaemonNews, Outgoing
from ec_client.copy import CopyBackend, get_backend
from ec_client.copy.mapping import RegionMapping
from ec_client.worker_side.load_checksums import checksum_holds
from ec_client.worker_side.regions import Regions
from ec_client.worker_side.saver import Saver
from ec_client.worker_side.staging import StagingArea
from ec_protocol.protocol import BOTH, SAVING_ROLES, Layout, Role
from ec_protocol.stamps import FREE
from ec_protocol.transport import DEFAULT_DEADLINE_SECONDS, Transport

log = logging.getLogger(__name__)


class _Refused(Exception):
    """A load that cannot be made, with its reason as the message."""


@dataclass
class LoadResult:
    loaded: dict[str, Any] = field(default_factory=dict)  # mm_hash -> array
    done: list[int] = field(default_factory=list)  # transfer ids served
    failed: dict[int, str] = field(default_factory=dict)  # transfer id -> why it failed
    # transfer id -> what failed (ec_client.common.contract: STAMP_MISMATCH,
    # CHECKSUM_MISMATCH: the entry's bytes are not its writer's; UNUSABLE)
    kinds: dict[int, str] = field(default_factory=dict)


class WorkerDelegate(LinkListener):
    def __init__(self, socket: str, *, engine_id: str, layout: Layout, rank: int = 0,
                 world_size: int = 1, role: Role = BOTH, backend: str | CopyBackend = "cpu",
                 save_rank: int = 0, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
                 client_name: str = "",
                 allocate_out: Callable[[tuple[int, ...], str], Any] | None = None,
                 save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES,
                 token_file: str | None = None, tls_ca: str | None = None,
                 stream_saves: bool = True, start: bool = True,
                 engine_token: str = "", hold_saves: bool = False,
                 staging_bytes: int = DEFAULT_STAGING_BYTES,
                 verify_checksum: bool = DEFAULT_VERIFY_CHECKSUM) -> None:
        """`allocate_out(shape, dtype)`: a load's output (default: the
        backend's `empty`, on its device, ordered for its copies).
        `stream_saves=False`: saves by Allocate and Report calls even where
        the daemon takes them on the stream (benchmarks compare the two).
        `engine_token`: the engine's token when this process can derive it
        (`ec_client.engine_token`); else `join` presents it once learnt.
        `hold_saves`: saves wait, within `save_queue_bytes`, until
        `follow_scheduler` hears the scheduler's namespace (the vLLM
        connector: its workers and scheduler identify the weights apart).
        `staging_bytes`: the bound of the staging area (`stage`).
        `verify_checksum`: check each load against its entry's checksum."""
        self.rank = rank
        self.verify_checksum = verify_checksum
        # The engine's token, and the attachment it was presented on.
        self._engine_token = engine_token
        self._joined: tuple[Attachment, str] | None = None
        self.saves_enabled = role in SAVING_ROLES and rank == save_rank
        self.transport = Transport(socket, deadline_seconds, token_file=token_file,
                                   tls_ca=tls_ca)
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.allocate_out = allocate_out or self.backend.empty
        self.stats: Counter[str] = Counter()
        self._stats_taken: Counter[str] = Counter()
        self.regions = Regions(on_map=self.backend.attach, on_unmap=self.backend.detach,
                               open_mapping=self._open_region)
        self.staging = StagingArea(staging_bytes)
        self._region_owner: int | None = None  # the socket's owner at the last attach
        self.link = SessionLink(
            self.transport, engine_id=engine_id, role=role, layout=layout, rank=rank,
            world_size=world_size, client_name=client_name, listener=self,
            engine_token=engine_token)
        self.saver = Saver(link=self.link, transport=self.transport, regions=self.regions,
                           backend=self.backend, stats=self.stats,
                           queue_bytes=save_queue_bytes, use_stream=stream_saves,
                           name=f"ec-saver-{rank}", held=hold_saves and self.saves_enabled)
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
            self.saver.drop(mm_hash)
            return False
        return self.saver.put(mm_hash, output)

    def take_dropped(self) -> list[str]:
        """The saves that ended without their entry in the cache since the
        last call (skipped, refused, failed, lost; not those another engine
        had cached already), by mm_hash: the scheduler's producer then
        announces no metadata for them."""
        return self.saver.take_dropped()

    def follow_scheduler(self, namespace: str) -> None:
        """The engine's scheduler answers hits from `namespace` (each step's
        metadata; "" while it is not attached). A worker attached with
        another namespace identified the weights differently (for instance
        before a download moved a hub model's ref): its saves would land
        where engines on other weights read, so it stops saving, for good,
        drops the saves it held, and says so. With `hold_saves`, saves wait
        until the first step names the worker's own namespace. Loads are
        unaffected."""
        attachment = self.link.attachment
        if not namespace or attachment is None or not self.saves_enabled:
            return
        if attachment.namespace == namespace:
            self.saver.release_held()
            return
        self.saves_enabled = False
        dropped = self.saver.drop_held()
        self.stats["saves_off_namespace"] += 1 + dropped
        log.error("ec-daemon worker rank %d: its namespace %r differs from its scheduler's %r "
                  "(the weights were identified differently in the two processes): this "
                  "worker saves nothing (%d held saves dropped). Pin the model's revision "
                  "to a commit, or set ec_daemon_weights_id.", self.rank,
                  attachment.namespace, namespace, dropped)

    def join(self, engine_token: str) -> None:
        """The engine's scheduler names its instance by `engine_token` (each
        step's metadata): present it to the daemon, once per attachment, so
        this rank counts toward that engine's views. Later attaches present
        it at once."""
        if not engine_token:
            return
        if engine_token != self._engine_token:
            self._remember(engine_token)
        attachment, joined = self.link.attachment, self._joined
        if attachment is None or (joined is not None and joined[0] is attachment
                                  and joined[1] == engine_token):
            return
        if self.link.send_on(attachment, Outgoing(engine_token=engine_token)):
            self._joined = (attachment, engine_token)

    def _remember(self, engine_token: str) -> None:
        self._engine_token = engine_token
        self.link.present_engine_token(engine_token)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save landed or was dropped."""
        return self.saver.flush(timeout)

    @property
    def queued_bytes(self) -> int:
        return self.saver.queued_bytes

    @property
    def save_messages(self) -> int:
        """Messages sent on the session stream for saves (allocations, reports)."""
        return self.saver.stream.messages

    # ------------------------------------------------------------- loads

    def load(self, specs: Sequence[LoadSpec], regions: Mapping[int, RegionInfo]) -> LoadResult:
        """Copy each dispatched entry out of the region generation it names
        (`regions` by generation) and verify its stamps. No daemon call; one
        wait for all the copies, then the stamps (read after they landed)."""
        result = LoadResult()
        reasons: dict[int, str] = {}
        with ExitStack() as held:
            planned = []  # (spec, stamps, output, mapping)
            for spec in specs:
                try:
                    planned.append(self._plan(spec, regions.get(spec.generation), held))
                except _Refused as exc:
                    reasons[spec.transfer_id] = str(exc)
                except (OSError, ValueError, TypeError, RuntimeError, AttributeError) as exc:
                    reasons[spec.transfer_id] = f"{type(exc).__name__}: {exc}"
            try:
                errors = self.backend.load_all([(m, spec.extents, out)
                                                for spec, _, out, m in planned])
            except (OSError, ValueError, TypeError, RuntimeError, AttributeError) as exc:
                errors = [exc] * len(planned)
            # The region's canary, after the copies landed: a file another
            # process cut under them fails their loads (`Regions.intact`).
            errors = self.regions.check_loads([m for *_, m in planned], errors)
            for (spec, stamps, out, mapping), error in zip(planned, errors, strict=True):
                if error is not None:
                    reasons[spec.transfer_id] = f"{type(error).__name__}: {error}"
                elif not stamps.holds(spec.extents, spec.entry_id):  # after the copy landed
                    self.stats["loads_stamp_mismatch"] += 1
                    reasons[spec.transfer_id] = ("its pages were reused (stamp mismatch): "
                                                 "the bytes are not the entry's")
                    result.kinds[spec.transfer_id] = STAMP_MISMATCH
                elif self.verify_checksum and spec.checksum \
                        and (holds := checksum_holds(self.backend, spec, out,
                                                     mapping)) is not True:
                    if holds is not False:  # the file ended under the read: a cut
                        reasons[spec.transfer_id] = f"{type(holds).__name__}: {holds}"
                        continue
                    self.stats["loads_checksum_mismatch"] += 1
                    reasons[spec.transfer_id] = ("its bytes do not match the checksum its "
                                                 "writer recorded: another process rewrote them")
                    result.kinds[spec.transfer_id] = CHECKSUM_MISMATCH
                else:
                    result.loaded[spec.mm_hash] = out
        for spec in specs:  # in the step's order
            reason = reasons.get(spec.transfer_id)
            if reason is None:
                result.done.append(spec.transfer_id)
                self.stats["loads_done"] += 1
            else:
                log.error("ec-daemon load of %s (entry %d) failed: %s", spec.mm_hash,
                          spec.entry_id, reason)
                result.failed[spec.transfer_id] = reason
                result.kinds.setdefault(spec.transfer_id, UNUSABLE)
                self.stats["loads_failed"] += 1
        return result

    def stage(self, specs: Sequence[LoadSpec], regions: Mapping[int, RegionInfo],
              step: int = 0) -> LoadResult:
        """`load` each spec into the staging area (a step before the step
        that uses it), in step `step` of the scheduler's count: the result
        lists what was staged (`done`) and what failed, nothing `loaded`.
        A load that finds the area full fails (its request encodes the item).
        Outputs no step adopted `STAGED_STEPS` steps after theirs are dropped
        first."""
        expired = self.staging.expire(step)
        if expired:
            self.stats["staged_expired"] += expired
        room = self.staging.limit_bytes - self.staging.bytes
        fitting: list[LoadSpec] = []
        full: list[LoadSpec] = []
        for spec in specs:
            if spec.nbytes <= room:
                room -= spec.nbytes
                fitting.append(spec)
            else:
                full.append(spec)
        result = self.load(fitting, regions) if fitting else LoadResult()
        for spec in fitting:
            output = result.loaded.pop(spec.mm_hash, None)
            if output is not None and spec.transfer_id not in result.failed:
                self.staging.put(spec.transfer_id, spec.mm_hash, output, spec.nbytes, step)
        for spec in full:
            reason = (f"the staging area holds {self.staging.bytes} of its "
                      f"{self.staging.limit_bytes} bytes (ec_daemon_staging_bytes)")
            log.warning("ec-daemon load of %s (entry %d) not staged: %s", spec.mm_hash,
                        spec.entry_id, reason)
            result.failed[spec.transfer_id] = reason
            result.kinds[spec.transfer_id] = UNUSABLE
            self.stats["loads_staging_full"] += 1
        return result

    def adopt(self, transfer_id: int) -> Any | None:
        """The output staged under `transfer_id`, out of the staging area
        (None when this rank holds none: it failed here, or was dropped)."""
        taken = self.staging.take(transfer_id)
        if taken is None:
            return None
        self.stats["loads_adopted"] += 1
        return taken[1]

    def drop(self, transfer_ids: Sequence[int]) -> None:
        """Staged outputs no step will use (their requests ended)."""
        dropped = self.staging.drop(list(transfer_ids))
        if dropped:
            self.stats["staged_dropped"] += dropped

    def _plan(self, spec: LoadSpec, info: RegionInfo | None,
              held: ExitStack) -> tuple[LoadSpec, Any, Any, RegionMapping]:
        """A load's region (kept mapped by `held`), its stamps and its output."""
        if info is None:
            raise _Refused(f"no region of generation {spec.generation:016x} came with the load")
        if spec.entry_id == FREE:
            raise _Refused("entry id 0 names no entry (it is the stamp of free pages)")
        mapping, stamps = held.enter_context(self.regions.use(info))
        return spec, stamps, self.allocate_out(spec.shape, spec.dtype), mapping

    def take_stats(self, load_seconds: list[float] | None = None) -> dict[str, Any]:
        """Counters that moved since the previous call, plus `load_seconds`
        (for vLLM's connector stats; `stats` itself keeps the totals)."""
        now = Counter(self.stats) + self.backend.stats
        moved: dict[str, Any] = {k: v for k, v in (now - self._stats_taken).items() if v}
        self._stats_taken = now
        if load_seconds:
            moved["load_seconds"] = list(load_seconds)
        return moved

    # ------------------------------------------------------------ common

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

    def opening_message(self, attachment: Attachment) -> Any:
        """The engine's token, when known, counts this rank from the stream's
        opening (the attach request carried it too, if it was known then)."""
        token = self._engine_token
        if not token:
            return None
        self._joined = (attachment, token)
        return Outgoing(engine_token=token)

    def on_attached(self, attachment: Attachment) -> None:
        self._region_owner = attached_socket_owner(self.transport.uri)  # raises if untrusted
        self.regions.make_current(attachment.region)
        log.info("ec-daemon worker rank %d session %d attached (generation %016x)", self.rank,
                 attachment.index, attachment.region.generation)

    def on_message(self, message: DaemonNews) -> None:
        if message.allocations or message.reported:
            self.saver.stream.on_message(message)

    def on_detached(self) -> None:
        self.saver.stream.detached()
        self.regions.make_current(None)

    def close(self) -> None:
        self.staging.clear()
        self.saver.close(timeout=self.transport.deadline_seconds)
        self.link.stop()
        self.regions.close()
        self.transport.close()
