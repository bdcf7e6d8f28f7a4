"""The scheduler delegate without a daemon: the link is a stand-in whose
freshness the test sets and whose sends are recorded, and daemon messages
are handed to the delegate as the link thread would. Workers are stood in
for by the reports they would send (`apply_worker_output`)."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ec_client.scheduler_side.staging as staging
from ec_client.common.contract import CHECKSUM_MISMATCH, UNUSABLE, RegionInfo
from ec_client.common.limits import ADOPT_STEPS, UNUSABLE_SECONDS
from ec_client.common.session import Attachment
from ec_client.common.wire import DaemonNews, Outgoing
from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.scheduler_side.staging import Stage
from ec_protocol.checksums import checksum
from ec_protocol.protocol import Layout, pb
from tests.unit.daemon_news import news

LAYOUT = Layout("m", "float32", {"image": 4096})
# The scheduler answers hits only for a region file it can open: these exist
# while the module's tests run (made by `region_files`, not at import: a run
# that collects the module and runs none of its tests leaves nothing behind).
FOLDER = Path(tempfile.gettempdir()) / f"ecd-sched-{os.getpid()}-{secrets.token_hex(4)}"
REGION = RegionInfo(str(FOLDER / "ec-daemon-a.region"), 1 << 20, 0xA, 4096, 4096)
NEW_REGION = RegionInfo(str(FOLDER / "ec-daemon-b.region"), 1 << 20, 0xB, 4096, 4096)


@pytest.fixture(scope="module", autouse=True)
def region_files() -> Iterator[None]:
    FOLDER.mkdir(mode=0o700)
    for region in (REGION, NEW_REGION):
        Path(region.path).write_bytes(b"")
    yield
    shutil.rmtree(FOLDER, ignore_errors=True)


def attachment(region: RegionInfo = REGION, index: int = 7,
               producer_claims: bool = True) -> Attachment:
    return Attachment(session_id=f"s{index}", index=index, namespace="ns", region=region,
                      lease_ms=10000, heartbeat_ms=2000, producer_claims=producer_claims)


# What a daemon says with its snapshot when both ranks of an engine mapped the region.
ALL_MAPPED = pb.EngineRanks(mapped=2, world_size=2)


def ready(mm_hash: str, entry_id: int, nbytes: int = 4096,
          ranks: pb.EngineRanks = ALL_MAPPED, checksum: int = 0) -> DaemonNews:
    return news(ready=[pb.EntryInfo(
        mm_hash=mm_hash, entry_id=entry_id, nbytes=nbytes, shape=[nbytes // 4],
        dtype="float32", extents=[pb.Extent(offset=4096 + entry_id * 4096, length=nbytes)],
        checksum=checksum)], snapshot_done=True, ranks=ranks)


def evicted(*refs: tuple[str, int]) -> DaemonNews:
    return news(evicted=[pb.EntryRef(mm_hash=h, entry_id=e) for h, e in refs])


def make(role: str = "both", ranks: int = 1, **options: Any) -> SchedulerDelegate:
    d = SchedulerDelegate("unix:///nonexistent/ec.sock", engine_id="E", layout=LAYOUT,
                          role=role, ranks=ranks, start=False, **options)
    d.acks = []
    d.freshness = True
    d.link.fresh = lambda: d.freshness

    def send_acks(acks):
        d.acks += acks
        return True

    d.link.send_acks = send_acks
    d.on_attached(attachment())
    return d


@pytest.fixture
def delegate() -> Iterator[SchedulerDelegate]:
    d = make()
    yield d
    d.transport.close()


@pytest.fixture
def two_ranks() -> Iterator[SchedulerDelegate]:
    d = make(ranks=2)
    yield d
    d.transport.close()


def dispatch(d: SchedulerDelegate, *mm_hashes: str) -> dict[str, int]:
    """One step that stages `mm_hashes` (their requests deferred): their
    transfer ids."""
    for i, mm_hash in enumerate(mm_hashes):
        assert not d.ensure([mm_hash], f"req-{mm_hash}-{i}")
    return {spec.mm_hash: spec.transfer_id for spec in d.build_step_metadata().loads}


def staged(d: SchedulerDelegate, *mm_hashes: str) -> dict[str, int]:
    """`dispatch`, and every rank reports each staged: their transfer ids."""
    ids = dispatch(d, *mm_hashes)
    d.apply_worker_output(done=list(ids.values()) * d.ranks)
    return ids


def used(d: SchedulerDelegate, *mm_hashes: str) -> Any:
    """A step whose requests use these staged items: its metadata."""
    for mm_hash in mm_hashes:
        assert d.has_item(mm_hash), mm_hash
        assert d.after_alloc(f"use-{mm_hash}", mm_hash)
    return d.build_step_metadata(tokens=1)


def test_a_ready_item_is_staged_a_step_before_its_use_without_any_rpc(delegate):
    assert delegate.ensure(["a"], "r1")  # not in the cache: encoded (nobody else asked)
    assert not delegate.has_item("a")
    delegate.on_message(ready("a", 3, nbytes=8192))
    assert not delegate.ensure(["a"], "r1")  # in the cache: deferred while it is staged
    assert not delegate.has_item("a")
    meta = delegate.build_step_metadata()
    (spec,) = meta.loads
    assert (spec.mm_hash, spec.entry_id, spec.generation, spec.nbytes) == ("a", 3, 0xA, 8192)
    assert spec.extents == ((4096 + 3 * 4096, 8192),)
    assert (spec.shape, spec.dtype) == ((2048,), "float32")
    assert meta.regions == {0xA: REGION} and meta.adopt == [] and meta.step == 1
    assert delegate.view.inflight() == 1  # its eviction waits for the workers' reports
    assert not delegate.ensure(["a"], "r1")  # staging: deferred, not staged twice
    assert delegate.build_step_metadata().loads == []

    delegate.apply_worker_output(done=[spec.transfer_id])
    assert delegate.view.inflight() == 0
    assert delegate.ensure(["a"], "r1")  # staged on every rank: a hit now
    assert delegate.has_item("a") and delegate.after_alloc("r1", "a")
    meta = delegate.build_step_metadata(tokens=20)
    assert [(a.mm_hash, a.transfer_id) for a in meta.adopt] == [("a", spec.transfer_id)]
    assert meta.loads == [] and meta.step == 3
    assert not delegate.has_item("a")  # adopted: vLLM's encoder cache holds it now
    assert sum(delegate.transport.calls.values()) == 0
    assert delegate.acks == []


def test_a_step_without_hits_sends_an_empty_metadata(delegate):
    delegate.on_message(ready("a", 1))
    assert not delegate.has_item("b")
    meta = delegate.build_step_metadata()
    assert (meta.loads, meta.adopt, meta.drop, meta.inline, meta.regions) == ([], [], [], [], {})


def test_transfer_ids_are_unique_per_staging(delegate):
    delegate.on_message(ready("a", 1))
    ids = []
    for i in range(3):
        ids.append(staged(delegate, "a")["a"])
        used(delegate, "a")
        delegate.request_finished(f"req-a-{i}", ["a"])
    assert len(set(ids)) == 3


def test_nothing_is_staged_while_the_session_is_not_fresh(delegate):
    delegate.on_message(ready("a", 1))
    delegate.freshness = False
    assert delegate.ensure(["a"], "r")  # a miss: encoded
    assert not delegate.has_item("a") and not delegate.after_alloc("r", "a")
    assert delegate.build_step_metadata().loads == []
    delegate.freshness = True
    assert not delegate.ensure(["a"], "r")
    assert delegate.stage("a", "r") is Stage.WAIT


def test_a_staged_item_stays_a_hit_while_the_daemon_is_gone(delegate):
    """Its bytes are on the workers already: nothing of the daemon's is needed."""
    delegate.on_message(ready("a", 1))
    staged(delegate, "a")
    delegate.freshness = False
    delegate.on_detached()
    assert delegate.ensure(["a"], "r") and delegate.has_item("a")


