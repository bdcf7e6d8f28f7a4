"""One attached session, kept alive in a background thread.

`SessionLink` attaches, opens the session stream, sends heartbeats (the
request generator yields one whenever nothing else was sent for a heartbeat
interval), hands each daemon message to a callback, and after any loss
(daemon restart, stream error, a callback that raised) calls `on_detached`
and attaches again with backoff. Nothing here blocks the caller: `send` only
queues.

The client-side lease: each heartbeat carries a sequence number and the
daemon echoes it after renewing the session's lease, so when the echo of a
heartbeat sent at time t arrives, the daemon keeps the session (and awaits
its acknowledgements) until at least t + lease. `fresh()` is true until
t + lease * FRESH_FRACTION: a view answers hits only while it is, so a view
the daemon may have dropped (a frozen process, a stalled stream) never
dispatches. Both clocks are the host's monotonic clock.

A stream the daemon has not sent a message on for SILENT_LEASES leases,
while heartbeats went out, is given up and attached again: the daemon cuts
the call of a client that stopped reading, but gRPC cannot deliver a status
behind a write in flight, so a client that resumes reading after a freeze
would otherwise wait on a dead stream forever (answering no hits).

Callbacks run on the link's thread, in order: opening (what the stream's
first message carries besides the session id), on_attached (before the
stream opens: the daemon counts a worker whose stream is open as having
mapped the region, and tells a view nothing before), on_message...,
on_detached. A callback that raises is logged once, and the link detaches
(telling the daemon) and attaches again (a link thread that died would stop
acknowledging evictions, and reclamation would stall for every engine on the
host). An attachment whose on_attached raised never opens its stream, so
the daemon holds nothing for it, not even a ghost.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc

from ec_client.common.detached import DetachedNotice
from ec_client.common.limits import (
    BACKOFF_MAX_SECONDS,
    BACKOFF_START_SECONDS,
    EARLY_BEAT_SECONDS,
    FRESH_FRACTION,
    MAX_BEATS_IN_FLIGHT,
    MIN_BEAT_SECONDS,
    RECONNECT_MAX_SECONDS,
    SILENT_LEASES,
    STOP_SECONDS,
)
from ec_client.common.wire import (
    Attachment,
    DaemonNews,
    EntryRef,
    Heartbeat,
    Outgoing,
    attach_request,
    attachment_of,
    client_message,
    daemon_news,
    detach_request,
    with_engine_token,
)
from ec_protocol.protocol import MAX_BATCH, RETRYABLE, ROLES, Layout, Role

log = logging.getLogger(__name__)

_NOTHING = object()

Refs = list[tuple[str, int]]  # (mm_hash, entry_id)


class _Acks(NamedTuple):
    acks: Refs

    def to_message(self) -> Outgoing:
        return Outgoing(acks=[EntryRef(h, e) for h, e in self.acks])


def default_client_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class LinkListener:
    """What a link tells its owner, on the link's thread, in this order for
    each attachment: `opening_message`, `on_attached`, `on_message` for each
    daemon message, `on_detached`; `heartbeat_message` builds each heartbeat.
    These do nothing; an owner overrides what it needs."""

    def opening_message(self, attachment: Attachment) -> Outgoing | None:
        """A ClientMessage merged into the stream's first message, or None."""
        return None

    def on_attached(self, attachment: Attachment) -> None:
        """Before the stream opens; raising gives this attachment up, and the
        link attaches again later."""

    def on_message(self, message: DaemonNews) -> None:
        """One DaemonMessage."""

    def on_detached(self) -> None:
        """The attachment is lost (or the link stopped)."""

    def heartbeat_message(self) -> Outgoing:
        """The ClientMessage of the next heartbeat (counters, batched touches)."""
        return Outgoing(heartbeat=Heartbeat())

    def beat_due(self) -> bool:
        """Whether the next heartbeat should go out early (after
        EARLY_BEAT_SECONDS): it has something that should not wait a whole
        interval. Called on gRPC's request thread, beside the engine's; must
        be cheap and thread-safe (a raise counts as False)."""
        return False


