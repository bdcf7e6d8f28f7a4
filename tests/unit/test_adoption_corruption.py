"""Warm restart over a region another process wrote: every engine worker maps
the region read-write, so its stamp table may hold any value, and the index's
id reservation sits outside the header's checksum. Whatever they hold, the
next start adopts what it can prove and serves (or starts fresh, saying why);
records the daemon never writes are never adopted."""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ec_daemon.core import invariants
from ec_daemon.core.events import AllocOutcome
from ec_daemon.core.limits import ID_BLOCK, MAX_IDS_RESERVED
from ec_daemon.core.records import State
from ec_daemon.durable.index import index_path
from ec_daemon.durable.journal import IDS_AT, encode_ready
from tests.unit.cache_helpers import worker
from tests.unit.test_adoption import PAGE, Host, entries, payload, region_spec

PAGES = 32
LAST = PAGES - 1  # free in these tests: saves take pages from the front
U64_MAX = (1 << 64) - 1


def poke_stamps(host: Host, stamps: dict[int, int]) -> None:
    """Write raw values into the stamp slots of pages (as any worker can)."""
    fd = os.open(host.region.path, os.O_RDWR)
    try:
        for page, value in stamps.items():
            os.pwrite(fd, struct.pack("=Q", value), 8 * page)
    finally:
        os.close(fd)


def poke_reservation(host: Host, value: int) -> None:
    fd = os.open(index_path(host.region.path), os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack("<Q", value), IDS_AT)
    finally:
        os.close(fd)


def append_record(host: Host, entry_id: int, mm_hash: str, pages: int,
                  runs: list[tuple[int, int]], *, namespace: str = "ns",
                  shape: tuple[int, ...] | None = None, dtype: str = "uint8") -> None:
    with open(index_path(host.region.path), "ab") as f:
        f.write(encode_ready(entry_id, namespace, mm_hash, pages * PAGE,
                             shape or (pages, PAGE), dtype, runs))


def saves_go_on(host: Host) -> None:
    """A save after the restart gets pages, an id and its stamps."""
    w = worker(host.cache, engine="later")
    result = host.save(w, "after-restart", 1)
    assert result.outcome is AllocOutcome.ALLOCATED
    entry = host.cache.get("ns", "after-restart")
    assert host.read(entry) == payload(entry.entry_id, PAGE)
    assert host.table.holds(host.cache.extents(entry), entry.entry_id)
    invariants.check(host.cache)


# ------------------------------------------------------------ item 1: stamps


@pytest.mark.parametrize("value", [U64_MAX, U64_MAX - 99, 1 << 63, ID_BLOCK + 2])
def test_a_stamp_no_daemon_issued_is_quarantined_and_saves_go_on(tmp_path, value):
    first = Host(tmp_path, region_spec(pages=PAGES))
    w = worker(first.cache)
    first.save(w, "a", 2)
    first.save(w, "b", 1)
    first.crash()
    poke_stamps(first, {5: value})  # a free page, as `kill -9; poke; restart` leaves it

    second = Host(tmp_path, region_spec(pages=PAGES))
    assert second.adoption is not None, second.why_not
    v = second.adoption.verified
    assert set(entries(second.cache)) == {"a", "b"} and v.corrupt_pages == 1
    assert v.next_entry_id == ID_BLOCK + 1  # the reservation, not the stamp
    assert second.cache.quarantine.pages == 1
    assert "1 page(s) quarantined whose stamp is an id no daemon issued" in \
        second.adoption.summary()
    saves_go_on(second)
    # The quarantine ends: the page is cleared and reused, the value gone for good.
    second.clock.now += 31
    second.cache.release_quarantine()
    assert second.table.stamps(5, 1) == [0]
    invariants.check(second.cache)
    second.crash()
    third = Host(tmp_path, region_spec(pages=PAGES))
    assert third.adoption is not None and third.adoption.verified.corrupt_pages == 0
    third.crash()


