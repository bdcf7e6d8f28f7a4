"""SessionLink: the client-side lease (`fresh`) on an injected clock, and a
link that survives its own callbacks raising, on a stand-in transport."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import ec_client.common.session as session
from ec_client.common.session import (
    FRESH_FRACTION,
    MAX_BEATS_IN_FLIGHT,
    Attachment,
    LinkListener,
    SessionLink,
)
from ec_client.common.wire import Heartbeat, Outgoing, Touch
from ec_protocol.protocol import Layout, pb

LAYOUT = Layout("m", "float32", {"image": 4096})
LEASE = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def listening(**overrides: Any) -> LinkListener:
    """A listener whose named methods are these functions."""
    listener = LinkListener()
    for name, function in overrides.items():
        setattr(listener, name, function)
    return listener


def link_on(clock: Clock, transport: Any = None, **overrides: Any) -> SessionLink:
    return SessionLink(transport, engine_id="E", role="consumer", layout=LAYOUT, clock=clock,
                       listener=listening(**overrides))


def test_a_link_is_not_fresh_before_any_echo():
    clock = Clock()
    link = link_on(clock)
    assert not link.fresh()
    link._beat()
    assert not link.fresh()


def test_fresh_until_the_echoed_heartbeats_send_time_plus_a_fraction_of_the_lease():
    clock = Clock()
    link = link_on(clock)
    sent = clock.now
    beat = link._beat()
    clock.now += 2.0  # the echo takes a while
    link._renewed(beat.heartbeat.seq, LEASE)
    assert link.fresh_until == sent + LEASE * FRESH_FRACTION
    clock.now = sent + LEASE * FRESH_FRACTION - 0.001
    assert link.fresh()
    clock.now = sent + LEASE * FRESH_FRACTION
    assert not link.fresh()


def test_a_late_echo_extends_from_the_send_time_not_the_arrival():
    """A frozen client (or a stalled stream) wakes up to an old echo: the
    daemon's lease ran from the send time, so the link is not fresh."""
    clock = Clock()
    link = link_on(clock)
    beat = link._beat()
    clock.now += LEASE  # frozen for a whole lease
    link._renewed(beat.heartbeat.seq, LEASE)
    assert not link.fresh()


def test_a_frozen_client_stops_being_fresh():
    clock = Clock()
    link = link_on(clock)
    link._renewed(link._beat().heartbeat.seq, LEASE)
    assert link.fresh()
    clock.now += 3600  # the process was stopped
    assert not link.fresh()


def test_an_echo_of_an_unknown_or_older_seq_does_not_extend():
    clock = Clock()
    link = link_on(clock)
    first = link._beat().heartbeat.seq
    clock.now += 1
    second = link._beat().heartbeat.seq
    clock.now += 1
    link._renewed(second, LEASE)
    until = link.fresh_until
    assert until == 1001.0 + LEASE * FRESH_FRACTION
    link._renewed(first, LEASE)  # older than what was echoed: already settled
    link._renewed(second, LEASE)  # the same echo twice
    link._renewed(second + 50, LEASE)  # never sent
    assert link.fresh_until == until
    clock.now += 1
    third = link._beat().heartbeat.seq
    link._renewed(third, LEASE)
    assert link.fresh_until == 1003.0 + LEASE * FRESH_FRACTION


def test_only_the_newest_beats_are_remembered_when_the_daemon_stops_echoing():
    clock = Clock()
    link = link_on(clock)
    first = link._beat().heartbeat.seq
    for _ in range(MAX_BEATS_IN_FLIGHT):
        clock.now += 1
        link._beat()
    link._renewed(first, LEASE)  # forgotten: no renewal from a beat this old
    assert not link.fresh()


def test_heartbeats_carry_a_rising_seq_and_the_callers_message():
    clock = Clock()
    link = link_on(clock, heartbeat_message=lambda: Outgoing(
        heartbeat=Heartbeat(lookups=5, hits=2), touches=[Touch("a", 1, 3)]))
    beats = [link._beat() for _ in range(3)]
    assert [b.heartbeat.seq for b in beats] == [1, 2, 3]
    assert all((b.heartbeat.lookups, b.heartbeat.hits) == (5, 2) for b in beats)
    assert [t.mm_hash for t in beats[0].touches] == ["a"]


# ---------------------------------------------- on a stand-in transport


class Stream:
    """A session stream: reads the client's messages on a thread (as gRPC
    does), echoes heartbeats if `echo`, and ends when the client half-closes
    or cancels."""

    def __init__(self, requests: Iterator[Any], first: list[Any], echo: bool) -> None:
        self._responses: queue.Queue[Any] = queue.Queue()
        for message in first:
            self._responses.put(message)
        self._echo = echo
        self._cancelled = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(requests,), daemon=True)
        self._reader.start()

    def _read(self, requests: Iterator[Any]) -> None:
        for message in requests:
            if self._cancelled.is_set():
                break
            if self._echo and message.heartbeat.seq:
                self._responses.put(pb.DaemonMessage(heartbeat_seq=message.heartbeat.seq))
        self._responses.put(None)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Any:
        message = self._responses.get(timeout=10)
        if message is None:
            raise StopIteration
        return message

    def cancel(self) -> None:
        self._cancelled.set()
        self._responses.put(None)

    def join(self) -> None:
        self._reader.join(10)
        assert not self._reader.is_alive()