def test_nothing_is_staged_while_detached(delegate):
    delegate.on_message(ready("a", 1))
    delegate.on_detached()
    assert delegate.stage("a", "r") is Stage.ABSENT
    assert len(delegate.view) == 0


def test_producers_never_stage():
    d = make(role="producer")
    try:
        d.on_message(ready("a", 1))
        assert d.ensure(["a"], "r") and d.stage("a", "r") is Stage.ABSENT
        assert not d.has_item("a")
    finally:
        d.transport.close()


def test_requests_for_one_item_share_one_staging_and_a_failure_is_a_miss_for_each(delegate):
    delegate.on_message(ready("a", 1))
    assert not delegate.ensure(["a"], "r1") and not delegate.ensure(["a"], "r2")
    (spec,) = delegate.build_step_metadata().loads
    assert delegate.view.inflight() == 1
    delegate.apply_worker_output(failed=[(spec.transfer_id, UNUSABLE)])
    assert delegate.view.inflight() == 0
    # Both go on, and encode it: vLLM asks, and it is no hit.
    assert delegate.ensure(["a"], "r1") and delegate.ensure(["a"], "r2")
    assert delegate.stage("a", "r3") is Stage.FAILED  # (a request without media fails)
    assert not delegate.has_item("a") and not delegate.after_alloc("r1", "a")
    assert delegate.build_step_metadata().loads == []  # not staged again
    assert delegate.take_stats()["load_failures"] == 1


def test_an_entry_whose_bytes_were_wrong_is_never_staged_again_nor_one_unusable_for_a_while(
        delegate, monkeypatch):
    class Clock:
        now = 1000.0

        @classmethod
        def monotonic(cls) -> float:
            return cls.now

    monkeypatch.setattr(staging, "time", Clock)
    delegate.on_message(ready("bad", 1))
    delegate.on_message(ready("odd", 2))
    ids = dispatch(delegate, "bad", "odd")
    delegate.apply_worker_output(failed=[(ids["bad"], CHECKSUM_MISMATCH),
                                         (ids["odd"], UNUSABLE)])
    Clock.now += UNUSABLE_SECONDS + 1
    assert delegate.stage("bad", "r", now=Clock.now) is Stage.FAILED
    assert delegate.stage("odd", "r", now=Clock.now) is Stage.WAIT  # tried again
    delegate.on_message(evicted(("bad", 1)))
    delegate.on_message(ready("bad", 7))  # saved again: another entry
    assert delegate.stage("bad", "r", now=Clock.now) is Stage.WAIT


