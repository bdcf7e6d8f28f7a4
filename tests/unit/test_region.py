import fcntl
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from ec_daemon.durable.dead import clean_stale
from ec_daemon.durable.region import PREFIX, Region, RegionError
from ec_protocol.stamps import TRAILER_BYTES, file_bytes, read_canary, whole


def test_create_locks_prefaults_and_close_removes(tmp_path):
    region = Region.create(tmp_path, 1 << 20)
    assert region.path.exists() and region.path.stat().st_size == (1 << 20) + TRAILER_BYTES
    assert stat.S_IMODE(region.path.stat().st_mode) == 0o600
    assert clean_stale(tmp_path) == []  # locked: a live daemon's
    region.close()
    assert not region.path.exists()


def test_dead_regions_and_stale_half_created_ones_are_cleaned(tmp_path):
    dead = tmp_path / f"{PREFIX}00000000000000aa.region"
    dead.write_bytes(b"x")
    fresh = tmp_path / f".{PREFIX}00000000000000bb.creating"
    fresh.write_bytes(b"x")  # a daemon creating its region right now
    old = tmp_path / f".{PREFIX}00000000000000cc.creating"
    old.write_bytes(b"x")
    long_ago = time.time() - 3600
    os.utime(old, (long_ago, long_ago))
    assert clean_stale(tmp_path) == [dead]
    assert not dead.exists() and not old.exists()
    assert fresh.exists()


def test_a_region_that_does_not_fit_is_refused_cleanly(tmp_path):
    with pytest.raises(RegionError, match="does not fit"):
        Region.create(tmp_path, 1 << 60)
    assert list(tmp_path.iterdir()) == []