class Transport:
    uri = "unix:///stand-in"

    def __init__(self, first: list[Any], echo: bool = True) -> None:
        self.first = first
        self.echo = echo
        self.attaches = 0
        self.detached = ""
        self.streams: list[Stream] = []

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        if method == "Detach":
            self.detached = request.session_id
            return pb.DetachReply()
        assert method == "Attach"
        self.attaches += 1
        return pb.AttachReply(
            session_id=f"s{self.attaches}", session_index=self.attaches, namespace="ns",
            region=pb.Region(path="/dev/shm/r", size_bytes=1 << 20, page_bytes=4096,
                             generation=7, data_offset=4096),
            lease_ms=int(LEASE * 1000), heartbeat_ms=20)

    def stream(self, requests: Iterator[Any]) -> Stream:
        self.streams.append(Stream(requests, self.first, self.echo))
        return self.streams[-1]

    def ended(self) -> None:
        """Every stream's reader stopped (nothing left running)."""
        for stream in self.streams:
            stream.join()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "BACKOFF_MAX_SECONDS", 0.05)


@pytest.mark.parametrize("echo", [True, False])
def test_an_attached_link_stays_fresh_only_while_its_heartbeats_are_echoed(echo):
    clock = Clock()
    transport = Transport(first=[pb.DaemonMessage(snapshot_done=True)], echo=echo)
    link = link_on(clock, transport)
    try:
        link.start()
        attachment = link.wait_attached(10)
        assert attachment is not None and attachment.region.generation == 7
        assert link.fresh()  # the lease began after the Attach call was made
        clock.now += LEASE  # past what the attach alone vouches for
        if echo:
            wait_for(link.fresh)  # a heartbeat sent since then was echoed
        else:
            time.sleep(0.2)  # ten heartbeat intervals, none echoed
            assert not link.fresh()
    finally:
        link.stop()
    transport.ended()
    assert link.attachment is None and not link.fresh()


@pytest.mark.parametrize("failing", ["on_message", "on_detached"])
def test_a_raising_callback_detaches_and_attaches_again(quick_backoff, failing):
    transport = Transport(first=[pb.DaemonMessage(snapshot_done=True)])
    events: list[str] = []
    raised = threading.Event()

    def on_message(message: Any) -> None:
        if message.snapshot_done:
            events.append("message")
            if not raised.is_set() and failing == "on_message":
                raised.set()
                raise RuntimeError("a bug in the view")

    def on_detached() -> None:
        events.append("detached")
        if not raised.is_set() and failing == "on_detached":
            raised.set()
            raise RuntimeError("a bug in the detach")

    link = SessionLink(
        transport, engine_id="E", role="consumer", layout=LAYOUT,
        listener=listening(on_attached=lambda a: events.append(f"attached {a.session_id}"),
                           on_message=on_message, on_detached=on_detached))
    try:
        link.start()
        if failing == "on_detached":
            wait_for(lambda: events.count("message") == 1)
            link._end_stream()  # the stream is lost: on_detached runs, and raises
        wait_for(lambda: transport.attaches == 2 and link.attachment is not None)
        wait_for(lambda: events.count("message") == 2)
    finally:
        link.stop()
    transport.ended()
    assert events == ["attached s1", "message", "detached", "attached s2", "message",
                      "detached"]


def test_a_raising_on_attached_attaches_again(quick_backoff):
    transport = Transport(first=[])
    calls: list[str] = []

    def on_attached(attachment: Attachment) -> None:
        calls.append(attachment.session_id)
        if len(calls) == 1:
            raise FileNotFoundError("the region vanished")

    link = SessionLink(transport, engine_id="E", role="consumer", layout=LAYOUT,
                       listener=listening(on_attached=on_attached))
    try:
        link.start()
        attachment = link.wait_attached(10)
        assert attachment is not None and attachment.session_id == "s2"
    finally:
        link.stop()
    transport.ended()
    assert calls == ["s1", "s2"]


def test_acknowledgements_leave_in_messages_of_at_most_max_batch():
    from ec_protocol.protocol import MAX_BATCH

    link = link_on(Clock())
    outbox: list[Any] = []
    link._outbox = type("Queue", (), {"put": staticmethod(outbox.append)})()
    acks = [(f"k{i}", i) for i in range(2 * MAX_BATCH + 1)]
    assert link.send_acks(acks)
    sizes = [len(part.to_message().acks) for part in outbox]
    assert sizes == [MAX_BATCH, MAX_BATCH, 1]
    assert [(r.mm_hash, r.entry_id) for p in outbox for r in p.to_message().acks] == acks


