"""Warm restart on the core (`ec_daemon.serving.adoption`): a real region file and its
index, written by a real Cache, then adopted by the next "daemon" after a
crash at any write. What is adopted is exactly what was ready, with its
bytes; nothing pending or freed is; no page is owned twice; ids go on."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from ec_daemon.core import cache as cache_module
from ec_daemon.core import invariants
from ec_daemon.core.cache import Cache
from ec_daemon.core.events import AllocOutcome, EvictedEvent
from ec_daemon.core.records import State
from ec_daemon.core.sessions import SessionTable
from ec_daemon.durable import index as index_module
from ec_daemon.durable.dead import dead_regions
from ec_daemon.durable.index import index_path
from ec_daemon.durable.journal import encode_ready
from ec_daemon.durable.region import Region
from ec_daemon.durable.stamp_file import StampFile
from ec_daemon.errors import ResourceExhausted
from ec_daemon.serving.adoption import RegionSpec, find
from ec_protocol.stamps import file_bytes, table_bytes, whole
from tests.unit.cache_helpers import FakeClock, drain, scheduler, worker

PAGE = 4096
SOCKET = "unix:///run/ec-test/ec.sock"


def region_spec(pages: int = 32, page: int = PAGE, socket: str = SOCKET) -> RegionSpec:
    offset = table_bytes(pages, page)
    return RegionSpec(socket, offset + pages * page, page, offset)


class Host:
    """A daemon's core over a real region in `folder` (no gRPC)."""

    def __init__(self, folder: Path, shape: RegionSpec, *, adopt: bool = True,
                 clock: FakeClock | None = None) -> None:
        self.spec = shape
        self.clock = clock or FakeClock()
        adoption, self.why_not, _ = find(str(folder), shape) if adopt else (None, "", ())
        self.adoption = adoption
        self.region = adoption.region if adoption is not None else Region.create(
            folder, shape.region_size, index_header=shape.header)
        self.table = self.region.stamps(shape.page_bytes, shape.data_offset)
        self.cache = Cache(capacity_bytes=shape.region_size - shape.data_offset,
                           page_bytes=shape.page_bytes,
                           sessions=SessionTable(10.0, clock=self.clock),
                           data_offset=shape.data_offset, stamps=self.table,
                           index=self.region.index, quarantine_seconds=30.0)
        if adoption is not None:
            v = adoption.verified
            self.cache.restore(v.records, v.free, v.quarantined, v.next_entry_id, v.views,
                               self.cache.sessions.previous_daemon)
        invariants.check(self.cache)

    def save(self, writer: Any, mm_hash: str, pages: int, *, commit: bool = True) -> Any:
        result = self.cache.allocate(writer, mm_hash, pages * self.spec.page_bytes,
                                     (pages, self.spec.page_bytes), "uint8")
        if result.outcome is AllocOutcome.ALLOCATED:
            self.region.write(result.extents, [payload(result.entry_id, pages * PAGE)])
            if commit:
                self.cache.commit(writer, [mm_hash])
        return result

    def read(self, entry: Any) -> bytes:
        return b"".join(self.region.read(self.cache.extents(entry)))

    def crash(self) -> None:
        """What kill -9 leaves: the files as they are, the lock released."""
        self.table.release()
        self.region.close(remove=False)


def payload(entry_id: int, nbytes: int) -> bytes:
    """Bytes that say which entry wrote them."""
    return random.Random(entry_id).randbytes(nbytes)


def entries(cache: Cache) -> dict[str, tuple[int, State, tuple[Any, ...]]]:
    return {e.mm_hash: (e.entry_id, e.state, cache.extents(e)) for e in cache.entries()}


