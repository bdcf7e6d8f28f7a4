"""The cache's bookkeeping, checked from scratch (tests, fuzzing and
`--check-invariants` call `check`). Raises AssertionError naming what drifted.
With a real stamp table the stamps are checked too: every page of an entry
carries its id (so no page is owned twice), free pages carry none."""

from __future__ import annotations

from ec_daemon.core.cache import Cache
from ec_daemon.core.records import State
from ec_daemon.durable.stamp_file import StampFile
from ec_protocol.stamps import StampTable


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
    used += cache.quarantine.pages
    assert used + cache.allocator.free_pages == cache.allocator.total_pages, "pages leaked"
    assert cache.quarantine.pages == sum(q[2] for q in cache.quarantine)
    assert cache.table.ready_entries + cache.table.hidden_entries == len(visible)
    assert cache.table.hidden_entries == sum(e.state is State.HIDDEN for e in visible)
    assert sum(u[1] for u in cache.table.usage.values()) == sum(e.nbytes for e in visible)
    assert (pending, hidden) == (cache.table.pending_pages, cache.table.hidden_pages), \
        "counters drifted"
    for session in cache.sessions:
        owned = [cache.get(*key) for key in session.pending]
        assert session.pending_pages == sum(e.pages for e in owned if e is not None), \
            "a session's pending pages drifted"
    clients = sum(e.pages for e in cache.entries()
                  if e.state is State.PENDING and e.owner is not None and e.owner.session_id)
    assert cache.quota.held_pages == clients + cache.quota.charged_pages(), \
        "the pending-save quota drifted"
    for session in [*cache.sessions, *cache.sessions.ghosts()]:
        for entry in session.awaiting:
            assert entry.state is State.HIDDEN and session in entry.awaiting
    assert all(g.is_ghost and not g.alive for g in cache.sessions.ghosts())
    if isinstance(cache.stamps, (StampTable, StampFile)):
        _check_stamps(cache, cache.stamps)


def _check_stamps(cache: Cache, table: StampTable | StampFile) -> None:
    for entry in cache.entries():
        if entry.entry_id in cache.lost:
            assert entry.state is not State.PENDING, "a pending entry whose pages were cut"
            continue  # its pages were cut off the file: stamped LOST, never its id
        for first, pages in entry.runs:
            assert set(table.stamps(first, pages)) == {entry.entry_id}, (
                f"pages of entry {entry.entry_id} carry other stamps")
    for first, pages in cache.allocator.runs():
        assert not any(table.stamps(first, pages)), "a free page carries a stamp"
    for _, runs, _ in cache.quarantine:
        for first, pages in runs:
            assert all(table.stamps(first, pages)), "a quarantined page lost its stamp"
