"""Streams whose client never reads, against the real daemon (issue 40,
finding 3): they cannot grow it without bound, and once what they stream for
has ended, or their client has read nothing for a lease, their calls end."""

from __future__ import annotations

import threading
import time

import grpc
import psutil
import pytest

from ec_protocol.protocol import Layout, pb, rpc
from tests.integration.daemon import Daemon
from tests.integration.raw import RawStream, attach

pytestmark = pytest.mark.integration
LAYOUT = Layout("unread-model", "uint8", {"image": 64})
MiB = 1 << 20


def fill(daemon: Daemon, entries: int) -> None:
    """`entries` ready entries of one 4 KiB page each, saved on a stream in
    batches (unary calls would take minutes)."""
    writer = RawStream(daemon.stub, attach(daemon.stub, LAYOUT, engine="writer",
                                           token="5" * 32).session_id)
    batch = 128  # --session-pending-entries
    for start in range(0, entries, batch):
        keys = [f"{i:06d}" + "k" * 64 for i in range(start, min(entries, start + batch))]
        writer.send(allocations=[pb.SaveAllocate(request_id=start + n + 1, mm_hash=key,
                                                 nbytes=4096, shape=[4096], dtype="uint8")
                                 for n, key in enumerate(keys)])
        answered = 0
        while answered < len(keys):
            message = writer.next(30)
            assert message is not None, writer.error
            assert all(a.status == pb.ALLOCATED for a in message.allocations)
            answered += len(message.allocations)
        writer.send(reports=[pb.SaveReport(mm_hash=key, saved=True) for key in keys])
    daemon.wait_for(lambda: daemon.stats()["entries"] == entries, timeout=60,
                    what="the entries to be ready")
    writer.close()


def rss(daemon: Daemon) -> int:
    assert daemon.proc is not None
    return int(psutil.Process(daemon.proc.pid).memory_info().rss)


def test_unread_views_of_a_large_namespace_do_not_grow_the_daemon():
    """100 views of 16,384 entries, opened and never read, took the daemon
    from 78 to 542 MiB (a snapshot of events built for each). Their snapshots
    are now made as they are sent, and each unread call holds at most the
    message it is blocked writing."""
    with Daemon(cpu_bytes="80MiB", page_bytes="4KiB", check_invariants=False,
                extra=("--lease-seconds", "60", "--max-tokenless-sessions", "256")) as daemon:
        fill(daemon, 16_384)
        before = rss(daemon)
        stop = threading.Event()
        # A client announcing no more than gRPC's first 64 KiB flow-control
        # window: what it does not read stays on the daemon's side.
        channel = grpc.insecure_channel(daemon.socket, options=[("grpc.http2.bdp_probe", 0)])
        stub = rpc.ECDaemonStub(channel)
        views = [RawStream(stub, attach(daemon.stub, LAYOUT, engine=f"v{n}",
                                        rank=None).session_id, read=False)
                 for n in range(100)]

        def beat() -> None:  # alive: only their reading stopped
            while not stop.wait(1):
                for view in views:
                    view.send(heartbeat=pb.Heartbeat())

        beating = threading.Thread(target=beat, daemon=True)
        beating.start()
        try:
            daemon.wait_for(lambda: daemon.stats()["sessions"] == 100, what="the views")
            time.sleep(3)  # every view's handler has made and written what it could
            grown = rss(daemon) - before
            assert grown < 200 * MiB, f"{grown / MiB:.0f} MiB for 100 unread views"
        finally:
            stop.set()
            beating.join()
            for view in views:
                view.close()
            channel.close()


def test_unread_streams_whose_sessions_end_do_not_pile_up_in_the_daemon():
    """Unread streams whose sessions had expired stayed blocked writing,
    holding their messages and counting against no cap (600 of them: 701 ->
    2,120 MiB). A call blocked writing is now cut once its session ends (its
    handler and what it made are released), and what gRPC itself keeps until
    the client reads or disconnects is one message of at most 64 KiB."""
    lease = 1.0
    with Daemon(cpu_bytes="80MiB", page_bytes="4KiB", check_invariants=False,
                extra=("--lease-seconds", str(lease), "--quarantine-seconds", "1",
                       "--max-tokenless-sessions", "1024")) as daemon:
        fill(daemon, 8192)  # each snapshot far larger than what transports buffer
        # A client that announces no more than gRPC's first 64 KiB flow-control
        # window, on one connection: its calls block on their first messages.
        channel = grpc.insecure_channel(daemon.socket, options=[("grpc.http2.bdp_probe", 0)])
        stub = rpc.ECDaemonStub(channel)
        before = rss(daemon)
        calls = []
        try:
            for round_ in range(3):
                for n in range(200):  # never read, never heartbeaten: each expires
                    session = attach(daemon.stub, LAYOUT, engine=f"s{round_}-{n}", rank=None)
                    calls.append(RawStream(stub, session.session_id, read=False))
                daemon.wait_for(lambda: daemon.stats()["sessions"] == 0, timeout=30,
                                what="the unread sessions to expire")
            time.sleep(2)  # the cuts of the last round ran
            grown = rss(daemon) - before
            assert grown < 250 * MiB, f"{grown / MiB:.0f} MiB for 600 unread calls"
        finally:
            for call in calls:
                call.close()
            channel.close()


def test_a_stream_whose_client_stops_reading_is_ended_after_a_lease():
    """A client that heartbeats but reads nothing keeps its session alive:
    its call, blocked writing, is cut after a lease, its session ended as a
    reader too slow (a ghost for a lease: its engine may still be loading)."""
    lease = 2.0
    with Daemon(cpu_bytes="80MiB", page_bytes="4KiB", check_invariants=False,
                extra=("--lease-seconds", str(lease), "--quarantine-seconds", "2")) as daemon:
        fill(daemon, 8192)
        channel = grpc.insecure_channel(daemon.socket, options=[("grpc.http2.bdp_probe", 0)])
        beating = RawStream(rpc.ECDaemonStub(channel), attach(
            daemon.stub, LAYOUT, engine="beating", rank=None).session_id, read=False)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(0.2):
                beating.send(heartbeat=pb.Heartbeat())

        threading.Thread(target=beat, daemon=True).start()
        try:
            daemon.wait_for(lambda: daemon.stats()["stalled_streams"] == 1, timeout=30,
                            what="the stalled stream to be cut")
            stats = daemon.stats()
            assert stats["sessions"] == 0 and stats["ghost_sessions"] == 1
            assert "detached: its client has not read a message for 2s" in daemon.log()
        finally:
            stop.set()
            beating.close()
            channel.close()
