"""One encode per item across the engines of a host (cold-key convergence).

Engines that miss the same new item at once ask the daemon (`ensure`, vLLM's
ensure_cache_available) before scheduling it: one is told to encode, the
others defer until its save lands and then hit. A claimant that dies passes
its claim on at once; one that never saves is waited for no longer than
the bound. A lone engine is never deferred.
"""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_daemon.core.limits import CLAIM_START_SECONDS
from ec_protocol.protocol import BOTH, CONSUMER, MAX_BATCH, PRODUCER, Role, pb
from tests import staged
from tests.integration import engines, raw
from tests.integration.daemon import Daemon
from tests.integration.engines import LAYOUT, Proc, ensure_within, wait_until

pytestmark = pytest.mark.integration
DATA = np.random.default_rng(7).integers(0, 256, (256, 2048), dtype=np.uint8)
WAIT = 20.0  # generous bounds: a busy machine is slow, never wrong


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="16MiB") as d:
        yield d


def scheduler(daemon: Daemon, engine: str, max_defer: float = 30.0,
              answer_wait: float = 0.005, role: Role = BOTH,
              save_queue_bytes: int = DATA.nbytes * 4) -> SchedulerDelegate:
    """An engine's scheduler side, with a worker rank (it hits only once its
    ranks mapped the region; `s.rank`); closing it closes both."""
    s = SchedulerDelegate(daemon.socket, engine_id=engine, layout=LAYOUT, role=role,
                          max_defer_seconds=max_defer, answer_wait_seconds=answer_wait)
    rank = WorkerDelegate(daemon.socket, engine_id=engine, layout=LAYOUT, role=role,
                          save_queue_bytes=save_queue_bytes)
    s.rank = rank  # type: ignore[attr-defined]
    close = s.close
    s.close = lambda: (rank.close(), close())  # type: ignore[method-assign]
    assert s.link.wait_attached(WAIT) and rank.link.wait_attached(WAIT)
    return s


def wanting(*schedulers: SchedulerDelegate) -> None:
    """Until every view knows another engine shares the namespace."""
    wait_until(lambda: all(s.wanting and s.serving() for s in schedulers),
               "the views never learnt that another engine shares the namespace")


def save(daemon: Daemon, engine: str, mm_hash: str) -> None:
    writer = WorkerDelegate(daemon.socket, engine_id=engine, layout=LAYOUT)
    try:
        assert writer.link.wait_attached(WAIT)
        assert writer.save(mm_hash, DATA) and writer.flush(WAIT)
        assert writer.stats["saves_done"] == 1, dict(writer.stats)
    finally:
        writer.close()


def test_engines_that_miss_one_item_at_once_encode_it_once(daemon):
    a, b, c = (scheduler(daemon, e) for e in "ABC")
    try:
        wanting(a, b, c)
        views = {"A": a, "B": b, "C": c}
        # All three miss the new item in the same step: at most one goes
        # ahead (told to encode within the step's answer wait)...
        assert sum(s.ensure(["img"]) for s in views.values()) <= 1
        # ...exactly one is told to encode; the others keep deferring.
        wait_until(lambda: any(s.ensure(["img"]) for s in views.values()),
                   "nobody was told to encode")
        time.sleep(0.3)  # the others' answers have long arrived
        through = [e for e, s in views.items() if s.ensure(["img"])]
        assert len(through) == 1, through
        encoder = through[0]
        waiters = [s for e, s in views.items() if e != encoder]
        assert not any(staged.servable(s, "img") for s in waiters)
        for s in views.values():
            s.build_step_metadata()
        # The encoder's worker saves: the waiters load it, nobody else encodes.
        save(daemon, encoder, "img")
        for s in waiters:
            wait_until(lambda s=s: s.view.get("img") is not None, "the save never landed")
            assert not s.ensure(["img"])  # its load is staged, a hit next step
            assert [spec.mm_hash for spec in s.build_step_metadata().loads] == ["img"]
        stats = daemon.stats()
        assert stats["convergence"]["claims"] == 1
        assert stats["convergence"]["waits"] >= 2
        assert sum(s.take_stats()["defer_timeouts"] for s in views.values()) == 0
    finally:
        for s in (a, b, c):
            s.close()


