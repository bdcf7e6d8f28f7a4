"""Raw protocol calls for integration tests: sessions attached and streams
driven by hand (nothing acknowledged, read or heartbeaten unless the test
says so), and a writer that takes room in the cache on demand."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from ec_protocol.protocol import PROTOCOL_VERSION, Layout, pb

MiB = 1 << 20
# Flags lifting the pending-save caps (a quarter and half of --cpu-bytes by
# default) for tests whose `Filler` asks for a whole test-sized cache at once.
UNCAPPED = ("--session-pending-bytes", "1TiB", "--total-pending-bytes", "1TiB")


def attach(stub: Any, layout: Layout, *, engine: str = "E", role: int = pb.ROLE_BOTH,
           rank: int | None = 0, world: int = 1, version: int = PROTOCOL_VERSION,
           store_namespace: str = "", token: str = "") -> Any:
    """Attach a worker rank (or, with rank=None, a scheduler side), presenting
    engine token `token` if given (32 hex digits)."""
    request = pb.AttachRequest(protocol_version=version, engine_id=engine, role=role,
                               layout=layout.to_pb(), store_namespace=store_namespace)
    if rank is None:
        request.scheduler.SetInParent()
        request.scheduler.engine_token = token
    else:
        request.worker.rank, request.worker.world_size = rank, world
        request.worker.engine_token = token
    return stub.Attach(request, timeout=5)


def answers_of(stream: RawStream, wanted: int, timeout: float = 10) -> dict[str, int]:
    """The verdicts of the next `wanted` answers on `stream` (by mm_hash)."""
    got: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while len(got) < wanted:
        message = stream.next(max(0.1, deadline - time.monotonic()))
        assert message is not None, stream.error
        got.update((a.mm_hash, a.verdict) for a in message.answers)
    return got


class RawStream:
    """A session stream driven by hand: sends what the test queues, and
    reads in a thread (unless `read` is False: then nothing is read until
    `drain`)."""

    def __init__(self, stub: Any, session_id: str, *, read: bool = True) -> None:
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.outbox.put(pb.ClientMessage(open_session_id=session_id))
        self.responses = stub.Session(self._requests())
        self.messages: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.error: grpc.RpcError | None = None
        if read:
            threading.Thread(target=self._read, daemon=True).start()

    def _requests(self) -> Iterator[Any]:
        while (message := self.outbox.get()) is not None:
            yield message

    def _read(self) -> None:
        try:
            for message in self.responses:
                self.messages.put(message)
        except grpc.RpcError as exc:
            self.error = exc
        self.messages.put(None)

    def drain(self, timeout: float | None = None) -> int:
        """Read everything until the stream ends; returns how many messages
        came. With `timeout`, a stream the daemon has not ended by then is
        cancelled here (its `error` then says CANCELLED)."""
        timer = None
        if timeout is not None:
            timer = threading.Timer(timeout, self.responses.cancel)
            timer.start()
        count = 0
        try:
            for _ in self.responses:
                count += 1
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            if timer is not None:
                timer.cancel()
        return count

    def send(self, **fields: Any) -> None:
        self.outbox.put(pb.ClientMessage(**fields))

    def next(self, timeout: float = 5) -> Any:
        return self.messages.get(timeout=timeout)

    def half_close(self, timeout: float = 10) -> None:
        """Stop sending and read until the daemon ends the stream (needs the
        reader thread). Without a Detach first, a scheduler session ends as
        a ghost."""
        self.outbox.put(None)
        while self.next(timeout) is not None:
            pass

    def close(self) -> None:
        """Cancel the stream (as a lost connection would)."""
        self.outbox.put(None)
        self.responses.cancel()


def allocate(stub: Any, session_id: str, mm_hash: str, nbytes: int = MiB,
             timeout: float = 10) -> Any:
    return stub.Allocate(pb.AllocateRequest(session_id=session_id, mm_hash=mm_hash,
                                            nbytes=nbytes, shape=[nbytes], dtype="uint8"),
                         timeout=timeout)


def save(stub: Any, session_id: str, mm_hash: str, nbytes: int = MiB) -> Any:
    """Allocate and report saved (the bytes are whatever the pages held)."""
    reply = allocate(stub, session_id, mm_hash, nbytes)
    assert reply.status == pb.ALLOCATED, reply
    assert list(stub.Report(pb.ReportRequest(session_id=session_id, saved=[mm_hash])).saved) \
        == [pb.ACCEPTED]
    return reply


class Filler:
    """A producer session of its own engine that asks for all the room the
    ready entries and free pages hold, which hides every ready entry (the
    LRU policy takes them all). Views that acknowledge let the pages come
    back; one that withholds keeps its entry's pages, and the ask is
    refused (RESOURCE_EXHAUSTED) once the daemon's --alloc-wait-seconds
    are over."""

    def __init__(self, stub: Any, layout: Layout, engine: str = "filler") -> None:
        self.stub = stub
        self.layout = layout
        self.engine = engine
        self.session_id = attach(stub, layout, engine=engine, role=pb.ROLE_PRODUCER).session_id
        self.asks = 0

    def evict_all(self, stats: dict[str, Any]) -> bool:
        """Hide every ready entry; True if the room came free (then it is
        given back at once), False if some view withheld its acknowledgement."""
        room = stats["capacity_bytes"] - stats["pending_bytes"] - stats["hidden_bytes"] \
            - stats["quarantined_bytes"]
        return room > 0 and self.take(room, keep=False)

    def take(self, nbytes: int, *, keep: bool = True) -> bool:
        """Ask for `nbytes` (evicting what it must). True if allocated (kept
        pending when `keep`, else aborted at once)."""
        self.asks += 1
        mm_hash = f"filler-{self.asks}"
        try:
            reply = allocate(self.stub, self.session_id, mm_hash, nbytes)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # its lease ran out (no stream)
                self.session_id = attach(self.stub, self.layout, engine=self.engine,
                                         role=pb.ROLE_PRODUCER).session_id
                return self.take(nbytes, keep=keep)
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return False
        assert reply.status == pb.ALLOCATED, reply
        if not keep:
            self.stub.Report(pb.ReportRequest(session_id=self.session_id, aborted=[mm_hash]))
        return True

    def close(self) -> None:
        try:
            self.stub.Detach(pb.DetachRequest(session_id=self.session_id), timeout=5)
        except grpc.RpcError as exc:  # the daemon is gone or the session expired
            if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                raise
