"""The durable index (`ec_daemon.durable.index`, in the format of `ec_daemon.durable.journal`):
what a journal says after a crash at any byte, compaction, the id
reservation, and files it must not trust."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from ec_daemon.durable import index as index_module
from ec_daemon.durable.index import Index, open_own_file, read_header, read_index
from ec_daemon.durable.journal import (
    GONE,
    HEADER_BYTES,
    Header,
    IndexUnreadable,
    decode_records,
    encode_header,
    encode_ready,
    encode_ref,
)

HEADER = Header(generation=0xAB, region_size=1 << 20, page_bytes=4096, data_offset=4096,
                socket="unix:///run/ec/ec.sock")


def ready(index: Index, entry_id: int, pages: int = 1, first: int = 0) -> None:
    index.ready(entry_id, "ns", f"h{entry_id}", pages * 4096, (pages, 4096), "uint8",
                [(first, pages)])


def test_a_journal_says_which_entries_are_ready_hidden_or_gone(tmp_path):
    index = Index.create(tmp_path / "x.index", HEADER)
    for i in (1, 2, 3):
        ready(index, i, first=i)
    index.hidden(2)
    index.gone(3)
    index.close()
    header, journal = read_index(tmp_path / "x.index")
    assert header == HEADER and journal.highest == 3
    assert [(r.entry_id, r.hidden, r.mm_hash, r.runs) for r in journal.records.values()] == [
        (1, False, "h1", [(1, 1)]), (2, True, "h2", [(2, 1)])]


def test_a_torn_tail_ends_the_journal_at_every_byte(tmp_path):
    """A daemon killed mid-append leaves a prefix of its last record: the
    journal is read up to the record before it, never a partial one."""
    path = tmp_path / "x.index"
    index = Index.create(path, HEADER)
    ready(index, 1)
    before = path.stat().st_size
    ready(index, 2, first=1)
    index.close()
    data = path.read_bytes()
    for cut in range(before, len(data)):
        journal = decode_records(data[:cut])
        assert list(journal.records) == [1] and journal.end == before
    assert list(decode_records(data).records) == [1, 2]


def test_a_corrupt_record_ends_the_journal_there(tmp_path):
    path = tmp_path / "x.index"
    index = Index.create(path, HEADER)
    for i in (1, 2, 3):
        ready(index, i, first=i)
    index.close()
    data = bytearray(path.read_bytes())
    second = HEADER_BYTES + len(encode_ready(1, "ns", "h1", 4096, (1, 4096), "uint8",
                                             [(1, 1)]))
    data[second + 12] ^= 0xFF  # inside record 2's body: its checksum fails
    assert list(decode_records(bytes(data)).records) == [1]


def test_a_gone_record_of_a_repeated_id_removes_it(tmp_path):
    data = encode_header(HEADER) + encode_ready(5, "ns", "a", 1, (1,), "uint8", [(0, 1)]) \
        + encode_ref(GONE, 5) + encode_ready(5, "ns", "b", 1, (1,), "uint8", [(1, 1)])
    journal = decode_records(data)
    assert [r.mm_hash for r in journal.records.values()] == ["b"] and journal.highest == 5


@pytest.mark.parametrize("damage", ["magic", "version", "checksum"])
def test_a_header_it_does_not_understand_is_refused(tmp_path, damage):
    raw = bytearray(encode_header(HEADER))
    at = {"magic": 0, "version": 8, "checksum": 20}[damage]
    raw[at] ^= 0x01
    (tmp_path / "x.index").write_bytes(bytes(raw))
    with pytest.raises(IndexUnreadable):
        read_header(tmp_path / "x.index")


def test_ids_are_reserved_in_the_header(tmp_path):
    index = Index.create(tmp_path / "x.index", HEADER)
    index.reserve_ids(70_000)
    index.close()
    assert read_header(tmp_path / "x.index").ids_reserved == 70_000


def test_compaction_keeps_live_records_in_the_given_order(tmp_path, monkeypatch):
    monkeypatch.setattr(index_module, "COMPACT_MIN_BYTES", 0)
    path = tmp_path / "x.index"
    index = Index.create(path, HEADER)
    index.reserve_ids(99)
    for i in range(1, 41):
        ready(index, i, first=i)
    for i in range(1, 31):
        index.gone(i)
    index.hidden(35)
    grown = path.stat().st_size
    assert index.needs_compaction()
    index.compact([38, 31, 12])  # 12 is gone: ignored; the others follow in journal order
    assert not index.needs_compaction() and path.stat().st_size < grown
    ready(index, 41, first=41)  # appends go on after the rewrite
    index.close()
    header, journal = read_index(path)
    assert header.ids_reserved == 99
    assert list(journal.records) == [38, 31, 32, 33, 34, 35, 36, 37, 39, 40, 41]
    assert [i for i, r in journal.records.items() if r.hidden] == [35]
    assert [p.name for p in tmp_path.iterdir()] == ["x.index"]  # no temporary left


def test_a_write_error_disables_the_index_and_removes_it(tmp_path, monkeypatch, caplog):
    path = tmp_path / "x.index"
    index = Index.create(path, HEADER)
    ready(index, 1)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(index_module.os, "pwrite", full)
    ready(index, 2, first=1)
    assert not index.ok and not path.exists()
    assert "warm restart is off" in caplog.text
    index.gone(1)  # later records are dropped quietly
    index.reserve_ids(10)


def test_only_a_regular_file_of_this_user_is_opened(tmp_path):
    (tmp_path / "real").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(PermissionError):
        open_own_file(tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    refused: list[BaseException] = []  # a FIFO must not block the open: bounded by a thread

    def open_fifo() -> None:
        try:
            open_own_file(tmp_path / "fifo")
        except PermissionError as exc:
            refused.append(exc)

    thread = threading.Thread(target=open_fifo, daemon=True)
    thread.start()
    thread.join(5)
    assert refused and not thread.is_alive()
    if os.getuid() == 0:  # another user's file (root can make one)
        (tmp_path / "theirs").write_bytes(b"x")
        os.chown(tmp_path / "theirs", 12345, 12345)
        with pytest.raises(PermissionError):
            open_own_file(tmp_path / "theirs")
    os.close(open_own_file(tmp_path / "real"))


def test_the_journal_says_which_engines_views_were_attached(tmp_path, monkeypatch):
    """Counted per engine and namespace (an engine re-attaching has two
    sessions for a moment); compaction keeps the attached ones."""
    monkeypatch.setattr(index_module, "COMPACT_MIN_BYTES", 0)
    path = tmp_path / "x.index"
    index = Index.create(path, HEADER)
    index.view_on("A", "ns")
    index.view_on("A", "ns")  # its new session, before the old one is gone
    index.view_on("B", "ns")
    index.view_off("A", "ns")
    index.view_off("B", "ns")
    assert read_index(path)[1].views == {("A", "ns")}
    ready(index, 1)
    index.gone(1)
    index.compact([])
    index.close()
    assert read_index(path)[1].views == {("A", "ns")}
