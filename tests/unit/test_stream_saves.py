"""Saves on the session stream without a daemon: StreamSaves matches
answers to requests by id (any order, several outstanding, given up at the
deadline or when the stream is lost), and a worker's saver batches, copies
and reports through it, answered by a stand-in daemon on the link's outbox."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ec_client.common.session import Attachment
from ec_client.common.wire import daemon_news
from ec_client.worker_side.stream_saves import Report, StreamSaves
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import pb
from tests import cuda_model
from tests.unit.daemon_news import news
from tests.unit.test_worker_load import LAYOUT, PAGE, Region, page


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def attachment_of(region: Region | None = None, index: int = 1) -> Attachment:
    info = region.info if region is not None else None
    return Attachment(session_id=f"s{index}", index=index, namespace="ns", region=info,  # type: ignore[arg-type]
                      lease_ms=10000, heartbeat_ms=2000, stream_saves=True)


class Wire:
    """What StreamSaves sends, per attachment; `current` is the link's."""

    def __init__(self, current: Attachment) -> None:
        self.current: Attachment | None = current
        self.sent: list[Any] = []

    def send_on(self, attachment: Attachment, message: Any) -> bool:
        if attachment is not self.current:
            return False
        self.sent.append(message)
        return True


def allocated(request_id: int, entry_id: int = 5, status: Any = pb.ALLOCATED) -> Any:
    return pb.SaveAllocation(request_id=request_id, status=status, entry_id=entry_id,
                             extents=[pb.Extent(offset=page(0), length=PAGE)])


ASKS = [(f"k{i}", PAGE, (PAGE,), "uint8") for i in range(3)]


def test_a_batch_is_one_message_and_answers_match_their_requests_in_any_order():
    a = attachment_of()
    wire = Wire(a)
    saves = StreamSaves(wire.send_on)
    ids = saves.allocate(a, ASKS)
    assert ids is not None and len(set(ids)) == 3 and 0 not in ids
    (message,) = wire.sent
    assert [x.mm_hash for x in message.allocations] == ["k0", "k1", "k2"]
    assert [x.request_id for x in message.allocations] == ids
    assert saves.outstanding == 3  # pipelined: all three asked at once
    saves.on_message(news(allocations=[allocated(i, entry_id=i + 100)
                                                   for i in reversed(ids)]))
    assert [saves.wait(i, 5.0).entry_id for i in ids] == [i + 100 for i in ids]
    assert saves.outstanding == 0


def test_reports_ride_on_the_next_allocations_and_are_answered_by_id():
    a = attachment_of()
    wire = Wire(a)
    saves = StreamSaves(wire.send_on)
    answers: list[tuple[str, int | None]] = []
    report = Report(saved=["a", "b"], aborted=["c"],
                    on_reported=lambda h, status: answers.append((h, status)))
    ids = saves.allocate(a, ASKS[:1], report)
    assert ids is not None
    (message,) = wire.sent
    assert [(r.mm_hash, r.saved) for r in message.reports] == [("a", True), ("b", True),
                                                               ("c", False)]
    assert message.reports[2].request_id == 0  # an abort is not answered
    report_ids = [r.request_id for r in message.reports[:2]]
    saves.on_message(news(reported=[
        pb.SaveReported(request_id=report_ids[1], status=pb.UNKNOWN),
        pb.SaveReported(request_id=report_ids[0], status=pb.ACCEPTED)]))
    assert sorted(answers) == [("a", pb.ACCEPTED), ("b", pb.UNKNOWN)]
    assert saves.outstanding == 1  # the allocation


def test_an_allocation_answered_after_its_deadline_is_aborted():
    clock = Clock()
    a = attachment_of()
    wire = Wire(a)
    saves = StreamSaves(wire.send_on, clock=clock)
    (late, never) = saves.allocate(a, ASKS[:2]) or []
    clock.now += 5.0
    assert saves.wait(late, 5.0) is None and saves.wait(never, 5.0) is None
    assert saves.outstanding == 0
    saves.on_message(news(allocations=[allocated(late),
                                                   allocated(never, status=pb.ALREADY_READY)]))
    abort = wire.sent[-1]
    assert [(r.mm_hash, r.saved, r.request_id) for r in abort.reports] == [("k0", False, 0)]
    assert len(wire.sent) == 2  # nothing for the one that was not allocated


