"""Sessions that claim another engine's identity cannot touch its loads.

Engine ids are labels: a load involves no call to the daemon, so no session
can release the pages an engine is loading. What protects a load is the
acknowledgement owed by that engine's own scheduler session, which only it
can give; another session attached "as engine X" owes and gives its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import PROTOCOL_VERSION, Layout, pb
from tests import staged
from tests.integration.daemon import Daemon
from tests.integration.raw import UNCAPPED

LAYOUT = Layout("identity-model", "float32", {"image": 4096})
ROWS = 128  # 128 x 1024 float32 = 512 KiB = 8 pages of 64 KiB
ATTACH = 15.0


def output(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, 1024)).astype(np.float32)


def wait(predicate, what: str, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def small_daemon() -> Iterator[Daemon]:
    with Daemon(cpu_bytes="2MiB", extra=UNCAPPED) as d:  # 32 pages: the 4th 8-page save evicts
        yield d


def state(daemon: Daemon, mm_hash: str) -> int:
    return daemon.lookup(LAYOUT, mm_hash)[0].state


def test_an_impostor_of_engine_x_cannot_release_xs_load(small_daemon: Daemon) -> None:
    daemon = small_daemon
    writer = WorkerDelegate(daemon.socket, engine_id="W", layout=LAYOUT)
    x_sched = SchedulerDelegate(daemon.socket, engine_id="X", layout=LAYOUT)
    x_worker = WorkerDelegate(daemon.socket, engine_id="X", layout=LAYOUT, role="consumer")
    # The impostor: a scheduler session of "engine X" that acknowledges every
    # eviction at once (it never loads), and a raw worker session of "X".
    impostor = SchedulerDelegate(daemon.socket, engine_id="X", layout=LAYOUT)
    try:
        for party in (writer, x_sched, x_worker, impostor):
            assert party.link.wait_attached(ATTACH)
        saved = output(1)
        assert writer.save("a", saved) and writer.flush(ATTACH)
        wait(lambda: x_sched.link.fresh() and x_sched.view.get("a") is not None, "a in X's view")
        hits, meta = staged.plan(x_sched, ["a"])  # X's load of "a" is now in flight
        assert hits == [True]
        assert [s.mm_hash for s in meta.loads] == ["a"]

        channel = grpc.insecure_channel(daemon.socket)
        stub = pb_stub(channel)
        forged = stub.Attach(pb.AttachRequest(
            protocol_version=PROTOCOL_VERSION, engine_id="X", role=pb.ROLE_BOTH,
            worker=pb.WorkerComponent(rank=0, world_size=1), layout=LAYOUT.to_pb()), timeout=5)
        reply = stub.Report(pb.ReportRequest(session_id=forged.session_id, saved=["a"],
                                             aborted=["a"]), timeout=5)
        assert list(reply.saved) == [pb.DUPLICATE] and list(reply.aborted) == [pb.UNKNOWN]
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Session(iter([
                pb.ClientMessage(open_session_id=forged.session_id,
                                 acks=[pb.EntryRef(mm_hash="a", entry_id=meta.loads[0].entry_id)]),
            ]), timeout=5))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        # Fill the cache until "a" is the LRU victim. X's heartbeat touches
        # its load of "a" (0.1 s after the dispatch): on a busy machine that
        # lands among these saves, making "a" recent, and entries saved
        # before the touch go first.
        for seed in range(2, 12):
            assert writer.save(f"w{seed}", output(seed))
            assert writer.flush(ATTACH)
            if state(daemon, "a") == pb.HIDDEN:
                break
        wait(lambda: state(daemon, "a") == pb.HIDDEN, "a hidden")
        time.sleep(0.5)  # the impostor's acknowledgement has long arrived by now
        assert state(daemon, "a") == pb.HIDDEN, "pages of a load in flight were released"
        result = x_worker.load(meta.loads, meta.regions)
        assert not result.failed and np.array_equal(result.loaded["a"], saved)

        staged.report(x_sched, result)  # X's own report: now X acknowledges
        wait(lambda: state(daemon, "a") == pb.ABSENT, "a reclaimed after X's report")
        channel.close()
    finally:
        for party in (impostor, x_worker, x_sched, writer):
            party.close()


def pb_stub(channel: grpc.Channel):  # type: ignore[no-untyped-def]
    from ec_protocol.protocol import rpc

    return rpc.ECDaemonStub(channel)
