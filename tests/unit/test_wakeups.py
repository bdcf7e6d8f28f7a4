"""The daemon's keyed wake-ups: a pin wakes only the reports waiting on its
own scheduler session; every wait ends by its deadline; nothing is left
registered afterwards."""

import asyncio
import time

from ec_daemon.service import Wakeups


def run(coro):
    return asyncio.run(coro)


def test_a_wake_reaches_only_its_key():
    async def scenario():
        wakeups = Wakeups()
        deadline = time.monotonic() + 0.3
        a = asyncio.ensure_future(wakeups.wait(("pins", 1), deadline))
        b = asyncio.ensure_future(wakeups.wait(("pins", 2), deadline))
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
        waits = [asyncio.ensure_future(wakeups.wait(key, deadline)) for key in ("space", 7, 8)]
        await asyncio.sleep(0.01)
        started = time.monotonic()
        wakeups.wake_all()
        assert await asyncio.gather(*waits) == [True, True, True]
        assert time.monotonic() - started < 1
        assert await wakeups.wait("space", time.monotonic() - 1) is False
        assert wakeups._waiters == {}

    run(scenario())


def test_a_cancelled_wait_leaves_nothing_behind():
    async def scenario():
        wakeups = Wakeups()
        wait = asyncio.ensure_future(wakeups.wait("space", time.monotonic() + 5))
        await asyncio.sleep(0.01)
        wait.cancel()  # the RPC was cancelled
        await asyncio.gather(wait, return_exceptions=True)
        assert wakeups._waiters == {}
        wakeups.wake("space")  # no stale future to settle

    run(scenario())
