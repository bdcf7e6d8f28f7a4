"""Warm restart: a new daemon adopts the region a dead one left.

At start the daemon looks in its --shm-dir for a dead daemon's region (its
flock free) whose index names the same socket. If its format, size, page
size and layout are the ones the flags ask for, it is adopted: the region
file, its generation and every verified ready entry stay, so engines
re-attach and hit at once and their workers' mappings (and loads in flight)
are untouched. Anything else starts a fresh region, with one line saying why.

What is adopted is decided by the stamp table, not by the journal alone: an
index record is adopted only when every page of its runs, and no other page,
carries its entry id. Stamps are written before a writer learns its extents
and cleared only after the GONE record (`cache`), so a record of freed or
reused pages, a pending save (stamped, never recorded) and a torn tail
(ignored) can never put wrong bytes under a key. Stamped pages no adopted
entry owns may still be written by a writer of the dead daemon: they are
quarantined. Ids continue above every id the dead daemon reserved, stamped or
recorded, so a stamp never names two entries of one region.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ec_daemon.errors import InvalidArgument
from ec_daemon.index import Index, index_path, read_index
from ec_daemon.journal import FORMAT_VERSION, Header, IndexUnreadable, Record
from ec_daemon.limits import validate_save
from ec_daemon.records import Run
from ec_daemon.region import DeadRegion, Region, dead_regions, region_path
from ec_daemon.sizes import format_size

log = logging.getLogger(__name__)


class NotAdoptable(Exception):
    """The region cannot be adopted; the message says why (for the log line)."""


@dataclass(frozen=True)
class Layout:
    """What the flags ask the region to be."""

    socket: str
    region_size: int
    page_bytes: int
    data_offset: int

    def header(self, generation: int) -> Header:
        return Header(generation, self.region_size, self.page_bytes, self.data_offset,
                      self.socket)


@dataclass
class Verified:
    """The outcome of checking a journal against a stamp table."""

    records: list[Record] = field(default_factory=list)  # adopted, journal order
    free: list[Run] = field(default_factory=list)
    quarantined: list[Run] = field(default_factory=list)
    next_entry_id: int = 1
    rejected: int = 0  # records whose pages did not carry their stamp alone
    views: list[tuple[str, str]] = field(default_factory=list)  # (engine, namespace) attached


@dataclass
class Adoption:
    region: Region
    verified: Verified
    seconds: float

    def summary(self) -> str:
        v = self.verified
        hidden = sum(r.hidden for r in v.records)
        nbytes = sum(r.nbytes for r in v.records)
        parts = [f"adopted region {self.region.path} (generation {self.region.generation:016x}): "
                 f"{len(v.records)} entries ({format_size(nbytes)}"
                 + (f", {hidden} evicted awaiting acknowledgement" if hidden else "")
                 + f") in {self.seconds * 1e3:.0f} ms"]
        if v.quarantined:
            pages = sum(n for _, n in v.quarantined)
            parts.append(f"{pages} page(s) of unfinished saves quarantined")
        if v.rejected:
            parts.append(f"{v.rejected} record(s) not adopted: their pages no longer carry "
                         "their stamp")
        return "; ".join(parts)


def verify(records: Iterable[Record], table: bytes, *, page_bytes: int, highest_id: int,
           ids_reserved: int) -> Verified:
    """Which `records` (journal order) the stamp table `table` (one native
    uint64 per payload page) proves, which pages are free, which quarantined,
    and where entry ids continue. A record is adopted when every page of its
    runs carries its id and no record adopted before claimed one of them."""
    work = bytearray(table)
    slots = memoryview(work).cast("Q")
    pages = len(slots)
    out = Verified()
    for record in records:
        stamp = array("Q", [record.entry_id]).tobytes()
        if _valid(record, page_bytes, pages) and all(
                slots[first:first + n].tobytes() == stamp * n for first, n in record.runs):
            for first, n in record.runs:
                slots[first:first + n] = array("Q", bytes(8 * n))  # claimed: once only
            out.records.append(record)
        else:
            out.rejected += 1
    # Stamped pages no adopted entry owns (unfinished saves, rejected records).
    out.quarantined = _runs(re.finditer(rb"[^\x00]+", work), inside=False)
    highest_stamp = max((max(slots[first:first + n]) for first, n in out.quarantined),
                        default=0)
    out.free = _runs(re.finditer(rb"\x00+", table), inside=True)
    out.next_entry_id = max(highest_id, highest_stamp, ids_reserved - 1) + 1
    slots.release()
    return out


def _runs(matches: Iterator[re.Match[bytes]], *, inside: bool) -> list[Run]:
    """Page runs of byte ranges of the table: the slots wholly `inside` them
    (zero slots), or every slot they touch (stamped slots); adjacent joined."""
    out: list[Run] = []
    for match in matches:
        start, end = match.span()
        first, last = (-(-start // 8), end // 8) if inside else (start // 8, -(-end // 8))
        if last <= first:
            continue
        if out and out[-1][0] + out[-1][1] >= first:
            out[-1] = (out[-1][0], max(out[-1][0] + out[-1][1], last) - out[-1][0])
        else:
            out.append((first, last - first))
    return out


def _valid(record: Record, page_bytes: int, pages: int) -> bool:
    """A record the daemon could have written: a key, shape and size it
    accepts, and exactly the pages its bytes need, inside the region."""
    try:
        validate_save(record.mm_hash, record.nbytes, record.shape, record.dtype)
    except InvalidArgument:
        return False
    need = -(-record.nbytes // page_bytes)
    return bool(record.namespace) and all(
        n > 0 and first >= 0 and first + n <= pages for first, n in record.runs) \
        and sum(n for _, n in record.runs) == need


def adopt(dead: DeadRegion, layout: Layout) -> Adoption:
    """Adopt `dead` (its lock held) as a region of `layout`. Raises
    NotAdoptable; the caller then removes it."""
    started = time.perf_counter()
    header = dead.header
    if header is None:
        raise NotAdoptable(dead.problem)
    _check_layout(dead, header, layout)
    path = index_path(dead.path)
    try:
        header, journal = read_index(path)
    except (OSError, IndexUnreadable) as exc:
        raise NotAdoptable(f"its index cannot be read: {exc}") from None
    pages = (layout.region_size - layout.data_offset) // layout.page_bytes
    table = os.pread(dead.fd, 8 * pages, 0)
    if len(table) != 8 * pages:
        raise NotAdoptable("its stamp table is short")
    verified = verify(journal.records.values(), table, page_bytes=layout.page_bytes,
                      highest_id=journal.highest, ids_reserved=header.ids_reserved)
    verified.views = sorted(journal.views)
    try:  # ids continuing above every old one; a torn tail cut
        index = Index.reopen(path, dataclasses.replace(
            header, ids_reserved=verified.next_entry_id), journal, verified.records,
            verified.views)
    except OSError as exc:
        raise NotAdoptable(f"its index cannot be rewritten: {exc.strerror or exc}") from None
    return Adoption(dead.take(index), verified, time.perf_counter() - started)


def _check_layout(dead: DeadRegion, header: Header, layout: Layout) -> None:
    if header.page_bytes != layout.page_bytes:
        raise NotAdoptable(f"its pages are {format_size(header.page_bytes)} and --page-bytes "
                           f"asks for {format_size(layout.page_bytes)}")
    if header.region_size != layout.region_size or header.data_offset != layout.data_offset:
        raise NotAdoptable(
            f"it caches {format_size(header.region_size - header.data_offset)} and "
            f"--cpu-bytes asks for {format_size(layout.region_size - layout.data_offset)}")
    if dead.size != layout.region_size:
        raise NotAdoptable(f"its file is {format_size(dead.size)}, not the "
                           f"{format_size(layout.region_size)} its index says")
    if dead.path != region_path(dead.path.parent, header.generation):
        raise NotAdoptable("its index names another generation")


def find(shm_dir: str, layout: Layout, *, fresh_start: bool = False) -> tuple[
        Adoption | None, str]:
    """Adopt the newest dead region of this socket, if one fits; remove the
    other dead regions of this socket and those without a readable index
    (older versions, or a daemon that died creating one). Regions of other
    sockets are left for their own daemons, never even locked. Returns (the
    adoption or None, why not: for the log line)."""
    mine: list[DeadRegion] = []
    unreadable = []
    for dead in dead_regions(shm_dir, layout.socket):
        if dead.header is None:
            log.info("removed stale region %s of a dead daemon (%s)", dead.path, dead.problem)
            unreadable.append(f"{dead.path.name}: {dead.problem}")
            dead.remove()
        else:
            mine.append(dead)
    if not mine:
        removed = f" (removed {'; '.join(unreadable)})" if unreadable else ""
        return None, f"no region of a previous daemon on {layout.socket} in {shm_dir}{removed}"
    if fresh_start:
        for dead in mine:
            dead.remove()
        return None, f"--fresh-start: removed {len(mine)} region(s) of a previous daemon"
    reasons = []
    adoption = None
    for dead in mine:
        if adoption is not None:
            dead.remove()
            continue
        try:
            adoption = adopt(dead, layout)
        except NotAdoptable as exc:
            reasons.append(f"{dead.path.name}: {exc}")
            dead.remove()
    if adoption is not None:
        return adoption, ""
    return None, "cannot adopt the previous region (" + "; ".join(reasons) + \
        f"; format version {FORMAT_VERSION}): removed it"