def test_a_restart_adopts_what_was_ready_with_its_bytes(tmp_path):
    first = Host(tmp_path, region_spec())
    view, w = scheduler(first.cache), worker(first.cache)
    for name, pages in (("a", 2), ("b", 3), ("c", 1)):
        first.save(w, name, pages)
    first.save(w, "pending", 2, commit=False)
    gone_writer = worker(first.cache, engine="F")
    first.save(gone_writer, "quarantined", 1, commit=False)
    first.cache.end_session(gone_writer)  # its pages: quarantined
    a, b = first.cache.get("ns", "a"), first.cache.get("ns", "b")
    first.cache.views.touch(view, [("a", a.entry_id, 1), ("b", b.entry_id, 1)])  # c: least recent
    assert first.save(w, "big", 24).outcome is AllocOutcome.WAIT  # c evicted, not acknowledged
    assert first.cache.state_of("ns", "c") is State.HIDDEN
    before = entries(first.cache)
    highest = max(e.entry_id for e in first.cache.entries())
    drain(view)
    first.crash()

    second = Host(tmp_path, region_spec())
    assert second.region.path == first.region.path
    assert second.region.generation == first.region.generation
    after = entries(second.cache)
    assert after == {k: v for k, v in before.items() if k != "pending"}
    for name in ("a", "b", "c"):
        entry = second.cache.get("ns", name)
        assert second.read(entry) == payload(entry.entry_id, entry.nbytes)
    # Evicted at the crash: back hidden, awaited by a ghost of the engine whose
    # view of the previous daemon may still be loading it.
    (ghost,) = second.cache.get("ns", "c").awaiting
    assert ghost.is_ghost and ghost.engine_id == "E"
    # The pending save and the dead writer's save: quarantined, not adopted.
    assert second.cache.quarantine.pages == 3
    summary = second.adoption.summary()
    assert "3 entries" in summary and "1 evicted" in summary and "quarantined" in summary
    # Ids go on above every id of the dead daemon.
    w2 = worker(second.cache)
    assert second.save(w2, "d", 1).entry_id > highest
    # A view of the new daemon sees the ready ones; c goes after one lease.
    assert {e.mm_hash for e in drain(scheduler(second.cache)) if hasattr(e, "extents")} \
        == {"a", "b", "d"}
    second.clock.now += 11
    second.cache.release_ghosts()
    assert second.cache.get("ns", "c") is None
    invariants.check(second.cache)
    second.crash()


def test_an_engine_that_comes_back_releases_its_ghost_at_once(tmp_path):
    """The ghost of an engine's old view holds the evictions of its namespace
    only until that engine re-attaches and declares its loads (`hold`), not
    for a whole lease: saves of a full cache go on within moments."""
    first = Host(tmp_path, region_spec())
    a_view, b_view = scheduler(first.cache, engine="A"), scheduler(first.cache, engine="B")
    w = worker(first.cache)
    first.save(w, "x", 30)
    first.save(w, "y", 1)
    assert first.save(w, "big", 4).outcome is AllocOutcome.WAIT  # x hidden, awaiting A and B
    drain(a_view)
    drain(b_view)
    first.crash()

    second = Host(tmp_path, region_spec())
    x = second.cache.get("ns", "x")
    assert x.state is State.HIDDEN and {g.engine_id for g in x.awaiting} == {"A", "B"}
    a_again = scheduler(second.cache, engine="A")
    second.cache.views.hold(a_again, [("x", x.entry_id)])  # A is still loading x
    second.cache.reattached(a_again)
    b_again = scheduler(second.cache, engine="B")
    second.cache.reattached(b_again)  # B loads nothing
    assert x.awaiting == {a_again}  # both ghosts gone; A's new view holds it
    assert not list(second.cache.sessions.ghosts())
    second.cache.views.acknowledge(a_again, [("x", x.entry_id)])  # A's load ended
    assert second.cache.get("ns", "x") is None
    second.crash()


def test_an_engine_back_after_its_ghost_expired_stays_journaled(tmp_path):
    """Its old view's ghost ran out first: the engine's new session, attached
    later, is what the journal must still name (a crash now awaits it)."""
    first = Host(tmp_path, region_spec())
    scheduler(first.cache, engine="A")
    first.crash()
    second = Host(tmp_path, region_spec())
    second.cache.acks.serving()
    second.clock.now += 11
    assert [g.engine_id for g in second.cache.release_ghosts()] == ["A"]
    back = scheduler(second.cache, engine="A")
    second.cache.reattached(back)
    second.crash()
    third = Host(tmp_path, region_spec())
    assert [g.engine_id for g in third.cache.sessions.ghosts()] == ["A"]
    third.crash()


def test_an_entry_hidden_when_no_view_was_attached_is_freed_at_restore():
    """No engine's view was attached (none journaled): nobody can be loading
    a hidden entry, so its pages come back at once, with no ghost."""
    from ec_daemon.durable.journal import Record
    from tests.unit.cache_helpers import make_cache

    cache = make_cache(pages=8)
    records = [Record(5, "ns", "hidden", 1024, (1, 1024), "uint8", [(0, 1)], hidden=True),
               Record(6, "ns", "ready", 1024, (1, 1024), "uint8", [(1, 1)])]
    cache.restore(records, [(2, 6)], [], 7, (), cache.sessions.previous_daemon)
    assert cache.state_of("ns", "hidden") is None and cache.state_of("ns", "ready") is State.READY
    assert cache.allocator.free_pages == 7 and not list(cache.sessions.ghosts())


