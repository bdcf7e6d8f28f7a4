"""Tensor parallelism at contract level: one scheduler side (ranks=2) and two
worker ranks of one engine, each in its own process, against a real daemon.

An entry is evicted while its load is in flight (a third writer asks for
the whole cache). The daemon may reuse its pages only once the engine's view
acknowledged the eviction, and the view does so only when every rank
reported the load: the pages stay hidden until both reports arrived, in
either order. A rank that shows up late maps the region named in the step
metadata and loads the right bytes; a rank that dies leaves the other rank's
load and the hidden pages untouched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ec_client.worker_side.worker import WorkerDelegate
from tests.integration import engines
from tests.integration.daemon import Daemon
from tests.integration.engines import LAYOUT, Proc
from tests.integration.raw import UNCAPPED, Filler, MiB

pytestmark = pytest.mark.integration
ENGINE = "tp-engine"
KEY = "tp-key"
DATA = np.random.default_rng(11).integers(0, 256, (MiB // 1024, 1024), dtype=np.uint8)


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="4MiB", extra=("--alloc-wait-seconds", "0.2", *UNCAPPED)) as d:
        yield d


class Engine:
    """The scheduler side and worker ranks of ENGINE, plus a writer of
    another engine that saved KEY, and a filler that evicts."""

    def __init__(self, daemon: Daemon, ranks: tuple[int, ...]) -> None:
        self.daemon = daemon
        self.procs: list[Proc] = []
        self.writer = WorkerDelegate(daemon.socket, engine_id="writer", layout=LAYOUT,
                                     role="producer")
        assert self.writer.link.wait_attached(10)
        assert self.writer.save(KEY, DATA) and self.writer.flush(10)
        assert self.writer.stats["saves_done"] == 1
        self.filler = Filler(daemon.stub, LAYOUT)
        self.scheduler = self.start(engines.scheduler_main, daemon.socket, ENGINE, 2)
        self.ranks = {r: self.start_rank(r) for r in ranks}

    def start(self, target: Any, *args: Any) -> Proc:
        proc = Proc(target, *args)
        self.procs.append(proc)
        assert proc.recv() == "ready"
        return proc

    def start_rank(self, rank: int, attached: bool = True) -> Proc:
        return self.start(engines.worker_main, self.daemon.socket, ENGINE, rank, 2, attached)

    def dispatch(self) -> Any:
        """The step metadata of one load of KEY."""
        assert self.scheduler.call("wait_hit", KEY)
        hits, metadata = self.scheduler.call("step", ([KEY], True))
        assert hits == [True] and len(metadata.loads) == 1
        return metadata

    def evict(self) -> None:
        """Hide KEY (its load is in flight: the view withholds the acknowledgement)."""
        assert not self.filler.evict_all(self.daemon.stats())
        assert self.hidden()

    def hidden(self) -> bool:
        """Is KEY hidden, its pages not reused, awaiting exactly our view?"""
        (result,) = self.daemon.lookup(LAYOUT, KEY)
        if result.state != engines.pb.HIDDEN:
            return False
        assert result.awaiting == 1
        # The whole cache is asked for again: refused while KEY holds its pages.
        return not self.filler.take(self.daemon.stats()["capacity_bytes"], keep=False)

    def reclaimed(self) -> bool:
        return self.daemon.lookup(LAYOUT, KEY)[0].state == engines.pb.ABSENT

    def load(self, rank: int, metadata: Any) -> list[int]:
        done, failed, loaded = self.ranks[rank].call("load", (metadata.loads, metadata.regions))
        assert failed == [] and done == [metadata.loads[0].transfer_id]
        assert loaded == {KEY: engines.describe(DATA)}  # never other bytes
        return done

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        self.writer.close()
        self.filler.close()


@pytest.fixture
def engine(daemon: Daemon, request: Any) -> Iterator[Engine]:
    e = Engine(daemon, request.param)
    yield e
    e.close()


# Protects: with TP, the eviction of an entry under a load waits for every
# rank's report (SchedulerDelegate(ranks=2) counts them), whichever comes first.
@pytest.mark.parametrize("engine", [(0, 1)], indirect=True)
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_pages_stay_hidden_until_both_ranks_reported(engine, order):
    metadata = engine.dispatch()
    engine.evict()
    first, second = order
    done = engine.load(first, metadata)  # copies after the eviction: the bytes are intact
    assert engine.scheduler.call("report", (done, [])) == 1
    assert engine.hidden()  # one rank reported: the pages are still held
    done = engine.load(second, metadata)
    assert engine.scheduler.call("report", (done, [])) == 0
    engine.daemon.wait_for(engine.reclaimed, what="reclamation after both reports")
    assert engine.filler.take(engine.daemon.stats()["capacity_bytes"], keep=False)


# Protects: hits are answered only once every rank of the engine mapped the
# region: a rank that cannot (another node, another container's /dev/shm)
# would turn the first hit into a failed load; the engine misses instead.
@pytest.mark.parametrize("engine", [(0,)], indirect=True)
def test_hits_are_answered_only_once_every_rank_mapped_the_region(engine):
    for _ in range(20):
        hits, metadata = engine.scheduler.call("step", ([KEY], True))
        assert hits == [False] and metadata.loads == []
        time.sleep(0.05)
    engine.ranks[1] = engine.start_rank(1)
    engine.dispatch()  # hits now
    engine.ranks[1].kill()  # a rank died: misses again
    engine.daemon.wait_for(lambda: engine.daemon.components(ENGINE) == ["scheduler", "worker 0/2"],
                           what="the dead rank's session to end")
    engine.daemon.wait_for(lambda: engine.scheduler.call("step", ([KEY], False))[0] == [False],
                           what="the engine to miss again")


# Protects: a load carries its region (path, generation, stamp table offset),
# so a rank needs no session of its own to read it, whenever it starts.
@pytest.mark.parametrize("engine", [(0, 1)], indirect=True)
def test_a_rank_restarted_after_the_dispatch_loads_from_the_region_in_the_metadata(engine):
    metadata = engine.dispatch()
    engine.evict()
    done = engine.load(0, metadata)
    assert engine.scheduler.call("report", (done, [])) == 1
    engine.ranks[1].kill()  # it dies; its successor starts, not attached yet
    late = engine.start_rank(1, attached=False)
    engine.ranks[1] = late
    assert late.call("generations") == []
    done = engine.load(1, metadata)
    (generation,) = metadata.regions
    assert late.call("generations") == [generation]
    assert isinstance(late.call("attach"), int)  # and it can still attach afterwards
    assert engine.scheduler.call("report", (done, [])) == 0
    engine.daemon.wait_for(engine.reclaimed, what="reclamation after both reports")


# Protects: a rank that dies mid-copy releases nothing: the surviving rank's
# load returns the saved bytes and the pages stay hidden (the view still
# waits for the dead rank's report) until the engine goes away.
@pytest.mark.parametrize("engine", [(0, 1)], indirect=True)
def test_a_rank_killed_mid_load_leaves_the_other_ranks_load_protected(engine):
    metadata = engine.dispatch()
    engine.evict()
    sessions = engine.daemon.stats()["sessions"]
    victim = engine.ranks[1]
    assert victim.call("copy_forever", (metadata.loads[0], metadata.regions)) == "copying"
    victim.kill()
    engine.daemon.wait_for(lambda: engine.daemon.stats()["sessions"] == sessions - 1,
                           what="the dead rank's session to end")
    assert engine.hidden()
    done = engine.load(0, metadata)
    assert engine.scheduler.call("report", (done, [])) == 1
    assert engine.hidden()
    # The engine shuts down cleanly: its view is gone, nothing is awaited any more.
    assert engine.scheduler.call("close") == "closed"
    engine.daemon.wait_for(engine.reclaimed, what="reclamation after the engine left")
    assert engine.daemon.stats()["ghost_sessions"] == 0