def test_a_claimant_killed_mid_encode_passes_its_claim_on(daemon):
    a = Proc(engines.scheduler_main, daemon.socket, "A", 1)
    a_rank = Proc(engines.worker_main, daemon.socket, "A", 0, 1, True)
    b = scheduler(daemon, "B")
    try:
        assert a.recv() == "ready" and a_rank.recv() == "ready"
        wanting(b)
        assert a.call("wait_serving")
        ok, _ = a.call("ensure", (["img"], WAIT))
        assert ok  # A asked first and holds the claim
        assert not b.ensure(["img"])
        time.sleep(0.3)
        assert not b.ensure(["img"]), "B did not wait for A's encode"
        a.signal(signal.SIGKILL)
        ok, _ = ensure_within(b, ["img"], WAIT)
        assert ok and not staged.servable(b, "img")  # B encodes now ...
        assert b.take_stats()["defer_timeouts"] == 0  # ... told to, not timed out
        assert daemon.stats()["convergence"]["handovers"] == 1
    finally:
        a.kill()
        a_rank.kill()
        b.close()


# Protects: an engine told to encode an item whose request then does not run
# (no KV room this step, or aborted) gives the claim back at once: the engine
# waiting for it encodes now, not after ec_daemon_max_defer_seconds (30 s here).
def test_a_claim_whose_request_does_not_run_passes_on_at_once(daemon):
    a = scheduler(daemon, "A")
    b = scheduler(daemon, "B")
    try:
        wanting(a, b)
        ok, _ = ensure_within(a, ["img"], WAIT)
        assert ok  # A holds the claim
        assert not b.ensure(["img"])
        time.sleep(0.3)
        assert not b.ensure(["img"]), "B did not wait for A"
        a.build_step_metadata(scheduled=set())  # A's request found no room this step
        ok, _ = ensure_within(b, ["img"], WAIT)
        assert ok and not staged.servable(b, "img")  # B encodes, told to at once
        assert not b.after_alloc("req-b", "img")  # (vLLM: its encoder output is allocated)
        b.build_step_metadata()
        assert daemon.stats()["convergence"]["releases"] == 1
        ok, _ = ensure_within(a, ["img"], 1.0)
        assert not ok  # A's request, back, waits for B's encode
        assert b.take_stats().get("defer_timeouts", 0) == 0
    finally:
        a.close()
        b.close()


def test_a_claimant_that_never_saves_is_waited_for_only_up_to_the_bound(daemon):
    a = scheduler(daemon, "A")
    b = scheduler(daemon, "B", max_defer=1.0)
    try:
        wanting(a, b)
        ok, _ = ensure_within(a, ["img"], WAIT)
        assert ok
        assert not b.ensure(["img"])
        ok, seconds = ensure_within(b, ["img"], WAIT)
        assert ok and seconds >= 0.9  # the bound, from B's first ask
        assert b.take_stats()["defer_timeouts"] == 1
    finally:
        a.close()
        b.close()


# Protects (issue 40, finding 10): a view that wants an item and never starts
# encoding it (never schedules the request, never saves, never gives it up)
# held every other engine's request for it for the waiter's whole bound (10 s,
# 199 deferred steps; a request without media failed instead). An engine that
# encodes says so when vLLM allocates the output: a claim not started within
# CLAIM_START_SECONDS passes to a waiting engine, which is told to encode.
def test_a_claimant_that_never_starts_encoding_passes_its_claim_on_within_seconds(daemon):
    a = scheduler(daemon, "A")
    b = scheduler(daemon, "B", max_defer=10.0)  # the default bound
    try:
        wanting(a, b)
        ok, _ = ensure_within(a, ["img"], WAIT)
        assert ok  # A holds the claim, and never schedules the request
        assert not b.ensure(["img"])
        ok, seconds = ensure_within(b, ["img"], 8.0)
        assert ok and seconds < 5.0, seconds  # passed on, long before B's own bound
        assert not staged.servable(b, "img")  # B encodes it
        assert b.take_stats().get("defer_timeouts", 0) == 0  # told to, not timed out
        assert daemon.stats()["convergence"]["handovers"] == 1
    finally:
        a.close()
        b.close()


def test_a_claimant_that_started_encoding_keeps_its_claim_until_its_save(daemon):
    a = scheduler(daemon, "A")
    b = scheduler(daemon, "B", max_defer=10.0)
    try:
        wanting(a, b)
        ok, _ = ensure_within(a, ["img"], WAIT)
        assert ok and not a.after_alloc("req-a", "img")  # vLLM allocated it: A encodes
        a.build_step_metadata(scheduled={"req-a"})  # (the step's end says so)
        assert not b.ensure(["img"])
        time.sleep(CLAIM_START_SECONDS + 1.0)
        assert not b.ensure(["img"]), "B did not wait for A's encode"
        save(daemon, "A", "img")
        wait_until(lambda: staged.servable(b, "img"), "A's save never reached B")
        assert daemon.stats()["convergence"]["handovers"] == 0
    finally:
        a.close()
        b.close()