def test_a_record_whose_pages_lost_their_stamp_is_not_adopted(tmp_path):
    first = Host(tmp_path, region_spec())
    w = worker(first.cache)
    first.save(w, "a", 2)
    first.save(w, "b", 1)
    a = first.cache.get("ns", "a")
    first.table.write([(a.runs[0][0] + 1, 1)], 0)  # one page of a: free now
    first.crash()
    second = Host(tmp_path, region_spec())
    assert set(entries(second.cache)) == {"b"}
    assert second.adoption.verified.rejected == 1
    assert second.cache.quarantine.pages == 1  # a's page that kept its stamp
    second.crash()


def test_two_records_never_adopt_one_page(tmp_path):
    first = Host(tmp_path, region_spec())
    w = worker(first.cache)
    first.save(w, "a", 2)
    a = first.cache.get("ns", "a")
    # A forged record claiming a's pages under a's own id, for another key:
    # the later record of an id wins, and only once.
    with open(index_path(first.region.path), "ab") as f:
        f.write(encode_ready(a.entry_id, "ns", "forged", a.nbytes, a.shape, a.dtype, a.runs))
        f.write(encode_ready(a.entry_id + 100, "ns", "other", a.nbytes, a.shape, a.dtype,
                             a.runs))
    first.crash()
    second = Host(tmp_path, region_spec())
    adopted = entries(second.cache)
    assert list(adopted) == ["forged"] and second.adoption.verified.rejected == 1
    second.crash()


@pytest.mark.parametrize(("change", "why"), [
    ({"pages": 64}, "--cpu-bytes"), ({"page": 8192, "pages": 16}, "--page-bytes")])
def test_a_region_of_another_size_is_not_adopted(tmp_path, change, why):
    first = Host(tmp_path, region_spec())
    first.save(worker(first.cache), "a", 1)
    first.crash()
    second = Host(tmp_path, region_spec(**change))
    assert second.adoption is None and why in second.why_not
    assert second.region.path != first.region.path and not first.region.path.exists()
    assert entries(second.cache) == {}
    second.crash()


def test_regions_of_other_sockets_are_left_and_fresh_start_removes_ours(tmp_path):
    other = Host(tmp_path, region_spec(socket="unix:///other.sock"))
    other.crash()
    mine = Host(tmp_path, region_spec())
    mine.crash()
    adoption, why, _ = find(str(tmp_path), region_spec(), fresh_start=True)
    assert adoption is None and "--fresh-start" in why
    assert not mine.region.path.exists() and other.region.path.exists()
    for dead in dead_regions(tmp_path):
        dead.remove()


def test_a_region_without_a_readable_index_is_removed(tmp_path):
    first = Host(tmp_path, region_spec())
    first.crash()
    index_path(first.region.path).write_bytes(b"garbage")
    adoption, why, _ = find(str(tmp_path), region_spec())
    assert adoption is None and "unreadable" in why and not first.region.path.exists()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------- crash points


class CrashPoints:
    """Copies of the region and its index taken at I/O boundaries of a
    running cache: before and after each journal write (and halfway through
    some, a torn record) and each stamp change, as kill -9 could leave them."""

    def __init__(self, monkeypatch: Any, folder: Path, rng: random.Random,
                 host: Host, every: float) -> None:
        self.folder, self.rng, self.host, self.every = folder, rng, host, every
        self.taken: list[tuple[Path, int]] = []
        real_write = index_module._write_at

        def write_at(fd: int, data: bytes, offset: int) -> None:
            if rng.random() < every and len(data) > 1:
                cut = rng.randrange(1, len(data))
                real_write(fd, data[:cut], offset)  # a torn record
                self.take()
                real_write(fd, data[cut:], offset + cut)
            else:
                self.maybe_take()
                real_write(fd, data, offset)
            self.maybe_take()

        monkeypatch.setattr(index_module, "_write_at", write_at)
        for name in ("write", "clear"):
            real = getattr(StampFile, name)

            def stamped(table: StampFile, *args: Any, _real: Any = real) -> None:
                self.maybe_take()
                _real(table, *args)
                self.maybe_take()

            monkeypatch.setattr(StampFile, name, stamped)

    def maybe_take(self) -> None:
        if self.rng.random() < self.every:
            self.take()

    def take(self) -> None:
        """A copy of both files now, and every id handed out so far."""
        snap = self.folder / f"crash{len(self.taken)}"
        snap.mkdir()
        region = self.host.region
        shutil.copy(region.path, snap / region.path.name)  # with its mode
        shutil.copyfile(index_path(region.path), snap / index_path(region.path).name)
        self.taken.append((snap, self.host.cache._next_entry_id))


