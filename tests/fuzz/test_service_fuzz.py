"""Malformed and adversarial requests straight to the gRPC service.

Every case must get OK or a precise status code, never kill the daemon, and
leave the bookkeeping consistent: the daemon runs with --check-invariants, so
it verifies its invariants after every call and would answer INTERNAL.
Each property test stops at its count cap or after FUZZ_SECONDS, whichever
comes first (tests/property_budget.py); FUZZ_EXAMPLES sets the caps
(CI: 10,000 cases in at most 120 s per test; `make fuzz`: many more, longer).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import strategies as st

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import PROTOCOL_VERSION, Layout, pb, rpc, unix_path
from tests.integration.daemon import Daemon
from tests.property_budget import Budget, run_given

pytestmark = pytest.mark.integration
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "10000"))
SECONDS = float(os.environ.get("FUZZ_SECONDS", "120"))
QUIET = {"database": None, "suppress_health_check": list(HealthCheck)}
PRECISE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ABORTED}
LAYOUT = Layout("fuzz-model", "float16", {"image": 64})
U64 = st.integers(0, 2**64 - 1)
# Lookup counters a heartbeat claims: plausible, or as large as they can be.
COUNTS = st.one_of(st.integers(0, 1000), st.just(2**64 - 1), U64)


class World:
    """A daemon with real sessions, so random calls hit real state."""

    def __init__(self) -> None:
        # Thousands of cases attach and leave their sessions to the lease: the
        # session caps are not what is fuzzed here.
        self.daemon = Daemon(cpu_bytes="4MiB", extra=(
            "--alloc-wait-seconds", "0.05", "--max-sessions", "1000000",
            "--max-sessions-per-engine", "1000000", "--max-tokenless-sessions", "1000000"))
        self.daemon.start()
        self.channel = grpc.insecure_channel(self.daemon.socket)
        self.stub = rpc.ECDaemonStub(self.channel)
        self.schedulers = [SchedulerDelegate(self.daemon.socket, engine_id=e, layout=LAYOUT)
                           for e in ("A", "B")]
        self.workers = [WorkerDelegate(self.daemon.socket, engine_id=e, layout=LAYOUT,
                                       rank=r, world_size=2)
                        for e in ("A", "B") for r in (0, 1)]
        for delegate in (*self.schedulers, *self.workers):
            assert delegate.link.wait_attached(10)
        for i in range(8):  # some ready entries to touch, evict and acknowledge
            self.workers[0].save(f"seed-{i}", np.full(3000 * (i + 1), i, np.uint8))
        self.workers[0].flush(10)
        self.namespace = self.schedulers[0].link.attachment.namespace  # type: ignore[union-attr]

    def session_ids(self) -> list[str]:
        ids = []
        for delegate in (*self.schedulers, *self.workers):
            attachment = delegate.link.attachment
            if attachment is not None:
                ids.append(attachment.session_id)
        return ids

    def refs(self) -> list[tuple[str, int]]:
        """(mm_hash, entry_id) of the seeds as they are now (ready, hidden or gone)."""
        reply = self.stub.Lookup(pb.LookupRequest(
            namespace=self.namespace, mm_hashes=[f"seed-{i}" for i in range(8)]), timeout=10)
        return [(r.entry.mm_hash, r.entry.entry_id) for r in reply.results if r.entry.entry_id]

    def close(self) -> None:
        for delegate in (*self.schedulers, *self.workers):
            delegate.close()
        self.channel.close()
        self.daemon.cleanup()


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


text = st.one_of(st.just(""), st.text(max_size=40), st.text(min_size=600, max_size=700),
                 st.sampled_from(["seed-0", "seed-1", "seed-7", "x" * 10000]))
shapes = st.lists(st.one_of(st.integers(0, 4096), U64), max_size=10)


@st.composite
def session_id(draw: Any, world: World) -> str:
    return draw(st.one_of(st.sampled_from(world.session_ids() or [""]), text))


@st.composite
def attach(draw: Any) -> Any:
    request = pb.AttachRequest(
        protocol_version=draw(st.sampled_from([PROTOCOL_VERSION, 0, 2, 2**32 - 1])),
        engine_id=draw(text), role=draw(st.integers(0, 7)), client_name=draw(text))
    if draw(st.booleans()):
        request.layout.model = draw(text)
        request.layout.dtype = draw(st.sampled_from(["float16", "", "f" * 40, "bad dtype"]))
        for key, value in draw(st.dictionaries(text, U64, max_size=3)).items():
            request.layout.row_bytes[key] = value
    which = draw(st.sampled_from(["scheduler", "worker", None]))
    if which == "scheduler":
        request.scheduler.SetInParent()
    elif which == "worker":
        request.worker.rank = draw(st.integers(0, 2**32 - 1))
        request.worker.world_size = draw(st.integers(0, 2**32 - 1))
    return request


def call(world: World, method: str, request: Any) -> None:
    try:
        getattr(world.stub, method)(request, timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() in PRECISE, f"{method} -> {exc.code()}: {exc.details()}"


@st.composite
def operation(draw: Any, world: World) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["attach", "allocate", "report", "lookup", "detach",
                                 "stats"]))
    if kind == "attach":
        return "Attach", draw(attach())
    if kind == "allocate":
        return "Allocate", pb.AllocateRequest(
            session_id=draw(session_id(world)), mm_hash=draw(text),
            nbytes=draw(st.one_of(st.integers(0, 5 << 20), U64)), shape=draw(shapes),
            dtype=draw(st.sampled_from(["uint8", "float16", "", "not a dtype", "x" * 40])))
    if kind == "report":
        return "Report", pb.ReportRequest(
            session_id=draw(session_id(world)), saved=draw(st.lists(text, max_size=4)),
            aborted=draw(st.lists(text, max_size=4)),
            saved_checksums=draw(st.lists(U64, max_size=5)))
    if kind == "lookup":
        return "Lookup", pb.LookupRequest(
            namespace=draw(st.one_of(text, st.just("fuzz-model|float16|image=64|"))),
            mm_hashes=draw(st.lists(text, max_size=6)))
    if kind == "detach":
        # Only sessions of our own making: the world's are kept for later cases.
        return "Detach", pb.DetachRequest(session_id=draw(text))
    return "Stats", pb.StatsRequest()


def test_unary_calls_get_precise_codes_and_keep_invariants(world: World,
                                                           record_property: Any) -> None:
    def case(data: Any) -> None:
        for _ in range(data.draw(st.integers(1, 4))):
            method, request = data.draw(operation(world))
            call(world, method, request)

    run_given(Budget(EXAMPLES, SECONDS), case, st.data(), **QUIET).record(record_property)
    stats = world.stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.used_bytes + stats.free_bytes == stats.capacity_bytes
    assert world.daemon.serving()


def test_huge_batches_are_refused_before_any_work(world: World) -> None:
    ids = world.session_ids()
    with pytest.raises(grpc.RpcError) as info:
        world.stub.Lookup(pb.LookupRequest(namespace="n", mm_hashes=["h"] * 5000))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for request in (pb.ReportRequest(session_id=ids[-1], saved=["h"] * 5000),
                    pb.ReportRequest(session_id=ids[-1], aborted=["h"] * 5000)):
        with pytest.raises(grpc.RpcError) as info:
            world.stub.Report(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    scheduler = world.stub.Attach(pb.AttachRequest(
        protocol_version=PROTOCOL_VERSION, engine_id="Z", role=pb.ROLE_BOTH,
        layout=LAYOUT.to_pb(), scheduler=pb.SchedulerComponent()))
    refs = [pb.EntryRef(mm_hash="h", entry_id=1)] * 5000
    touches = [pb.Touch(mm_hash="h", entry_id=1)] * 5000
    for message in (pb.ClientMessage(acks=refs), pb.ClientMessage(touches=touches)):
        responses = world.stub.Session(iter([
            pb.ClientMessage(open_session_id=scheduler.session_id), message]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            list(responses)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        scheduler = world.stub.Attach(pb.AttachRequest(
            protocol_version=PROTOCOL_VERSION, engine_id="Z", role=pb.ROLE_BOTH,
            layout=LAYOUT.to_pb(), scheduler=pb.SchedulerComponent()))


def test_stream_messages_get_precise_codes(world: World, record_property: Any) -> None:
    def case(data: Any) -> None:
        request = pb.AttachRequest(
            protocol_version=PROTOCOL_VERSION, engine_id=data.draw(st.sampled_from(["A", "Z"])),
            role=pb.ROLE_BOTH, layout=LAYOUT.to_pb())
        if data.draw(st.booleans()):
            request.scheduler.SetInParent()
        else:  # a worker session may not acknowledge, touch or count lookups
            request.worker.rank, request.worker.world_size = 0, 1
        attached = world.stub.Attach(request)
        known = world.refs()
        ref = st.one_of(st.sampled_from(known) if known else st.nothing(), st.tuples(text, U64))
        messages = [pb.ClientMessage(open_session_id=data.draw(st.one_of(
            st.just(attached.session_id), text)))]
        for _ in range(data.draw(st.integers(0, 3))):
            message = pb.ClientMessage()
            for mm_hash, entry_id in data.draw(st.lists(ref, max_size=3)):
                message.acks.add(mm_hash=mm_hash, entry_id=entry_id)
            for mm_hash, entry_id in data.draw(st.lists(ref, max_size=3)):
                message.touches.add(mm_hash=mm_hash, entry_id=entry_id,
                                    loads=data.draw(st.integers(0, 2**32 - 1)))
            for mm_hash, entry_id in data.draw(st.lists(ref, max_size=2)):
                message.mismatches.add(mm_hash=mm_hash, entry_id=entry_id)
            if data.draw(st.booleans()):
                message.heartbeat.seq = data.draw(U64)
                message.heartbeat.lookups = lookups = data.draw(COUNTS)
                message.heartbeat.hits = data.draw(st.one_of(st.integers(0, lookups), U64))
            if data.draw(st.integers(0, 9)) == 0:
                message.open_session_id = data.draw(text)
            messages.append(message)
        responses = world.stub.Session(iter(messages), timeout=5)
        try:
            for _ in responses:
                pass
        except grpc.RpcError as exc:
            assert exc.code() in PRECISE, f"{exc.code()}: {exc.details()}"
        # Whatever the counters a heartbeat claimed, Stats still answers.
        world.stub.Stats(pb.StatsRequest(), timeout=10)

    budget = Budget(max(EXAMPLES // 20, 50), SECONDS)
    run_given(budget, case, st.data(), **QUIET).record(record_property)
    assert world.daemon.serving()


def test_garbage_bytes_on_the_socket_do_not_hurt(world: World, record_property: Any) -> None:
    def case(garbage: bytes, with_preface: bool) -> None:
        path = unix_path(world.daemon.socket)
        assert path is not None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(2)
            raw.connect(path)
            preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" if with_preface else b""
            try:
                raw.sendall(preface + garbage)
                raw.recv(1024)
            except OSError:
                pass  # the daemon may hang up on us: that is the point
        assert world.daemon.serving()

    budget = Budget(max(EXAMPLES // 50, 30), SECONDS)
    run_given(budget, case, st.binary(max_size=4096), st.booleans(),
              database=None).record(record_property)
