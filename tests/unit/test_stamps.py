"""The region file's layout: the stamp table the daemon writes and a worker
checks (in memory, and through the file with pread), and the canary."""

import os
import random
from array import array

import pytest

import ec_protocol.stamps as stamps_module
from ec_protocol.stamps import (
    CANARY_BYTES,
    FREE,
    MERGE_GAP_SLOTS,
    SLOT_BYTES,
    StampReader,
    StampTable,
    file_bytes,
    read_canary,
    table_bytes,
    whole,
    write_canary,
)

PAGE = 64  # 8 stamps per table page
PAGES = 20  # payload pages


@pytest.mark.parametrize(("payload_pages", "page_bytes", "expected"), [
    (0, 4096, 0),
    (1, 4096, 4096),
    (512, 4096, 4096),  # exactly one page of stamps
    (513, 4096, 8192),
    (3, 4, 24),  # pages smaller than a stamp
    (20, 64, 192),
])
def test_the_table_is_whole_pages_of_one_stamp_per_payload_page(payload_pages, page_bytes,
                                                                 expected):
    assert table_bytes(payload_pages, page_bytes) == expected
    assert expected >= payload_pages * SLOT_BYTES and expected % page_bytes == 0


@pytest.fixture
def memory():
    return bytearray(table_bytes(PAGES, PAGE))


@pytest.fixture
def table(memory):
    return StampTable(memoryview(memory), PAGE, len(memory))


def extent(table, first_page, pages, *, skip=0, trim=0):
    """Byte extent over `pages` payload pages from `first_page`, starting
    `skip` bytes into the first and ending `trim` bytes before the last ends."""
    return (table.data_offset + first_page * PAGE + skip, pages * PAGE - skip - trim)


def test_a_fresh_table_is_all_free(table):
    assert table.holds([extent(table, 0, PAGES)], FREE)


def test_write_stamps_exactly_the_pages_of_each_run(table, memory):
    table.write([(2, 3), (10, 1)], 7)
    slots = memoryview(memory).cast("Q")
    assert [p for p in range(PAGES) if slots[p] == 7] == [2, 3, 4, 10]
    assert all(slots[p] == FREE for p in range(PAGES) if p not in (2, 3, 4, 10))
    assert table.holds([extent(table, 2, 3), extent(table, 10, 1)], 7)


