"""Scheduler delegate: what vLLM's scheduler side calls each step, on plain values.

Hot-path rules (DESIGN.md, "Per-step protocol"): nothing here waits on the
network. Misses and hits are answered from the local `ReadyView`; a hit's
load goes into the step metadata with a transfer id minted here (unique per
session and dispatch: session_index << 32 | counter) and its pin is queued on
the session stream together with the step's deferred acknowledgements, pins
first. Saves need nothing from the scheduler: workers save what they compute.

While detached (daemon down or restarting) every lookup misses and the view
is empty; the link re-attaches in the background and the view refills from
the new session's snapshot. Loads that cannot be served end up in
`take_unavailable_requests` (a failed pin, or a worker's failed copy), so the
engine fails those requests, never itself.

Threads: vLLM makes every per-step call from its one scheduling thread, so
the delegate's own state (planned, dispatched and unavailable loads) is that
thread's alone and takes no lock; the link thread hands pin failures over
through a deque. The only lock on a step is the view's, taken once at the
step boundary and only when the step looked anything up.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ec_client.session import Attachment, SessionLink
from ec_client.view import ReadyView, ViewEntry
from ec_protocol.protocol import TRANSFER_ID_SHIFT, Layout, pb
from ec_protocol.transport import DEFAULT_DEADLINE_SECONDS, Transport

log = logging.getLogger(__name__)

# Dispatched loads remembered for mapping failures back to requests.
MAX_DISPATCHED = 65536


class LoadSpec(NamedTuple):
    """One load for the workers: copy `extents` of region `generation` into
    an output of `shape`/`dtype`, then report `transfer_id`. (A NamedTuple:
    built once per hit on the scheduler's path, and cheap to pickle.)"""

    mm_hash: str
    transfer_id: int
    entry_id: int
    generation: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    extents: tuple[tuple[int, int], ...]


@dataclass
class StepMetadata:
    """Scheduler -> workers, once per step. Extents, never one id per row."""

    loads: list[LoadSpec] = field(default_factory=list)


class _Minting:
    """Transfer ids of one attachment."""

    def __init__(self, attachment: Attachment) -> None:
        self.attachment = attachment
        self._counter = itertools.count(1)

    def next_id(self) -> int:
        return (self.attachment.index << TRANSFER_ID_SHIFT) | next(self._counter)


class SchedulerDelegate:
    def __init__(self, socket: str, *, engine_id: str, layout: Layout, role: str = "both",
                 deadline_seconds: float = DEFAULT_DEADLINE_SECONDS, client_name: str = "",
                 token_file: str | None = None, tls_ca: str | None = None,
                 start: bool = True) -> None:
        self.role = role
        self.can_load = role in ("consumer", "both")
        self.transport = Transport(socket, deadline_seconds, token_file=token_file,
                                   tls_ca=tls_ca)
        self.view = ReadyView()
        self._minting: _Minting | None = None
        self._planned: dict[str, tuple[LoadSpec, list[str]]] = {}
        self._dispatched: dict[int, list[str]] = {}
        self._unavailable: set[str] = set()
        self._pin_failures: deque[int] = deque()  # from the link thread
        self._hits_this_step: dict[str, tuple[ViewEntry, _Minting | None]] = {}
        self.link = SessionLink(
            self.transport, engine_id=engine_id, role=role, layout=layout, rank=None,
            client_name=client_name, on_attached=self._on_attached,
            on_detached=self._on_detached, on_message=self._on_message,
            heartbeat=self._heartbeat)
        if start:
            self.link.start()

    # --------------------------------------------------- per-step calls

    def has_item(self, mm_hash: str) -> bool:
        """Is `mm_hash` cached and loadable? Local; a yes stays loadable
        until this step's `build_step_metadata`."""
        if not self.can_load:
            return False
        # The minting first: a re-attach clears the view before it publishes
        # the new minting, so a new session's minting never meets an entry
        # of the old one (the other way round, the pin is refused).
        minting = self._minting
        entry = self.view.claim(mm_hash)
        if entry is None:
            return False
        # What after_alloc will dispatch, even if the link detaches meanwhile.
        self._hits_this_step[mm_hash] = (entry, minting)
        return True

    def after_alloc(self, request_id: str, mm_hash: str) -> bool:
        """vLLM allocated encoder space for this item; plan its load if it
        was a hit. Returns True when the item will be loaded."""
        planned = self._planned.get(mm_hash)
        if planned is not None:
            planned[1].append(request_id)
            return True
        hit = self._hits_this_step.get(mm_hash)
        if hit is None:
            return False  # computed by the engine (and saved by its worker)
        entry, minting = hit
        if minting is None:  # detached as has_item answered: the load cannot be served
            self._unavailable.add(request_id)
            return True
        spec = LoadSpec(mm_hash, minting.next_id(), entry.entry_id, minting.attachment.generation,
                        entry.nbytes, entry.shape, entry.dtype, entry.extents)
        self._planned[mm_hash] = (spec, [request_id])
        return True

    def build_step_metadata(self) -> StepMetadata:
        """The step's loads; queues their pins, then the deferred acks."""
        planned, self._planned = self._planned, {}
        if self._hits_this_step:
            self._hits_this_step = {}
        if not planned:
            self.view.end_step(self._send_acks)
            return StepMetadata([])
        # Plain tuples here; the link thread builds the protobuf message.
        pins = [(spec.transfer_id, spec.mm_hash, spec.entry_id) for spec, _ in planned.values()]
        for spec, request_ids in planned.values():
            self._dispatched[spec.transfer_id] = request_ids
        if len(self._dispatched) > MAX_DISPATCHED:
            self._trim_dispatched()
        # Releasing the claims and queueing the pins ahead of the deferred
        # acks is one step under the view's lock (see view.py).
        if not self.view.end_step(lambda acks: self.link.send_parts(pins, acks)):
            # Detached since has_item: the pins cannot land, the loads fail.
            for _, request_ids in planned.values():
                self._unavailable.update(request_ids)
        return StepMetadata([spec for spec, _ in planned.values()])

    def apply_worker_output(self, done: Iterable[int] = (), failed: Iterable[int] = ()) -> None:
        """Worker reports of this step: transfers finished, transfers whose
        copy must be discarded (their requests become unavailable)."""
        for transfer_id in failed:
            self._unavailable.update(self._dispatched.pop(transfer_id, ()))
        for transfer_id in done:
            self._dispatched.pop(transfer_id, None)

    def take_unavailable_requests(self) -> set[str]:
        failures = self._pin_failures
        while failures:
            self._unavailable.update(self._dispatched.pop(failures.popleft(), ()))
        if not self._unavailable:
            return set()
        taken, self._unavailable = self._unavailable, set()
        return taken

    def close(self) -> None:
        self.link.stop()
        self.transport.close()

    # ------------------------------------------------- link callbacks

    def _on_attached(self, attachment: Attachment) -> None:
        self.view.clear()
        self._minting = _Minting(attachment)
        log.info("ec-daemon scheduler session %d attached (generation %016x, namespace %r)",
                 attachment.index, attachment.generation, attachment.namespace)

    def _on_detached(self) -> None:
        self._minting = None
        self.view.clear()

    def _on_message(self, message: Any) -> None:
        self.view.apply(message, self._send_acks)
        for failure in message.pin_failures:
            log.warning("ec-daemon refused pin %d: %s", failure.transfer_id, failure.reason)
            self._pin_failures.append(failure.transfer_id)

    def _send_acks(self, acks: list[tuple[str, int]]) -> bool:
        return not acks or self.link.send_parts([], acks)

    def _heartbeat(self) -> Any:
        lookups, hits = self.view.take_counts()
        return pb.Heartbeat(lookups=lookups, hits=hits)

    def _trim_dispatched(self) -> None:
        while len(self._dispatched) > MAX_DISPATCHED:
            del self._dispatched[next(iter(self._dispatched))]
