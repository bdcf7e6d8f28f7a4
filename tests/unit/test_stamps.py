"""The stamp table's layout: what the daemon writes and a worker checks."""

import pytest

from ec_protocol.stamps import FREE, SLOT_BYTES, StampTable, table_bytes

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