class SessionLink:
    def __init__(self, transport: Any, *, engine_id: str, role: Role, layout: Layout,
                 rank: int | None = None, world_size: int = 1, client_name: str = "",
                 listener: LinkListener | None = None, engine_token: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`engine_token`: the engine instance's token (a scheduler's own, or
        what a worker learnt from its scheduler; `present_engine_token`)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        self.transport = transport
        self._request = attach_request(
            engine_id=engine_id, role=role, layout=layout,
            client_name=client_name or default_client_name(), rank=rank,
            world_size=world_size, engine_token=engine_token)
        self.listener = listener or LinkListener()
        self._clock = clock
        self._attachment: Attachment | None = None
        self._outbox: queue.SimpleQueue[Any] | None = None
        self._responses: Any = None
        self._heard = 0.0  # when the daemon last sent anything on the current stream
        self._stopping = threading.Event()
        self._beat_due_failed = False  # (logged once)
        self._attached = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"ec-session-{engine_id}",
                                        daemon=True)
        self._beats: dict[int, float] = {}  # heartbeat seq -> send time
        self._seq = 0
        self._last_echo = 0
        self._echoed = threading.Condition()
        self.fresh_until = 0.0
        self.last_error = ""
        self._notice = DetachedNotice(getattr(transport, "uri", "?"), clock=clock)

    @property
    def attachment(self) -> Attachment | None:
        """The current attachment, None while detached."""
        return self._attachment

    def fresh(self) -> bool:
        """Is the daemon known to keep this session for a good while yet?"""
        return self._clock() < self.fresh_until

    def start(self) -> None:
        self._thread.start()

    def wait_attached(self, timeout: float) -> Attachment | None:
        with self._attached:
            self._attached.wait_for(lambda: self._attachment is not None, timeout)
        return self._attachment

    def present_engine_token(self, token: str) -> None:
        """A worker's later attaches present `token` (any thread: the request
        is replaced whole, never changed under the link's thread)."""
        self._request = with_engine_token(self._request, token)

    def send(self, message: Outgoing) -> bool:
        """Queue a ClientMessage on the stream; False (dropped) while detached."""
        return self._queue(message)

    def _queue(self, message: Outgoing | _Acks) -> bool:
        outbox = self._outbox
        if outbox is None:
            return False
        outbox.put(message)
        return True

    def send_on(self, attachment: Attachment, message: Outgoing) -> bool:
        """`send`, only while `attachment` is the current one (a message
        that names what it learnt from that session, such as a save's
        extents, must not reach a later one). False: dropped."""
        with self._attached:  # the stream's end clears both under this lock
            if self._attachment is not attachment or self._outbox is None:
                return False
            self._outbox.put(message)
        return True

    def send_acks(self, acks: Refs) -> bool:
        """Queue acknowledgements (mm_hash, entry_id), at most MAX_BATCH per
        message, built on the link's thread so the caller pays for a queue
        put only. False (dropped) while detached. (Touches ride on
        heartbeats, built by the `heartbeat` callback.)"""
        ok = True
        for start in range(0, len(acks), MAX_BATCH):
            ok = self._queue(_Acks(acks[start:start + MAX_BATCH])) and ok
        return ok

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Detach (the daemon releases everything the session held: this
        client loads nothing more), then flush the last heartbeat and
        half-close the stream. Cancels the stream if the daemon does not
        answer in time. Call it only once no load of this engine runs."""
        self._stopping.set()
        attachment, outbox = self._attachment, self._outbox
        if attachment is not None and outbox is not None:
            final = self._beat()  # the last counters and touches; its echo says applied
            outbox.put(final)
            seq = final.heartbeat.seq if final.heartbeat is not None else 0  # (always set)
            with self._echoed:
                self._echoed.wait_for(lambda: self._last_echo >= seq, timeout)
            try:
                self.transport.call("Detach", detach_request(attachment.session_id),
                                    timeout=timeout)
            except grpc.RpcError as exc:  # gone already: its stream ending does the rest
                log.debug("ec-daemon detach: %s", exc.code().name)
        if outbox is not None:
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
            asked = self._clock()
            try:
                reply = self.transport.call("Attach", self._request)
            except grpc.RpcError as exc:
                self._note_error(f"attach failed: {exc.code().name}: {exc.details()}",
                                 retryable=exc.code() in RETRYABLE)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_SECONDS)
                continue
            backoff = BACKOFF_START_SECONDS
            if not self._serve(reply, asked):
                self._stopping.wait(BACKOFF_MAX_SECONDS)  # a callback failed: not in a loop

    def _serve(self, reply: Any, asked: float) -> bool:
        """Serve one attachment until it is lost; False if a callback raised."""
        attachment = attachment_of(reply)
        lease = attachment.lease_ms / 1000
        outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        first = Outgoing(open_session_id=attachment.session_id)
        try:
            extra = self.listener.opening_message(attachment)
        except Exception:
            log.exception("ec-daemon opening callback failed; opening without it")
            extra = None
        if extra is not None:
            first.merge(extra)
        outbox.put(first)
        # Before the stream opens: the daemon counts a worker whose stream is
        # open as having mapped the region, and tells a view nothing before.
        try:
            self.listener.on_attached(attachment)
        except Exception as exc:  # e.g. the region vanished: attach again
            self._note_error(f"attach could not complete: {exc}", retryable=True)
            self._give_up(attachment)
            return False
        if self._stopping.is_set():  # stopped meanwhile (mapping a large region takes time)
            self._give_up(attachment)
            return True
        self._beats.clear()
        self._heard = time.monotonic()
        responses = self.transport.stream(self._requests(outbox, attachment.heartbeat_ms / 1000,
                                                         lease * SILENT_LEASES))
        self._responses = responses
        self.fresh_until = asked + lease * FRESH_FRACTION  # the lease began after `asked`
        with self._attached:
            self._outbox = outbox
            self._attachment = attachment
            self._attached.notify_all()
        self._notice.now_attached()
        healthy = True
        try:
            for received in responses:
                self._heard = time.monotonic()
                message = daemon_news(received)
                if message.heartbeat_seq:
                    self._renewed(message.heartbeat_seq, lease)
                self.listener.on_message(message)
            if not self._stopping.is_set():
                self._note_error("the daemon closed the session stream", retryable=True)
        except grpc.RpcError as exc:
            if not self._stopping.is_set():
                self._note_error(f"session stream lost: {exc.code().name}", retryable=True)
        except Exception:
            log.exception("ec-daemon session callback failed; attaching again")
            healthy = False
            responses.cancel()
        finally:
            self.fresh_until = 0.0
            with self._attached:
                self._attachment = None
                self._outbox = None
            outbox.put(None)
            healthy = self._detached() and healthy
        return healthy

    def _give_up(self, attachment: Attachment) -> None:
        """An attachment this client cannot use: detach it at once, so the
        daemon holds nothing for it (best effort: else its lease ends it)."""
        try:
            self.transport.call("Detach", detach_request(attachment.session_id), timeout=1.0)
        except grpc.RpcError as exc:
            log.debug("ec-daemon detach of an unusable attachment: %s", exc.code().name)

    def _detached(self) -> bool:
        try:
            self.listener.on_detached()
        except Exception:
            log.exception("ec-daemon detach callback failed")
            return False
        return True

    def _renewed(self, seq: int, lease: float) -> None:
        """The daemon renewed the lease after heartbeat `seq` was sent."""
        with self._echoed:  # beats are made on gRPC's thread, echoes read on ours
            self._last_echo = max(self._last_echo, seq)
            self._echoed.notify_all()
            sent = self._beats.get(seq)
            if sent is None:
                return
            for old in [s for s in self._beats if s <= seq]:
                del self._beats[old]
            self.fresh_until = max(self.fresh_until, sent + lease * FRESH_FRACTION)

    def _beat(self) -> Outgoing:
        with self._echoed:
            self._seq += 1
            seq = self._seq
            if len(self._beats) >= MAX_BEATS_IN_FLIGHT:  # the daemon stopped echoing
                del self._beats[min(self._beats)]
            self._beats[seq] = self._clock()  # before it leaves: a conservative send time
        message = self.listener.heartbeat_message()
        if message.heartbeat is None:
            message.heartbeat = Heartbeat()
        message.heartbeat.seq = seq
        return message

    def _beat_due(self) -> bool:
        """The listener's `beat_due`; a raise is logged once and is False
        (raised here, on gRPC's request thread, it would end the stream)."""
        try:
            return bool(self.listener.beat_due())
        except Exception:
            if not self._beat_due_failed:
                self._beat_due_failed = True
                log.exception("ec-daemon link: beat_due raised; heartbeats keep their interval")
            return False

    def _requests(self, outbox: queue.SimpleQueue[Any], interval: float,
                  silent: float = float("inf")) -> Iterator[Any]:
        """The stream's messages: what `send` queued, plus a heartbeat every
        `interval` whether or not anything else went out, and one as soon as
        EARLY_BEAT_SECONDS after the last when the listener says one is due
        (asked every EARLY_BEAT_SECONDS, by listeners that can say so). The
        stream is cancelled once nothing came from the daemon for `silent`
        seconds (the read loop then attaches again)."""
        yield client_message(outbox.get())  # the open message
        yield client_message(self._beat())  # renews the lease at once: fresh from the first step
        interval = max(interval, MIN_BEAT_SECONDS)
        early = min(interval, EARLY_BEAT_SECONDS)
        asks = type(self.listener).beat_due is not LinkListener.beat_due
        due = self._beat_due
        last_beat = time.monotonic()
        while True:
            wake = last_beat + interval
            if asks:
                wake = min(wake, max(last_beat + early, time.monotonic() + early / 2))
            try:
                message = outbox.get(timeout=max(0.0, wake - time.monotonic()))
            except queue.Empty:
                message = _NOTHING
            if message is None:
                return
            if isinstance(message, _Acks):
                yield client_message(message.to_message())
            elif message is not _NOTHING:
                yield client_message(message)
            now = time.monotonic()
            if now >= last_beat + interval or (asks and now >= last_beat + early and due()):
                if now - self._heard > silent:
                    log.warning("ec-daemon %s: nothing heard on the session stream for %.0fs; "
                                "attaching again", self.transport.uri, now - self._heard)
                    self._end_stream()
                    return
                yield client_message(self._beat())
                last_beat = time.monotonic()

    def _end_stream(self) -> None:
        responses = self._responses
        if responses is not None:
            responses.cancel()

    def _note_error(self, message: str, *, retryable: bool) -> None:
        """Logged at a low rate while detached (`DetachedNotice`)."""
        self._notice.failed(message, retryable=retryable)
        self.last_error = message