def test_a_staging_eviction_waits_for_the_reports_and_a_claim_for_the_step_end(delegate):
    delegate.on_message(ready("a", 1))
    assert not delegate.ensure(["a"], "r")  # claimed: planned
    delegate.on_message(evicted(("a", 1)))  # before the step's metadata is built
    assert delegate.acks == []
    (spec,) = delegate.build_step_metadata().loads
    assert delegate.acks == []  # the load is in flight
    assert delegate.stage("a", "r2") is Stage.WAIT  # (the staging goes on)
    delegate.apply_worker_output(done=[spec.transfer_id])
    assert delegate.acks == [("a", 1)]
    assert delegate.has_item("a")  # its bytes are on the workers: still a hit


def test_a_planned_load_whose_request_ended_is_not_sent(delegate):
    delegate.on_message(ready("a", 1))
    assert not delegate.ensure(["a"], "r")
    delegate.on_message(evicted(("a", 1)))
    delegate.request_finished("r", ["a"])  # aborted before the step's end
    assert delegate.build_step_metadata().loads == []
    assert delegate.acks == [("a", 1)] and delegate.view.inflight() == 0


def test_with_two_ranks_the_ack_waits_for_both_reports_in_any_order(two_ranks):
    d = two_ranks
    d.on_message(ready("a", 1))
    d.on_message(ready("b", 2))
    ids = dispatch(d, "a", "b")
    d.on_message(evicted(("a", 1), ("b", 2)))
    assert d.acks == []
    d.apply_worker_output(done=[ids["b"], ids["a"]])  # one rank reported both
    d.build_step_metadata()
    assert d.acks == [] and not d.has_item("a")
    d.apply_worker_output(done=[999_999])  # a report of nothing dispatched: ignored
    d.apply_worker_output(done=[ids["b"]])  # the other rank, one step apart
    assert d.acks == [("b", 2)]
    d.build_step_metadata()
    d.apply_worker_output(done=[ids["a"]])
    assert d.acks == [("b", 2), ("a", 1)]
    d.apply_worker_output(done=[ids["a"], ids["b"]])  # late duplicates change nothing
    assert d.acks == [("b", 2), ("a", 1)] and d.view.inflight() == 0
    assert d.has_item("a") and d.has_item("b")


def test_a_failed_report_is_that_ranks_and_the_ranks_that_staged_it_drop_it(two_ranks):
    d = two_ranks
    d.on_message(ready("a", 1))
    ids = dispatch(d, "a")
    d.on_message(evicted(("a", 1)))
    d.apply_worker_output(failed=[(ids["a"], UNUSABLE)])
    assert d.acks == []  # the other rank may still be copying
    assert d.stage("a", "req-a-0") is Stage.WAIT
    d.apply_worker_output(done=[ids["a"]])  # the other rank staged it
    assert d.acks == [("a", 1)]
    assert d.ensure(["a"], "req-a-0") and not d.has_item("a")  # a miss: encoded
    assert d.build_step_metadata(tokens=1).drop == [ids["a"]]
    assert d.take_stats()["load_failures"] == 1


def test_a_reattach_before_the_step_end_stages_from_the_old_region_and_spares_the_new_view(
        delegate):
    delegate.on_message(ready("a", 1))
    assert not delegate.ensure(["a"], "r")
    delegate.on_detached()  # the daemon restarted between the plan and the step's end
    delegate.on_attached(attachment(NEW_REGION, index=8))
    delegate.on_message(ready("a", 1))  # entry ids restart with the daemon
    meta = delegate.build_step_metadata()
    (spec,) = meta.loads
    assert spec.generation == 0xA and meta.regions == {0xA: REGION}  # the saved bytes
    assert delegate.view.inflight() == 0  # not the new view's load
    delegate.on_message(evicted(("a", 1)))
    assert delegate.acks == [("a", 1)]  # the new daemon's entry is not held
    delegate.apply_worker_output(done=[spec.transfer_id])
    assert delegate.acks == [("a", 1)]  # and the old load's report acks nothing
    assert delegate.has_item("a")


@pytest.mark.parametrize("moment", ["before the view is read", "after the view is read"])
def test_a_reattach_during_a_lookup_never_pairs_an_entry_with_another_region(delegate, moment):
    """`stage` reads the attachment, then the view, and the link thread may
    re-attach to a restarted daemon in between. Entry ids restart with the
    daemon, so a new entry's extents in the old region may carry the same
    stamp over other bytes: a load must name the region its entry came from."""
    delegate.on_message(ready("a", 1))

    def reattach() -> None:
        delegate.on_detached()
        delegate.on_attached(attachment(NEW_REGION, index=8))
        delegate.on_message(ready("a", 1, nbytes=8192))

    class Entries(dict):
        def get(self, key, default=None):
            if moment == "before the view is read":
                reattach()
            value = super().get(key, default)
            if moment == "after the view is read":
                reattach()
            return value

    delegate.view._entries = Entries(delegate.view._entries)
    delegate.stage("a", "r")
    delegate.view._entries = dict(delegate.view._entries)
    for spec in delegate.build_step_metadata().loads:
        assert (spec.generation, spec.nbytes) in ((0xA, 4096), (0xB, 8192))
        delegate.request_finished("r", ["a"])
        delegate.apply_worker_output(done=[spec.transfer_id])
    assert not delegate.ensure(["a"], "r2")  # staged from the new view
    (spec,) = delegate.build_step_metadata().loads
    assert (spec.generation, spec.nbytes) == (0xB, 8192)