def test_holds_covers_every_page_an_extent_touches(table):
    table.write([(4, 2)], 9)
    # 4.5 pages .. 5.5 pages: both pages, read through their middles.
    assert table.holds([extent(table, 4, 2, skip=PAGE // 2, trim=PAGE // 2)], 9)
    assert table.holds([extent(table, 5, 1, trim=PAGE - 1)], 9)  # a single byte
    table.write([(5, 1)], 10)  # the last page was reused
    assert not table.holds([extent(table, 4, 2, skip=PAGE - 1, trim=PAGE - 1)], 9)
    assert not table.holds([extent(table, 4, 1), extent(table, 5, 1)], 9)  # any mismatch
    assert table.holds([extent(table, 4, 1, skip=3)], 9)


def test_an_extent_one_byte_into_the_next_page_needs_that_page(table):
    table.write([(0, 1)], 5)
    assert table.holds([(table.data_offset, PAGE)], 5)
    assert not table.holds([(table.data_offset, PAGE + 1)], 5)


def test_clear_frees_the_runs_only(table):
    table.write([(0, PAGES)], 3)
    table.clear([(1, 2), (6, 1)])
    assert table.holds([extent(table, 1, 2), extent(table, 6, 1)], FREE)
    assert table.holds([extent(table, 0, 1), extent(table, 3, 3), extent(table, 7, 13)], 3)


def test_stamps_use_all_64_bits(table):
    big = 2**64 - 1
    table.write([(19, 1)], big)
    assert table.holds([extent(table, 19, 1)], big)
    assert not table.holds([extent(table, 19, 1)], big & 0xFFFF_FFFF)


@pytest.mark.parametrize("bad", [
    "before the payload", "past the payload", "past the table", "empty", "negative",
])
def test_holds_is_false_for_extents_outside_the_table_or_empty(table, bad):
    table.write([(0, PAGES)], 5)  # every page stamped: only the extent can be wrong
    offset, length = {
        "before the payload": (table.data_offset - PAGE, PAGE),
        "past the payload": (table.data_offset + (PAGES - 1) * PAGE, PAGE + 1),
        "past the table": (table.data_offset + 100 * PAGE, PAGE),
        "empty": (table.data_offset, 0),
        "negative": (table.data_offset + PAGE, -1),
    }[bad]
    assert not table.holds([(offset, length)], 5)
    assert not table.holds([extent(table, 0, 1), (offset, length)], 5)


def test_a_released_table_can_no_longer_be_read(table):
    table.release()
    with pytest.raises(ValueError):
        table.holds([extent(table, 0, 1)], FREE)


# ------------------------------------------------------------ StampReader


@pytest.fixture
def table_file(tmp_path, memory):
    """The table of `memory` as a file: what a worker reads with pread."""
    path = tmp_path / "table"
    path.write_bytes(bytes(memory))
    fd = os.open(path, os.O_RDWR)
    yield path, fd
    os.close(fd)


def test_a_reader_through_the_file_answers_as_the_table_does(table, memory, table_file):
    """`StampReader` (pread, what workers use) agrees with the table over the
    same bytes, for extents in any order, overlapping, far apart or not."""
    rng = random.Random(5)
    table.write([(0, 6)], 4)
    table.write([(6, 7)], 9)
    table.write([(13, 7)], 4)
    path, fd = table_file
    path.write_bytes(bytes(memory))
    reader = StampReader(fd, PAGE, len(memory), PAGES)
    for _ in range(300):
        extents = [extent(table, first, rng.randint(1, PAGES - first), skip=rng.randrange(PAGE))
                   for first in (rng.randrange(PAGES) for _ in range(rng.randint(1, 4)))]
        extents = [(o, length) for o, length in extents if length > 0]
        for stamp in (4, 9, FREE):
            assert reader.holds(extents, stamp) == table.holds(extents, stamp), extents
    assert reader.stamps(4, 4) == table.stamps(4, 4) == [4, 4, 9, 9]


def test_a_reader_reads_nearby_runs_in_one_call(table_file, monkeypatch):
    """A load's extents (scattered pages of one entry) cost one pread, not one
    per extent; runs more than MERGE_GAP_SLOTS pages apart cost one each."""
    _, fd = table_file
    pages = 4 * MERGE_GAP_SLOTS
    os.ftruncate(fd, pages * SLOT_BYTES)
    os.pwrite(fd, array("Q", [3]) * pages, 0)
    reader = StampReader(fd, PAGE, pages * SLOT_BYTES, pages)
    calls = []
    real = os.pread
    monkeypatch.setattr(stamps_module.os, "pread", lambda *a: calls.append(a) or real(*a))
    scattered = [(reader.data_offset + p * PAGE, PAGE) for p in (9, 2, 40, 17, 3)]
    assert reader.holds(scattered, 3) and len(calls) == 1
    calls.clear()
    far = [(reader.data_offset + p * PAGE, PAGE) for p in (0, 2 * MERGE_GAP_SLOTS)]
    assert reader.holds(far, 3) and len(calls) == 2


def test_pages_cut_off_the_file_read_as_free_never_as_the_entry(table, table_file):
    """Another process truncated the file: the stamps it cut read as free
    (no entry's check passes), and nothing faults (no mapping)."""
    table.write([(0, PAGES)], 7)
    path, fd = table_file
    os.pwrite(fd, array("Q", [7]) * PAGES, 0)
    reader = StampReader(fd, PAGE, len(path.read_bytes()), PAGES)
    assert reader.holds([extent(table, 0, PAGES)], 7)
    os.ftruncate(fd, 4 * SLOT_BYTES)
    assert reader.holds([extent(table, 0, 4)], 7)
    assert not reader.holds([extent(table, 3, 2)], 7)
    assert reader.stamps(2, 4) == [7, 7, FREE, FREE]
    os.ftruncate(fd, 0)
    assert not reader.holds([extent(table, 0, 1)], 7)


@pytest.mark.parametrize("bad", ["before the payload", "past the payload", "empty",
                                 "negative", "none"])
def test_a_reader_is_false_for_extents_outside_the_table_or_empty(table, table_file, bad):
    _, fd = table_file
    os.pwrite(fd, array("Q", [5]) * PAGES, 0)
    reader = StampReader(fd, PAGE, table.data_offset, PAGES)
    extents = {
        "before the payload": [(table.data_offset - PAGE, PAGE)],
        "past the payload": [(table.data_offset + (PAGES - 1) * PAGE, PAGE + 1)],
        "empty": [(table.data_offset, 0)],
        "negative": [(table.data_offset + PAGE, -1)],
        "none": [],
    }[bad]
    assert not reader.holds(extents, 5)


def test_the_canary_is_whole_only_as_the_daemon_writes_it(tmp_path):
    """The daemon writes canaries none of whose bytes is 0; a cut zeroes at
    least one (a short file reads 0)."""
    path = tmp_path / "region"
    size = 2 * PAGE
    path.write_bytes(bytes(file_bytes(size)))
    fd = os.open(path, os.O_RDWR)
    try:
        assert read_canary(fd, size) == 0 and not whole(0)
        canary = int.from_bytes(bytes(range(1, 9)), "little")
        write_canary(fd, size, canary)
        assert read_canary(fd, size) == canary and whole(canary)
        assert path.read_bytes()[-CANARY_BYTES:] == bytes(range(1, 9))  # the file's end
        os.ftruncate(fd, file_bytes(size) - 1)
        assert read_canary(fd, size) == 0  # short
        os.ftruncate(fd, file_bytes(size))
        assert read_canary(fd, size) == canary & ((1 << 56) - 1)
        assert not whole(read_canary(fd, size))
    finally:
        os.close(fd)
