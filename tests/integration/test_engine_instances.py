"""Engine instances against a real daemon: the rank count and the adoption
ghost belong to one engine instance (its scheduler's token), not to an
engine id. Two engines configured with the same engine id, or any client of
the socket attaching a worker under an engine's id, never make an engine
answer hits before its own ranks all mapped the region, and one engine's
re-attach after a warm restart never releases the other's ghost."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from ec_client.engine_token import derived_engine_token, new_engine_token
from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import PROTOCOL_VERSION, pb
from tests.integration.daemon import Daemon, short_tmpdir
from tests.integration.engines import LAYOUT
from tests.integration.raw import UNCAPPED, Filler, RawStream, attach

pytestmark = pytest.mark.integration
ENGINE = "shared-id"  # the engine id both engines were configured with
KEY = "instance-key"
DATA = np.random.default_rng(5).integers(0, 256, (64, 1024), dtype=np.uint8)
WAIT = 20.0


class Delegates:
    """Delegates made in the test, all closed at the end."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.made: list[SchedulerDelegate | WorkerDelegate] = []

    def scheduler(self, token: str, ranks: int = 2) -> SchedulerDelegate:
        scheduler = SchedulerDelegate(self.daemon.socket, engine_id=ENGINE, layout=LAYOUT,
                                      ranks=ranks, engine_token=token)
        self.made.append(scheduler)
        self.daemon.wait_for(lambda: scheduler.view.synced, WAIT, "the view's snapshot")
        return scheduler

    def rank(self, rank: int, token: str, world: int = 2,
             engine: str = ENGINE) -> WorkerDelegate:
        """A worker rank that learnt `token` from its scheduler's step metadata."""
        worker = WorkerDelegate(self.daemon.socket, engine_id=engine, layout=LAYOUT,
                                rank=rank, world_size=world)
        self.made.append(worker)
        assert worker.link.wait_attached(WAIT)
        worker.join(token)
        return worker

    def close(self) -> None:
        for delegate in self.made:
            delegate.close()


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="4MiB") as d:
        yield d


@pytest.fixture
def delegates(daemon: Daemon) -> Iterator[Delegates]:
    made = Delegates(daemon)
    yield made
    made.close()


def told(scheduler: SchedulerDelegate, mapped: int, daemon: Daemon) -> None:
    daemon.wait_for(lambda: scheduler.mapped_ranks == (mapped, 2), WAIT,
                    f"the view to be told {mapped} of 2 ranks mapped")


