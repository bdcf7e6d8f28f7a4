"""The Watch RPC and `ec-daemon events` against real daemon processes: what a
router sees (every store and eviction, in order, after a snapshot), what a
watcher that stops reading costs (itself only), and how the CLI ends."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import pytest

from ec_protocol.protocol import Layout, pb, rpc
from ec_protocol.transport import Transport
from tests.integration import raw
from tests.integration.daemon import Daemon, free_port
from tests.integration.raw import attach, save

pytestmark = pytest.mark.integration
LAYOUT = Layout("watch-model", "uint8", {"image": 64})
OTHER = Layout("watch-other", "uint8", {"image": 64})
PAGE = 64 << 10
# Raw worker sessions here have no stream: keep them alive for the test.
LONG_LEASE = ("--lease-seconds", "600", "--quarantine-seconds", "600")
STORED, EVICTED = pb.WatchEvent.STORED, pb.WatchEvent.EVICTED


class Watch:
    """A Watch call read in a thread (unless `read` is False): its messages,
    then None, on a queue; `error` is how it ended."""

    def __init__(self, stub: Any, namespace: str = "", *, read: bool = True,
                 metadata: tuple[tuple[str, str], ...] = (), engine: str = "",
                 token: str = "") -> None:
        self.call = stub.Watch(pb.WatchRequest(namespace=namespace, engine_id=engine,
                                               engine_token=token), metadata=metadata)
        self.messages: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.error: grpc.RpcError | None = None
        self.snapshot_done = False
        if read:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.put(message)
        except grpc.RpcError as exc:
            self.error = exc
        self.messages.put(None)

    def next(self, timeout: float = 10) -> Any:
        return self.messages.get(timeout=timeout)

    def snapshot(self, timeout: float = 10) -> tuple[list[Any], int]:
        """The snapshot's events and the generation its messages carried."""
        events: list[Any] = []
        generations = set()
        deadline = time.monotonic() + timeout
        while not self.snapshot_done:
            message = self.next(max(0.01, deadline - time.monotonic()))
            assert message is not None, f"the watch ended: {self.error}"
            generations.add(message.generation)
            events += message.events
            self.snapshot_done = message.snapshot_done
        (generation,) = generations
        return events, generation

    def events(self, count: int, timeout: float = 20) -> list[Any]:
        """The next `count` live events (more in the last message fail the test)."""
        events: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(events) < count:
            message = self.next(max(0.01, deadline - time.monotonic()))
            assert message is not None, f"the watch ended: {self.error}"
            assert not message.snapshot_done
            events += message.events
        assert len(events) == count, [brief(e) for e in events[count:]]
        return events

    def drain(self, timeout: float = 30) -> None:
        """Read (in this thread) until the call ends; `error` says how."""
        deadline = time.monotonic() + timeout
        try:
            for _ in self.call:
                assert time.monotonic() < deadline, "the watch did not end"
        except grpc.RpcError as exc:
            self.error = exc

    def close(self) -> None:
        self.call.cancel()


def brief(event: Any) -> tuple[str, str, int]:
    return pb.WatchEvent.Kind.Name(event.kind), event.mm_hash, event.entry_id


def namespace_of(layout: Layout) -> str:
    return "|".join((layout.model, layout.dtype, ",".join(
        f"{k}={v}" for k, v in sorted(layout.row_bytes.items())), layout.variant))


def writer(daemon: Daemon, layout: Layout = LAYOUT) -> str:
    return attach(daemon.stub, layout, engine=f"W-{layout.model}",
                  role=pb.ROLE_PRODUCER).session_id


def small_buffer_daemon(events: int, **kwargs: Any) -> Daemon:
    """A daemon whose watchers may have `events` waiting (not 65,536), so a
    test fills a buffer with a few thousand saves instead of some 35,000."""
    daemon = Daemon(**kwargs)
    assert daemon.args[1:3] == ["-m", "ec_daemon"]
    daemon.args[1:3] = ["-c", "import sys, ec_daemon.plane.watch as w; "
                        f"w.WATCH_BUFFER_EVENTS = {events}; "
                        "from ec_daemon.serving.cli import main; sys.exit(main())"]
    return daemon


