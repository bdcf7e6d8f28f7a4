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
quarantined. Ids continue above every id the dead daemon reserved, so an id
it may have issued is never issued again for the region.

Every engine worker maps the region read-write, so the stamp table may say
anything: a stamp at or above the index's id reservation is one no daemon
issued (ids are reserved before they are used), so its pages are quarantined
like unfinished saves, counted (`corrupt_stamp_pages`) and never raise the
ids. The reservation itself (a u64 at a fixed offset, rewritten in place, so
outside the header's checksum) is written by the daemon's user alone: one
above MAX_IDS_RESERVED is corruption and the region starts fresh, saying so
(`refused_corrupt_index`); records at or above it, and any other record the
daemon never writes, are not adopted (`invalid_records`). A region whose mode
or group is not what --socket-mode and --group ask for starts fresh
(`refused_access`): descriptors and mappings opened under the old access
would keep it, so adopting it would not revoke what the operator took away.
"""

from __future__ import annotations

import dataclasses
import grp
import logging
import os
import re
import stat
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import NamedTuple

from ec_daemon.core.limits import (
    DEFAULT_SOCKET_MODE,
    MAX_IDS_RESERVED,
    validate_layout_namespace,
    validate_save,
)
from ec_daemon.core.records import Run
from ec_daemon.durable.dead import DeadRegion, dead_regions
from ec_daemon.durable.index import Index, index_path, read_index
from ec_daemon.durable.journal import FORMAT_VERSION, Header, IndexUnreadable, Record
from ec_daemon.durable.region import Region, region_path
from ec_daemon.errors import InvalidArgument
from ec_protocol.sizes import format_size
from ec_protocol.stamps import file_bytes, whole

log = logging.getLogger(__name__)


class NotAdoptable(Exception):
    """The region cannot be adopted; the message says why (for the log line),
    `kind` which counter says it: "layout" (the flags changed or the files
    are not a daemon's), "corrupt" (its index cannot be right) or "access"."""

    def __init__(self, why: str, kind: str = "layout") -> None:
        super().__init__(why)
        self.kind = kind


@dataclass(frozen=True)
class RegionSpec:
    """What the flags ask the region to be."""

    socket: str
    region_size: int
    page_bytes: int
    data_offset: int
    mode: int = DEFAULT_SOCKET_MODE  # --socket-mode: the region's permissions
    gid: int | None = None  # --group; None: the group a new file of this daemon gets

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
    invalid: int = 0  # records the daemon never writes (ids, pages, keys): not adopted
    corrupt_pages: int = 0  # stamped with an id never reserved: quarantined
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
        unfinished = sum(n for _, n in v.quarantined) - v.corrupt_pages
        if unfinished:
            parts.append(f"{unfinished} page(s) of unfinished saves quarantined")
        if v.rejected:
            parts.append(f"{v.rejected} record(s) not adopted: their pages no longer carry "
                         "their stamp")
        if v.invalid:
            parts.append(f"{v.invalid} record(s) not adopted: not records this daemon writes "
                         "(an id 0 or never reserved, a page named twice, pages outside the "
                         "region, a key or shape it refuses, a key twice)")
        if v.corrupt_pages:
            parts.append(f"{v.corrupt_pages} page(s) quarantined whose stamp is an id no daemon "
                         "issued (written by another process: corruption)")
        return "; ".join(parts)

    @property
    def corrupt(self) -> bool:
        """Did the index or the stamp table hold what no daemon writes?"""
        return bool(self.verified.invalid or self.verified.corrupt_pages)


def verify(records: Iterable[Record], table: bytes, *, page_bytes: int,
           ids_reserved: int) -> Verified:
    """Which `records` (journal order) the stamp table `table` (one native
    uint64 per payload page) proves, which pages are free, which quarantined,
    and where entry ids continue. A record is adopted when it is one the
    daemon writes, every page of its runs carries its id and no record
    adopted before claimed one of them or its key. Any table and any
    reservation up to MAX_IDS_RESERVED are accepted."""
    work = bytearray(table)
    slots = memoryview(work).cast("Q")
    pages = len(slots)
    out = Verified()
    keys: set[tuple[str, str]] = set()
    for record in records:
        key = (record.namespace, record.mm_hash)
        if not _valid(record, page_bytes, pages, ids_reserved) or key in keys:
            out.invalid += 1
            continue
        stamp = array("Q", [record.entry_id]).tobytes()
        if all(slots[first:first + n].tobytes() == stamp * n for first, n in record.runs):
            for first, n in record.runs:
                slots[first:first + n] = array("Q", bytes(8 * n))  # claimed: once only
            out.records.append(record)
            keys.add(key)
        else:
            out.rejected += 1
    # Stamped pages no adopted entry owns (unfinished saves, rejected records).
    out.quarantined = _runs(re.finditer(rb"[^\x00]+", work), inside=False)
    # A stamp no daemon issued: an engine wrote the table. Quarantined too, and
    # no reason to raise the ids: no reader was ever told it.
    out.corrupt_pages = sum(1 for first, n in out.quarantined
                            for stamp_ in slots[first:first + n] if stamp_ >= ids_reserved)
    out.free = _runs(re.finditer(rb"\x00+", table), inside=True)
    out.next_entry_id = max(ids_reserved, 1)
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


def _valid(record: Record, page_bytes: int, pages: int, ids_reserved: int) -> bool:
    """A record the daemon could have written: an id it reserved, a key,
    shape and size it accepts, and exactly the pages its bytes need, inside
    the region, each named once."""
    if not 0 < record.entry_id < ids_reserved:
        return False
    try:
        validate_save(record.mm_hash, record.nbytes, record.shape, record.dtype)
        validate_layout_namespace(record.namespace)  # no longer than Attach makes one
    except InvalidArgument:
        return False
    need = -(-record.nbytes // page_bytes)
    runs = sorted(record.runs)
    return bool(record.namespace) and all(
        n > 0 and first >= 0 and first + n <= pages for first, n in runs) \
        and sum(n for _, n in runs) == need \
        and all(a + n <= b for (a, n), (b, _) in pairwise(runs))


def adopt(dead: DeadRegion, spec: RegionSpec) -> Adoption:
    """Adopt `dead` (its lock held) as a region of `spec`. Raises
    NotAdoptable; the caller then removes it."""
    started = time.perf_counter()
    header = dead.header
    if header is None:
        raise NotAdoptable(dead.problem)
    _check_size(dead, header, spec)
    _check_access(dead, spec)
    canary = _canary(dead, spec)
    path = index_path(dead.path)
    try:
        header, journal = read_index(path)
    except (OSError, IndexUnreadable) as exc:
        raise NotAdoptable(f"its index cannot be read: {exc}") from None
    if header.ids_reserved > MAX_IDS_RESERVED:
        raise NotAdoptable(f"its index reserves ids up to {header.ids_reserved}, beyond any "
                           f"a daemon reserves ({MAX_IDS_RESERVED}): the index is corrupt",
                           "corrupt")
    pages = (spec.region_size - spec.data_offset) // spec.page_bytes
    table = os.pread(dead.fd, 8 * pages, 0)
    if len(table) != 8 * pages:
        raise NotAdoptable("its stamp table is short")
    verified = verify(journal.records.values(), table, page_bytes=spec.page_bytes,
                      ids_reserved=header.ids_reserved)
    verified.views = sorted(journal.views)
    try:  # ids continuing above every old one; a torn tail cut
        index = Index.reopen(path, dataclasses.replace(
            header, ids_reserved=verified.next_entry_id), journal, verified.records,
            verified.views, fd=dead.take_index_fd())
    except OSError as exc:
        raise NotAdoptable(f"its index cannot be rewritten: {exc.strerror or exc}") from None
    region = dead.take(index, spec.region_size, canary)
    if not canary:
        try:
            region.add_canary()
        except OSError as exc:  # upkeep adds it (a short file is restored)
            log.warning("could not add a canary to the adopted region %s: %s", region.path,
                        exc)
    return Adoption(region, verified, time.perf_counter() - started)


def _check_size(dead: DeadRegion, header: Header, spec: RegionSpec) -> None:
    if header.page_bytes != spec.page_bytes:
        raise NotAdoptable(f"its pages are {format_size(header.page_bytes)} and --page-bytes "
                           f"asks for {format_size(spec.page_bytes)}")
    if header.region_size != spec.region_size or header.data_offset != spec.data_offset:
        raise NotAdoptable(
            f"it caches {format_size(header.region_size - header.data_offset)} and "
            f"--cpu-bytes asks for {format_size(spec.region_size - spec.data_offset)}")
    if dead.size not in (spec.region_size, file_bytes(spec.region_size)):
        raise NotAdoptable(f"its file is {format_size(dead.size)}, not the "
                           f"{format_size(file_bytes(spec.region_size))} its index says")
    if dead.path != region_path(dead.path.parent, header.generation):
        raise NotAdoptable("its index names another generation")


def _canary(dead: DeadRegion, spec: RegionSpec) -> int:
    """The canary of `dead`'s file, kept: workers still mapping it (a warm
    restart leaves their mappings alone) go on checking the value they have.
    0 for a region of an older daemon (no trailer: `adopt` adds one). A file
    with a trailer whose canary has a zero byte was cut while no daemon
    watched it, and what was cut is unknown: it is not adopted."""
    if dead.size == spec.region_size:
        return 0
    canary = dead.canary(spec.region_size)
    if not whole(canary):
        raise NotAdoptable("its canary was cut: a client truncated the file while no daemon "
                           "watched it (what the cut reached is unknown)", "corrupt")
    return canary


def _check_access(dead: DeadRegion, spec: RegionSpec) -> None:
    """The region's mode and group are what the flags ask (its owner is this
    user: `dead_regions` locks no other). Else access taken away by the new
    flags would live on in what clients opened and mapped under the old."""
    info = os.fstat(dead.fd)
    mode = stat.S_IMODE(info.st_mode)
    if mode != spec.mode:
        raise NotAdoptable(f"its mode is {mode:04o} and --socket-mode asks for "
                           f"{spec.mode:04o}", "access")
    group = spec.gid if spec.gid is not None else _new_file_group(dead.path.parent)
    if mode & 0o070 and info.st_gid != group:
        asked = "--group asks for" if spec.gid is not None else "without --group it would be"
        raise NotAdoptable(f"its group is {_group_name(info.st_gid)} and {asked} "
                           f"{_group_name(group)}", "access")


def _new_file_group(folder: os.PathLike[str]) -> int:
    """The group a file this daemon creates in `folder` gets (no --group)."""
    info = os.stat(folder)
    return info.st_gid if info.st_mode & stat.S_ISGID else os.getegid()


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} ({gid})"
    except KeyError:
        return str(gid)


class Found(NamedTuple):
    """What `find` found: the adoption or None, why not (for the log line),
    and the kind (`NotAdoptable.kind`) of each dead region it could not adopt."""

    adoption: Adoption | None
    why_not: str
    refused: tuple[str, ...] = ()

    def counters(self) -> dict[str, int]:
        """What the start found, for Stats and metrics (`metrics.ADOPTION`)."""
        v = self.adoption.verified if self.adoption is not None else Verified()
        return {"adopted_entries": len(v.records), "rejected_records": v.rejected,
                "invalid_records": v.invalid, "corrupt_stamp_pages": v.corrupt_pages,
                "refused_corrupt_index": self.refused.count("corrupt"),
                "refused_access": self.refused.count("access"),
                "refused_errors": self.refused.count("error")}


def find(shm_dir: str, spec: RegionSpec, *, fresh_start: bool = False) -> Found:
    """Adopt the newest dead region of this socket, if one fits; remove the
    other dead regions of this socket and those without a readable index
    (older versions, or a daemon that died creating one). Regions of other
    sockets are left for their own daemons, never even locked. Whatever the
    region holds, this returns: an unexpected error adopting one is logged
    and that region removed (a start fresh, never a daemon that cannot start)."""
    mine: list[DeadRegion] = []
    unreadable = []
    for dead in dead_regions(shm_dir, spec.socket):
        if dead.header is None:
            log.info("removed stale region %s of a dead daemon (%s)", dead.path, dead.problem)
            unreadable.append(f"{dead.path.name}: {dead.problem}")
            dead.remove()
        else:
            mine.append(dead)
    if not mine:
        removed = f" (removed {'; '.join(unreadable)})" if unreadable else ""
        return Found(None, f"no region of a previous daemon on {spec.socket} in {shm_dir}"
                     f"{removed}")
    if fresh_start:
        for dead in mine:
            dead.remove()
        return Found(None, f"--fresh-start: removed {len(mine)} region(s) of a previous daemon")
    reasons = []
    kinds: list[str] = []
    adoption = None
    for dead in mine:
        if adoption is not None:
            dead.remove()
            continue
        try:
            adoption = adopt(dead, spec)
        except NotAdoptable as exc:
            reasons.append(f"{dead.path.name}: {exc}")
            kinds.append(exc.kind)
            dead.remove()
        except Exception as exc:  # a bug here must not stop every start
            log.exception("adopting %s failed", dead.path)
            reasons.append(f"{dead.path.name}: {type(exc).__name__}: {exc}")
            kinds.append("error")
            dead.remove()
    if adoption is not None:
        return Found(adoption, "", tuple(kinds))
    return Found(None, "cannot adopt the previous region (" + "; ".join(reasons) +
                 f"; format version {FORMAT_VERSION}): removed it", tuple(kinds))