def test_a_load_whose_reports_never_arrive_is_released_after_the_ttl(delegate, monkeypatch):
    class Clock:
        now = 1000.0

        @classmethod
        def monotonic(cls) -> float:
            return cls.now

    import ec_client.scheduler_side.scheduler as scheduler

    monkeypatch.setattr(staging, "time", Clock)
    monkeypatch.setattr(scheduler, "time", Clock)
    delegate.on_message(ready("a", 1))
    ids = dispatch(delegate, "a")
    delegate.on_message(evicted(("a", 1)))
    # Its request goes on as a miss once it waited its bound, the pages stay.
    Clock.now += delegate.max_defer_seconds + 1
    assert delegate.stage("a", "r") is Stage.FAILED
    delegate.build_step_metadata()
    assert delegate.acks == []
    Clock.now += staging.INFLIGHT_TTL_SECONDS
    delegate.build_step_metadata()
    assert delegate.acks == [("a", 1)] and delegate.view.inflight() == 0
    delegate.apply_worker_output(done=[ids["a"]])  # a report that comes after all
    assert delegate.acks == [("a", 1)] and not delegate.has_item("a")


def test_staged_loads_no_request_uses_are_dropped(delegate):
    delegate.on_message(ready("a", 1))
    delegate.on_message(ready("b", 2))
    ids = staged(delegate, "a", "b")
    delegate.request_finished("req-a-0", ["a"])  # aborted while its load was staged
    assert not delegate.has_item("a")
    assert delegate.build_step_metadata().drop == [ids["a"]]
    assert delegate.staging.bytes == 4096  # "b" alone
    for _ in range(ADOPT_STEPS):  # "b"'s request never runs (no KV room)
        delegate.build_step_metadata()
    assert not delegate.has_item("b")
    assert delegate.staging.bytes == 0
    assert not delegate.ensure(["b"], "req-b-1")  # staged again when it asks again


def test_a_load_staging_when_its_request_ends_is_dropped_once_reported(delegate):
    delegate.on_message(ready("a", 1))
    ids = dispatch(delegate, "a")
    delegate.request_finished("req-a-0", ["a"])
    delegate.apply_worker_output(done=[ids["a"]])
    assert not delegate.has_item("a")
    assert delegate.build_step_metadata().drop == [ids["a"]]


def test_staged_loads_hold_at_most_the_staging_bytes(delegate):
    d = make(staging_bytes=8192)
    try:
        for i, key in enumerate(("a", "b", "c")):
            d.on_message(ready(key, i + 1))
        assert not d.ensure(["a"], "r1") and not d.ensure(["b"], "r2")
        assert d.ensure(["c"], "r3")  # no room: a miss, encoded
        assert [spec.mm_hash for spec in d.build_step_metadata().loads] == ["a", "b"]
        assert d.staging.bytes == 8192
    finally:
        d.transport.close()


def test_steps_the_workers_do_not_run_stage_here_and_the_bytes_ride_the_step_that_uses_them(
        tmp_path):
    """vLLM's V1 model runner runs no EC connector in a step without tokens:
    such a step's loads are copied and verified in this process."""
    region = RegionInfo(str(tmp_path / "ec-daemon-r.region"), 1 << 20, 0xA, 4096, 4096)
    content = bytearray(region.size)
    content[8:16] = (1).to_bytes(8, "little")  # page 1 carries entry 1's stamp
    content[4096 + 4096:4096 + 8192] = bytes(range(256)) * 16
    content[24:32] = (2).to_bytes(8, "little")  # page 3: entry 2's, whose pages change
    Path(region.path).write_bytes(content)
    d = make(workers_run_idle_steps=False)
    try:
        d.on_detached()
        d.on_attached(attachment(region, index=9))
        d.on_message(ready("a", 1))
        d.on_message(ready("b", 2))
        assert not d.ensure(["a", "b"], "r")
        d.on_message(evicted(("b", 2)))
        with open(region.path, "r+b") as f:  # b's pages were given to entry 5
            f.seek(24)
            f.write((5).to_bytes(8, "little"))
        meta = d.build_step_metadata(scheduled={}, tokens=0)
        assert meta.loads == [] and meta.step == 0  # the workers never see it
        assert d.view.inflight() == 0 and d.acks == [("b", 2)]
        touched = [(t.mm_hash, t.entry_id) for t in d.heartbeat_message().touches]
        assert touched == [("a", 1)]  # the daemon's recency and load counts hear of it
        assert d.stage("b", "r") is Stage.FAILED  # its stamps moved
        assert d.ensure(["a"], "r") and d.has_item("a") and d.after_alloc("r", "a")
        meta = d.build_step_metadata(tokens=18)
        (inline,) = meta.inline
        assert (inline.mm_hash, inline.shape, inline.dtype) == ("a", (1024,), "float32")
        assert bytes(inline.payload) == bytes(range(256)) * 16
        assert meta.adopt == [] and meta.step == 1
        stats = d.take_stats()
        assert stats["loads_inline"] == 1 and stats["load_failures"] == 1
    finally:
        d.close()


def test_a_load_whose_bytes_were_rewritten_is_told_to_the_daemon_once(two_ranks):
    d = two_ranks
    sent: list[Outgoing] = []
    d.link.send = lambda message: sent.append(message) or True
    d.on_message(ready("a", 1))
    ids = dispatch(d, "a")
    d.apply_worker_output(failed=[(ids["a"], CHECKSUM_MISMATCH)] * 2)  # both ranks found it
    d.build_step_metadata()
    assert [[(r.mm_hash, r.entry_id) for r in m.mismatches] for m in sent if m.mismatches] == [
        [("a", 1)]]
    assert d.stage("a", "r2") is Stage.FAILED  # never staged again, by this engine


