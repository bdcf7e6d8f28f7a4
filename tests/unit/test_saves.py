"""The daemon's saves on the session stream (`ec_daemon.plane.saves`), driven
through the data plane as the stream handler drives it: each allocation
and report answered by its request id (a refusal too), an allocation that
waits for pages answered later while the stream goes on, and the same
rules as the unary calls."""

from __future__ import annotations

import asyncio
import time

import pytest

from ec_daemon.core.events import (
    AllocationAnswer,
    AllocOutcome,
    ClientMessage,
    Heartbeat,
    HeartbeatEcho,
    ReportAnswer,
    ReportStatus,
    SaveAllocate,
    SaveReport,
)
from ec_daemon.core.records import State
from ec_daemon.errors import FailedPrecondition, InvalidArgument
from ec_daemon.plane import room as room_module
from ec_daemon.plane.room import SPACE
from ec_daemon.serving import wire
from ec_protocol.protocol import pb
from tests.unit.cache_helpers import PAGE, allocate, drain, make_plane, save, scheduler, worker


def message(*, allocations=(), reports=(), beat=None) -> ClientMessage:
    return ClientMessage(acks=[], holds=[], touches=[], wants=[], releases=[], yields=[],
                         heartbeat=beat, allocations=list(allocations), reports=list(reports))


def ask(request_id: int, mm_hash: str, pages: int = 1) -> SaveAllocate:
    return SaveAllocate(request_id, mm_hash, pages * PAGE, (pages, PAGE), "uint8")


def test_allocations_and_reports_are_answered_by_request_id():
    plane = make_plane(pages=16)
    cache = plane.cache
    w = worker(cache)
    save(cache, w, "ready")
    plane.apply(w, message(allocations=[ask(7, "a", 2), ask(8, "ready"), ask(9, "b")]))
    answers = {a.request_id: a for a in drain(w)}
    assert answers[7].result.outcome is AllocOutcome.ALLOCATED
    assert answers[8].result.outcome is AllocOutcome.ALREADY_READY  # said so, not allocated
    assert answers[9].result.outcome is AllocOutcome.ALLOCATED
    assert cache.state_of("ns", "a") is State.PENDING  # never served until reported
    plane.apply(w, message(reports=[SaveReport(3, "a", True), SaveReport(0, "b", False),
                                    SaveReport(4, "never", True)]))
    assert drain(w) == [ReportAnswer(3, ReportStatus.ACCEPTED),
                        ReportAnswer(4, ReportStatus.UNKNOWN)]  # the abort: no id, no answer
    assert cache.state_of("ns", "a") is State.READY and cache.state_of("ns", "b") is None


def test_reports_are_applied_before_the_allocations_of_their_message():
    plane = make_plane(pages=2)
    cache = plane.cache
    w = worker(cache)
    allocate(cache, w, "first", pages=2)
    plane.apply(w, message(reports=[SaveReport(0, "first", False)],
                           allocations=[ask(1, "second", 2)]))
    (answer,) = drain(w)
    assert answer.result.outcome is AllocOutcome.ALLOCATED


def test_a_refusal_is_an_answer_and_the_stream_goes_on():
    plane = make_plane(pages=4)
    cache = plane.cache
    w = worker(cache)
    plane.apply(w, message(allocations=[ask(1, "huge", 5), ask(2, "", 1), ask(3, "fine")]))
    huge, empty, fine = drain(w)
    assert wire.status_code(huge.error).name == "RESOURCE_EXHAUSTED"
    assert wire.status_code(empty.error).name == "INVALID_ARGUMENT"
    assert fine.result.outcome is AllocOutcome.ALLOCATED
    converted = wire.daemon_message([huge, fine])
    assert [a.request_id for a in converted.allocations] == [1, 3]
    assert converted.allocations[0].error_code == 8 and converted.allocations[0].error
    assert converted.allocations[1].status == pb.ALLOCATED and converted.allocations[1].extents