def test_a_cold_miss_nobody_else_makes_is_scheduled_in_the_step_that_asked(daemon):
    """Wanting costs a round trip to the daemon, not a deferred step; the
    engine that asks second waits for the first one's encode."""
    # Bounds far above a round trip: the daemon's answers end the waits.
    a, b = (scheduler(daemon, e, answer_wait=WAIT) for e in "AB")
    try:
        wanting(a, b)
        assert a.ensure(["img"], "r1")
        assert not b.ensure(["img"], "r2")
        a.build_step_metadata()
        b.build_step_metadata()
        stats = a.take_stats()
        assert stats["answer_waits"] == 1 and "deferred" not in stats
        assert b.take_stats()["deferred"] == 1
        assert daemon.stats()["convergence"]["claims"] == 1
    finally:
        a.close()
        b.close()


def test_a_lone_engine_is_never_deferred(daemon):
    a = scheduler(daemon, "A")
    try:
        wait_until(lambda: a.view.synced and a.link.fresh(), "never synced")
        time.sleep(0.2)
        assert a.ensure(["img", "other"])
        assert "deferred" not in a.take_stats()
        assert daemon.stats()["convergence"].get("wants", 0) == 0
    finally:
        a.close()


def test_a_claimant_whose_save_is_aborted_or_skipped_passes_its_claim_on(daemon):
    """An engine that encoded but will not save (its copy failed, the cache
    refused it, its save queue was full) must not keep the others waiting."""
    a = scheduler(daemon, "A")
    b = scheduler(daemon, "B")
    writer = WorkerDelegate(daemon.socket, engine_id="A", layout=LAYOUT,
                            save_queue_bytes=DATA.nbytes)
    try:
        assert writer.link.wait_attached(WAIT)
        wanting(a, b)
        for mm_hash in ("aborted", "skipped", "too-large"):
            ok, _ = ensure_within(a, [mm_hash], WAIT)
            assert ok  # A holds the claim
            assert not b.ensure([mm_hash])
            time.sleep(0.3)
            assert not b.ensure([mm_hash]), "B did not wait for A"
            if mm_hash == "aborted":
                session_id = writer.link.attachment.session_id
                reply = writer.transport.call("Allocate", pb.AllocateRequest(
                    session_id=session_id, mm_hash=mm_hash, nbytes=4096, shape=[2, 2048],
                    dtype="uint8"))
                assert reply.status == pb.ALLOCATED
                writer.transport.call("Report", pb.ReportRequest(session_id=session_id,
                                                                 aborted=[mm_hash]))
            elif mm_hash == "skipped":  # the queue holds one save: the second is skipped
                assert writer.save("filler", DATA)
                assert not writer.save(mm_hash, DATA.copy())  # (DATA itself is held already)
                assert writer.flush(WAIT)
            else:  # larger than the whole queue, with nothing queued: reported at once
                assert not writer.save(mm_hash, np.concatenate([DATA, DATA]))
            ok, _ = ensure_within(b, [mm_hash], WAIT)
            assert ok and not staged.servable(b, mm_hash)  # B encodes, told to at once
            b.build_step_metadata()
        assert b.take_stats().get("defer_timeouts", 0) == 0
        assert daemon.stats()["convergence"]["handovers"] == 3
    finally:
        writer.close()
        a.close()
        b.close()


# E/PD: an encoder instance (a producer: it cannot load) claims each item it
# is about to encode, so a prefill/decode instance (a consumer) that misses
# the item meanwhile waits for that save instead of encoding it again.
def test_a_producer_claims_what_it_encodes_and_a_consumer_waits_for_its_save(daemon):
    e = scheduler(daemon, "E", role=PRODUCER, answer_wait=WAIT)
    pd = scheduler(daemon, "PD", role=CONSUMER)
    try:
        wanting(e, pd)
        assert e.ensure(["img"], "e1")  # never deferred, whatever the daemon says
        wait_until(lambda: daemon.stats()["convergence"]["claims"] == 1, "E claimed nothing")
        assert not pd.ensure(["img"], "p1")
        time.sleep(0.3)
        assert not pd.ensure(["img"], "p1"), "PD did not wait for E's save"
        assert pd.unobtainable(["img"], "p2") == []  # being made: not lost
        assert not e.after_alloc("e1", "img")  # E encodes it, and its worker saves it
        e.build_step_metadata()
        assert e.rank.save("img", DATA) and e.rank.flush(WAIT)
        ok, _ = ensure_within(pd, ["img"], WAIT)
        assert ok and staged.servable(pd, "img")  # PD loads E's save
        assert pd.take_stats().get("defer_timeouts", 0) == 0
        assert daemon.stats()["convergence"]["waits"] >= 1
    finally:
        e.close()
        pd.close()


