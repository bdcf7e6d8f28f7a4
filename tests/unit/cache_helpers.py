"""Small builders for driving the cache core directly in tests.

`make_cache` returns a cache that checks its invariants (`ec_daemon.core.invariants`)
after every public call, whether the call returned or raised, so every test
step is also a bookkeeping check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ec_daemon.core import invariants
from ec_daemon.core.cache import AllocResult, Cache, CacheListener
from ec_daemon.core.events import ReadySnapshot
from ec_daemon.core.quotas import PendingCaps
from ec_daemon.core.sessions import Session, SessionTable
from ec_daemon.plane.dataplane import DataPlane
from ec_protocol.stamps import StampTable, table_bytes

PAGE = 1024
# Every public Cache method that may change state, and its views' (`Cache.views`).
_MUTATORS = ("attach", "end_session", "expire_sessions", "release_ghosts", "allocate",
             "refuse_waited_save", "commit", "abort", "release_quarantine", "restore",
             "compact_index")
_VIEW_MUTATORS = ("open", "record_lookups", "acknowledge", "hold", "touch")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _checked(method: Callable[..., Any], cache: Cache | None = None) -> Callable[..., Any]:
    """`method` of the cache (or, bound, of `cache`'s parts), checking the
    cache's invariants after it."""
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            invariants.check(cache if cache is not None else args[0])

    return call


class CheckedCache(Cache):
    """A Cache whose invariants are checked after every state-changing call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in _VIEW_MUTATORS:
            setattr(self.views, name, _checked(getattr(self.views, name), self))


for _name in _MUTATORS:
    setattr(CheckedCache, _name, _checked(getattr(Cache, _name)))


def stamp_table(pages: int) -> StampTable:
    """A real stamp table for `pages` payload pages over plain memory (the
    region file's front), with the payload starting after it."""
    offset = table_bytes(pages, PAGE)
    return StampTable(memoryview(bytearray(offset)), PAGE, offset)


def make_cache(pages: int = 16, lease: float = 10.0, clock: FakeClock | None = None, *,
               stamps: StampTable | None = None, quarantine: float = 300.0,
               pending_caps: PendingCaps | None = None,
               listener: CacheListener | None = None) -> Cache:
    """A checked cache of `pages` pages; with `stamps`, payload starts at its
    data_offset and allocations are stamped into it."""
    table = SessionTable(lease, clock=clock or FakeClock())
    return CheckedCache(capacity_bytes=pages * PAGE, page_bytes=PAGE, sessions=table,
                        data_offset=stamps.data_offset if stamps is not None else 0,
                        stamps=stamps, quarantine_seconds=quarantine,
                        pending_caps=pending_caps, listener=listener)


def make_plane(pages: int = 16, clock: FakeClock | None = None, *,
               alloc_wait_seconds: float = 5.0) -> DataPlane:
    """A data plane (invariants checked) running a checked cache of `pages`
    pages (`plane.cache`), its listener."""
    return DataPlane(lambda listener: make_cache(pages, clock=clock, listener=listener),
                     lease_seconds=10.0, alloc_wait_seconds=alloc_wait_seconds,
                     check_invariants=True)


def scheduler(cache: Cache, engine: str = "E", role: str = "both", ns: str = "ns", *,
              stream: bool = True) -> Session:
    """A scheduler session; with `stream` its stream opened too (a view)."""
    session = cache.attach(engine_id=engine, role=role, rank=None, world_size=1, namespace=ns,
                           client_name="test")
    if stream:
        cache.views.open(session)
    return session


def worker(cache: Cache, engine: str = "E", rank: int = 0, world: int = 1,
           role: str = "both", ns: str = "ns", *, stream: bool = True,
           token: str = "") -> Session:
    """A worker session; with `stream` its stream opened too (it mapped the region)."""
    session = cache.attach(engine_id=engine, role=role, rank=rank, world_size=world,
                           namespace=ns, client_name="test", engine_token=token)
    if stream:
        cache.views.open(session)
    return session


def allocate(cache: Cache, session: Session, mm_hash: str, pages: int = 1, *,
             count_hidden: bool = True) -> AllocResult:
    return cache.allocate(session, mm_hash, pages * PAGE, (pages, PAGE), "uint8",
                          count_hidden=count_hidden)


def save(cache: Cache, session: Session, mm_hash: str, pages: int = 1) -> AllocResult:
    result = allocate(cache, session, mm_hash, pages)
    cache.commit(session, [mm_hash])
    return result


def drain(session: Session) -> list[Any]:
    """The session's outbox as its stream would send it (a snapshot's ready
    events made), emptied."""
    events: list[Any] = []
    for item in session.outbox:
        if isinstance(item, ReadySnapshot):
            events += iter(item.next, None)
        else:
            events.append(item)
    session.outbox.clear()
    return events


def stamped(table: StampTable, pages: Any, stamp: int) -> bool:
    """Does every payload page in `pages` carry `stamp`?"""
    return all(table.holds([(table.data_offset + p * table.page_bytes, table.page_bytes)],
                           stamp) for p in pages)


def page_numbers(cache: Cache, extents: Any) -> list[int]:
    """The payload pages under byte extents of the region."""
    return [p for offset, length in extents
            for p in range((offset - cache.data_offset) // cache.page_bytes,
                           (offset - cache.data_offset + length - 1) // cache.page_bytes + 1)]