@pytest.mark.parametrize("value", [U64_MAX, MAX_IDS_RESERVED + 1])
def test_a_reservation_no_daemon_makes_starts_fresh(tmp_path, value):
    first = Host(tmp_path, region_spec(pages=PAGES))
    first.save(worker(first.cache), "a", 2)
    first.crash()
    poke_reservation(first, value)
    second = Host(tmp_path, region_spec(pages=PAGES))
    assert second.adoption is None and "the index is corrupt" in second.why_not
    assert second.region.path != first.region.path and not first.region.path.exists()
    saves_go_on(second)
    second.crash()


def test_a_reservation_at_the_limit_is_adopted_and_saves_go_on(tmp_path):
    first = Host(tmp_path, region_spec(pages=PAGES))
    first.save(worker(first.cache), "a", 2)
    first.crash()
    poke_reservation(first, MAX_IDS_RESERVED)
    second = Host(tmp_path, region_spec(pages=PAGES))
    assert second.adoption is not None and set(entries(second.cache)) == {"a"}
    saves_go_on(second)
    assert second.cache.get("ns", "after-restart").entry_id == MAX_IDS_RESERVED
    second.crash()


def test_a_lowered_reservation_keeps_what_it_covers_and_quarantines_the_rest(tmp_path):
    first = Host(tmp_path, region_spec(pages=PAGES))
    w = worker(first.cache)
    first.save(w, "a", 2)
    first.save(w, "b", 1)
    b = first.cache.get("ns", "b")
    first.crash()
    poke_reservation(first, b.entry_id)  # b's id is no longer reserved: not adopted
    second = Host(tmp_path, region_spec(pages=PAGES))
    v = second.adoption.verified
    assert set(entries(second.cache)) == {"a"} and v.invalid == 1 and v.corrupt_pages == 1
    assert second.cache.quarantine.pages == 1
    saves_go_on(second)
    second.crash()


# Protects: adoption survives ANY stamp table and ANY reservation. It either
# adopts (every adopted entry's pages carry its id, each page owned once, ids
# going on below 2^64 with room to spare) or starts fresh because the
# reservation is corrupt; and saves go on either way.
values = st.one_of(st.integers(0, U64_MAX),
                   st.sampled_from([0, 1, 2, ID_BLOCK, ID_BLOCK + 1, ID_BLOCK + 2,
                                    MAX_IDS_RESERVED, MAX_IDS_RESERVED + 1, 1 << 63,
                                    U64_MAX - 99, U64_MAX]))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(saved=st.lists(st.integers(1, 4), max_size=5),
       stamps=st.dictionaries(st.integers(0, PAGES - 1), values, max_size=PAGES),
       reservation=st.one_of(st.none(), values))
def test_adoption_survives_any_stamp_table_and_reservation(saved, stamps, reservation):
    with tempfile.TemporaryDirectory() as folder:
        first = Host(Path(folder), region_spec(pages=PAGES))
        w = worker(first.cache)
        for i, pages in enumerate(saved):
            first.save(w, f"k{i}", pages)
        first.crash()
        poke_stamps(first, stamps)
        if reservation is not None:
            poke_reservation(first, reservation)

        second = Host(Path(folder), region_spec(pages=PAGES))  # restores and checks invariants
        if second.adoption is None:
            assert reservation is not None and reservation > MAX_IDS_RESERVED, second.why_not
        else:
            v = second.adoption.verified
            assert v.next_entry_id <= MAX_IDS_RESERVED
            owned = [p for r in v.records for first_page, n in r.runs
                     for p in range(first_page, first_page + n)]
            assert len(owned) == len(set(owned))
            for r in v.records:
                entry = second.cache.get(r.namespace, r.mm_hash)
                assert entry.state in (State.READY, State.HIDDEN)
                assert second.table.holds(second.cache.extents(entry), entry.entry_id)
            quarantined = sum(n for _, n in v.quarantined)
            assert second.cache.allocator.free_pages + quarantined + len(owned) == PAGES
        if second.cache.allocator.free_pages:
            saves_go_on(second)
        second.crash()


# --------------------------------------- item 5: records the daemon never writes