def test_a_waiting_save_ends_when_the_stream_is_lost():
    a = attachment_of()
    wire = Wire(a)
    saves = StreamSaves(wire.send_on)
    answers: list[tuple[str, int | None]] = []
    assert saves.report(a, Report(saved=["r"], on_reported=lambda h, s: answers.append((h, s))))
    (request_id,) = saves.allocate(a, ASKS[:1]) or []
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(saves.wait(request_id, 60.0)))
    waiter.start()
    time.sleep(0.05)
    wire.current = None
    saves.detached()
    waiter.join(5)
    assert not waiter.is_alive() and got == [None]
    assert answers == [("r", None)] and saves.outstanding == 0
    # A later answer (another stream's ids never repeat these) changes nothing.
    saves.on_message(news(allocations=[allocated(request_id)]))
    assert len(wire.sent) == 2


def test_nothing_is_asked_on_an_attachment_that_is_no_longer_the_links():
    old, new = attachment_of(index=1), attachment_of(index=2)
    wire = Wire(new)
    saves = StreamSaves(wire.send_on)
    assert saves.allocate(old, ASKS) is None
    assert not saves.report(old, Report(saved=["x"]))
    assert saves.outstanding == 0 and wire.sent == []


def test_reports_unanswered_past_the_deadline_are_given_up():
    clock = Clock()
    a = attachment_of()
    wire = Wire(a)
    saves = StreamSaves(wire.send_on, clock=clock)
    answers: list[tuple[str, int | None]] = []
    assert saves.report(a, Report(saved=["x"], on_reported=lambda h, s: answers.append((h, s))))
    assert saves.expire(5.0) == 0
    clock.now += 5.0
    assert saves.expire(5.0) == 1 and answers == [("x", None)]
    (report_id,) = [r.request_id for r in wire.sent[0].reports]
    saves.on_message(news(reported=[pb.SaveReported(request_id=report_id,
                                                                status=pb.ACCEPTED)]))
    assert answers == [("x", None)]  # too late: counted once, as lost


# ------------------------------------------------------- through the saver