class Touching(LinkListener):
    """A scheduler's listener in miniature: loads to touch make a heartbeat due."""

    def __init__(self) -> None:
        self.pending = False

    def beat_due(self) -> bool:
        return self.pending

    def heartbeat_message(self) -> Any:
        touched, self.pending = self.pending, False
        return Outgoing(heartbeat=Heartbeat(), touches=[Touch("hit", 1, 1)] if touched else [])


def _stream_of(link: SessionLink, interval: float) -> tuple[queue.SimpleQueue[Any],
                                                             queue.Queue[Any]]:
    """Run the link's request generator on a thread: (its outbox, what it yields)."""
    outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    outbox.put(Outgoing())  # the open message
    sent: queue.Queue[Any] = queue.Queue()
    requests = link._requests(outbox, interval)
    threading.Thread(target=lambda: [sent.put(m) for m in requests], daemon=True).start()
    return outbox, sent


def test_loads_to_touch_send_a_heartbeat_early_not_a_whole_interval_later(monkeypatch):
    """The daemon's LRU hears of hits within EARLY_BEAT_SECONDS: with a
    heartbeat only every lease/10 (1 s by default), entries hit every step
    were evicted from a cache turning over faster. Nothing due, nothing
    extra is sent; early beats are spaced by EARLY_BEAT_SECONDS at least."""
    monkeypatch.setattr(session, "EARLY_BEAT_SECONDS", 0.05)
    listener = Touching()
    link = SessionLink(None, engine_id="E", role="consumer", layout=LAYOUT, listener=listener)
    outbox, sent = _stream_of(link, interval=60.0)
    try:
        sent.get(timeout=10)  # the open message
        assert sent.get(timeout=10).heartbeat.seq == 1  # the first beat, at once
        with pytest.raises(queue.Empty):
            sent.get(timeout=0.3)  # nothing due: nothing before the interval
        listener.pending = True
        started = time.monotonic()
        beat = sent.get(timeout=10)
        assert beat.heartbeat.seq == 2 and [t.mm_hash for t in beat.touches] == ["hit"]
        assert time.monotonic() - started < 10  # (the interval is 60 s)
        beats, until = 0, time.monotonic() + 0.5
        while time.monotonic() < until:  # due all the time: one per 50 ms at most
            listener.pending = True
            with contextlib.suppress(queue.Empty):
                sent.get(timeout=max(0.0, until - time.monotonic()))
                beats += 1
        assert 1 <= beats <= 11
    finally:
        outbox.put(None)


def test_a_listener_that_never_has_a_beat_due_is_not_asked(monkeypatch):
    """Workers' links (no touches) keep the plain interval and are never
    woken to ask."""
    monkeypatch.setattr(session, "EARLY_BEAT_SECONDS", 0.05)
    asked = []
    listener = LinkListener()
    listener.beat_due = lambda: asked.append(1) or True  # type: ignore[method-assign]
    link = SessionLink(None, engine_id="E", role="consumer", layout=LAYOUT, rank=0,
                       listener=listener)
    outbox, sent = _stream_of(link, interval=60.0)
    try:
        sent.get(timeout=10)
        assert sent.get(timeout=10).heartbeat.seq == 1
        with pytest.raises(queue.Empty):
            sent.get(timeout=0.3)
        assert not asked
    finally:
        outbox.put(None)


def test_a_beat_due_that_raises_keeps_the_stream_and_its_heartbeats(monkeypatch):
    """Raised on gRPC's request thread, it would end the stream (the lease
    lost, the link attaching again): it counts as not due instead, and the
    interval's heartbeats go on."""
    monkeypatch.setattr(session, "EARLY_BEAT_SECONDS", 0.05)

    class Broken(LinkListener):
        def beat_due(self) -> bool:
            raise RuntimeError("a listener bug")

    link = SessionLink(None, engine_id="E", role="consumer", layout=LAYOUT, listener=Broken())
    outbox, sent = _stream_of(link, interval=0.2)
    try:
        sent.get(timeout=10)
        seqs = [sent.get(timeout=10).heartbeat.seq for _ in range(3)]
        assert seqs == [1, 2, 3]
    finally:
        outbox.put(None)


def test_a_stream_the_daemon_went_silent_on_is_given_up_and_attached_again(
        quick_backoff, monkeypatch):
    """Issue 40, finding 3: the daemon cuts the call of a client that stopped
    reading, but gRPC cannot deliver a status behind a write in flight, so a
    client that reads again after a freeze would wait on a dead stream for
    ever, answering no hits. After SILENT_LEASES leases with nothing heard
    (heartbeats sent), the link cancels the stream and attaches again."""
    monkeypatch.setattr(session, "SILENT_LEASES", 0.2 / LEASE)  # 0.2 s here
    transport = Transport(first=[pb.DaemonMessage(snapshot_done=True)], echo=False)
    link = link_on(Clock(), transport)
    try:
        link.start()
        assert link.wait_attached(10) is not None
        wait_for(lambda: transport.attaches >= 2)
        assert transport.streams[0]._cancelled.is_set()
    finally:
        link.stop()
    transport.ended()
