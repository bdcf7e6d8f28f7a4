"""One attached session, kept alive in a background thread.

`SessionLink` attaches, opens the session stream, sends heartbeats (the
request generator yields one whenever nothing else was sent for a heartbeat
interval), hands each daemon message to a callback, and after any loss
(daemon restart, stream error) calls `on_detached` and attaches again with
backoff. Nothing here blocks the caller: `send` only queues.

Callbacks run on the link's thread, in order: on_attached, on_message..., on_detached.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from ec_protocol.protocol import PROTOCOL_VERSION, RETRYABLE, ROLES, Layout, pb
from ec_protocol.transport import Transport

log = logging.getLogger(__name__)

_NOTHING = object()


class _Parts(NamedTuple):
    pins: list[tuple[int, str, int]]
    acks: list[tuple[str, int]]

    def to_message(self) -> Any:
        return pb.ClientMessage(
            pins=[pb.Pin(transfer_id=t, mm_hash=h, entry_id=e) for t, h, e in self.pins],
            acks=[pb.EntryRef(mm_hash=h, entry_id=e) for h, e in self.acks])
BACKOFF_START_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 2.0


@dataclass(frozen=True)
class Attachment:
    session_id: str
    index: int
    namespace: str
    region_path: str
    region_size: int
    page_bytes: int
    generation: int
    lease_ms: int
    heartbeat_ms: int


def default_client_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class SessionLink:
    def __init__(self, transport: Transport, *, engine_id: str, role: str, layout: Layout,
                 rank: int | None = None, world_size: int = 1, client_name: str = "",
                 on_attached: Callable[[Attachment], None] = lambda a: None,
                 on_detached: Callable[[], None] = lambda: None,
                 on_message: Callable[[Any], None] = lambda m: None,
                 heartbeat: Callable[[], Any] | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        self.transport = transport
        request = pb.AttachRequest(protocol_version=PROTOCOL_VERSION, engine_id=engine_id,
                                   role=ROLES[role], layout=layout.to_pb(),
                                   client_name=client_name or default_client_name())
        if rank is None:
            request.scheduler.SetInParent()
        else:
            request.worker.rank = rank
            request.worker.world_size = world_size
        self._request = request
        self._on_attached = on_attached
        self._on_detached = on_detached
        self._on_message = on_message
        self._heartbeat = heartbeat or pb.Heartbeat
        self._attachment: Attachment | None = None
        self._outbox: queue.SimpleQueue[Any] | None = None
        self._responses: Any = None
        self._stopping = threading.Event()
        self._attached = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"ec-session-{engine_id}",
                                        daemon=True)
        self.last_error = ""

    @property
    def attachment(self) -> Attachment | None:
        """The current attachment, None while detached."""
        return self._attachment

    def start(self) -> None:
        self._thread.start()

    def wait_attached(self, timeout: float) -> Attachment | None:
        with self._attached:
            self._attached.wait_for(lambda: self._attachment is not None, timeout)
        return self._attachment

    def send(self, message: Any) -> bool:
        """Queue a ClientMessage on the stream; False (dropped) while detached."""
        outbox = self._outbox
        if outbox is None:
            return False
        outbox.put(message)
        return True

    def send_parts(self, pins: list[tuple[int, str, int]], acks: list[tuple[str, int]]) -> bool:
        """Queue pins (transfer_id, mm_hash, entry_id) then acknowledgements
        (mm_hash, entry_id) as one message, built on the link's thread so the
        caller pays for a queue put only. False (dropped) while detached."""
        return self.send(_Parts(pins, acks))

    def stop(self, timeout: float = 2.0) -> None:
        """Flush the last heartbeat and half-close the stream: the daemon
        applies everything sent, then ends the session (releasing all it
        held). Cancels the stream if the daemon does not answer in time."""
        self._stopping.set()
        outbox = self._outbox
        if outbox is not None:
            outbox.put(pb.ClientMessage(heartbeat=self._heartbeat()))
            outbox.put(None)
        if threading.current_thread() is self._thread:
            return
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            self._end_stream()
            self._thread.join(timeout)

    # ------------------------------------------------------------ thread

    def _run(self) -> None:
        backoff = BACKOFF_START_SECONDS
        while not self._stopping.is_set():
            try:
                reply = self.transport.call("Attach", self._request)
            except grpc.RpcError as exc:
                self._note_error(f"attach failed: {exc.code().name}: {exc.details()}",
                                 retryable=exc.code() in RETRYABLE)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_SECONDS)
                continue
            backoff = BACKOFF_START_SECONDS
            self._serve(reply)

    def _serve(self, reply: Any) -> None:
        attachment = Attachment(
            session_id=reply.session_id, index=reply.session_index, namespace=reply.namespace,
            region_path=reply.region.path, region_size=reply.region.size_bytes,
            page_bytes=reply.region.page_bytes, generation=reply.region.generation,
            lease_ms=reply.lease_ms, heartbeat_ms=reply.heartbeat_ms)
        outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        outbox.put(pb.ClientMessage(open_session_id=attachment.session_id))
        responses = self.transport.stream(self._requests(outbox, attachment.heartbeat_ms / 1000))
        self._responses = responses
        try:
            self._on_attached(attachment)
        except Exception as exc:  # e.g. the region vanished: attach again
            self._note_error(f"attach could not complete: {exc}", retryable=True)
            responses.cancel()
            return
        with self._attached:
            self._outbox = outbox
            self._attachment = attachment
            self._attached.notify_all()
        try:
            for message in responses:
                self._on_message(message)
            if not self._stopping.is_set():
                self._note_error("the daemon closed the session stream", retryable=True)
        except grpc.RpcError as exc:
            if not self._stopping.is_set():
                self._note_error(f"session stream lost: {exc.code().name}", retryable=True)
        finally:
            with self._attached:
                self._attachment = None
                self._outbox = None
            outbox.put(None)
            self._on_detached()

    def _requests(self, outbox: queue.SimpleQueue[Any], interval: float) -> Iterator[Any]:
        """The stream's messages: what `send` queued, plus a heartbeat every
        `interval` whether or not anything else went out."""
        next_beat = time.monotonic() + interval
        while True:
            try:
                message = outbox.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                message = _NOTHING
            if message is None:
                return
            if isinstance(message, _Parts):
                yield message.to_message()
            elif message is not _NOTHING:
                yield message
            if time.monotonic() >= next_beat:
                yield pb.ClientMessage(heartbeat=self._heartbeat())
                next_beat = time.monotonic() + interval

    def _end_stream(self) -> None:
        responses = self._responses
        if responses is not None:
            responses.cancel()

    def _note_error(self, message: str, *, retryable: bool) -> None:
        if message != self.last_error:
            (log.warning if retryable else log.error)("ec-daemon %s: %s", self.transport.uri,
                                                      message)
        self.last_error = message