class StandInDaemon:
    """Answers the worker's stream messages as the daemon would: pages
    allocated one after the other in `region`, stamped; reports accepted.
    `answering=False`: it reads and never answers."""

    def __init__(self, worker: WorkerDelegate, region: Region, answering: bool = True) -> None:
        self.worker = worker
        self.region = region
        self.answering = answering
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.messages: list[Any] = []
        self.extents: dict[str, tuple[tuple[int, int], ...]] = {}
        self.next_page = 0
        self.entry_id = 10
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            message = self.outbox.get()
            if message is None:
                return
            self.messages.append(message)
            if self.answering:
                self.worker.on_message(self._answer(message))

    def _answer(self, message: Any) -> Any:
        answer = pb.DaemonMessage()
        for report in message.reports:
            if report.request_id:
                answer.reported.add(request_id=report.request_id, status=pb.ACCEPTED)
        for asked in message.allocations:
            pages = -(-asked.nbytes // PAGE)
            extents = ((page(self.next_page), asked.nbytes),)
            self.next_page += pages
            self.entry_id += 1
            self.region.stamp(extents, self.entry_id)
            self.extents[asked.mm_hash] = extents
            answer.allocations.add(request_id=asked.request_id, status=pb.ALLOCATED,
                                   entry_id=self.entry_id,
                                   extents=[pb.Extent(offset=o, length=n) for o, n in extents])
        return daemon_news(answer)

    def stop(self) -> None:
        self.outbox.put(None)
        self._thread.join(5)


class CudaModelWorker(WorkerDelegate):
    """A worker on the CUDA copy path under the model of CUDA's rules
    (tests/cuda_model.py): its outputs are the model's device tensors."""

    def save(self, mm_hash: str, output: Any) -> bool:
        model = self.backend.model  # type: ignore[attr-defined]
        return super().save(mm_hash, model.to_device(torch.from_numpy(output)))


@pytest.fixture(params=["cpu", "cuda-model"])
def stream_worker(tmp_path, request) -> Iterator[tuple[WorkerDelegate, Region]]:
    """A worker with the cpu backend, and one on the CUDA copy path."""
    if request.param == "cpu":
        w = WorkerDelegate("unix:///nonexistent/ec.sock", engine_id="E", layout=LAYOUT,
                           start=False, deadline_seconds=1.0)
    else:
        w = CudaModelWorker("unix:///nonexistent/ec.sock", engine_id="E", layout=LAYOUT,
                            start=False, deadline_seconds=1.0, backend=cuda_model.Backend(
                                chunk_bytes=3 * PAGE // 2, wait_pinned=True))
    region = Region(tmp_path, 0xA)
    w.on_attached(attachment_of(region))
    yield w, region
    w.link._attachment = None
    w.close()
    if request.param != "cpu":
        assert w.backend.model.violations == []  # type: ignore[attr-defined]


def attach(worker: WorkerDelegate, daemon: StandInDaemon, region: Region) -> Attachment:
    """As the link does once the stream opened: the attachment and its outbox."""
    a = attachment_of(region)
    worker.link._outbox = daemon.outbox  # type: ignore[assignment]
    worker.link._attachment = a
    worker.link.fresh_until = time.monotonic() + 100
    return a


def test_queued_saves_go_in_one_message_and_land_in_their_pages(stream_worker):
    worker, region = stream_worker
    daemon = StandInDaemon(worker, region)
    attach(worker, daemon, region)
    gate = threading.Event()
    real_save = worker.backend.save
    worker.backend.save = lambda *a: (gate.wait(10), real_save(*a))  # type: ignore[method-assign]
    outputs = {f"k{i}": np.full(PAGE, i, np.uint8) for i in range(4)}
    try:
        for mm_hash, output in outputs.items():
            assert worker.save(mm_hash, output)
        gate.set()
        assert worker.flush(10)
    finally:
        daemon.stop()
    assert worker.stats["saves_done"] == 4 and sum(worker.transport.calls.values()) == 0
    allocations = [len(m.allocations) for m in daemon.messages if m.allocations]
    assert sum(allocations) == 4 and len(allocations) <= 2  # queued during the first copy
    reported = [r.mm_hash for m in daemon.messages for r in m.reports if r.saved]
    assert sorted(reported) == sorted(outputs)
    data = region.path.read_bytes()
    for mm_hash, output in outputs.items():
        ((offset, length),) = daemon.extents[mm_hash]
        assert data[offset:offset + length] == output.tobytes()


def test_a_save_whose_answer_never_comes_is_given_up_at_the_deadline(stream_worker):
    worker, region = stream_worker
    daemon = StandInDaemon(worker, region, answering=False)
    attach(worker, daemon, region)
    try:
        started = time.monotonic()
        assert worker.save("k", np.zeros(PAGE, np.uint8)) and worker.flush(10)
        assert 0.9 < time.monotonic() - started < 5  # the 1 s deadline
    finally:
        daemon.stop()
    assert worker.stats["saves_failed"] == 1 and worker.queued_bytes == 0


def test_a_detach_mid_save_ends_it_and_later_saves_are_skipped(stream_worker):
    worker, region = stream_worker
    daemon = StandInDaemon(worker, region, answering=False)
    attach(worker, daemon, region)
    try:
        assert worker.save("k", np.zeros(PAGE, np.uint8))
        while not daemon.messages:
            time.sleep(0.01)
        worker.link._attachment = None  # the stream is lost, as the link sees it
        worker.on_detached()
        assert worker.flush(0.5)  # at once, not at the deadline
        assert not worker.save("later", np.zeros(PAGE, np.uint8))
    finally:
        daemon.stop()
    assert worker.stats["saves_failed"] == 1 and worker.stats["saves_skipped_detached"] == 1


def test_a_saver_whose_session_is_not_fresh_aborts_on_the_stream(stream_worker):
    worker, region = stream_worker
    daemon = StandInDaemon(worker, region)
    attach(worker, daemon, region)
    worker.link.fresh_until = 0.0  # as after a freeze past the lease
    try:
        assert worker.save("k", np.full(PAGE, 7, np.uint8)) and worker.flush(10)
    finally:
        daemon.stop()
    assert worker.stats["saves_stale"] == 1 and worker.stats["saves_done"] == 0
    aborted = [r.mm_hash for m in daemon.messages for r in m.reports if not r.saved]
    assert aborted == ["k"]
    ((offset, length),) = daemon.extents["k"]
    assert region.path.read_bytes()[offset:offset + length] == bytes(length)  # never copied
