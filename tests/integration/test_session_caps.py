"""What one socket client may hold, against the real daemon: pending saves
per session (unary and stream allocations, the quarantine a re-attach leaves
behind) and sessions in total and per engine, with Stats still answering
after thousands of attaches."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from ec_client.worker_side.worker import WorkerDelegate
from ec_daemon.core.sessions import PREEMPTIBLE_SECONDS
from ec_daemon.core.stats import LISTED_NAMESPACES
from ec_protocol.protocol import PROTOCOL_VERSION, Layout, pb
from tests.integration import engines
from tests.integration.daemon import Daemon
from tests.integration.raw import RawStream, allocate, attach, save

pytestmark = pytest.mark.integration
KiB, MiB = 1 << 10, 1 << 20
LAYOUT = engines.LAYOUT


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ec_daemon", *args], capture_output=True,
                          text=True, timeout=timeout)


def refused(call) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# ------------------------------------------------------------ pending saves


def test_a_session_that_never_reports_cannot_take_the_cache():
    """The issue's reproduction: one session allocating again and again
    without reporting used to evict every ready entry and refuse everyone's
    saves. Now it stops at its cap, nothing is evicted for the refused one,
    and another engine still saves."""
    with Daemon(cpu_bytes="8MiB", extra=("--session-pending-bytes", "1MiB",
                                         "--session-pending-entries", "64")) as daemon:
        victim = attach(daemon.stub, LAYOUT, engine="victim", token="1" * 32).session_id
        for i in range(4):
            save(daemon.stub, victim, f"ready-{i}", MiB)
        hostile = attach(daemon.stub, LAYOUT, engine="hostile", token="2" * 32).session_id
        for i in range(16):  # 16 x 64 KiB: exactly the cap
            assert allocate(daemon.stub, hostile, f"p-{i}", 64 * KiB).status == pb.ALLOCATED
        before = daemon.stats()
        for i in range(16, 64):
            error = refused(lambda i=i: allocate(daemon.stub, hostile, f"p-{i}", 64 * KiB))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "pending-save cap" in error.details()
            assert "--session-pending-bytes 1048576" in error.details()
            assert "cache full" not in error.details()
        after = daemon.stats()
        for name in ("pending_bytes", "entries", "evictions", "refused_saves", "free_bytes"):
            assert after[name] == before[name], name
        assert after["capped_saves"] == 48
        assert [r.state for r in daemon.lookup(LAYOUT, *(f"ready-{i}" for i in range(4)))] \
            == [pb.READY] * 4
        save(daemon.stub, victim, "later", MiB)  # another engine's save is taken


def test_pending_saves_are_bounded_in_all_and_scale_with_the_cache():
    """Issue 40, finding 2: two sessions under engine ids x1 and x2 took
    512 MiB each, the whole default cache: every ready entry evicted, the
    victim refused "cache full", a gigabyte in quarantine after they left,
    `capped_saves` 0. With default flags the bounds scale with --cpu-bytes
    (an instance a quarter, all sessions half, the tokenless clients together
    a quarter of that): the two hold 4 MiB of a 32 MiB cache between them,
    nothing is evicted for them, and an engine presenting its token saves."""
    with Daemon(cpu_bytes="32MiB") as daemon:
        token = "e" * 32
        victim = attach(daemon.stub, LAYOUT, engine="victim", token=token).session_id
        for i in range(8):
            save(daemon.stub, victim, f"ready-{i}", MiB)
        taken = {}
        for engine in ("x1", "x2"):
            hostile = attach(daemon.stub, LAYOUT, engine=engine).session_id
            taken[engine] = 0
            for i in range(16):
                try:
                    allocate(daemon.stub, hostile, f"{engine}-{i}", MiB)
                    taken[engine] += 1
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "without an engine token" in exc.details(), exc.details()
            daemon.stub.Detach(pb.DetachRequest(session_id=hostile), timeout=5)
        assert sum(taken.values()) == 4  # 32 MiB / 2 / 4
        stats = daemon.stats()
        assert stats["capped_saves"] == 32 - 4
        assert stats["evictions"] == 0 and stats["entries"] == 8
        assert stats["quarantined_bytes"] == 4 * MiB
        for i in range(8):  # the engine's saves land: 4 MiB free, the rest evicted for them
            save(daemon.stub, victim, f"later-{i}", MiB)
        assert daemon.stats()["refused_saves"] == 0


def test_the_entry_cap_refuses_precisely():
    with Daemon(cpu_bytes="8MiB", extra=("--session-pending-entries", "3")) as daemon:
        session = attach(daemon.stub, LAYOUT, engine="many").session_id
        for i in range(3):
            allocate(daemon.stub, session, f"e-{i}", 64 * KiB)
        error = refused(lambda: allocate(daemon.stub, session, "e-3", 64 * KiB))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--session-pending-entries 3" in error.details()
        # A key pending already is said so, not refused: the cap counts new entries.
        assert allocate(daemon.stub, session, "e-0", 64 * KiB).status == pb.ALREADY_PENDING
        daemon.stub.Report(pb.ReportRequest(session_id=session, saved=["e-0"]))
        assert allocate(daemon.stub, session, "e-3", 64 * KiB).status == pb.ALLOCATED
        assert daemon.stats()["capped_saves"] == 1


def test_stream_allocations_past_the_cap_are_refused_answers():
    with Daemon(cpu_bytes="8MiB", extra=("--session-pending-bytes", "256KiB")) as daemon:
        session = attach(daemon.stub, LAYOUT, engine="streamer").session_id
        stream = RawStream(daemon.stub, session)
        try:
            asks = [pb.SaveAllocate(request_id=i + 1, mm_hash=f"s-{i}", nbytes=64 * KiB,
                                    shape=[64 * KiB], dtype="uint8") for i in range(6)]
            stream.send(allocations=asks)
            answers: dict[int, pb.SaveAllocation] = {}
            deadline = time.monotonic() + 20
            while len(answers) < len(asks) and time.monotonic() < deadline:
                message = stream.next(20)
                assert message is not None, stream.error
                answers.update({a.request_id: a for a in message.allocations})
            allocated = [i for i, a in answers.items() if a.status == pb.ALLOCATED
                         and not a.error_code]
            capped = [a for a in answers.values() if a.error_code]
            assert sorted(allocated) == [1, 2, 3, 4]
            assert len(capped) == 2
            for answer in capped:
                assert answer.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                assert "--session-pending-bytes 262144" in answer.error
            # The stream goes on: reporting makes room for the next ask.
            stream.send(reports=[pb.SaveReport(mm_hash="s-0", saved=True)],
                        allocations=[pb.SaveAllocate(request_id=9, mm_hash="s-9",
                                                     nbytes=64 * KiB, shape=[64 * KiB],
                                                     dtype="uint8")])
            answer = None
            while answer is None:
                message = stream.next(20)
                assert message is not None, stream.error
                answer = next((a for a in message.allocations if a.request_id == 9), None)
            assert answer.status == pb.ALLOCATED and not answer.error_code
            assert daemon.stats()["capped_saves"] == 2
        finally:
            stream.close()


def test_unary_allocations_waiting_for_pages_are_bounded_like_the_streams():
    """Issue 40, finding 9: unary Allocate calls waiting for pages were
    uncapped (the stream's were 64 a session), and every page coming back
    woke them all: 8,000 parked by one client cost everyone 763 ms. Now a
    session parks at most 64, on either path; the rest are refused at once."""
    with Daemon(cpu_bytes="8MiB", extra=("--alloc-wait-seconds", "3")) as daemon:
        writer = attach(daemon.stub, LAYOUT, engine="writer").session_id
        for i in range(8):
            save(daemon.stub, writer, f"ready-{i}", MiB)
        view = RawStream(daemon.stub, attach(daemon.stub, LAYOUT, engine="viewer",
                                             rank=None).session_id)  # never acknowledges
        assert view.next() is not None  # its snapshot: every eviction awaits it
        parker = attach(daemon.stub, LAYOUT, engine="parker").session_id
        calls = [daemon.stub.Allocate.future(pb.AllocateRequest(
            session_id=parker, mm_hash=f"park-{i}", nbytes=MiB, shape=[MiB], dtype="uint8"),
            timeout=30) for i in range(100)]
        at_once = []
        for call in calls:
            error = call.exception(timeout=30)
            assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            if "already wait for pages" in error.details():
                at_once.append(call)
            else:
                assert "not acknowledged in time" in error.details(), error.details()
        assert len(at_once) == 100 - 64
        view.close()


def test_an_ended_sessions_quarantine_counts_against_its_engine():
    """Ending and re-attaching gives no fresh allowance while the pages the
    ended session left are quarantined: one engine instance holds at most one
    cap of the cache, pending and quarantined together."""
    with Daemon(cpu_bytes="8MiB", extra=("--session-pending-bytes", "1MiB",
                                         "--quarantine-seconds", "600")) as daemon:
        for round_ in range(3):
            session = attach(daemon.stub, LAYOUT, engine="churner", token="3" * 32).session_id
            taken = 0
            for i in range(32):
                try:
                    allocate(daemon.stub, session, f"q-{round_}-{i}", 64 * KiB)
                    taken += 1
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "in quarantine" in exc.details()
                    break
            assert taken == (16 if round_ == 0 else 0)
            daemon.stub.Detach(pb.DetachRequest(session_id=session), timeout=5)
        stats = daemon.stats()
        assert stats["quarantined_bytes"] == MiB
        # Another engine is not charged for it.
        other = attach(daemon.stub, LAYOUT, engine="other", token="4" * 32).session_id
        save(daemon.stub, other, "fine", MiB)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_the_client_takes_a_capped_save_as_not_cached(stream):
    with Daemon(cpu_bytes="16MiB", extra=("--session-pending-bytes", "1MiB")) as daemon:
        worker = WorkerDelegate(daemon.socket, engine_id="client", layout=LAYOUT,
                                role="producer", stream_saves=stream)
        try:
            assert worker.link.wait_attached(10) is not None
            # On the stream 16 saves are asked at once (4.8 MB pending: over
            # the cap); a unary save is alone, so over the cap only when larger.
            outputs = {f"c-{i}": np.full(300_000 + i, i, np.uint8) for i in range(16)} \
                if stream else {"big": np.ones(2 * MiB, np.uint8)}
            for mm_hash, output in outputs.items():
                assert worker.save(mm_hash, output)
            assert worker.flush(30)
            assert worker.stats["saves_refused"] > 0
            assert worker.stats["save_errors"] == 0 and worker.stats["saves_failed"] == 0
            assert worker.stats["saves_refused"] + worker.stats["saves_done"] == len(outputs)
            assert worker.save("small", np.ones(1000, np.uint8)) and worker.flush(30)
            assert worker.stats["saves_done"] == len(outputs) - worker.stats["saves_refused"] + 1
        finally:
            worker.close()
        stats = daemon.stats()
        assert stats["capped_saves"] == worker.stats["saves_refused"]
        assert stats["pending_bytes"] == 0


# ------------------------------------------------------------------ sessions


def test_thousands_of_attaches_leave_stats_working():
    """4,000 attaches that never open a stream (each lives 60 s), with long
    names, used to all succeed and grow the Stats reply past gRPC's default
    4 MiB: a plain client (a router, grpcurl) could no longer read it. With
    the default flags the daemon holds what --max-sessions leaves to attaches
    of no running engine (three quarters), refuses the rest precisely, and
    lists the first sessions, counting the others. Each attach names a model
    of its own, so each holds a namespace of its own: namespaces are listed
    the same way, the largest first. (Tokenless attaches are capped far
    lower by default: lifted here to reach the total.)"""
    layout = Layout("m" * 500, "bfloat16", {"image": 8192}, variant="v" * 250)
    count, cap = 4000, 768  # cap: the default --max-sessions (1024) less the running share
    with Daemon(cpu_bytes="8MiB", extra=("--max-tokenless-sessions", "4096")) as daemon:
        request = pb.AttachRequest(protocol_version=PROTOCOL_VERSION, role=pb.ROLE_BOTH,
                                   layout=layout.to_pb(), client_name="c" * 250)
        request.scheduler.SetInParent()
        futures, errors = [], []
        for i in range(count):
            request.engine_id = f"{i:06d}" + "e" * 250
            request.layout.model = f"{i:06d}" + "m" * 500
            futures.append(daemon.stub.Attach.future(request, timeout=120))
            if len(futures) >= 200 or i == count - 1:
                for future in futures:
                    if future.exception() is not None:
                        errors.append(future.exception())
                futures.clear()
        assert len(errors) == count - cap
        for error in errors:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the last 256 of --max-sessions 1024 are kept for engine instances already " \
                "running" in error.details()
        stats = daemon.stats()  # a plain channel: gRPC's default 4 MiB receive limit
        assert stats["sessions"] == cap and stats["refused_attaches"] == count - cap
        assert 0 < len(stats["session_list"]) < cap
        assert stats["sessions_not_listed"] == cap - len(stats["session_list"])
        assert len(stats["namespaces"]) == LISTED_NAMESPACES
        assert stats["namespaces_not_listed"] == cap - LISTED_NAMESPACES
        result = cli("stats", "--socket", daemon.socket, "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["sessions"] == cap
        table = cli("stats", "--socket", daemon.socket)
        assert table.returncode == 0, table.stderr
        assert f"and {stats['sessions_not_listed']} more sessions" in table.stdout
        assert f"and {cap - 5} more namespaces" in table.stdout  # the table shows 5
        assert f"{count - cap} attaches refused" in table.stdout


def test_attaches_that_never_open_cannot_lock_an_engine_out():
    """Issue 40, finding 6: 1,024 attaches under 16 engine ids that never
    opened a stream (0.9 s) locked every engine out for a minute, and again
    each time the client re-attached. Now clients without a token share one
    bucket; attaches of instances that run nothing stop short of the places
    kept for running engines; and a new engine presenting its token takes the
    place of an attach that never opened its stream in PREEMPTIBLE_SECONDS."""
    flags = ("--max-sessions", "32", "--max-sessions-per-engine", "8",
             "--max-tokenless-sessions", "8")
    with Daemon(cpu_bytes="8MiB", extra=flags) as daemon:
        refusals = []
        for engine in range(16):  # the reproduction, scaled: 16 ids x 8 tokenless attaches
            for _ in range(8):
                try:
                    attach(daemon.stub, LAYOUT, engine=f"hog-{engine}", rank=None)
                except grpc.RpcError as exc:
                    refusals.append(exc)
        assert len(refusals) == 16 * 8 - 8
        assert all("--max-tokenless-sessions 8" in e.details() for e in refusals)
        running = attach(daemon.stub, LAYOUT, engine="running", rank=None, token="9" * 32)
        view = RawStream(daemon.stub, running.session_id)  # it runs: its stream is open
        for n in range(32):  # invented tokens, never opening: up to 24 places (3/4)
            try:
                attach(daemon.stub, LAYOUT, engine="hog", rank=None, token=f"{n:032x}")
            except grpc.RpcError as exc:
                assert "kept for engine instances already running" in exc.details()
        assert daemon.stats()["sessions"] == 24
        for rank in range(7):  # the running engine's ranks find the kept places
            attach(daemon.stub, LAYOUT, engine="running", rank=rank, world=7, token="9" * 32)
        assert daemon.stats()["sessions"] == 31
        # A new engine presenting its token: the attaches that never opened
        # are taken once PREEMPTIBLE_SECONDS old (tokenless ones first).
        new_token = "a" * 32
        time.sleep(PREEMPTIBLE_SECONDS + 0.5)
        for rank in range(4):
            attach(daemon.stub, LAYOUT, engine="new", rank=rank, world=4, token=new_token)
        stats = daemon.stats()
        assert stats["preempted_sessions"] >= 4 and stats["sessions"] <= 32
        assert sum(s["engine_id"] == "new" for s in stats["session_list"]) == 4
        view.close()


def test_session_caps_refuse_precisely_and_free_up_as_sessions_expire():
    lease = 1.0
    with Daemon(cpu_bytes="8MiB", extra=("--max-sessions", "16", "--max-sessions-per-engine",
                                         "5", "--lease-seconds", str(lease),
                                         "--quarantine-seconds", "5")) as daemon:
        streams = []
        for i in range(5):  # attacker A opens its streams, then goes silent
            session = attach(daemon.stub, LAYOUT, engine="attacker-a", rank=i, world=8)
            streams.append(RawStream(daemon.stub, session.session_id, read=False))
        error = refused(lambda: attach(daemon.stub, LAYOUT, engine="attacker-a", rank=5,
                                       world=8))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "engine 'attacker-a' has 5 sessions" in error.details()
        assert "--max-sessions-per-engine 5" in error.details()
        for i in range(7):
            session = attach(daemon.stub, LAYOUT, engine=f"attacker-{i}")
            streams.append(RawStream(daemon.stub, session.session_id, read=False))
        daemon.wait_for(lambda: daemon.stats()["sessions"] == 12, what="12 sessions")
        error = refused(lambda: attach(daemon.stub, LAYOUT, engine="legit", rank=None))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "12 sessions attached; the last 4 of --max-sessions 16 are kept for engine " \
            "instances already running" in error.details()
        stats = daemon.stats()
        assert stats["sessions"] == 12 and stats["refused_attaches"] == 2
        # The attackers' sessions expire (silent for a lease): the legit engine
        # gets in, as its link would on its next try.
        deadline = time.monotonic() + 30
        while True:
            try:
                legit = attach(daemon.stub, LAYOUT, engine="legit", rank=None)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, daemon.stats()
                time.sleep(0.1)
        assert legit.session_id
        for stream in streams:
            stream.close()