# Protects: a router can rebuild the host's contents from the stream alone:
# every store and every eviction, in the order they happened, as saved.
def test_a_watcher_sees_every_store_and_eviction_of_a_churn_run_in_order():
    # 64 pages of 64 KiB; 150 saves of 1..3 pages: most are evicted again.
    with Daemon(cpu_bytes="4MiB", page_bytes="64KiB", extra=LONG_LEASE) as daemon:
        watch = Watch(daemon.stub)
        try:
            snapshot, generation = watch.snapshot()
            assert snapshot == [] and generation == daemon.stats()["generation"]
            session = writer(daemon)
            started = time.time_ns()
            saved = []
            for i in range(150):
                nbytes = PAGE * (1 + i % 3) - 7
                reply = save(daemon.stub, session, f"churn-{i}", nbytes)
                saved.append((f"churn-{i}", reply.entry_id, nbytes))
            stats = daemon.stats()
            assert stats["evictions"] > 50
            events = watch.events(len(saved) + stats["evictions"])
            ended = time.time_ns()
        finally:
            watch.close()
        namespace = namespace_of(LAYOUT)
        stored = [e for e in events if e.kind == STORED]
        assert [(e.mm_hash, e.entry_id, e.nbytes) for e in stored] == saved
        for e in events:
            assert e.namespace == namespace and e.dtype == "uint8"
            assert list(e.shape) == [e.nbytes]
            assert started - 10**9 <= e.time_unix_ns <= ended + 10**9  # the wall clock
        # Least recently used first (nothing was loaded): the oldest saves,
        # each evicted once, and only after it was stored.
        evicted = [(e.mm_hash, e.entry_id, e.nbytes) for e in events if e.kind == EVICTED]
        assert evicted == saved[:len(evicted)]
        # In the order it happened: room was made before each store that needed it.
        live: dict[int, int] = {}
        for e in events:
            if e.kind == STORED:
                live[e.entry_id] = -(-e.nbytes // PAGE)
                assert sum(live.values()) <= 64, f"more stored than fits at {brief(e)}"
            else:
                assert live.pop(e.entry_id)
        ready = {e.mm_hash for e in stored if e.entry_id in live}
        results = daemon.lookup(LAYOUT, *[key for key, _, _ in saved])
        assert {key for (key, _, _), r in zip(saved, results, strict=True)
                if r.state == pb.READY} == ready


# Protects: a router that connects late learns what is there (a snapshot,
# then a marker), then follows live; Stats and /metrics count watchers.
def test_a_late_watcher_gets_the_snapshot_then_live_events():
    port = free_port()
    extra = (*LONG_LEASE, "--metrics-port", str(port))
    with Daemon(cpu_bytes="4MiB", page_bytes="64KiB", extra=extra) as daemon:
        session = writer(daemon)
        ids = {f"old-{i}": save(daemon.stub, session, f"old-{i}", PAGE).entry_id
               for i in range(70)}  # 64 fit: the first 6 are evicted
        before = time.time_ns()
        watch = Watch(daemon.stub)
        try:
            snapshot, generation = watch.snapshot()
            assert generation == daemon.stats()["generation"]
            assert sorted((e.mm_hash, e.entry_id) for e in snapshot) \
                == sorted((f"old-{i}", ids[f"old-{i}"]) for i in range(6, 70))
            assert all(e.kind == STORED and e.nbytes == PAGE for e in snapshot)
            assert len({e.time_unix_ns for e in snapshot}) == 1  # when it was taken
            assert snapshot[0].time_unix_ns >= before - 10**9
            stats = daemon.stats()
            assert stats["watchers"] == 1 and stats["dropped_watchers"] == 0
            assert scrape(port)[("ec_daemon_watchers", ())] == 1
            new = save(daemon.stub, session, "new", PAGE).entry_id
            # The oldest ready entry makes room, then the new one is stored.
            assert [brief(e) for e in watch.events(2)] \
                == [("EVICTED", "old-6", ids["old-6"]), ("STORED", "new", new)]
        finally:
            watch.close()
        daemon.wait_for(lambda: daemon.stats()["watchers"] == 0, what="the watch to close")
        metrics = scrape(port)
        assert metrics[("ec_daemon_watchers", ())] == 0
        assert metrics[("ec_daemon_dropped_watchers_total", ())] == 0


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from tests.integration.test_observability import scrape as scrape_metrics

    return scrape_metrics(port)


# Protects: a watcher that stops reading never slows the daemon or the saves:
# it is dropped with the reason once its buffer is full, and saves go on.
def test_a_stalled_watcher_is_dropped_with_a_reason_and_saves_carry_on():
    buffer = 2000
    daemon = small_buffer_daemon(buffer, cpu_bytes="8MiB", page_bytes="4KiB",
                                 check_invariants=False,
                                 extra=(*LONG_LEASE, "--session-pending-entries", "250"))
    # A client that reads nothing and announces no more than gRPC's first
    # 64 KiB flow-control window, so the daemon's writer blocks early on.
    channel = None
    stalled = None
    try:
        daemon.start()
        channel = grpc.insecure_channel(daemon.socket, options=[("grpc.http2.bdp_probe", 0)])
        stalled = Watch(rpc.ECDaemonStub(channel), read=False)
        reading = Watch(daemon.stub)
        reading.snapshot()
        session = writer(daemon)
        daemon.wait_for(lambda: daemon.stats()["watchers"] == 2, what="both watches")
        saves = 0
        deadline = time.monotonic() + 120
        while not daemon.stats()["dropped_watchers"]:
            assert time.monotonic() < deadline, f"not dropped after {saves} saves"
            keys = [f"k{saves + i}" for i in range(250)]
            for key in keys:
                reply = daemon.stub.Allocate(pb.AllocateRequest(
                    session_id=session, mm_hash=key, nbytes=64, shape=[64], dtype="uint8"),
                    timeout=10)
                assert reply.status == pb.ALLOCATED
            daemon.stub.Report(pb.ReportRequest(session_id=session, saved=keys), timeout=10)
            saves += len(keys)
        assert "dropped: it read events too slowly" in daemon.log()
        assert daemon.stats()["watchers"] == 1  # the reading one
        # Saves carry on (a generous bound: this is no benchmark).
        started = time.monotonic()
        for i in range(200):
            save(daemon.stub, session, f"after-{i}", 64)
        assert time.monotonic() - started < 60
        assert daemon.stats()["dropped_watchers"] == 1
        # The watcher that kept reading saw everything, the last saves too.
        seen = reading.events(daemon.stats()["saves"] + daemon.stats()["evictions"], timeout=60)
        assert seen[-1].mm_hash == "after-199" and seen[-1].kind == STORED
        # When the stalled one reads at last, its call says why it ended.
        stalled.drain()
        assert stalled.error is not None
        assert stalled.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"more than {buffer} events were waiting" in stalled.error.details()
        assert "read too slowly" in stalled.error.details()
        reading.close()
    finally:
        if stalled is not None:
            stalled.close()
        if channel is not None:
            channel.close()
        daemon.cleanup()


# Protects: a router that serves one model sees that model's entries only.
def test_namespace_filter():
    with Daemon(cpu_bytes="4MiB", page_bytes="64KiB", extra=LONG_LEASE) as daemon:
        a, b = writer(daemon, LAYOUT), writer(daemon, OTHER)
        save(daemon.stub, b, "b-before", PAGE)
        only_a = Watch(daemon.stub, namespace_of(LAYOUT))
        every = Watch(daemon.stub)
        only_b = Watch(daemon.stub, namespace_of(OTHER))
        try:
            assert only_a.snapshot()[0] == []
            assert [e.mm_hash for e in every.snapshot()[0]] == ["b-before"]
            assert [e.mm_hash for e in only_b.snapshot()[0]] == ["b-before"]
            for session, key in ((a, "a1"), (b, "b1"), (a, "a2")):
                save(daemon.stub, session, key, PAGE)
            assert [(e.namespace, e.mm_hash) for e in only_a.events(2)] \
                == [(namespace_of(LAYOUT), "a1"), (namespace_of(LAYOUT), "a2")]
            assert [e.mm_hash for e in every.events(3)] == ["a1", "b1", "a2"]
            assert [e.mm_hash for e in only_b.events(1)] == ["b1"]
        finally:
            for watch in (only_a, every, only_b):
                watch.close()


@pytest.mark.parametrize(("namespace", "message"), [
    ("watch-model", "namespace 'watch-model' is not a namespace: use one as Attach returns"),
    ("m|d|w|" + "x" * 9000, "namespace is longer than 4096 bytes"),
])
def test_a_bad_namespace_gets_invalid_argument(daemon, namespace, message):
    watch = Watch(daemon.stub, namespace, read=False)
    watch.drain()
    assert watch.error is not None
    assert watch.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert watch.error.details().startswith(message), watch.error.details()
    assert daemon.stats()["watchers"] == 0


# Protects: watchers are capped in number, in all and per peer (every client
# of the Unix socket is one peer): one more is refused with its reason and
# changes nothing, and closing one makes room again.
@pytest.mark.parametrize(("flags", "message"), [
    (("--max-watchers", "2", "--max-watchers-per-peer", "10"),
     "too many watchers: 2 watch calls are open (at most 2, --max-watchers; dropped "
     "watchers whose clients stopped reading count until they disconnect); close one, or "
     "share one watch between routers"),
    (("--max-watchers", "10", "--max-watchers-per-peer", "2"),
     "too many watchers from unix: 2 watch calls are open (at most 2 per peer, "
     "--max-watchers-per-peer)"),
])
def test_watchers_are_capped_in_all_and_per_peer(flags, message):
    with Daemon(extra=flags) as daemon:
        first, second = Watch(daemon.stub), Watch(daemon.stub)
        first.snapshot()
        second.snapshot()
        refused = Watch(daemon.stub, read=False)
        refused.drain()
        assert refused.error is not None
        assert refused.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.error.details() == message
        assert daemon.stats()["watchers"] == 2
        first.close()
        daemon.wait_for(lambda: daemon.stats()["watchers"] == 1, what="the closed watch to end")
        third = Watch(daemon.stub)
        third.snapshot()
        assert daemon.stats()["watchers"] == 2
        second.close()
        third.close()


def test_one_local_client_cannot_take_the_watch_slots_of_a_running_engine():
    """Issue 40, finding 12: every client of the Unix socket counts as one
    peer, so one client's 16 unread Watch calls took every local slot. A watch
    presenting a running engine's id and token counts in that instance's own
    bucket (and may use the slots kept for such watches); one presenting an
    engine that does not run is a tokenless one."""
    with Daemon() as daemon:
        hog = [Watch(daemon.stub, read=False) for _ in range(16)]
        daemon.wait_for(lambda: daemon.stats()["watchers"] == 16, what="16 watchers")
        refused = Watch(daemon.stub, read=False)
        refused.drain()
        assert refused.error is not None and "from unix: 16 watch calls" \
            in refused.error.details()
        token = "7" * 32
        unknown = Watch(daemon.stub, read=False, engine="router-engine", token=token)
        unknown.drain()  # no session of that instance runs: a tokenless watch
        assert unknown.error is not None and "from unix" in unknown.error.details()
        view = raw.attach(daemon.stub, LAYOUT, engine="router-engine", rank=None, token=token)
        stream = raw.RawStream(daemon.stub, view.session_id)
        assert stream.next() is not None  # its stream is open: the instance runs
        engine_watch = Watch(daemon.stub, engine="router-engine", token=token)
        engine_watch.snapshot()
        assert daemon.stats()["watchers"] == 17
        for watch in (*hog, engine_watch):
            watch.close()
        stream.close()


# ---------------------------------------------------------------- the CLI


class Cli:
    """`ec-daemon events` as a subprocess; its stdout lines on a queue."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ec_daemon", "events", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def line(self, timeout: float = 20) -> str:
        line = self.lines.get(timeout=timeout)
        assert line is not None, f"ec-daemon events ended: {self.finish(5)}"
        return line

    def finish(self, timeout: float = 20) -> tuple[int, str]:
        """Its exit code and stderr, once it exits."""
        code = self.proc.wait(timeout)
        assert self.proc.stderr is not None
        return code, self.proc.stderr.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def test_events_cli_prints_json_lines_and_ctrl_c_exits_zero():
    with Daemon(cpu_bytes="4MiB", page_bytes="64KiB", extra=LONG_LEASE) as daemon:
        session = writer(daemon)
        first = save(daemon.stub, session, "before", 3 * 64).entry_id
        generation = f"{daemon.stats()['generation']:016x}"
        cli = Cli("--socket", daemon.socket, "--json")
        text = Cli("--socket", daemon.socket, "--namespace", namespace_of(LAYOUT))
        try:
            snapshot = json.loads(cli.line())
            assert snapshot == {
                "event": "stored", "generation": generation, "namespace": namespace_of(LAYOUT),
                "mm_hash": "before", "entry_id": first, "nbytes": 192, "shape": [192],
                "dtype": "uint8", "time": snapshot["time"], "snapshot": True}
            assert isinstance(snapshot["time"], float)
            assert json.loads(cli.line()) == {"event": "snapshot_done", "generation": generation,
                                              "entries": 1}
            assert text.line().endswith(" stored  before id=1 192 B uint8[192] "
                                        + namespace_of(LAYOUT))
            assert text.line().startswith("-- snapshot complete: 1 ready entries")
            entry_id = save(daemon.stub, session, "after", PAGE).entry_id
            stored = json.loads(cli.line())
            assert {k: v for k, v in stored.items() if k != "time"} == {
                "event": "stored", "generation": generation, "namespace": namespace_of(LAYOUT),
                "mm_hash": "after", "entry_id": entry_id, "nbytes": PAGE, "shape": [PAGE],
                "dtype": "uint8", "snapshot": False}
            assert abs(stored["time"] - time.time()) < 60
            assert " stored  after id=2 64 KiB uint8[65536] " in text.line()
            for proc in (cli, text):
                proc.proc.send_signal(signal.SIGINT)  # Ctrl-C
                assert proc.finish() == (0, "")
        finally:
            cli.stop()
            text.stop()


def test_events_cli_says_why_it_stops():
    down = Daemon()  # never started: nothing listens on its socket
    try:
        gone = Cli("--socket", down.socket)
        code, stderr = gone.finish()
        assert code == 1 and stderr.startswith(f"ec-daemon: error: daemon at {down.socket} is "
                                               "not reachable"), stderr
    finally:
        down.cleanup()
    with Daemon() as daemon:
        bad = Cli("--socket", daemon.socket, "--namespace", "nonsense")
        code, stderr = bad.finish()
        assert code == 2 and "refused the watch: namespace 'nonsense' is not a namespace" \
            in stderr, stderr
        watching = Cli("--socket", daemon.socket)
        try:
            assert watching.line().startswith("-- snapshot complete: 0 ready entries")
            assert daemon.stop() == 0
            code, stderr = watching.finish()
            assert code == 1 and "ended the event stream: UNAVAILABLE: the daemon is shutting " \
                "down" in stderr, stderr
        finally:
            watching.stop()


def wait_ready(daemon: Daemon, token_file: str) -> None:
    transport = Transport(daemon.socket, token_file=token_file)
    try:
        daemon.wait_for(lambda: _answers(transport), timeout=30, what="the daemon to serve")
    finally:
        transport.close()


def _answers(transport: Transport) -> bool:
    try:
        transport.call("Stats", pb.StatsRequest(), timeout=1)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False
    return True


def test_watch_needs_the_token_like_every_call(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-0123456789abcdef\n")
    token_file.chmod(0o600)
    daemon = Daemon(extra=("--token-file", str(token_file)))
    daemon.socket = f"127.0.0.1:{free_port()}"
    daemon.args[daemon.args.index("--socket") + 1] = daemon.socket
    channel = None
    try:
        daemon.start(wait=False)
        wait_ready(daemon, str(token_file))
        authorised = Cli("--socket", daemon.socket, "--token-file", str(token_file), "--json",
                         "--timeout", "30")
        try:
            assert json.loads(authorised.line(timeout=40))["event"] == "snapshot_done"
        finally:
            authorised.stop()
        channel = grpc.insecure_channel(daemon.socket)
        anonymous = Watch(rpc.ECDaemonStub(channel), read=False)
        anonymous.drain()
        assert anonymous.error is not None
        assert anonymous.error.code() == grpc.StatusCode.UNAUTHENTICATED
        refused = Cli("--socket", daemon.socket)
        code, stderr = refused.finish()
        assert code == 1 and "refused the watch: UNAUTHENTICATED" in stderr, stderr
    finally:
        if channel is not None:
            channel.close()
        daemon.cleanup()