def test_only_worker_sessions_of_saving_engines_save_on_the_stream():
    plane = make_plane()
    cache = plane.cache
    with pytest.raises(FailedPrecondition):
        plane.apply(scheduler(cache), message(allocations=[ask(1, "a")]))
    consumer = worker(cache, engine="C", role="consumer")
    plane.apply(consumer, message(allocations=[ask(1, "a")]))
    (answer,) = drain(consumer)
    assert wire.status_code(answer.error).name == "FAILED_PRECONDITION"
    w = worker(cache)
    with pytest.raises(InvalidArgument):  # a bad report key changes nothing
        plane.apply(w, message(reports=[SaveReport(1, "", True)]))


def test_a_stream_allocation_without_a_request_id_is_refused_whole():
    request = pb.ClientMessage(allocations=[pb.SaveAllocate(mm_hash="a", nbytes=8, shape=[8],
                                                            dtype="uint8")])
    with pytest.raises(InvalidArgument):
        wire.client_message(request)


def test_an_allocation_that_waits_for_pages_is_answered_later_and_the_stream_goes_on():
    """A cache of 16 pages: 8 pending, 8 ready and seen by a view, so a save
    of 8 pages hides the ready entry and waits for the view's ack."""
    plane = make_plane(pages=16)
    cache = plane.cache
    view, w = scheduler(cache), worker(cache)
    allocate(cache, w, "pending", pages=8)
    ready = save(cache, w, "ready", pages=8)
    drain(view)

    async def scenario():
        plane.apply(w, message(allocations=[ask(5, "new", 8)]))
        deadline = time.monotonic() + 5
        while SPACE not in plane.room.wakeups._waiters:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        plane.apply(w, message(beat=None, allocations=[ask(6, "ready")]))  # goes on meanwhile
        assert [a.request_id for a in drain(w)] == [6]
        cache.views.acknowledge(view, [("ready", ready.entry_id)])
        while not w.outbox:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)

    asyncio.run(scenario())
    (answer,) = drain(w)
    assert answer.request_id == 5 and answer.result.outcome is AllocOutcome.ALLOCATED


def test_a_session_that_ends_while_its_allocation_waits_allocates_nothing():
    plane = make_plane(pages=16)
    cache = plane.cache
    view, w = scheduler(cache), worker(cache)
    allocate(cache, w, "pending", pages=8)
    save(cache, w, "ready", pages=8)

    async def scenario():
        plane.apply(w, message(allocations=[ask(5, "new", 8)]))
        while SPACE not in plane.room.wakeups._waiters:
            await asyncio.sleep(0.005)
        plane.end_session(w)  # its pending save is quarantined
        cache.views.acknowledge(view, [(e.mm_hash, e.entry_id) for e in list(view.awaiting)])
        for _ in range(20):
            await asyncio.sleep(0.005)

    asyncio.run(scenario())
    assert cache.state_of("ns", "new") is None and not plane.saves._waiting
    assert cache.table.pending_pages == 0


def test_a_session_has_at_most_so_many_allocations_waiting_for_pages():
    """A misbehaving client cannot park thousands of waiting allocations
    (each woken by every page that comes back): past the bound one is
    refused at once, and the bound frees as the waits end."""
    plane = make_plane(pages=16, alloc_wait_seconds=0.2)
    cache = plane.cache
    view, w = scheduler(cache), worker(cache)
    allocate(cache, w, "pending", pages=8)
    save(cache, w, "ready", pages=8)
    drain(view)
    bound = room_module.WAITING_PER_SESSION

    async def scenario():
        plane.apply(w, message(allocations=[ask(i + 1, f"new{i}", 8) for i in range(bound + 1)]))
        (refused,) = drain(w)
        assert refused.request_id == bound + 1 and refused.result is None
        assert wire.status_code(refused.error).name == "RESOURCE_EXHAUSTED"
        assert len(plane.saves._waiting) == bound
        deadline = time.monotonic() + 10
        while plane.saves._waiting:  # the waits end (refused after the wait)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert len(drain(w)) == bound and plane.room.waiting == 0

    asyncio.run(scenario())


def test_a_heartbeat_on_a_saving_message_is_still_echoed():
    plane = make_plane()
    cache = plane.cache
    w = worker(cache)
    plane.apply(w, message(allocations=[ask(1, "a")], beat=Heartbeat(9, 0, 0)))
    events = drain(w)
    assert isinstance(events[0], AllocationAnswer) and events[-1] == HeartbeatEcho(9)