def test_loads_staged_here_are_checked_against_their_checksum(tmp_path):
    region = RegionInfo(str(tmp_path / "ec-daemon-s.region"), 1 << 20, 0xA, 4096, 4096)
    content = bytearray(region.size)
    for entry_id in (1, 2):
        content[8 * entry_id:8 * entry_id + 8] = entry_id.to_bytes(8, "little")
        content[4096 + entry_id * 4096:4096 + (entry_id + 1) * 4096] = bytes([entry_id]) * 4096
    Path(region.path).write_bytes(content)
    good = checksum([bytes([1]) * 4096])
    d = make(workers_run_idle_steps=False, verify_checksum=True)
    sent: list[Outgoing] = []
    d.link.send = lambda message: sent.append(message) or True
    try:
        d.on_detached()
        d.on_attached(attachment(region, index=9))
        d.on_message(ready("a", 1, checksum=good))
        d.on_message(ready("b", 2, checksum=good))  # not what its pages hold
        assert not d.ensure(["a", "b"], "r")
        d.build_step_metadata(tokens=0)
        assert d.stage("a", "r") is Stage.STAGED and d.stage("b", "r") is Stage.FAILED
        assert [(r.mm_hash, r.entry_id) for m in sent for r in m.mismatches] == [("b", 2)]
    finally:
        d.close()


def test_stats_and_heartbeats_each_see_every_lookup_once(delegate):
    delegate.on_message(ready("a", 1, nbytes=8192))
    delegate.has_item("x")
    delegate.has_item("y")
    staged(delegate, "a")
    used(delegate, "a")
    stats = delegate.take_stats()
    assert (stats["lookups"], stats["hits"], stats["loads"], stats["load_bytes"]) == (
        3, 1, 1, 8192)
    beat = delegate.heartbeat_message()  # the heartbeat counts independently of vLLM's stats
    assert (beat.heartbeat.lookups, beat.heartbeat.hits) == (3, 1)
    assert [(t.mm_hash, t.entry_id) for t in beat.touches] == [("a", 1)]
    empty = delegate.take_stats()
    assert all(v == 0 for v in empty.values())
    beat = delegate.heartbeat_message()
    assert (beat.heartbeat.lookups, beat.heartbeat.hits, len(beat.touches)) == (0, 0, 0)
    delegate.has_item("a")  # adopted: vLLM holds it; a lookup would miss
    delegate.has_item("z")
    beat = delegate.heartbeat_message()
    assert (beat.heartbeat.lookups, beat.heartbeat.hits) == (2, 0)
    stats = delegate.take_stats()
    assert (stats["lookups"], stats["hits"], stats["loads"]) == (2, 0, 0)


def test_heartbeat_counts_stay_consistent_under_concurrent_lookups(delegate):
    import threading

    delegate.on_message(ready("a", 1))
    staged(delegate, "a")
    stop = threading.Event()
    beats = []

    def beat() -> None:
        while not stop.is_set():
            beats.append(delegate.heartbeat_message().heartbeat)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        for i in range(20000):
            delegate.has_item("a" if i % 2 else "b")
    finally:
        stop.set()
        thread.join(10)
    beats.append(delegate.heartbeat_message().heartbeat)
    assert all(b.hits <= b.lookups for b in beats)
    assert sum(b.lookups for b in beats) == 20000 and sum(b.hits for b in beats) == 10000


def test_nothing_is_staged_until_every_worker_rank_mapped_the_region(two_ranks):
    """A rank that cannot map the region (another container's /dev/shm,
    another node) would fail the load: until the daemon counts every rank's
    stream, items miss and nothing is deferred for other engines."""
    d = two_ranks
    d.on_message(news(namespace_info=pb.NamespaceInfo(engines=2)))
    d.on_message(ready("a", 1, ranks=pb.EngineRanks(mapped=1, world_size=2)))
    sent = []
    d.link.send = lambda message: sent.append(message) or True
    assert d.ensure(["a"], "r") and d.ensure(["b"], "r") and sent == []  # nothing wanted
    assert not d.has_item("a")
    d.build_step_metadata()
    d.on_message(news(ranks=pb.EngineRanks(mapped=2, world_size=2)))
    assert not d.ensure(["a"], "r")
    assert len(d.build_step_metadata().loads) == 1
    d.on_message(news(ranks=pb.EngineRanks(mapped=1, world_size=2)))  # one died
    d.on_message(ready("c", 3, ranks=pb.EngineRanks(mapped=1, world_size=2)))
    assert d.stage("c", "r") is Stage.ABSENT


def test_a_rank_the_executor_does_not_count_must_map_the_region_too(delegate):
    """Under an executor that reports one rank's output (`ranks` 1), the
    workers' world size still says how many ranks load."""
    delegate.on_message(ready("a", 1, ranks=pb.EngineRanks(mapped=1, world_size=2)))
    assert delegate.stage("a", "r") is Stage.ABSENT
    delegate.on_message(news(ranks=pb.EngineRanks(mapped=2, world_size=2)))
    assert delegate.stage("a", "r") is Stage.WAIT