def stays(scheduler: SchedulerDelegate, mapped: int, seconds: float = 1.0) -> None:
    """The view's count does not move for `seconds` (a count the daemon
    would send for a stranger's rank arrives within milliseconds)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert scheduler.mapped_ranks == (mapped, 2)
        assert not scheduler.serving()
        time.sleep(0.05)


# Protects: the rank count of an engine is its own instance's. Before, the
# daemon counted distinct ranks per engine id: engine B with one rank of two
# mapped counted engine A's rank 1 and answered hits its missing rank would
# fail to load (the engine stops).
def test_two_engines_configured_with_one_engine_id_count_only_their_own_ranks(daemon,
                                                                            delegates):
    a, b = new_engine_token(), new_engine_token()
    engine_a, engine_b = delegates.scheduler(a), delegates.scheduler(b)
    delegates.rank(0, a)
    delegates.rank(1, a)
    delegates.rank(0, b)
    told(engine_a, 2, daemon)
    daemon.wait_for(engine_a.serving, WAIT, "engine A to answer hits")
    told(engine_b, 1, daemon)
    stays(engine_b, 1)
    assert daemon.components(ENGINE) == ["scheduler", "scheduler", "worker 0/2", "worker 0/2",
                                         "worker 1/2"]
    delegates.rank(1, b)  # its own rank 1 maps: now it is complete
    told(engine_b, 2, daemon)
    daemon.wait_for(engine_b.serving, WAIT, "engine B to answer hits")


# Protects: any client of the socket can attach a worker under an engine's
# id. Without the engine's token (which only its own workers get, in the step
# metadata) it never counts as one of the engine's ranks, whatever rank it
# claims; a token of the wrong form is refused at Attach and on the stream.
def test_a_stranger_attaching_a_worker_under_the_engines_id_does_not_count(daemon, delegates):
    token = new_engine_token()
    engine = delegates.scheduler(token)
    delegates.rank(0, token)
    told(engine, 1, daemon)
    streams = []
    for guess in ("", new_engine_token()):  # no token, and a well-formed wrong one
        session = attach(daemon.stub, LAYOUT, engine=ENGINE, rank=1, world=2)
        stream = RawStream(daemon.stub, session.session_id)
        streams.append(stream)
        if guess:
            stream.outbox.put(pb.ClientMessage(engine_token=guess))
    daemon.wait_for(lambda: daemon.components(ENGINE).count("worker 1/2") == 2, WAIT,
                    "the strangers' sessions")
    stays(engine, 1)
    # A scheduler names its token at Attach only: on its stream it is refused.
    view = RawStream(daemon.stub, attach(daemon.stub, LAYOUT, engine=ENGINE,
                                         rank=None).session_id)
    view.outbox.put(pb.ClientMessage(engine_token=token))
    daemon.wait_for(lambda: view.error is not None, WAIT, "the scheduler's stream to be refused")
    assert view.error is not None and view.error.code() == grpc.StatusCode.FAILED_PRECONDITION
    bad = attach_error(daemon, "X" * 32)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "engine_token must be 32 lowercase hex digits" in (bad.details() or "")
    for stream in streams:
        stream.outbox.put(None)
    delegates.rank(1, token)
    told(engine, 2, daemon)


# Protects: --max-sessions-per-engine counts by the engine instance presented
# at Attach. Before, it counted by engine id: a client of the socket holding
# 64 attaches under an engine's id kept that engine from (re-)attaching at all.
def test_a_stranger_filling_the_engines_session_cap_leaves_the_engine_its_room():
    with Daemon(cpu_bytes="4MiB", extra=("--max-sessions-per-engine", "3")) as daemon:
        squatters = [attach(daemon.stub, LAYOUT, engine=ENGINE, rank=r % 2, world=2)
                     for r in range(3)]
        with pytest.raises(grpc.RpcError) as refused:
            attach(daemon.stub, LAYOUT, engine=ENGINE, rank=1, world=2)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-sessions-per-engine 3" in (refused.value.details() or "")
        made = Delegates(daemon)
        try:
            token = new_engine_token()
            engine = made.scheduler(token)
            for rank in (0, 1):
                made.made.append(WorkerDelegate(daemon.socket, engine_id=ENGINE, layout=LAYOUT,
                                                rank=rank, world_size=2, engine_token=token))
            told(engine, 2, daemon)
            daemon.wait_for(engine.serving, WAIT, "the engine to answer hits")
            assert len(squatters) == 3 and daemon.stats()["refused_attaches"] == 1
        finally:
            made.close()


def attach_error(daemon: Daemon, token: str) -> grpc.RpcError:
    request = pb.AttachRequest(protocol_version=PROTOCOL_VERSION, engine_id=ENGINE,
                               role=pb.ROLE_BOTH, layout=LAYOUT.to_pb(),
                               worker=pb.WorkerComponent(rank=1, world_size=2,
                                                         engine_token=token))
    with pytest.raises(grpc.RpcError) as raised:
        daemon.stub.Attach(request, timeout=5)
    return raised.value


# Protects: an engine's processes derive its token alike (a private secret
# of the user), so its workers count from their attach and an engine started
# on a warm cache answers hits from its first step; another engine with the
# same engine id (another vLLM instance) derives another token.
def test_ranks_that_derive_the_token_count_before_the_first_step(daemon, delegates,
                                                                 tmp_path: Path):
    secret = tmp_path / "runtime"
    token = derived_engine_token(ENGINE, "1733200000000000001", secret)
    other = derived_engine_token(ENGINE, "1733200000000000002", secret)
    assert token and other and token != other
    engine = delegates.scheduler(token)
    stranger = delegates.scheduler(other)
    for rank in (0, 1):
        worker = WorkerDelegate(daemon.socket, engine_id=ENGINE, layout=LAYOUT, rank=rank,
                                world_size=2, engine_token=token)
        delegates.made.append(worker)
    told(engine, 2, daemon)  # no step ran: nobody called join
    daemon.wait_for(engine.serving, WAIT, "the engine to answer hits")
    told(stranger, 0, daemon)
    stays(stranger, 0)


# Protects: a worker re-attaching (a daemon restart) presents the token it
# learnt, so its engine answers hits again without waiting for a step.
def test_a_rank_that_learnt_the_token_counts_again_after_a_daemon_restart(shm_folder: Path):
    folder = short_tmpdir()
    flags = ("--lease-seconds", "5")
    first = Daemon(folder=folder, shm_dir=str(shm_folder), cpu_bytes="4MiB", extra=flags)
    second = Daemon(folder=folder, shm_dir=str(shm_folder), cpu_bytes="4MiB", extra=flags)
    made = Delegates(first.start())
    try:
        token = new_engine_token()
        engine = made.scheduler(token, ranks=1)
        made.rank(0, token, world=1)
        first.wait_for(engine.serving, WAIT, "the engine to answer hits")
        first.kill()
        second.start()
        # Nobody calls join again: the re-attach itself presents the token.
        second.wait_for(lambda: engine.link.attachment is not None and engine.serving(), WAIT,
                        "the engine to answer hits from the restarted daemon")
    finally:
        made.close()
        second.cleanup()
        first.cleanup()


# Protects: the previous daemon's view of each engine instance is a ghost of
# its own. Before, both engines' views were journalled as one ("shared-id"),
# and engine B's re-attach released the one ghost while engine A, frozen
# across the restart, could still be loading: A's entries' pages could be
# reused under its load.
def test_one_engines_reattach_keeps_the_ghost_of_another_engine_with_the_same_id(
        shm_folder: Path):
    folder = short_tmpdir()
    flags = ("--lease-seconds", "60", "--quarantine-seconds", "60", "--alloc-wait-seconds", "0.2",
             *UNCAPPED)
    first = Daemon(folder=folder, shm_dir=str(shm_folder), cpu_bytes="4MiB", extra=flags)
    second = Daemon(folder=folder, shm_dir=str(shm_folder), cpu_bytes="4MiB", extra=flags)
    made = Delegates(first.start())
    try:
        writer = WorkerDelegate(first.socket, engine_id="writer", layout=LAYOUT,
                                role="producer")
        made.made.append(writer)
        assert writer.link.wait_attached(WAIT)
        assert writer.save(KEY, DATA) and writer.flush(WAIT)
        engine_a = made.scheduler(new_engine_token())
        engine_b = made.scheduler(new_engine_token())
        first.wait_for(lambda: engine_a.view.get(KEY) is not None, WAIT, "A's view of the key")
        first.kill()
        engine_a.close()  # frozen across the restart: it never comes back
        second.start()
        second.wait_for(lambda: engine_b.link.attachment is not None and engine_b.view.synced,
                        WAIT, "engine B to re-attach")
        assert second.stats()["ghost_sessions"] == 1  # A's ghost; B's own was released
        filler = Filler(second.stub, LAYOUT)
        try:
            assert not filler.evict_all(second.stats())  # KEY's pages await A's ghost
            (result,) = second.lookup(LAYOUT, KEY)
            assert (result.state, result.awaiting) == (pb.HIDDEN, 1)
        finally:
            filler.close()
    finally:
        made.close()
        second.cleanup()
        first.cleanup()
