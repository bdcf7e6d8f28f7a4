"""The daemon's keyed wake-ups, and the one call that waits on them: an
allocation whose victims await acknowledgements wakes when pages come back
(an acknowledgement, an abort, a ghost's lease running out) and is refused
at its deadline. Every wait ends by its deadline and leaves nothing
registered."""

import asyncio
import time

import pytest

from ec_daemon.plane.room import SPACE
from ec_daemon.plane.wakeups import Wakeups
from ec_daemon.serving.service import ECDaemonService
from ec_protocol.protocol import pb
from tests.unit.cache_helpers import (
    PAGE,
    FakeClock,
    allocate,
    drain,
    make_plane,
    save,
    scheduler,
    worker,
)


def run(coro):
    return asyncio.run(coro)


class Aborted(Exception):
    pass


class FakeContext:
    """Records the status a handler ends its call with."""

    def __init__(self):
        self.code = None
        self.details = ""

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


def test_a_wake_reaches_only_its_key():
    async def scenario():
        wakeups = Wakeups()
        deadline = time.monotonic() + 0.3
        a = asyncio.ensure_future(wakeups.wait([("key", 1)], deadline))
        b = asyncio.ensure_future(wakeups.wait([("key", 2)], deadline))
        await asyncio.sleep(0.01)
        wakeups.wake(("key", 1))
        await asyncio.sleep(0.01)
        assert a.done() and a.result() is True
        assert not b.done()
        assert await b is False  # its deadline passed
        assert wakeups._waiters == {}

    run(scenario())


def test_wake_all_ends_every_wait_and_past_deadlines_return_at_once():
    async def scenario():
        wakeups = Wakeups()
        deadline = time.monotonic() + 5
        waits = [asyncio.ensure_future(wakeups.wait([key], deadline)) for key in (SPACE, 7, 8)]
        await asyncio.sleep(0.01)
        started = time.monotonic()
        wakeups.wake_all()
        assert await asyncio.gather(*waits) == [True, True, True]
        assert time.monotonic() - started < 1
        assert await wakeups.wait([SPACE], time.monotonic() - 1) is False
        assert wakeups._waiters == {}

    run(scenario())


def test_a_cancelled_wait_leaves_nothing_behind():
    async def scenario():
        wakeups = Wakeups()
        wait = asyncio.ensure_future(wakeups.wait([SPACE, ("key", 3)], time.monotonic() + 5))
        await asyncio.sleep(0.01)
        wait.cancel()  # the RPC was cancelled
        await asyncio.gather(wait, return_exceptions=True)
        assert wakeups._waiters == {}
        wakeups.wake(SPACE)  # no stale future to settle

    run(scenario())


def full_cache(alloc_wait_seconds=5.0, clock=None):
    """A cache of 16 pages: 8 pending, 8 ready and seen by a view, so a save
    of 8 pages hides the ready entry and waits for the view's ack."""
    plane = make_plane(pages=16, clock=clock, alloc_wait_seconds=alloc_wait_seconds)
    cache = plane.cache
    view, w = scheduler(cache), worker(cache)
    allocate(cache, w, "pending", pages=8)
    ready = save(cache, w, "ready", pages=8)
    drain(view)
    daemon = ECDaemonService(plane, pb.Region())
    request = pb.AllocateRequest(session_id=w.session_id, mm_hash="new", nbytes=8 * PAGE,
                                 shape=[8, PAGE], dtype="uint8")
    return cache, daemon, view, w, ready, request


def waits_then(daemon, request, action):
    """Start the allocation, check it waits, run `action`, then its reply."""
    async def scenario():
        allocation = asyncio.ensure_future(daemon.Allocate(request, FakeContext()))
        deadline = time.monotonic() + 5
        while SPACE not in daemon.plane.room.wakeups._waiters:  # until it waits for pages
            assert not allocation.done() and time.monotonic() < deadline
            await asyncio.sleep(0.005)
        action()
        return await asyncio.wait_for(allocation, 1)

    return run(scenario())


def test_a_waiting_allocation_wakes_when_the_view_acknowledges():
    cache, daemon, view, _, ready, request = full_cache()
    reply = waits_then(daemon, request,
                       lambda: cache.views.acknowledge(view, [("ready", ready.entry_id)]))
    assert reply.status == pb.ALLOCATED and reply.extents[0].offset == 8 * PAGE


def test_a_waiting_allocation_wakes_when_a_pending_save_is_aborted():
    cache, daemon, _, w, _, request = full_cache()
    reply = waits_then(daemon, request, lambda: cache.abort(w, ["pending"]))
    assert reply.status == pb.ALLOCATED and reply.extents[0].offset == 0


def test_a_waiting_allocation_wakes_when_a_ghost_is_released():
    clock = FakeClock()
    cache, daemon, view, _, _, request = full_cache(clock=clock)
    cache.end_session(view)  # the stream was lost: awaited as a ghost

    def lease_over():
        clock.now += cache.sessions.lease_seconds
        assert cache.release_ghosts() == [view]

    assert waits_then(daemon, request, lease_over).status == pb.ALLOCATED


def test_an_allocation_whose_victims_are_never_acknowledged_is_refused_at_its_deadline():
    cache, daemon, *_, request = full_cache(alloc_wait_seconds=0.2)
    context = FakeContext()

    async def scenario():
        started = time.monotonic()
        with pytest.raises(Aborted):
            await daemon.Allocate(request, context)
        return time.monotonic() - started

    waited = run(scenario())
    assert 0.15 < waited < 5
    assert context.code.name == "RESOURCE_EXHAUSTED"
    assert "not acknowledged in time" in context.details
    assert cache.counters["refused_saves"] == 1 and daemon.plane.room.wakeups._waiters == {}