def test_a_record_naming_one_page_twice_is_not_adopted_nor_freed_twice(tmp_path):
    first = Host(tmp_path, region_spec(pages=PAGES))
    first.save(worker(first.cache), "a", 1)
    first.crash()
    forged = ID_BLOCK  # a reserved id no entry used
    poke_stamps(first, {9: forged})
    append_record(first, forged, "twice", 2, [(9, 1), (9, 1)])

    second = Host(tmp_path, region_spec(pages=PAGES))
    assert set(entries(second.cache)) == {"a"}
    assert second.adoption.verified.invalid == 1
    assert "1 record(s) not adopted: not records this daemon writes" in \
        second.adoption.summary()
    assert second.cache.quarantine.pages == 1  # page 9: stamped, owned by nobody
    second.clock.now += 31
    assert second.cache.release_quarantine() == 1
    invariants.check(second.cache)
    # Every page comes back exactly once: fill the whole cache with saves.
    w = worker(second.cache, engine="later")
    total = second.cache.allocator.free_pages
    assert total == PAGES - 1
    for i in range(total):
        assert second.save(w, f"fill{i}", 1).outcome is AllocOutcome.ALLOCATED
    assert second.cache.allocator.free_pages == 0
    invariants.check(second.cache)
    second.crash()


@pytest.mark.parametrize("kind", ["id 0", "id above the reservation", "pages outside the region",
                                  "runs overlapping each other", "a key twice",
                                  "a dtype no loader makes", "bytes not the shape's",
                                  "a namespace longer than Attach makes"])
def test_records_the_daemon_never_writes_are_not_adopted(tmp_path, kind):
    """(Issue 40, findings 5 and 14: a bogus dtype or size, or a namespace
    of 65,535 bytes, was adopted; every engine hitting the entry failed its
    load, and Stats outgrew gRPC's 4 MiB.)"""
    first = Host(tmp_path, region_spec(pages=PAGES))
    first.save(worker(first.cache), "a", 1)
    a = first.cache.get("ns", "a")
    first.crash()
    last = LAST
    forged, mm_hash, runs, pages = ID_BLOCK, "forged", [(last - 1, 2)], 2
    fields: dict[str, object] = {}
    if kind == "a dtype no loader makes":
        fields = {"dtype": "notadtype"}
    elif kind == "bytes not the shape's":
        fields = {"dtype": "float32", "shape": (2 * PAGE,)}  # 4 bytes an element: 4x too few
    elif kind == "a namespace longer than Attach makes":
        fields = {"namespace": "m|uint8|image=1|" + "v" * 65_000}
    if kind == "id 0":
        forged = 0  # free pages carry 0: it would "match" them
    elif kind == "id above the reservation":
        forged = ID_BLOCK + 1 + 7
    elif kind == "pages outside the region":
        runs = [(PAGES - 1, 2)]
    elif kind == "runs overlapping each other":
        runs, pages = [(last - 2, 2), (last - 1, 1)], 3
    elif kind == "a key twice":
        mm_hash = "a"
    if forged:
        poke_stamps(first, {p: forged for first_page, n in runs
                            for p in range(first_page, min(first_page + n, PAGES))})
    append_record(first, forged, mm_hash, pages, runs, **fields)  # type: ignore[arg-type]

    second = Host(tmp_path, region_spec(pages=PAGES))
    assert entries(second.cache) == {"a": (a.entry_id, State.READY, second.cache.extents(
        second.cache.get("ns", "a")))}
    assert second.adoption.verified.invalid == 1
    assert second.cache.get("ns", "forged") is None
    assert all(e.key[0] in ("ns",) for e in second.cache.entries())
    invariants.check(second.cache)
    saves_go_on(second)
    second.crash()


def test_a_record_of_free_pages_under_id_0_leaves_them_free(tmp_path):
    first = Host(tmp_path, region_spec(pages=PAGES))
    first.crash()
    append_record(first, 0, "zero", 1, [(3, 1)])
    second = Host(tmp_path, region_spec(pages=PAGES))
    assert entries(second.cache) == {} and second.cache.allocator.free_pages == PAGES
    second.crash()

