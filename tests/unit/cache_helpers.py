"""Small builders for driving the cache core directly in tests."""

from __future__ import annotations

from typing import Any

from ec_daemon.cache import AllocResult, Cache
from ec_daemon.sessions import Session, SessionTable

PAGE = 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_cache(pages: int = 16, lease: float = 10.0, clock: FakeClock | None = None) -> Cache:
    table = SessionTable(lease, clock=clock or FakeClock())
    return Cache(capacity_bytes=pages * PAGE, page_bytes=PAGE, sessions=table)


def scheduler(cache: Cache, engine: str = "E", role: str = "both", ns: str = "ns") -> Session:
    return cache.attach(engine_id=engine, role=role, rank=None, world_size=1, namespace=ns,
                        client_name="test")


def worker(cache: Cache, engine: str = "E", rank: int = 0, world: int = 1,
           role: str = "both", ns: str = "ns") -> Session:
    return cache.attach(engine_id=engine, role=role, rank=rank, world_size=world,
                        namespace=ns, client_name="test")


def allocate(cache: Cache, session: Session, mm_hash: str, pages: int = 1) -> AllocResult:
    return cache.allocate(session, mm_hash, pages * PAGE, (pages, PAGE), "uint8")


def save(cache: Cache, session: Session, mm_hash: str, pages: int = 1) -> AllocResult:
    result = allocate(cache, session, mm_hash, pages)
    cache.commit(session, [mm_hash])
    return result


def drain(session: Session) -> list[Any]:
    events = list(session.outbox)
    session.outbox.clear()
    return events


def tid(session: Session, n: int) -> int:
    return (session.index << 32) | n