def test_a_reattach_forgets_which_ranks_had_mapped_the_old_region(delegate):
    delegate.on_message(ready("a", 1))
    delegate.on_detached()
    delegate.on_attached(attachment(NEW_REGION, index=8))
    delegate.on_message(ready("a", 1, ranks=pb.EngineRanks()))  # no rank has attached yet
    assert delegate.stage("a", "r") is Stage.ABSENT


def test_a_region_this_host_cannot_open_is_never_answered_for(delegate):
    """A scheduler left with a restarted container's old /dev/shm sees a new
    region it cannot open: it refuses the attachment (the link tries again
    later) and stages nothing, rather than loads its workers could not make."""
    missing = RegionInfo(str(FOLDER / "ec-daemon-c.region"), 1 << 20, 0xC, 4096, 4096)
    delegate.on_detached()
    with pytest.raises(FileNotFoundError):
        delegate.on_attached(attachment(missing, index=9))
    delegate.on_message(ready("img", 1))
    assert delegate.stage("img", "r") is Stage.ABSENT


def wanting(d: SchedulerDelegate) -> list[Outgoing]:
    """`d` shares its namespace (wants help); returns what it sends from now on."""
    d.on_message(ready("other", 9))
    d.on_message(news(namespace_info=pb.NamespaceInfo(engines=2)))
    sent: list[Outgoing] = []
    d.link.send = lambda message: sent.append(message) or True
    return sent


def answer(d: SchedulerDelegate, mm_hash: str, verdict: int) -> None:
    d.on_message(news(answers=[pb.Answer(mm_hash=mm_hash, verdict=verdict)]))


def answering(d: SchedulerDelegate, verdicts: dict[str, int]) -> list[Outgoing]:
    """As `wanting`, and a daemon that answers each want from another
    thread (as the link thread hands answers over)."""
    sent = wanting(d)

    def send(message: Outgoing) -> bool:
        sent.append(message)
        if message.wants:
            answers = news(answers=[pb.Answer(mm_hash=h, verdict=verdicts[h])
                                                for h in message.wants])
            threading.Thread(target=d.on_message, args=(answers,)).start()
        return True

    d.link.send = send
    return sent


def released(sent: list[Outgoing]) -> list[str]:
    return [h for m in sent for h in m.releases]


def yielded(sent: list[Outgoing]) -> list[str]:
    return [h for m in sent for h in m.yields]


def test_a_claim_whose_request_did_not_run_is_offered_and_stays_wanted(delegate):
    sent = wanting(delegate)
    assert not delegate.ensure(["img"], "r1")  # wanted: deferred until answered
    answer(delegate, "img", pb.VERDICT_ENCODE)
    assert delegate.ensure(["img"], "r1")  # this engine encodes it...
    delegate.build_step_metadata(scheduled={"r0"})  # ...but r1 found no KV room
    assert yielded(sent) == ["img"] and released(sent) == []
    assert delegate.ensure(["img"], "r1")  # nobody waited: still its to encode, no deferral
    answer(delegate, "img", pb.VERDICT_ENCODING)  # someone waited: it encodes, r1 waits
    assert not delegate.ensure(["img"], "r1")
    assert [list(m.wants) for m in sent if m.wants] == [["img"]]  # never asked twice


def test_a_claim_whose_request_runs_is_kept(delegate):
    sent = wanting(delegate)
    delegate.ensure(["img", "later"], "r1")
    answer(delegate, "img", pb.VERDICT_ENCODE)
    answer(delegate, "later", pb.VERDICT_ENCODE)
    assert delegate.ensure(["img", "later"], "r1")
    assert not delegate.after_alloc("r1", "img")  # a miss: encoded this step
    delegate.build_step_metadata(scheduled={"r1"})  # "later" is in a later chunk
    assert yielded(sent) == []
    assert delegate.ensure(["img", "later"], "r1")
    delegate.ensure(["later"], "r2")  # another request needs it too, and runs
    delegate.build_step_metadata(scheduled={"r2"})
    assert yielded(sent) == []
    delegate.ensure(["img", "later"], "r1")
    delegate.build_step_metadata()  # without the scheduled ids: what is not encoded
    assert yielded(sent) == ["later"]


def test_an_item_this_engine_encodes_is_said_at_the_steps_end_once(delegate):
    """The daemon keeps a claim whose engine says it encodes the item; one
    it hears nothing of passes to a waiting engine within seconds."""
    sent = wanting(delegate)
    delegate.ensure(["img", "theirs"], "r1")
    answer(delegate, "img", pb.VERDICT_ENCODE)
    answer(delegate, "theirs", pb.VERDICT_ENCODING)
    delegate.ensure(["img"], "r1")
    assert not delegate.after_alloc("r1", "img")  # vLLM allocated it: encoded this step
    assert not delegate.after_alloc("r1", "other")  # (never wanted: nothing to say)
    assert [list(m.encoding) for m in sent if m.encoding] == []  # said at the step's end
    delegate.build_step_metadata(scheduled={"r1"})
    assert not delegate.after_alloc("r2", "img")  # (another request: said once)
    delegate.build_step_metadata(scheduled={"r2"})
    assert [list(m.encoding) for m in sent if m.encoding] == [["img"]]


def test_a_deferred_request_offers_the_items_it_was_to_encode(delegate):
    """It waits for another engine's item: its own claims must not make that
    engine (or a third) wait too."""
    sent = wanting(delegate)
    delegate.ensure(["mine", "theirs"], "r1")
    answer(delegate, "mine", pb.VERDICT_ENCODE)
    answer(delegate, "theirs", pb.VERDICT_ENCODING)
    assert not delegate.ensure(["mine", "theirs"], "r1")
    delegate.build_step_metadata(scheduled=set())
    assert yielded(sent) == ["mine"]