def churn(host: Host, rng: random.Random, steps: int) -> None:
    """Saves (some never committed), evictions, acknowledgements, writers that
    vanish, quarantines that end, compactions."""
    cache = host.cache
    views = [scheduler(cache, engine=f"v{i}") for i in range(2)]
    writers = [worker(cache, engine=f"w{i}") for i in range(2)]
    for step in range(steps):
        roll = rng.random()
        writer = rng.choice(writers)
        if roll < 0.6:
            with contextlib.suppress(ResourceExhausted):  # full: nothing changed
                host.save(writer, f"k{rng.randrange(40)}", rng.randint(1, 4),
                          commit=rng.random() < 0.85)
        elif roll < 0.8:
            for view in views:
                refs = [(e.mm_hash, e.entry_id) for e in drain(view)
                        if isinstance(e, EvictedEvent)]
                cache.views.acknowledge(view, refs)
        elif roll < 0.85:
            writers.remove(writer)
            cache.end_session(writer)
            writers.append(worker(cache, engine=f"w{step}"))
        elif roll < 0.9:
            host.clock.now += rng.uniform(0, 40)
            cache.release_quarantine()
        else:
            cache.compact_index()


def test_any_crash_point_adopts_only_ready_entries_with_their_own_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(index_module, "COMPACT_MIN_BYTES", 0)
    monkeypatch.setattr(cache_module, "ID_BLOCK", 8)  # reservations on the way too
    deadline = time.monotonic() + 20
    adopted_total = snapshots = 0
    seed = 0
    while time.monotonic() < deadline and seed < 12:
        folder = tmp_path / f"run{seed}"
        folder.mkdir()
        rng = random.Random(seed)
        seed += 1
        (folder / "live").mkdir()
        host = Host(folder / "live", region_spec(pages=24))
        points = CrashPoints(monkeypatch, folder, rng, host, every=0.08)
        churn(host, rng, 250)
        monkeypatch.undo()
        monkeypatch.setattr(index_module, "COMPACT_MIN_BYTES", 0)
        monkeypatch.setattr(cache_module, "ID_BLOCK", 8)
        snapshots += len(points.taken)
        for snap, handed_out in points.taken:
            after = Host(snap, region_spec(pages=24), clock=FakeClock())
            assert after.adoption is not None, after.why_not
            invariants.check(after.cache)  # pages, counters, and every stamp
            for entry in after.cache.entries():
                assert entry.state is not State.PENDING
                assert after.read(entry) == payload(entry.entry_id, entry.nbytes), (
                    f"{entry.mm_hash} adopted with bytes that are not its own")
            assert after.cache._next_entry_id >= handed_out  # no id is handed out twice
            adopted_total += len(list(after.cache.entries()))
            after.crash()
            shutil.rmtree(snap)
        host.crash()
    print(f"{seed} runs, {snapshots} crash points, {adopted_total} entries adopted")
    assert seed >= 3 and adopted_total > 0


# ------------------------------------------------- issue 40: format 2, cuts


def test_a_format_1_index_is_still_adopted_and_becomes_format_2(tmp_path):
    """Format 2 added checksums to READY records (and the liveness lock on the
    index); a daemon of format 1 left READY records without them, which are
    adopted as entries without a checksum, the header rewritten to 2."""
    import struct

    from ec_daemon.durable.index import read_header
    from ec_daemon.durable.journal import HEADER_BYTES, VERSION_AT, _frame, decode_records

    first = Host(tmp_path, region_spec())
    first.save(worker(first.cache), "a", 2)
    entry = first.cache.get("ns", "a")
    first.crash()
    path = index_path(first.region.path)
    data = bytearray(path.read_bytes())
    (record,) = decode_records(bytes(data)).records.values()
    ns, h, d = record.namespace.encode(), record.mm_hash.encode(), record.dtype.encode()
    body = struct.pack("<BQQBIBHH", 1, record.entry_id, record.nbytes, len(record.shape),
                       len(record.runs), len(d), len(ns), len(h)) + struct.pack(
        f"<{len(record.shape) + 2 * len(record.runs)}Q", *record.shape,
        *(n for run in record.runs for n in run)) + d + ns + h
    data[VERSION_AT:VERSION_AT + 4] = struct.pack("<I", 1)
    path.write_bytes(bytes(data[:HEADER_BYTES]) + _frame(body))  # what format 1 wrote

    second = Host(tmp_path, region_spec())
    assert entries(second.cache) == {"a": (entry.entry_id, State.READY,
                                           second.cache.extents(entry))}
    assert second.cache.get("ns", "a").checksum == 0
    assert read_header(path).version == 2
    second.crash()


