"""The daemon's keyed wake-ups: a pin wakes only the reports waiting on its
own scheduler session; every wait ends by its deadline; nothing is left
registered afterwards."""

import asyncio
import time

from ec_daemon import service
from ec_daemon.service import Wakeups
from ec_protocol.protocol import pb
from tests.unit.cache_helpers import (
    PAGE,
    allocate,
    drain,
    make_cache,
    save,
    scheduler,
    tid,
    worker,
)


def run(coro):
    return asyncio.run(coro)


def test_a_wake_reaches_only_its_key():
    async def scenario():
        wakeups = Wakeups()
        deadline = time.monotonic() + 0.3
        a = asyncio.ensure_future(wakeups.wait([("pins", 1)], deadline))
        b = asyncio.ensure_future(wakeups.wait([("pins", 2)], deadline))
        await asyncio.sleep(0.01)
        wakeups.wake(("pins", 1))
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
        waits = [asyncio.ensure_future(wakeups.wait([key], deadline)) for key in ("space", 7, 8)]
        await asyncio.sleep(0.01)
        started = time.monotonic()
        wakeups.wake_all()
        assert await asyncio.gather(*waits) == [True, True, True]
        assert time.monotonic() - started < 1
        assert await wakeups.wait(["space"], time.monotonic() - 1) is False
        assert wakeups._waiters == {}

    run(scenario())


def test_a_cancelled_wait_leaves_nothing_behind():
    async def scenario():
        wakeups = Wakeups()
        wait = asyncio.ensure_future(wakeups.wait(["space", ("pins", 3)], time.monotonic() + 5))
        await asyncio.sleep(0.01)
        wait.cancel()  # the RPC was cancelled
        await asyncio.gather(wait, return_exceptions=True)
        assert wakeups._waiters == {}
        wakeups.wake("space")  # no stale future to settle

    run(scenario())


def test_a_report_waiting_on_two_schedulers_hears_either_ones_pin(monkeypatch):
    """A worker's report can hold transfers of two scheduler sessions of its
    engine (around a re-attach): a pin of the second must resolve its own."""
    monkeypatch.setattr(service, "REPORT_WAIT_SECONDS", 0.5)
    cache = make_cache(pages=16)
    old, new, w = scheduler(cache), scheduler(cache), worker(cache)  # one engine
    save(cache, w, "a")
    b = save(cache, w, "b")
    daemon = service.ECDaemonService(cache, None, lease_seconds=10, alloc_wait_seconds=1)

    async def scenario():
        report = asyncio.ensure_future(daemon.Report(
            pb.ReportRequest(session_id=w.session_id, loaded=[tid(old, 1), tid(new, 1)]), None))
        await asyncio.sleep(0.05)
        assert cache.pin(new, tid(new, 1), "b", b.entry_id)  # lands while the report waits
        return await report

    reply = run(scenario())
    assert list(reply.loaded) == [pb.NOT_HELD, pb.HELD]  # "a" was never pinned
    assert cache.pinned_pages == 0  # the held load was counted and released


def test_an_allocation_waiting_for_space_wakes_when_a_pending_save_is_aborted():
    cache = make_cache(pages=16)
    view, w = scheduler(cache), worker(cache)
    allocate(cache, w, "pending", pages=8)
    save(cache, w, "ready", pages=8)
    drain(view)
    daemon = service.ECDaemonService(cache, None, lease_seconds=10, alloc_wait_seconds=5)

    async def scenario():
        request = pb.AllocateRequest(session_id=w.session_id, mm_hash="new", nbytes=8 * PAGE,
                                     shape=[8, PAGE], dtype="uint8")
        allocation = asyncio.ensure_future(daemon.Allocate(request, None))
        await asyncio.sleep(0.05)
        assert not allocation.done()  # "ready" is hidden, awaiting the view's ack
        cache.abort(w, ["pending"])  # its pages come free: no ack needed
        return await asyncio.wait_for(allocation, 1)

    assert run(scenario()).status == pb.ALLOCATED