def test_a_finished_request_releases_what_no_other_request_needs(delegate):
    sent = wanting(delegate)
    delegate.ensure(["mine", "theirs", "done", "landed", "shared"], "r1")
    delegate.ensure(["shared"], "r2")
    answer(delegate, "mine", pb.VERDICT_ENCODE)
    answer(delegate, "theirs", pb.VERDICT_ENCODING)
    answer(delegate, "done", pb.VERDICT_ENCODE)
    answer(delegate, "landed", pb.VERDICT_READY)
    answer(delegate, "shared", pb.VERDICT_ENCODE)
    delegate.ensure(["mine", "theirs", "done", "landed", "shared"], "r1")
    delegate.after_alloc("r1", "done")  # being encoded: its save ends the claim
    delegate.request_finished("r1", ["mine", "theirs", "done", "landed", "shared", "unknown"])
    assert sorted(released(sent)) == ["mine", "theirs"]  # r2 still needs "shared"
    delegate.request_finished("r2", ["shared"])
    assert sorted(released(sent)) == ["mine", "shared", "theirs"]


def test_ranks_that_never_all_map_the_region_are_warned_about_once(two_ranks, monkeypatch,
                                                                   caplog):
    import ec_client.scheduler_side.rank_mapping as rank_mapping

    caplog.set_level(logging.INFO, logger="ec_client.scheduler_side.rank_mapping")
    d = two_ranks
    d.on_message(ready("a", 1, ranks=pb.EngineRanks(mapped=1, world_size=2)))
    d.heartbeat_message()
    assert "worker ranks mapped" not in caplog.text  # engines start workers after schedulers
    monkeypatch.setattr(rank_mapping, "UNMAPPED_WARNING_SECONDS", 0.0)
    d.heartbeat_message()
    d.heartbeat_message()
    assert caplog.text.count("1 of 2 worker ranks mapped the region; every lookup misses") == 1
    d.on_message(news(ranks=pb.EngineRanks(mapped=2, world_size=2)))
    assert "all 2 worker ranks mapped the region" in caplog.text
    d.on_message(news(ranks=pb.EngineRanks(mapped=1, world_size=2)))  # one died
    assert d.stage("a", "r") is Stage.ABSENT
    d.heartbeat_message()  # (said once it lasts: an engine that stops loses its workers first)
    assert caplog.text.count("1 of 2 worker ranks mapped the region") == 2


@pytest.mark.parametrize("ranks, world_size", [(4, 0), (1, 4)])
def test_every_loading_rank_of_tp_x_pcp_must_map_before_a_hit(ranks, world_size):
    """tp=2 x pcp=2: four loading ranks (each reports each load, or, under an
    executor that returns one rank's output, one report of a world of 4).
    Two ranks that attached as "rank r of 2" (tensor-parallel ranks only:
    the pcp ranks elsewhere) are not all of them: the engine misses."""
    d = make(ranks=ranks, world_size=world_size)
    try:
        d.on_message(ready("a", 1, ranks=pb.EngineRanks(mapped=2, world_size=2)))
        assert d.stage("a", "r") is Stage.ABSENT
        d.on_message(news(ranks=pb.EngineRanks(mapped=3, world_size=4)))
        assert d.stage("a", "r") is Stage.ABSENT
        d.on_message(news(ranks=pb.EngineRanks(mapped=4, world_size=4)))
        assert d.stage("a", "r") is Stage.WAIT
    finally:
        d.transport.close()


def test_the_engine_token_rides_every_steps_metadata():
    """The workers learn it there (and only there) to count as this engine's ranks."""
    d = make(engine_token="ab" * 16)
    try:
        assert d.build_step_metadata().engine_token == "ab" * 16
        assert d.link._request.scheduler.engine_token == "ab" * 16
    finally:
        d.transport.close()


def test_a_cold_miss_the_daemon_answers_in_time_is_scheduled_in_the_same_step():
    """The answer takes a round trip; a deferral would take a whole step."""
    d = make(answer_wait_seconds=30.0)  # generous: the answers, not the bound, end the waits
    try:
        sent = answering(d, {"new": pb.VERDICT_ENCODE, "theirs": pb.VERDICT_ENCODING})
        assert d.ensure(["new"], "r1")  # nobody makes it: encoded here, this step
        assert not d.ensure(["theirs"], "r2")  # another engine encodes it: r2 waits for it
        assert not d.ensure(["other"], "r3")  # in the cache: staged, asks nothing
        assert [list(m.wants) for m in sent if m.wants] == [["new"], ["theirs"]]
        d.build_step_metadata(scheduled=set())  # r1 found no KV room after all
        assert yielded(sent) == ["new"]  # it was this engine's to encode
        stats = d.take_stats()
        assert stats["answer_waits"] == 2 and stats["deferred"] == 1
    finally:
        d.transport.close()


