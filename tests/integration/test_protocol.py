"""Raw protocol calls against the real daemon: status codes, state unchanged."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_daemon.core.limits import MAX_NAMESPACE_BYTES
from ec_daemon.core.records import OUTBOX_MIN_EVENTS
from ec_protocol.protocol import PROTOCOL_VERSION, Layout, pb, rpc
from tests import staged
from tests.integration import raw
from tests.integration.daemon import Daemon
from tests.integration.raw import MiB, RawStream, allocate, save

pytestmark = pytest.mark.integration
LAYOUT = Layout("proto-model", "float16", {"image": 256})


def attach(stub: Any, **kwargs: Any) -> Any:
    return raw.attach(stub, LAYOUT, **kwargs)


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_attach_validation(daemon):
    stub = daemon.stub
    assert code_of(lambda: attach(stub, version=PROTOCOL_VERSION + 1)) \
        == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: attach(stub, version=1)) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: attach(stub, role=pb.ROLE_UNSPECIFIED)) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: attach(stub, rank=2, world=2)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: attach(stub, engine="")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.Attach(pb.AttachRequest(
        protocol_version=PROTOCOL_VERSION, engine_id="E", role=pb.ROLE_BOTH))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert daemon.stats()["sessions"] == 0
    reply = attach(stub)
    region = reply.region
    # The stamp table (one uint64 per payload page, whole pages) precedes the payload.
    assert region.page_bytes == 64 << 10 and region.data_offset == region.page_bytes
    assert region.size_bytes == region.data_offset + 64 * MiB
    assert region.path.startswith("/dev/shm/ec-daemon-") and region.generation
    assert reply.namespace == "proto-model|float16|image=256|"
    # Several heartbeats per half lease, the window in which a view answers hits.
    assert reply.lease_ms == 10_000 and 0 < reply.heartbeat_ms <= reply.lease_ms // 5


# vLLM's store namespace (ec_client.vllm_connector.store_namespace), as sent.
STORE_NAMESPACE = ("fleet-a@embedding@model:/models/paligemma#weights=60eef318ec4b0c9f"
                   "#layout=0123456789abcdef@revision:default@encoder:9718b4d8@"
                   "dtype:torch.bfloat16@protocol:v3")


BAD_CHARACTER = "store_namespace must be printable ASCII without whitespace, got {} at 17"


@pytest.mark.parametrize(("store_namespace", "message"), [
    ("x" * 1025, "store_namespace is longer than 1024 characters"),
    ("embedding@model:m name", BAD_CHARACTER.format("' '")),
    ("embedding@model:m\tx", BAD_CHARACTER.format("'\\t'")),
    ("embedding@model:m\u00e9", BAD_CHARACTER.format("'\\xe9'")),
    ("embedding@model:m\x00", BAD_CHARACTER.format("'\\x00'")),
    # Keys are "<store_namespace>@id:<mm_hash>": this namespace's key of item
    # "x" would be namespace "embedding@model:m"'s key of item "h@id:x".
    ("embedding@model:m@id:h", "store_namespace must not contain '@id:' (its keys would be "
                               "those of another namespace)"),
], ids=["too-long", "space", "tab", "non-ascii", "nul", "id-marker"])
def test_a_bad_store_namespace_is_refused_precisely(daemon, store_namespace, message):
    with pytest.raises(grpc.RpcError) as info:
        attach(daemon.stub, store_namespace=store_namespace)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == message
    assert daemon.stats()["sessions"] == 0


def test_a_store_namespace_as_vllm_builds_it_is_taken(daemon):
    longest = "x" * 1024
    for store_namespace in ("", STORE_NAMESPACE, longest):
        attach(daemon.stub, store_namespace=store_namespace)
    assert daemon.stats()["sessions"] == 3


def namespace_bytes(layout: Layout) -> int:
    """The length of the namespace the daemon makes of `layout`."""
    return len("|".join((layout.model, layout.dtype, ",".join(
        f"{k}={v}" for k, v in sorted(layout.row_bytes.items())), layout.variant)).encode())


def test_a_layout_whose_namespace_another_host_could_not_read_is_refused(daemon):
    """A namespace is carried in the second tier's values and index: one
    longer than they carry (MAX_NAMESPACE_BYTES, in UTF-8 bytes) is refused at
    attach, with the bound, rather than published where no host would read
    it. A long layout within it is taken."""
    wide = "\U0001f600"  # 4 bytes in UTF-8: the bound counts bytes
    long = Layout(wide * 512, "float16", {"image": 256}, variant=wide * 256)
    assert 3000 < namespace_bytes(long) <= MAX_NAMESPACE_BYTES
    raw.attach(daemon.stub, long)
    assert daemon.stats()["sessions"] == 1
    modalities = {f"m{i:02d}" + "x" * 60: 1 << 30 for i in range(64)}
    too_long = Layout("model", "float16", modalities)
    assert namespace_bytes(too_long) > MAX_NAMESPACE_BYTES
    with pytest.raises(grpc.RpcError) as info:
        raw.attach(daemon.stub, too_long)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        f"the layout makes a namespace longer than {MAX_NAMESPACE_BYTES} bytes (model, "
        "modalities and variant together)")
    assert daemon.stats()["sessions"] == 1


def test_bad_saves_get_precise_codes_and_change_nothing(daemon):
    stub = daemon.stub
    writer = attach(stub).session_id
    consumer = attach(stub, engine="C", role=pb.ROLE_CONSUMER).session_id
    scheduler = attach(stub, rank=None).session_id
    cases = [
        (pb.AllocateRequest(session_id="nope", mm_hash="h", nbytes=8, shape=[8], dtype="uint8"),
         grpc.StatusCode.NOT_FOUND),
        (pb.AllocateRequest(session_id=writer, mm_hash="", nbytes=8, shape=[8], dtype="uint8"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.AllocateRequest(session_id=writer, mm_hash="h", nbytes=0, shape=[8], dtype="uint8"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.AllocateRequest(session_id=writer, mm_hash="h", nbytes=8, shape=[3], dtype="uint8"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.AllocateRequest(session_id=writer, mm_hash="h", nbytes=1 << 40, shape=[1 << 40],
                            dtype="uint8"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (pb.AllocateRequest(session_id=consumer, mm_hash="h", nbytes=8, shape=[8],
                            dtype="uint8"), grpc.StatusCode.FAILED_PRECONDITION),
        (pb.AllocateRequest(session_id=scheduler, mm_hash="h", nbytes=8, shape=[8],
                            dtype="uint8"), grpc.StatusCode.FAILED_PRECONDITION),
    ]
    before = daemon.stats()
    for request, code in cases:
        assert code_of(lambda r=request: stub.Allocate(r)) == code, request
    after = daemon.stats()
    assert after["used_bytes"] == before["used_bytes"] == 0
    assert after["pending_bytes"] == 0


def test_a_save_no_loader_could_read_back_is_refused_on_both_paths(daemon):
    """Issue 40, finding 5: an entry saved with dtype `notadtype`, or as
    float32 [1024] in 1024 bytes, was accepted, and every engine that hit it
    failed its load. The daemon refuses both (INVALID_ARGUMENT naming the
    problem), on the unary Allocate and on the stream alike, and nothing
    is allocated; a right one is taken."""
    stub = daemon.stub
    writer = attach(stub).session_id
    bogus = [("notadtype", 1024, [1024], "dtype 'notadtype' is not one loaders make"),
             ("float32", 1024, [1024], "nbytes 1024 is not shape (1024,) x 4 bytes of float32")]
    for dtype, nbytes, shape, message in bogus:
        with pytest.raises(grpc.RpcError) as info:
            stub.Allocate(pb.AllocateRequest(session_id=writer, mm_hash=f"u-{dtype}",
                                             nbytes=nbytes, shape=shape, dtype=dtype))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in info.value.details()
    stream = RawStream(stub, writer)
    stream.send(allocations=[pb.SaveAllocate(request_id=i + 1, mm_hash=f"s-{dtype}",
                                             nbytes=nbytes, shape=shape, dtype=dtype)
                             for i, (dtype, nbytes, shape, _) in enumerate(bogus)]
                + [pb.SaveAllocate(request_id=3, mm_hash="fine", nbytes=4096, shape=[1024],
                                   dtype="float32")])
    answers: dict[int, Any] = {}
    while len(answers) < 3:
        for answer in stream.next().allocations:
            answers[answer.request_id] = answer
    for i, (_, _, _, message) in enumerate(bogus):
        assert answers[i + 1].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert message in answers[i + 1].error
    assert answers[3].status == pb.ALLOCATED
    assert daemon.stats()["pending_bytes"] == 64 << 10  # "fine" alone: one page
    stream.close()
    assert all(r.state == pb.ABSENT for r in daemon.lookup(
        LAYOUT, "u-notadtype", "u-float32", "s-notadtype", "s-float32"))


def test_duplicate_allocation_is_told_not_duplicated(daemon):
    stub = daemon.stub
    a, b = attach(stub, engine="A").session_id, attach(stub, engine="B").session_id
    first = allocate(stub, a, "k")
    again = allocate(stub, b, "k")
    assert (first.status, again.status) == (pb.ALLOCATED, pb.ALREADY_PENDING)
    assert again.entry_id == first.entry_id and not again.extents
    # Another session cannot complete or drop a save it did not allocate.
    reply = stub.Report(pb.ReportRequest(session_id=b, saved=["k"], aborted=["k"]))
    assert (list(reply.saved), list(reply.aborted)) == ([pb.UNKNOWN], [pb.UNKNOWN])
    assert daemon.lookup(LAYOUT, "k")[0].state == pb.ABSENT
    reply = stub.Report(pb.ReportRequest(session_id=a, saved=["k", "never"]))
    assert list(reply.saved) == [pb.ACCEPTED, pb.UNKNOWN]
    reply = stub.Report(pb.ReportRequest(session_id=a, saved=["k"]))
    assert list(reply.saved) == [pb.DUPLICATE]
    assert allocate(stub, b, "k").status == pb.ALREADY_READY
    assert daemon.stats()["used_bytes"] == MiB


def test_only_worker_sessions_report(daemon):
    stub = daemon.stub
    scheduler = attach(stub, rank=None).session_id
    assert code_of(lambda: stub.Report(pb.ReportRequest(session_id=scheduler, saved=["k"]))) \
        == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: stub.Report(pb.ReportRequest(session_id="nope", saved=["k"]))) \
        == grpc.StatusCode.NOT_FOUND


def test_a_report_with_a_bad_key_changes_nothing(daemon):
    stub = daemon.stub
    writer = attach(stub).session_id
    allocate(stub, writer, "k")
    allocate(stub, writer, "j")
    for request in (pb.ReportRequest(session_id=writer, saved=["k", ""]),
                    pb.ReportRequest(session_id=writer, saved=["k"], aborted=["j", ""]),
                    pb.ReportRequest(session_id=writer, saved=["k"], aborted=["x" * 600])):
        assert code_of(lambda r=request: stub.Report(r)) == grpc.StatusCode.INVALID_ARGUMENT
        assert [r.state for r in daemon.lookup(LAYOUT, "k", "j")] == [pb.ABSENT, pb.ABSENT]
        assert daemon.stats()["pending_bytes"] == 2 * MiB  # neither saved nor dropped
    reply = stub.Report(pb.ReportRequest(session_id=writer, saved=["k"], aborted=["j"]))
    assert (list(reply.saved), list(reply.aborted)) == ([pb.ACCEPTED], [pb.ACCEPTED])
    assert daemon.lookup(LAYOUT, "k")[0].state == pb.READY


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
        first.send(open_session_id=session)  # only in the first message
        assert first.next() is None
        assert first.error is not None
        assert first.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        first.close()


def test_heartbeats_are_echoed_after_the_lease_was_renewed(daemon):
    stub = daemon.stub
    session = attach(stub, rank=None).session_id
    stream = RawStream(stub, session)
    try:
        assert stream.next().snapshot_done
        stream.send(heartbeat=pb.Heartbeat(seq=7, lookups=3, hits=1))
        assert stream.next().heartbeat_seq == 7
        stream.send(heartbeat=pb.Heartbeat(lookups=1))  # no seq: nothing to echo
        stream.send(heartbeat=pb.Heartbeat(seq=8))
        assert stream.next().heartbeat_seq == 8
        (ns,) = daemon.stats()["namespaces"]
        assert (ns["hits"], ns["misses"]) == (1, 3)
    finally:
        stream.close()


def test_only_scheduler_sessions_acknowledge_touch_or_count(daemon):
    stub = daemon.stub
    writer = attach(stub).session_id
    save(stub, writer, "k")
    for message in (pb.ClientMessage(acks=[pb.EntryRef(mm_hash="k", entry_id=1)]),
                    pb.ClientMessage(touches=[pb.Touch(mm_hash="k", entry_id=1)]),
                    pb.ClientMessage(heartbeat=pb.Heartbeat(lookups=1))):
        worker = attach(stub, engine="W").session_id
        stream = RawStream(stub, worker)
        stream.outbox.put(message)
        assert stream.next() is None  # a worker session gets no events
        assert stream.error is not None
        assert stream.error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert code_of(lambda w=worker: stub.Detach(pb.DetachRequest(session_id=w))) \
            == grpc.StatusCode.NOT_FOUND  # a session whose stream broke is over
    stats = daemon.stats()
    assert stats["loads"] == 0 and stats["hits"] == 0 and stats["entries"] == 1


def test_touches_count_loads_and_keep_entries_recent(small_daemon):
    stub = small_daemon.stub
    writer = attach(stub).session_id
    ids = {f"k{i}": save(stub, writer, f"k{i}").entry_id for i in range(4)}
    view = attach(stub, rank=None)
    stream = RawStream(stub, view.session_id)
    try:
        assert len(stream.next().ready) == 4  # the snapshot
        stream.send(touches=[pb.Touch(mm_hash="k0", entry_id=ids["k0"], loads=2),
                             pb.Touch(mm_hash="k1", entry_id=ids["k1"] + 100),  # stale
                             pb.Touch(mm_hash="zz", entry_id=1)],  # unknown
                    heartbeat=pb.Heartbeat(seq=1))
        assert stream.next().heartbeat_seq == 1  # applied
        stats = small_daemon.stats()
        # Every dispatched load counts; bytes only for entries still known.
        assert stats["loads"] == 4 and stats["bytes_loaded"] == 2 * MiB
        assert stats["namespaces"][0]["loads"] == 4
        # k0 was loaded most recently: a new save evicts the least recent, k1
        # (and waits in vain for this view's acknowledgement, then evicts k2).
        assert code_of(lambda: allocate(stub, writer, "new")) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        stream.send(heartbeat=pb.Heartbeat(seq=2))
        evicted = until_echo(stream, 2)
        assert evicted == [("k1", ids["k1"]), ("k2", ids["k2"])]
        stream.send(acks=[pb.EntryRef(mm_hash=h, entry_id=e) for h, e in evicted])
        small_daemon.wait_for(lambda: small_daemon.stats()["hidden_bytes"] == 0,
                              what="the acknowledgement")
        assert allocate(stub, writer, "new").status == pb.ALLOCATED
    finally:
        stream.close()


# Protects: only Detach says "this engine loads nothing more"; a stream that
# ends (even as a clean half-close, which a killed client's may look like)
# leaves a ghost that evictions still await for a lease.
def test_ending_the_stream_ends_the_session_as_a_ghost(daemon):
    stub = daemon.stub
    session = attach(stub, rank=None).session_id
    stream = RawStream(stub, session)
    assert stream.next().snapshot_done
    assert daemon.stats()["sessions"] == 1
    stream.half_close()
    stats = daemon.stats()
    assert stats["sessions"] == 0 and stats["ghost_sessions"] == 1
    assert stream.error is None
    assert code_of(lambda: stub.Detach(pb.DetachRequest(session_id=session))) \
        == grpc.StatusCode.NOT_FOUND


def test_detach_ends_a_scheduler_session_without_a_ghost(daemon):
    stub = daemon.stub
    session = attach(stub, rank=None).session_id
    stream = RawStream(stub, session)
    assert stream.next().snapshot_done
    stub.Detach(pb.DetachRequest(session_id=session))
    stream.half_close()  # reads until the daemon has ended the stream
    stats = daemon.stats()
    assert stats["sessions"] == 0 and stats["ghost_sessions"] == 0


def test_detach_drops_pending_saves_into_quarantine(daemon):
    stub = daemon.stub
    writer = attach(stub).session_id
    allocate(stub, writer, "k")
    assert daemon.stats()["pending_bytes"] == MiB
    stub.Detach(pb.DetachRequest(session_id=writer))
    stats = daemon.stats()
    assert stats["pending_bytes"] == 0 and stats["sessions"] == 0
    # Its copy might still be landing: the pages are not reused for a while.
    assert stats["quarantined_bytes"] == MiB and stats["free_bytes"] == 63 * MiB
    assert daemon.lookup(LAYOUT, "k")[0].state == pb.ABSENT


@pytest.fixture
def small_daemon() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="4MiB", extra=("--alloc-wait-seconds", "0.5", *raw.UNCAPPED)) as d:
        yield d


def test_a_cache_full_of_pending_saves_refuses_at_once(small_daemon):
    stub = small_daemon.stub
    writer = attach(stub).session_id
    for i in range(4):
        allocate(stub, writer, f"k{i}")
    started = time.monotonic()
    assert code_of(lambda: allocate(stub, writer, "new")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - started < 0.5  # nothing to wait for: no eviction can help
    stats = small_daemon.stats()
    assert stats["evictions"] == 0 and stats["pending_bytes"] == 4 * MiB
    assert stats["refused_saves"] == 1


# Protects: the acknowledgement is the pin: pages of an evicted entry are not
# reused while a view has not acknowledged it, and a save waits for that; a
# save that waited a tenth of --alloc-wait-seconds in vain hides one more
# round of victims rather than give up while ready entries could be evicted.
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
        assert code_of(lambda: allocate(stub, writer, "new")) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - started >= 0.4  # it waited for the acknowledgement
        (k0,) = small_daemon.lookup(LAYOUT, "k0")
        assert k0.state == pb.HIDDEN and k0.awaiting == 1  # the delegate acknowledged
        assert allocate(stub, writer, "k0").status == pb.ALREADY_HIDDEN
        stream.send(acks=[pb.EntryRef(mm_hash="k0", entry_id=k0.entry.entry_id + 1)])  # stale
        stream.send(heartbeat=pb.Heartbeat(seq=1))
        evicted = until_echo(stream, 1)
        # The least recent first; then one more round once patience ran out.
        assert evicted == [("k0", k0.entry.entry_id), ("k1", k0.entry.entry_id + 1)]
        assert small_daemon.stats()["evictions"] == 2
        assert small_daemon.lookup(LAYOUT, "k0")[0].state == pb.HIDDEN
        stub.Detach(pb.DetachRequest(session_id=silent.session_id))  # it owes nothing now
        assert [r.state for r in small_daemon.lookup(LAYOUT, "k0", "k1")] == [pb.ABSENT] * 2
        assert allocate(stub, writer, "new").status == pb.ALLOCATED
    finally:
        stream.close()
        delegate.close()


def until_echo(stream: RawStream, seq: int) -> list[tuple[str, int]]:
    """The evictions a view is told of until the echo of heartbeat `seq`."""
    evicted = []
    while True:
        message = stream.next()
        evicted += [(r.mm_hash, r.entry_id) for r in message.evicted]
        if message.heartbeat_seq >= seq:
            return evicted


def test_lookup_never_shows_pending_entries(daemon):
    stub = daemon.stub
    writer = attach(stub).session_id
    allocate(stub, writer, "p")
    save(stub, writer, "r")
    states = [r.state for r in daemon.lookup(LAYOUT, "p", "r", "x")]
    assert states == [pb.ABSENT, pb.READY, pb.ABSENT]
    assert code_of(lambda: stub.Lookup(pb.LookupRequest(namespace="", mm_hashes=["p"]))) \
        == grpc.StatusCode.INVALID_ARGUMENT


def test_sigterm_lets_in_flight_calls_finish():
    d = Daemon(cpu_bytes="4MiB", extra=("--alloc-wait-seconds", "1", *raw.UNCAPPED))
    d.start()
    region_path = d.stats()["region_path"]
    stub = d.stub
    writer = attach(stub).session_id
    for i in range(4):
        save(stub, writer, f"k{i}")
    silent = attach(stub, engine="S", rank=None)
    stream = RawStream(stub, silent.session_id)  # never acknowledges evictions
    outcome: list[Any] = []

    def allocate_late() -> None:
        try:
            outcome.append(allocate(stub, writer, "late"))
        except grpc.RpcError as exc:
            outcome.append(exc.code())

    try:
        assert stream.next().ready
        waiting = threading.Thread(target=allocate_late)
        waiting.start()
        time.sleep(0.3)  # the allocation now waits for the silent view
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        waiting.join(10)
        assert d.proc.wait(15) == 0
        # The waiting call got its own answer (the view, ended by the shutdown,
        # is still awaited as a ghost), not a connection cut off under it.
        assert outcome == [grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert not d.socket_path.exists()
        assert os.path.exists(region_path)  # kept for the next start to adopt
    finally:
        stream.close()
        d.cleanup()


def test_a_stream_that_fails_to_open_ends_its_session(daemon):
    stub = daemon.stub
    session = attach(stub, rank=None).session_id
    bad_open = pb.ClientMessage(open_session_id=session,
                                heartbeat=pb.Heartbeat(lookups=1, hits=2))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Session(iter([bad_open])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert daemon.stats()["sessions"] == 0  # not left half-open until its lease ends


def keep_beating(stream: RawStream, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        stream.send(heartbeat=pb.Heartbeat())


# Protects: a view that stops reading its stream is detached (and awaited as a
# ghost for one lease only), so it cannot hold back reclamation for everyone,
# even while its blocked stream keeps the daemon's writer waiting.
def test_a_session_that_stops_reading_is_detached_and_others_carry_on():
    # Without invariant checks: each of the ~70,000 messages below would check them.
    with Daemon(cpu_bytes="64MiB", page_bytes="4KiB", check_invariants=False,
                extra=("--lease-seconds", "2", "--quarantine-seconds", "2",
                       "--session-pending-entries", "300")) as daemon:
        scheduler = SchedulerDelegate(daemon.socket, engine_id="other", layout=LAYOUT)
        worker = WorkerDelegate(daemon.socket, engine_id="other", layout=LAYOUT)
        # A client that reads nothing and announces no more than gRPC's first
        # 64 KiB flow-control window, so the daemon's writer blocks early on.
        channel = grpc.insecure_channel(daemon.socket, options=[("grpc.http2.bdp_probe", 0)])
        slow = None
        stop = threading.Event()
        try:
            assert scheduler.link.wait_attached(10) and worker.link.wait_attached(10)
            stub = rpc.ECDaemonStub(channel)
            slow = RawStream(stub, attach(stub, engine="slow", rank=None).session_id,
                             read=False)
            writer = attach(daemon.stub, engine="W").session_id
            keys = [f"{i:04d}" + "k" * 500 for i in range(300)]  # ~600-byte ready events
            for key in keys:
                allocate(daemon.stub, writer, key, nbytes=64)
            daemon.stub.Report(pb.ReportRequest(session_id=writer, saved=keys))
            # Then its own heartbeats: each echo is one more event it does not
            # read; and it keeps heartbeating, so its lease never runs out.
            for seq in range(1, OUTBOX_MIN_EVENTS + 1000):
                slow.send(heartbeat=pb.Heartbeat(seq=seq))
            beating = threading.Thread(target=keep_beating, args=(slow, stop), daemon=True)
            beating.start()
            daemon.wait_for(lambda: daemon.components("slow") == [], timeout=30,
                            what="the slow reader to be detached")
            # Whichever comes first: its outbox overflows, or its blocked write
            # outlasts a lease (issue 40: its call is cut, not left blocked).
            log = daemon.log()
            assert "(engine 'slow' scheduler) detached: it read events too slowly" in log \
                or "(engine 'slow' scheduler) detached: its client has not read a message" \
                in log
            assert daemon.stats()["ghost_sessions"] == 1  # its engine may still be loading
            daemon.wait_for(lambda: daemon.stats()["ghost_sessions"] == 0, timeout=10,
                            what="the ghost's lease")
            # The others never noticed: same sessions, and a save-hit-load round trip.
            assert daemon.components("other") == ["scheduler", "worker 0/1"]
            data = np.arange(5000, dtype=np.float16)
            assert worker.save("after", data) and worker.flush(10)
            daemon.wait_for(lambda: staged.servable(scheduler, "after"),
                            what="the save in the view")
            result = staged.load(scheduler, worker, ["after"])
            assert np.array_equal(result.loaded["after"], data)
            # When it reads at last, its stream says why it ended.
            slow.drain()
            assert slow.error is not None
            assert slow.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            stop.set()
            if slow is not None:
                slow.close()
            channel.close()
            scheduler.close()
            worker.close()
