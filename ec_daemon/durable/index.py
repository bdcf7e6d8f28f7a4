"""The durable index: which entries of the region are ready, in a file beside it.

A daemon that dies (kill -9, a crash, an upgrade) leaves its region in the
tmpfs; the next daemon adopts it (`adoption`) from this index and the
region's stamp table. The index, `ec-daemon-<generation>.index`, is written
only by the daemon (owner-only, never mapped by clients) in the format of
`journal`.

Why a journal and when each record is written (docs/architecture.md, "Warm
restart"): READY is appended before the entry becomes visible, GONE before
its pages are freed, and every entry id is reserved in the header before it
is used, so the file never says more than the truth: an entry without a
READY record is not adopted (its stamped pages are quarantined), a record
whose pages no longer all carry its stamp is not adopted, a torn tail ends
the journal, and no id is ever handed out twice for one region. HIDDEN only
brings an evicted entry back hidden instead of ready (losing it is harmless:
the bytes are intact until GONE). Records are written with write(2), once
per event-loop turn in the daemon (`flush_with`): a process that dies loses
nothing the kernel has, and a record it dies with only loses its entry.

The journal is compacted (rewritten whole, then renamed over) when it holds
more than twice what is live. Not thread-safe: the event loop is its caller.

The daemon holds an exclusive flock on its index for its whole life (format
2): that, not a lock on the region, says the region's daemon is alive. Every
client may open the region (it maps it) and so lock it: a client holding a
shared lock on a dead daemon's region made the next start begin empty and
`ec-daemon clean` leave the file. Only the daemon's user can open the index.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from ec_daemon.core.limits import COMPACT_MIN_BYTES, COMPACT_RATIO
from ec_daemon.durable.journal import (
    FORMAT_VERSION,
    GONE,
    HEADER_BYTES,
    HIDDEN,
    IDS_AT,
    REF_RECORD_BYTES,
    VERSION_AT,
    VIEW_OFF,
    VIEW_ON,
    Header,
    Journal,
    Record,
    decode_header,
    decode_records,
    encode_header,
    encode_ids,
    encode_ready,
    encode_ref,
    encode_version,
    encode_view,
)

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".index"
COMPACTING_SUFFIX = ".compacting"  # an index being rewritten; left by a daemon that died then


def index_path(region_path: Path) -> Path:
    """The index of a region file: same folder, same generation."""
    return region_path.with_suffix(INDEX_SUFFIX)


def read_index(path: Path) -> tuple[Header, Journal]:
    """The header and what the journal says, of the index file at `path`.
    Only a regular file of this user is read, never following a symlink and
    never blocking on a FIFO. Raises IndexUnreadable (or OSError)."""
    fd = open_own_file(path)
    try:
        size = os.fstat(fd).st_size
        data = _read_all(fd, size)
    finally:
        os.close(fd)
    return decode_header(data), decode_records(data)


def read_header(path: Path) -> Header:
    """The header alone (start-up's scan of dead regions). Raises IndexUnreadable/OSError."""
    fd = open_own_file(path)
    try:
        return decode_header(_read_all(fd, HEADER_BYTES))
    finally:
        os.close(fd)


def open_own_file(path: Path, flags: int = os.O_RDONLY) -> int:
    """Open `path` only if it is a regular file of this user: never follows a
    symlink, never blocks on a FIFO another user planted. Raises OSError."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(errno.EPERM, "not a regular file of this user", str(path))
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        opened = os.fstat(fd)
        if (opened.st_ino, opened.st_dev) != (info.st_ino, info.st_dev) \
                or not stat.S_ISREG(opened.st_mode) or opened.st_uid != os.getuid():
            raise PermissionError(errno.EPERM, "the file changed while opening it", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_all(fd: int, size: int) -> bytes:
    chunks = []
    at = 0
    while at < size:
        chunk = os.pread(fd, min(size - at, 64 << 20), at)
        if not chunk:
            break
        chunks.append(chunk)
        at += len(chunk)
    return b"".join(chunks)


class Index:
    """The journal of one region, open for appending. Any write error
    disables it for good: the file is removed, so no later daemon adopts
    what it no longer describes (a warm restart is lost, never an entry
    served wrong); `ok` then reads False."""

    def __init__(self, path: Path, fd: int, header: Header, journal_bytes: int) -> None:
        self.path = path
        self._fd = fd
        self.header = header
        self.ids_reserved = header.ids_reserved
        self._end = journal_bytes  # where the next record goes
        self._live: dict[int, bytes] = {}  # entry id -> its READY record
        self._hidden: set[int] = set()
        self._views: dict[tuple[str, str], int] = {}  # (engine, namespace) -> sessions
        self._live_bytes = 0
        self._buffer: list[bytes] = []  # records not written yet (`flush_with`)
        self._schedule: Callable[[Callable[[], None]], object] | None = None
        self.ok = True

    @classmethod
    def create(cls, path: Path, header: Header) -> Index:
        """A new, empty index (O_EXCL: never another user's file), locked for
        this daemon's life. Raises OSError."""
        return cls(path, _new_file(path, encode_header(header)), header, HEADER_BYTES)

    @classmethod
    def reopen(cls, path: Path, header: Header, journal: Journal, adopted: list[Record],
               views: Iterable[tuple[str, str]] = (), fd: int | None = None) -> Index:
        """The index of an adopted region, kept in place (no second copy in a
        tmpfs that may be short): a torn tail is cut where `journal` ends, the
        id reservation raised to `header`'s, the format made this daemon's,
        and GONE appended for every record not `adopted`. `views`: the
        engines still awaited (each counts once). `fd`: the index already
        open and locked (`dead.dead_regions`), taken over. Raises OSError."""
        if fd is None:
            fd = open_own_file(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (ours already, or free)
            os.ftruncate(fd, journal.end)
            _write_at(fd, encode_ids(header.ids_reserved), IDS_AT)
            if header.version != FORMAT_VERSION:
                _write_at(fd, encode_version(), VERSION_AT)
        except BaseException:
            os.close(fd)
            raise
        index = cls(path, fd, header, journal.end)
        for r in adopted:
            index._live[r.entry_id] = r.raw or encode_ready(
                r.entry_id, r.namespace, r.mm_hash, r.nbytes, r.shape, r.dtype, r.runs,
                r.checksum)
            if r.hidden:
                index._hidden.add(r.entry_id)
        index._views = dict.fromkeys(views, 1)
        index._live_bytes = sum(map(len, index._live.values()))
        for entry_id in journal.records.keys() - index._live.keys():
            index._append(encode_ref(GONE, entry_id))
        if not index.ok:
            raise OSError(errno.EIO, f"cannot write {path}")
        return index

    def flush_with(self, schedule: Callable[[Callable[[], None]], object]) -> None:
        """Write records once per `schedule` (the event loop's call_soon: once
        per loop turn, before that turn's messages go out) instead of one
        write(2) each. A record the process dies with only loses its entry:
        what is adopted is decided by the stamps, which are in the region."""
        self._schedule = schedule

    def flush(self) -> None:
        """Write the records appended since the last flush."""
        if not self._buffer:
            return
        data = b"".join(self._buffer)
        self._buffer.clear()
        if not self.ok:
            return
        try:
            _write_at(self._fd, data, self._end)
        except OSError as exc:
            self._disable(exc)
            return
        self._end += len(data)

    # ---------------------------------------------------------- records

    def ready(self, entry_id: int, namespace: str, mm_hash: str, nbytes: int,
              shape: tuple[int, ...], dtype: str, runs: list[tuple[int, int]],
              checksum: int = 0) -> None:
        """Before the entry becomes visible."""
        record = encode_ready(entry_id, namespace, mm_hash, nbytes, shape, dtype, runs,
                              checksum)
        if self._append(record):
            self._live[entry_id] = record
            self._live_bytes += len(record)

    def hidden(self, entry_id: int) -> None:
        """The entry was evicted (its bytes stay until `gone`)."""
        if entry_id in self._live and self._append(encode_ref(HIDDEN, entry_id)):
            self._hidden.add(entry_id)

    def gone(self, entry_id: int) -> None:
        """Before the entry's pages are freed."""
        record = self._live.pop(entry_id, None)
        if record is None:
            return
        self._live_bytes -= len(record)
        self._hidden.discard(entry_id)
        self._append(encode_ref(GONE, entry_id))

    def view_on(self, engine: str, namespace: str) -> None:
        """A scheduler session of engine instance `engine` (`sessions.engine_key`)
        attached (before it sees anything)."""
        key = (engine, namespace)
        self._views[key] = self._views.get(key, 0) + 1
        if self._views[key] == 1:
            self._append(encode_view(VIEW_ON, engine, namespace))

    def view_off(self, engine: str, namespace: str) -> None:
        """One of `engine`'s scheduler sessions can load nothing more."""
        key = (engine, namespace)
        left = self._views.get(key, 0) - 1
        if left > 0:
            self._views[key] = left
        elif self._views.pop(key, None) is not None:
            self._append(encode_view(VIEW_OFF, engine, namespace))

    def reserve_ids(self, below: int) -> None:
        """Every id below `below` may be used from now on: said before any is."""
        if not self.ok:
            return
        try:
            _write_at(self._fd, encode_ids(below), IDS_AT)
        except OSError as exc:
            self._disable(exc)
            return
        self.ids_reserved = below

    def needs_compaction(self) -> bool:
        live = self._live_bytes + len(self._hidden) * REF_RECORD_BYTES
        return self.ok and self._end - HEADER_BYTES > max(COMPACT_MIN_BYTES,
                                                          COMPACT_RATIO * live)

    def compact(self, order: Iterable[int]) -> None:
        """Rewrite the journal with only live records, `order` first (entry
        ids, least recently used first: the next adoption keeps that order)."""
        if not self.ok:
            return
        try:
            self._rewrite(order)
        except OSError as exc:
            self._disable(exc)

    def close(self, *, remove: bool = False) -> None:
        if self._fd >= 0:
            self.flush()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    # ---------------------------------------------------------- helpers

    def _append(self, record: bytes) -> bool:
        if not self.ok:
            return False
        if self._schedule is not None and not self._buffer:
            self._schedule(self.flush)
        self._buffer.append(record)
        if self._schedule is None:
            self.flush()
        return self.ok

    def _rewrite(self, order: Iterable[int]) -> None:
        """Header and live records into a new file, renamed over the old one:
        a crash leaves either file whole."""
        live, hidden = self._live, self._hidden
        ordered = [i for i in dict.fromkeys(order) if i in live]
        if len(ordered) != len(live):
            named = set(ordered)
            ordered += [i for i in live if i not in named]
        body = b"".join(live[i] for i in ordered)
        tail = b"".join(encode_ref(HIDDEN, i) for i in ordered if i in hidden) + b"".join(
            encode_view(VIEW_ON, engine, namespace) for engine, namespace in self._views)
        header = Header(self.header.generation, self.header.region_size,
                        self.header.page_bytes, self.header.data_offset, self.header.socket,
                        self.ids_reserved)
        temp = self.path.with_name(
            f".{self.path.name}.{secrets.token_hex(4)}{COMPACTING_SUFFIX}")
        fd = _new_file(temp, encode_header(header) + body + tail)
        try:
            os.rename(temp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                temp.unlink()
            raise
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self._buffer.clear()  # the rewrite says what they said
        self._live = {i: live[i] for i in ordered}
        self._end = HEADER_BYTES + len(body) + len(tail)

    def _disable(self, exc: OSError) -> None:
        self.ok = False
        log.error("the region's index %s cannot be written (%s): warm restart is off for this "
                  "daemon's life; the index is removed so no later daemon adopts a stale one",
                  self.path, exc.strerror or exc)
        self.close(remove=True)


class NoIndex:
    """What the cache journals to without an index: nothing (unit tests,
    tools, and a daemon run with --warm-restart false)."""

    ids_reserved = sys.maxsize

    def ready(self, entry_id: int, namespace: str, mm_hash: str, nbytes: int,
              shape: tuple[int, ...], dtype: str, runs: list[tuple[int, int]],
              checksum: int = 0) -> None:
        return None

    def hidden(self, entry_id: int) -> None:
        return None

    def gone(self, entry_id: int) -> None:
        return None

    def view_on(self, engine: str, namespace: str) -> None:
        return None

    def view_off(self, engine: str, namespace: str) -> None:
        return None

    def reserve_ids(self, below: int) -> None:
        return None

    def needs_compaction(self) -> bool:
        return False

    def compact(self, order: Iterable[int]) -> None:
        return None


def _new_file(path: Path, data: bytes) -> int:
    """A new owner-only file holding `data` (O_EXCL: never another user's, nor
    a link), open for writing and locked (the daemon's liveness: it is locked
    before it holds anything, so no scan takes it for a dead daemon's);
    nothing is left behind on failure."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _write_at(fd, data, 0)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    return fd


def _write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        wrote = os.pwrite(fd, view, offset)
        view, offset = view[wrote:], offset + wrote