def test_an_answer_later_than_the_steps_wait_defers_the_request_a_step():
    d = make(answer_wait_seconds=0.05)
    try:
        sent = wanting(d)  # a daemon that does not answer in time
        assert not d.ensure(["a"], "r1")  # waited its 50 ms: deferred
        assert not d.ensure(["b"], "r2")  # the step's wait is spent: deferred at once
        assert d.take_stats()["answer_waits"] == 1
        answer(d, "a", pb.VERDICT_ENCODE)
        d.build_step_metadata(scheduled=set())
        assert d.ensure(["a"], "r1")  # the next step: answered, and asked only once
        assert not d.ensure(["c"], "r3")  # a new step, a new wait
        assert d.take_stats()["answer_waits"] == 1
        assert [h for m in sent for h in m.wants] == ["a", "b", "c"]
    finally:
        d.transport.close()


def test_an_engine_told_not_to_wait_defers_every_cold_miss_a_step():
    d = make(answer_wait_seconds=0.0)
    try:
        wanting(d)
        assert not d.ensure(["a"], "r1")
        assert "answer_waits" not in d.take_stats()
        answer(d, "a", pb.VERDICT_ENCODE)
        assert d.ensure(["a"], "r1")
    finally:
        d.transport.close()


def test_a_producer_claims_what_it_encodes_and_is_never_deferred():
    """An encoder instance asks about each item it is about to encode, so
    the daemon records it as their encoder; it goes ahead whatever the
    answer (it cannot load), and never waits for one."""
    d = make(role="producer", answer_wait_seconds=30.0)  # a wait would show
    try:
        sent = wanting(d)
        assert d.ensure(["new", "other"], "e1")  # "other" is ready: nothing to claim
        answer(d, "new", pb.VERDICT_ENCODING)  # another engine encodes it: no matter
        assert d.ensure(["new"], "e1") and d.ensure(["new"], "e2")
        assert [list(m.wants) for m in sent if m.wants] == [["new"]]  # asked once
        assert not d.after_alloc("e1", "new")  # encoded here...
        d.build_step_metadata(scheduled=set())
        d.request_finished("e1", ["new"])
        d.request_finished("e2", ["new"])
        assert released(sent) == [] and yielded(sent) == []  # ...its save ends the claim
        assert "deferred" not in d.take_stats()
    finally:
        d.transport.close()


def test_a_producer_says_it_encodes_what_it_claimed_in_the_step_it_encodes_it():
    """An encoder instance claims an item and encodes it in one step, before
    the daemon's answer can arrive: it still says so at the step's end, or
    its claim would pass to a waiting engine within seconds (E/PD: PD would
    encode the image a second time)."""
    d = make(role="producer")
    try:
        sent = wanting(d)
        assert d.ensure(["new"], "e1")
        assert not d.after_alloc("e1", "new")  # encoded here, no answer yet
        d.build_step_metadata(scheduled={"e1"})
        assert [list(m.encoding) for m in sent if m.encoding] == [["new"]]
    finally:
        d.transport.close()


def test_a_producer_alone_in_its_namespace_or_on_an_older_daemon_asks_nothing():
    d = make(role="producer")
    try:
        sent: list[Outgoing] = []
        d.link.send = lambda message: sent.append(message) or True
        assert d.ensure(["new"], "e1")  # alone: nobody would wait for its save
        wanting(d)
        d.link.send = lambda message: sent.append(message) or True
        d.on_attached(attachment(producer_claims=False))  # a daemon that refuses its wants
        d.on_message(news(namespace_info=pb.NamespaceInfo(engines=2)))
        assert d.ensure(["new"], "e1")
        assert sent == []
    finally:
        d.transport.close()


def test_an_item_without_media_that_nobody_makes_is_unobtainable_at_once():
    """A consumer given items without their media asks about each, even
    alone in its namespace; the daemon's "encode it yourself" (nobody holds
    it, pending or claimed) or "ready" for an entry gone again says that
    nobody will make it; "being encoded" and no answer yet do not."""
    d = make(role="consumer", answer_wait_seconds=30.0)
    try:
        verdicts = {"dropped": pb.VERDICT_ENCODE, "claimed": pb.VERDICT_ENCODING,
                    "gone": pb.VERDICT_READY}
        sent = answering(d, verdicts)
        d.on_message(news(namespace_info=pb.NamespaceInfo(engines=1)))
        assert sorted(d.unobtainable(["dropped", "claimed", "gone", "other"], "p1")) == \
            ["dropped", "gone"]  # "other" is ready in the view: never asked about
        assert [list(m.wants) for m in sent if m.wants] == [["dropped", "claimed", "gone"]]
        answer(d, "claimed", pb.VERDICT_ENCODE)  # its claimant dropped the save
        assert d.unobtainable(["claimed"], "p1") == ["claimed"]
        assert [list(m.wants) for m in sent if m.wants] == [["dropped", "claimed", "gone"]]
        d.request_finished("p1", ["dropped", "claimed", "gone"])  # failed: forgotten
        assert released(sent) == ["dropped", "claimed"]  # (p1 no longer waits for them)
        verdicts["claimed"] = pb.VERDICT_ENCODING  # the retry's encode claimed it again
        assert d.unobtainable(["claimed"], "p2") == []  # asked afresh, not the old answer
        assert [h for m in sent for h in m.wants][-1] == "claimed"
    finally:
        d.transport.close()


def test_nothing_is_unobtainable_while_detached_or_stale():
    d = make(role="consumer")
    try:
        sent = wanting(d)
        d.freshness = False
        assert d.unobtainable(["a"], "p1") == []
        d.freshness = True
        d.on_detached()
        assert d.unobtainable(["a"], "p1") == []
        assert not any(m.wants for m in sent)
    finally:
        d.transport.close()