# Protects: a consumer given an item without its media (vLLM's metadata-only
# items) cannot encode it; when the producer's save is dropped after it
# announced the item, the consumer learns it at once from the daemon, not
# after ec_daemon_max_defer_seconds (120 s here).
@pytest.mark.parametrize("how", ["skipped", "producer gone"])
def test_a_consumer_without_the_media_learns_at_once_that_nobody_will_make_it(daemon, how):
    e = scheduler(daemon, "E", role=PRODUCER, save_queue_bytes=DATA.nbytes)
    pd = scheduler(daemon, "PD", role=CONSUMER, max_defer=120.0)
    try:
        wanting(e, pd)
        assert e.ensure(["img"], "e1")
        wait_until(lambda: daemon.stats()["convergence"]["claims"] == 1, "E claimed nothing")
        assert pd.unobtainable(["img"], "p1") == []  # E is encoding it: PD waits
        time.sleep(0.3)
        assert pd.unobtainable(["img"], "p1") == []
        e.after_alloc("e1", "img")
        if how == "skipped":  # the save queue is full: the worker reports it dropped at once
            assert e.rank.save("filler", DATA)
            assert not e.rank.save("img", DATA.copy())
            assert e.rank.take_dropped() == ["img"]  # (what the producer's scheduler hears)
        else:
            e.close()
            e.close = lambda: None  # type: ignore[method-assign]
        started = time.monotonic()
        wait_until(lambda: pd.unobtainable(["img"], "p1") == ["img"],
                   "PD was not told that nobody will make the item", WAIT)
        assert time.monotonic() - started < WAIT < pd.max_defer_seconds
        assert not staged.servable(pd, "img")
    finally:
        e.close()
        pd.close()


# ------------------------------------------- issue 40: what one client holds


def _view(daemon: Daemon, engine: str, token: str = "") -> raw.RawStream:
    """A scheduler view attached by hand (reading its stream in a thread)."""
    session = raw.attach(daemon.stub, LAYOUT, engine=engine, rank=None, token=token)
    return raw.RawStream(daemon.stub, session.session_id)


def test_one_view_claiming_every_item_leaves_room_for_the_engines(daemon):
    """Finding 8: one view wanting 65,536 items (16 messages) filled the whole
    table of items being made, so every other engine's want went unrecorded
    (two engines missing one image both encoded it), and every session end
    walked the table. Now the hog holds its share only, and two engines
    presenting their tokens still converge on one encode."""
    hog = _view(daemon, "hog")
    for start in range(0, 1 << 16, MAX_BATCH):
        hog.send(wants=[f"item-{i}" for i in range(start, start + MAX_BATCH)])
    assert len(raw.answers_of(hog, 1 << 16, timeout=60)) == 1 << 16
    a, b = _view(daemon, "A", "a" * 32), _view(daemon, "B", "b" * 32)
    a.send(wants=["fresh"])
    assert raw.answers_of(a, 1) == {"fresh": pb.VERDICT_ENCODE}
    b.send(wants=["fresh"])
    assert raw.answers_of(b, 1) == {"fresh": pb.VERDICT_ENCODING}  # it waits for A's save
    for stream in (hog, a, b):
        stream.close()


def test_a_client_naming_the_producers_id_cannot_take_its_claim_away(daemon):
    """Finding 11: a tokenless client naming the producer's engine id and
    reporting the save aborted took the claim away (the waiting engine was
    told to encode it as well). Only the producer's own instance passes it on."""
    token = "c" * 32
    producer, waiter = _view(daemon, "P", token), _view(daemon, "W", "d" * 32)
    producer.send(wants=["img"])
    assert raw.answers_of(producer, 1) == {"img": pb.VERDICT_ENCODE}
    waiter.send(wants=["img"])
    assert raw.answers_of(waiter, 1) == {"img": pb.VERDICT_ENCODING}
    stranger = raw.attach(daemon.stub, LAYOUT, engine="P").session_id
    daemon.stub.Report(pb.ReportRequest(session_id=stranger, aborted=["img"]), timeout=5)
    with pytest.raises(queue.Empty):
        waiter.next(timeout=1.5)  # told nothing: the claim is still P's
    own = raw.attach(daemon.stub, LAYOUT, engine="P", token=token).session_id
    daemon.stub.Report(pb.ReportRequest(session_id=own, aborted=["img"]), timeout=5)
    assert raw.answers_of(waiter, 1) == {"img": pb.VERDICT_ENCODE}
    for stream in (producer, waiter):
        stream.close()
