"""Raw protocol calls against the real daemon: status codes, state unchanged."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from ec_client.scheduler import SchedulerDelegate
from ec_protocol.protocol import PROTOCOL_VERSION, Layout, pb
from tests.integration.daemon import Daemon

pytestmark = pytest.mark.integration
LAYOUT = Layout("proto-model", "float16", {"image": 256})
MiB = 1 << 20


def attach(stub: Any, *, engine: str = "E", role: int = pb.ROLE_BOTH, rank: int | None = 0,
           world: int = 1, version: int = PROTOCOL_VERSION) -> Any:
    request = pb.AttachRequest(protocol_version=version, engine_id=engine, role=role,
                               layout=LAYOUT.to_pb())
    if rank is None:
        request.scheduler.SetInParent()
    else:
        request.worker.rank, request.worker.world_size = rank, world
    return stub.Attach(request, timeout=5)


class RawStream:
    """A session stream driven by hand (no automatic acks)."""

    def __init__(self, stub: Any, session_id: str) -> None:
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.outbox.put(pb.ClientMessage(open_session_id=session_id))
        self.responses = stub.Session(self._requests())
        self.messages: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.error: grpc.RpcError | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _requests(self) -> Iterator[Any]:
        while (message := self.outbox.get()) is not None:
            yield message

    def _read(self) -> None:
        try:
            for message in self.responses:
                self.messages.put(message)
        except grpc.RpcError as exc:
            self.error = exc
        self.messages.put(None)

    def send(self, **fields: Any) -> None:
        self.outbox.put(pb.ClientMessage(**fields))

    def next(self, timeout: float = 5) -> Any:
        return self.messages.get(timeout=timeout)

    def close(self) -> None:
        self.outbox.put(None)
        self.responses.cancel()


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def save(stub: Any, session_id: str, mm_hash: str, nbytes: int = MiB) -> Any:
    reply = stub.Allocate(pb.AllocateRequest(session_id=session_id, mm_hash=mm_hash,
                                             nbytes=nbytes, shape=[nbytes], dtype="uint8"))
    assert reply.status == pb.ALLOCATED
    stub.Report(pb.ReportRequest(session_id=session_id, saved=[mm_hash]))
    return reply


def test_attach_validation(daemon):
    stub = daemon.stub
    assert code_of(lambda: attach(stub, version=PROTOCOL_VERSION + 1)) \
        == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: attach(stub, role=pb.ROLE_UNSPECIFIED)) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: attach(stub, rank=2, world=2)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: attach(stub, engine="")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.Attach(pb.AttachRequest(
        protocol_version=PROTOCOL_VERSION, engine_id="E", role=pb.ROLE_BOTH))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert daemon.stats()["sessions"] == 0
    reply = attach(stub)
    assert reply.region.size_bytes == 64 * MiB and reply.region.page_bytes == 64 << 10
    assert reply.region.path.startswith("/dev/shm/ec-daemon-") and reply.region.generation
    assert reply.namespace == "proto-model|float16|image=256|"


def test_bad_saves_get_precise_codes_and_change_nothing(daemon):
    stub = daemon.stub
    writer = attach(stub).session_id
    consumer = attach(stub, engine="C", role=pb.ROLE_CONSUMER).session_id
    cases = [
        (pb.AllocateRequest(session_id="nope", mm_hash="h", nbytes=8, shape=[8], dtype="uint8"),
         grpc.StatusCode.NOT_FOUND),
        (pb.AllocateRequest(session_id=writer, mm_hash="", nbytes=8, shape=[8], dtype="uint8"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.AllocateRequest(session_id=writer, mm_hash="h", nbytes=0, shape=[8], dtype="uint8"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.AllocateRequest(session_id=writer, mm_hash="h", nbytes=1 << 40, shape=[1 << 40],
                            dtype="uint8"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (pb.AllocateRequest(session_id=consumer, mm_hash="h", nbytes=8, shape=[8],
                            dtype="uint8"), grpc.StatusCode.FAILED_PRECONDITION),
    ]
    before = daemon.stats()
    for request, code in cases:
        assert code_of(lambda r=request: stub.Allocate(r)) == code, request
    after = daemon.stats()
    assert after["used_bytes"] == before["used_bytes"] == 0
    assert after["pending_bytes"] == 0


def test_duplicate_allocation_is_told_not_duplicated(daemon):
    stub = daemon.stub
    a, b = attach(stub, engine="A").session_id, attach(stub, engine="B").session_id
    first = stub.Allocate(pb.AllocateRequest(session_id=a, mm_hash="k", nbytes=MiB,
                                             shape=[MiB], dtype="uint8"))
    again = stub.Allocate(pb.AllocateRequest(session_id=b, mm_hash="k", nbytes=MiB,
                                             shape=[MiB], dtype="uint8"))
    assert (first.status, again.status) == (pb.ALLOCATED, pb.ALREADY_PENDING)
    reply = stub.Report(pb.ReportRequest(session_id=a, saved=["k", "never"]))
    assert list(reply.saved) == [pb.ACCEPTED, pb.UNKNOWN]
    reply = stub.Report(pb.ReportRequest(session_id=a, saved=["k"]))
    assert list(reply.saved) == [pb.DUPLICATE]
    again = stub.Allocate(pb.AllocateRequest(session_id=b, mm_hash="k", nbytes=MiB,
                                             shape=[MiB], dtype="uint8"))
    assert again.status == pb.ALREADY_READY
    assert daemon.stats()["used_bytes"] == MiB


@contextlib.contextmanager
def pinned_entry(daemon: Daemon) -> Iterator[tuple[Any, str, int]]:
    """Entry "k" saved by engine E's worker and pinned by E's view:
    yields (stub, the worker's session id, the transfer id)."""
    stub = daemon.stub
    writer = attach(stub, engine="E").session_id
    save(stub, writer, "k")
    view = attach(stub, engine="E", rank=None)
    stream = RawStream(stub, view.session_id)
    try:
        assert stream.next().snapshot_done
        transfer = (view.session_index << 32) | 1
        stream.send(pins=[pb.Pin(transfer_id=transfer, mm_hash="k", entry_id=1)])
        daemon.wait_for(lambda: daemon.lookup(LAYOUT, "k")[0].pins == 1, what="pin")
        yield stub, writer, transfer
    finally:
        stream.close()


def test_reports_for_another_engines_transfer_are_denied(daemon):
    with pinned_entry(daemon) as (stub, writer, transfer):
        intruder = attach(stub, engine="X").session_id
        assert code_of(lambda: stub.Report(pb.ReportRequest(session_id=intruder,
                                                            loaded=[transfer]))) \
            == grpc.StatusCode.PERMISSION_DENIED
        assert daemon.lookup(LAYOUT, "k")[0].pins == 1
        reply = stub.Report(pb.ReportRequest(session_id=writer, loaded=[transfer]))
        assert list(reply.loaded) == [pb.HELD]
        assert daemon.lookup(LAYOUT, "k")[0].pins == 0


def test_stream_must_open_a_known_session_once(daemon):
    stub = daemon.stub
    responses = stub.Session(iter([pb.ClientMessage(heartbeat=pb.Heartbeat())]))
    with pytest.raises(grpc.RpcError) as info:
        list(responses)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    unknown = stub.Session(iter([pb.ClientMessage(open_session_id="nope")]))
    with pytest.raises(grpc.RpcError) as info:
        list(unknown)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    session = attach(stub, rank=None).session_id
    first = RawStream(stub, session)
    try:
        assert first.next().snapshot_done
        second = RawStream(stub, session)
        assert second.next() is None
        assert second.error is not None
        assert second.error.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        first.close()


def test_ending_the_stream_ends_the_session(daemon):
    stub = daemon.stub
    session = attach(stub, rank=None).session_id
    stream = RawStream(stub, session)
    assert stream.next().snapshot_done
    assert daemon.stats()["sessions"] == 1
    stream.close()
    daemon.wait_for(lambda: daemon.stats()["sessions"] == 0, what="session end")
    assert code_of(lambda: stub.Detach(pb.DetachRequest(session_id=session))) \
        == grpc.StatusCode.NOT_FOUND


def test_detach_releases_pending_saves(daemon):
    stub = daemon.stub
    writer = attach(stub).session_id
    stub.Allocate(pb.AllocateRequest(session_id=writer, mm_hash="k", nbytes=MiB, shape=[MiB],
                                     dtype="uint8"))
    assert daemon.stats()["pending_bytes"] == MiB
    stub.Detach(pb.DetachRequest(session_id=writer))
    assert daemon.stats()["pending_bytes"] == 0 and daemon.stats()["sessions"] == 0


@pytest.fixture
def small_daemon():
    with Daemon(cpu_bytes="4MiB", extra=("--alloc-wait-seconds", "0.5")) as d:
        yield d


def test_full_of_pins_refuses_saves_and_evicts_nothing(small_daemon):
    stub = small_daemon.stub
    writer = attach(stub).session_id
    view = attach(stub, rank=None)
    stream = RawStream(stub, view.session_id)
    try:
        for i in range(4):
            save(stub, writer, f"k{i}")
        for i in range(4):
            stream.send(pins=[pb.Pin(transfer_id=(view.session_index << 32) | (i + 1),
                                     mm_hash=f"k{i}", entry_id=i + 1)])
        small_daemon.wait_for(lambda: small_daemon.stats()["pinned_bytes"] == 4 * MiB,
                              what="all pinned")
        assert code_of(lambda: stub.Allocate(pb.AllocateRequest(
            session_id=writer, mm_hash="new", nbytes=MiB, shape=[MiB], dtype="uint8"))) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        stats = small_daemon.stats()
        assert stats["evictions"] == 0 and stats["entries"] == 4 and stats["refused_saves"] == 1
    finally:
        stream.close()


def test_a_save_waits_for_views_to_acknowledge_evictions(small_daemon):
    stub = small_daemon.stub
    writer = attach(stub).session_id
    for i in range(4):
        save(stub, writer, f"k{i}")
    silent = attach(stub, engine="S", rank=None)
    stream = RawStream(stub, silent.session_id)  # a view that never acknowledges
    delegate = SchedulerDelegate(small_daemon.socket, engine_id="D", layout=LAYOUT)
    try:
        assert stream.next().ready  # snapshot
        assert delegate.link.wait_attached(10)
        started = time.monotonic()
        assert code_of(lambda: stub.Allocate(pb.AllocateRequest(
            session_id=writer, mm_hash="new", nbytes=MiB, shape=[MiB], dtype="uint8"))) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - started >= 0.4  # it waited for the acknowledgement
        assert small_daemon.lookup(LAYOUT, "k0")[0].state == pb.EVICTING_STATE
        stream.close()  # the silent view goes away; the delegate acknowledged by itself
        small_daemon.wait_for(lambda: small_daemon.lookup(LAYOUT, "k0")[0].state == pb.ABSENT,
                              what="reclamation")
        reply = stub.Allocate(pb.AllocateRequest(session_id=writer, mm_hash="new", nbytes=MiB,
                                                 shape=[MiB], dtype="uint8"))
        assert reply.status == pb.ALLOCATED
    finally:
        stream.close()
        delegate.close()


def test_lookup_never_shows_pending_entries(daemon):
    stub = daemon.stub
    writer = attach(stub).session_id
    stub.Allocate(pb.AllocateRequest(session_id=writer, mm_hash="p", nbytes=MiB, shape=[MiB],
                                     dtype="uint8"))
    save(stub, writer, "r")
    states = [r.state for r in daemon.lookup(LAYOUT, "p", "r", "x")]
    assert states == [pb.ABSENT, pb.READY, pb.ABSENT]
    assert code_of(lambda: stub.Lookup(pb.LookupRequest(namespace="", mm_hashes=["p"]))) \
        == grpc.StatusCode.INVALID_ARGUMENT


def test_sigterm_lets_in_flight_calls_finish():
    d = Daemon(cpu_bytes="4MiB", extra=("--alloc-wait-seconds", "3"))
    d.start()
    region_path = d.stats()["region_path"]
    stub = d.stub
    writer = attach(stub).session_id
    for i in range(4):
        save(stub, writer, f"k{i}")
    silent = attach(stub, engine="S", rank=None)
    stream = RawStream(stub, silent.session_id)  # never acknowledges evictions
    outcome: list[Any] = []

    def allocate() -> None:
        try:
            outcome.append(stub.Allocate(pb.AllocateRequest(
                session_id=writer, mm_hash="late", nbytes=MiB, shape=[MiB], dtype="uint8"),
                timeout=10))
        except grpc.RpcError as exc:
            outcome.append(exc.code())

    try:
        assert stream.next().ready
        waiting = threading.Thread(target=allocate)
        waiting.start()
        time.sleep(0.3)  # the allocation now waits for the silent view
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        waiting.join(10)
        assert d.proc.wait(15) == 0
        # Shutdown ended the silent view's session, which freed the evicted pages:
        # the waiting call completed instead of being cut off.
        assert len(outcome) == 1 and not isinstance(outcome[0], grpc.StatusCode), outcome
        assert outcome[0].status == pb.ALLOCATED
        assert not d.socket_path.exists()
        assert not os.path.exists(region_path)
    finally:
        stream.close()
        d.cleanup()


def test_a_report_with_a_bad_key_changes_nothing(daemon):
    with pinned_entry(daemon) as (stub, writer, transfer):
        assert code_of(lambda: stub.Report(pb.ReportRequest(
            session_id=writer, loaded=[transfer], saved=[""]))) == grpc.StatusCode.INVALID_ARGUMENT
        assert daemon.lookup(LAYOUT, "k")[0].pins == 1  # the load report was not applied


def test_a_stream_that_fails_to_open_ends_its_session(daemon):
    stub = daemon.stub
    session = attach(stub, rank=None).session_id
    bad_open = pb.ClientMessage(open_session_id=session,
                                heartbeat=pb.Heartbeat(lookups=1, hits=2))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Session(iter([bad_open])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert daemon.stats()["sessions"] == 0  # not left half-open until its lease ends
