"""The cache's bookkeeping, checked from scratch (tests, fuzzing and
`--check-invariants` call `check`). Raises AssertionError naming what drifted."""

from __future__ import annotations

from ec_daemon.cache import Cache
from ec_daemon.records import State


def check(cache: Cache) -> None:
    used = pending = hidden = 0
    visible = []
    for entry in cache.entries():
        used += entry.pages
        if entry.state is State.PENDING:
            pending += entry.pages
            assert entry.owner is not None and entry.owner.alive, "pending entry without writer"
            assert entry.key in entry.owner.pending
            continue
        visible.append(entry)
        if entry.state is State.HIDDEN:
            hidden += entry.pages
            assert entry.awaiting, "hidden entry awaits nobody (should be reclaimed)"
            for view in entry.awaiting:
                assert view.alive or view.is_ghost, "dead session awaited"
                assert entry in view.awaiting, "awaiting sets disagree"
        else:
            assert not entry.awaiting, "ready entry awaits acknowledgements"
    used += cache.quarantined_pages
    assert used + cache.allocator.free_pages == cache.allocator.total_pages, "pages leaked"
    assert cache.quarantined_pages == sum(q[2] for q in cache.quarantine)
    assert cache.ready_entries + cache.hidden_entries == len(visible)
    assert cache.hidden_entries == sum(e.state is State.HIDDEN for e in visible)
    assert sum(u[1] for u in cache.namespace_usage.values()) == sum(e.nbytes for e in visible)
    assert (pending, hidden) == (cache.pending_pages, cache.hidden_pages), "counters drifted"
    for session in [*cache.sessions, *cache.sessions.ghosts()]:
        for entry in session.awaiting:
            assert entry.state is State.HIDDEN and session in entry.awaiting
    assert all(g.is_ghost and not g.alive for g in cache.sessions.ghosts())