def test_the_lock_is_held_for_the_daemons_life(tmp_path):
    region = Region.create(tmp_path, 1 << 16)
    fd = os.open(region.path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
        region.close()


def test_a_group_region_is_owner_only_until_its_group_is_set(tmp_path, monkeypatch):
    modes_at_chown = []
    real_fchown = os.fchown

    def fchown(fd, uid, gid):
        modes_at_chown.append(stat.S_IMODE(os.fstat(fd).st_mode))
        real_fchown(fd, uid, gid)

    monkeypatch.setattr(os, "fchown", fchown)
    old_umask = os.umask(0)  # the umask must not be what hides the window
    try:
        region = Region.create(tmp_path, 1 << 16, mode=0o660, gid=os.getegid())
    finally:
        os.umask(old_umask)
    try:
        assert modes_at_chown == [0o600]
        assert stat.S_IMODE(region.path.stat().st_mode) == 0o660
    finally:
        region.close()


def test_the_second_tier_writes_and_reads_payload_across_extents(tmp_path):
    """A promotion writes a value's parts (a chunked read) across the
    entry's extents without joining them; publishing reads them back."""
    payload = os.urandom(10_000)
    parts = [payload[:3000], payload[3000:3001], payload[3001:]]  # cuts unlike the extents'
    extents = [(4096, 4096), (12288, 4096), (20480, 10_000 - 8192)]
    with Region.create(tmp_path, 32768) as region:
        region.write(extents, parts)
        read = region.read(extents)
        assert [len(v) for v in read] == [4096, 4096, 10_000 - 8192]
        assert b"".join(read) == payload
        with open(region.path, "rb") as f:
            raw = f.read()
        assert raw[4096:8192] == payload[:4096] and raw[8192:12288] == bytes(4096)
        with pytest.raises(ValueError, match="shorter"):
            region.write(extents, [payload[:-1]])
        with pytest.raises(ValueError, match="longer"):
            region.write(extents, [payload, b"x"])
        with pytest.raises(ValueError, match="outside the region"):
            region.read([(32768 - 10, 11)])


def rss_shmem_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    raise AssertionError("no RssShmem in /proc/self/status")


def test_the_daemon_maps_no_page_of_the_region():
    """Issue 40, finding 4: a client can truncate the region (it opens it
    read-write to map it), and a mapped page past the end is a SIGBUS. The
    daemon reads and writes the payload and the stamps with pread/pwrite: no
    page of the region enters its RSS, and a truncated file reads short
    (zeros), then gets its size back."""
    mib = 1 << 20
    with Region.create("/dev/shm", 32 * mib) as region:
        extents = [(0, 16 * mib), (16 * mib, 16 * mib - 100)]
        region.write(extents, [b"\x01" * (32 * mib - 100)])
        stamps = region.stamps(4096, 4096)
        before = rss_shmem_kib()
        assert sum(v.count(1) for v in region.read(extents)) == 32 * mib - 100
        stamps.write([(0, 8)], 7)
        assert stamps.holds([(4096, 8 * 4096)], 7)
        assert rss_shmem_kib() - before < 1024
        assert region.shortfall() is None
        with open(region.path, "r+b") as f:  # what any client may do
            os.ftruncate(f.fileno(), 4 * 8)  # the stamps of pages 4-7 and every payload byte
        assert region.shortfall() == 4 * 8
        assert stamps.stamps(0, 8) == [7] * 4 + [0] * 4  # cut: reads as free
        assert region.read([(16 * mib, 10)]) == [bytes(10)]
        region.restore()
        assert region.shortfall() is None and os.stat(region.path).st_size == file_bytes(32 * mib)


def test_the_canary_shows_any_cut_even_one_regrown_at_once_and_is_renewed():
    """The file's last 8 bytes are a random non-zero canary the daemon wrote
    at creation, none of whose bytes is 0. A cut that is regrown before
    anyone looks at the size (a worker's ftruncate to 0, to mid-region, to
    the payload's end or one byte short, then back) leaves the file whole but
    zeroes a byte of the canary (all of it when a page was cut); renewing it
    after the repair gives another value, which a worker that mapped the file
    before finds changed."""
    size = 1 << 20
    with Region.create("/dev/shm", size) as region:
        first = region.canary
        assert whole(first) and region.canary_intact()
        with open(region.path, "rb") as f:
            assert read_canary(f.fileno(), size) == first
        for cut in (0, size // 2, size, file_bytes(size) - 1):
            with open(region.path, "r+b") as f:  # what any client may do
                os.ftruncate(f.fileno(), cut)
                os.ftruncate(f.fileno(), file_bytes(size))  # and back, at once
            assert region.shortfall() is None, cut  # the size says nothing
            assert not region.canary_intact(), cut
            with open(region.path, "rb") as f:
                cut_canary = read_canary(f.fileno(), size)
            assert not whole(cut_canary) and (cut_canary == 0) == (cut <= size), cut
            region.restore()
            renewed = region.renew_canary()
            assert whole(renewed) and renewed != first and region.canary_intact()
            first = renewed


def test_adopting_a_region_without_a_trailer_adds_one_with_a_canary(tmp_path):
    """An older daemon's region is exactly the region's size: `add_canary`
    grows it by the trailer and writes a canary (the payload untouched)."""
    size = 1 << 16
    with Region.create(tmp_path, size) as region:
        os.truncate(region.path, size)  # as an older daemon made it
        region.write([(size - 4, 4)], [b"last"])
        region.canary = 0
        assert region.shortfall() == size
        region.add_canary()
        assert whole(region.canary) and region.canary_intact() and region.shortfall() is None
        assert region.read([(size - 4, 4)]) == [b"last"]


def test_a_name_another_user_took_costs_a_generation_not_the_start(tmp_path, monkeypatch):
    """Someone who saw a generation created the region's final name first:
    link(2) never replaces it; the region takes another generation."""
    import ec_daemon.durable.region as region_module

    taken = tmp_path / f"{PREFIX}{0xAB:016x}.region"
    taken.write_bytes(b"not ours")
    if os.getuid() == 0:
        os.chown(taken, 12345, 12345)
    generations = iter([0xAB, 0xCD])
    monkeypatch.setattr(region_module, "new_generation", lambda: next(generations))
    region = Region.create(tmp_path, 1 << 16)
    try:
        assert region.generation == 0xCD and taken.read_bytes() == b"not ours"
    finally:
        region.close()
    assert taken.exists()


def test_fifos_and_other_users_files_under_region_names_are_left_alone(tmp_path):
    """A FIFO named like a dead region must not block the scan (any local user
    can plant one in /dev/shm); another user's file is never touched."""
    fifo = tmp_path / f"{PREFIX}{0x11:016x}.region"
    os.mkfifo(fifo)
    os.mkfifo(tmp_path / f"{PREFIX}{0x22:016x}.index")
    planted = [fifo]
    if os.getuid() == 0:  # another user's file (root can make one)
        theirs = tmp_path / f"{PREFIX}{0x33:016x}.region"
        theirs.write_bytes(b"x")
        os.chown(theirs, 12345, 12345)
        planted.append(theirs)
    found: list[list[Path]] = []
    scan = threading.Thread(target=lambda: found.append(clean_stale(tmp_path)), daemon=True)
    scan.start()
    scan.join(10)
    assert found == [[]], "the scan blocked on a FIFO"
    assert all(path.exists() for path in planted)


def test_a_symlink_loop_or_a_folder_under_our_names_never_fails_the_scan(tmp_path):
    """Another local user's link loop under a half-created region's name, or a
    folder under the index name of a dead region of ours (which has none):
    skipped, never raised; our dead region is still removed."""
    os.symlink(f".{PREFIX}loop.creating", tmp_path / f".{PREFIX}loop.creating")
    ours = tmp_path / f"{PREFIX}{0x44:016x}.region"
    ours.write_bytes(b"x")  # dead, no index (a --warm-restart false daemon)
    folder = tmp_path / f"{PREFIX}{0x44:016x}.index"
    folder.mkdir()
    if os.getuid() == 0:
        os.chown(folder, 12345, 12345)
    assert clean_stale(tmp_path) == [ours]
    assert not ours.exists() and folder.is_dir()


def test_regions_of_other_sockets_are_not_even_locked(tmp_path, monkeypatch):
    """Their own daemon may be starting at this moment: locking them, even
    briefly, would make it miss its region and start cold."""
    import ec_daemon.durable.dead as dead_module
    from ec_daemon.durable.journal import Header

    header = lambda gen, socket: Header(gen, 1 << 16, 4096, 4096, socket)  # noqa: E731
    mine = Region.create(tmp_path, 1 << 16, index_header=lambda g: header(g, "unix:///a.sock"))
    theirs = Region.create(tmp_path, 1 << 16,
                           index_header=lambda g: header(g, "unix:///b.sock"))
    mine.close(remove=False)
    theirs.close(remove=False)
    locked: list[Path] = []
    real = dead_module._lock_own
    monkeypatch.setattr(dead_module, "_lock_own", lambda p: locked.append(p) or real(p))
    (dead,) = dead_module.dead_regions(tmp_path, "unix:///a.sock")
    assert dead.path == mine.path and theirs.path not in locked
    dead.release()
    assert sorted(clean_stale(tmp_path)) == sorted([mine.path, theirs.path])