def test_pages_cut_off_the_region_are_never_served_nor_completed(tmp_path):
    """Issue 40, finding 4, on the core: the entries with a page past where a
    client truncated the file are dropped (a ready one hidden, its views
    told; a pending one quarantined), every such page stamped LOST until it
    is reclaimed, and the bookkeeping adds up throughout."""
    import os

    host = Host(tmp_path, region_spec(pages=8))
    view, w = scheduler(host.cache), worker(host.cache)
    host.save(w, "a", 2)
    host.save(w, "b", 2)
    host.save(w, "c", 1, commit=False)  # pending
    drain(view)
    a, b = host.cache.get("ns", "a"), host.cache.get("ns", "b")
    cut_at = host.spec.data_offset + 3 * PAGE  # b's second page and everything after
    with open(host.region.path, "r+b") as f:
        os.ftruncate(f.fileno(), cut_at)
    assert host.region.shortfall() == cut_at
    host.region.restore()
    lost = host.cache.cut_off(3)
    assert sorted(e.mm_hash for e in lost) == ["b", "c"]
    invariants.check(host.cache)
    assert host.cache.get("ns", "c") is None and host.cache.quarantine.pages == 1
    assert b.state is State.HIDDEN and b.entry_id in host.cache.lost
    assert not host.table.holds(host.cache.extents(b), b.entry_id)  # stamped LOST
    assert host.table.holds(host.cache.extents(a), a.entry_id)  # untouched
    assert drain(view) == [EvictedEvent("b", b.entry_id)]
    host.cache.views.acknowledge(view, [("b", b.entry_id)])
    assert host.cache.get("ns", "b") is None and not host.cache.lost
    invariants.check(host.cache)
    host.crash()


def test_an_adopted_region_keeps_its_canary_for_the_mappings_that_hold_it(tmp_path):
    """A warm restart leaves workers' mappings alone: they go on checking the
    canary they mapped the file with, so the next daemon keeps it (and tells
    it in its attach replies)."""
    first = Host(tmp_path, region_spec())
    first.save(worker(first.cache), "a", 2)
    canary = first.region.canary
    first.crash()
    second = Host(tmp_path, region_spec())
    assert second.adoption is not None and second.region.canary == canary
    assert second.region.canary_intact()


def test_an_older_daemons_region_without_a_canary_is_adopted_and_given_one(tmp_path):
    """A region an older daemon made has no trailer (the file is the region's
    size): it is adopted with its entries, and the file grows by the trailer,
    with a canary (workers of the older daemon check none; those of this one
    will)."""
    shape = region_spec()
    first = Host(tmp_path, shape)
    first.save(worker(first.cache), "a", 2)
    path = first.region.path
    first.crash()
    os.truncate(path, shape.region_size)  # as an older daemon leaves it
    second = Host(tmp_path, shape)
    assert second.adoption is not None, second.why_not
    entry = second.cache.get("ns", "a")
    assert entry is not None and second.read(entry) == payload(entry.entry_id, entry.nbytes)
    assert os.stat(path).st_size == file_bytes(shape.region_size)
    assert whole(second.region.canary) and second.region.canary_intact()


@pytest.mark.parametrize("cut", ["to 0", "mid-region", "the trailer's last byte"])
def test_a_region_cut_while_no_daemon_watched_is_not_adopted(tmp_path, cut):
    """A client that truncated a dead daemon's region (and regrew it) leaves
    its canary cut: what the cut reached is unknown, so the next start begins
    a fresh region, saying why."""
    shape = region_spec()
    first = Host(tmp_path, shape)
    first.save(worker(first.cache), "a", 2)
    path = first.region.path
    first.crash()
    size = {"to 0": 0, "mid-region": shape.region_size // 2,
            "the trailer's last byte": file_bytes(shape.region_size) - 1}[cut]
    os.truncate(path, size)
    os.truncate(path, file_bytes(shape.region_size))
    second = Host(tmp_path, shape)
    assert second.adoption is None and "its canary was cut" in second.why_not
    assert second.region.path != path and second.cache.get("ns", "a") is None
