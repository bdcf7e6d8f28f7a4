"""Caps on a session's pending saves, on the cache core: refused before
anything is evicted, counted, and the quarantine an ended session leaves
charged to its engine until it is released."""

import pytest

from ec_daemon.core.quotas import PendingCaps
from ec_daemon.core.records import State
from ec_daemon.core.sessions import engine_key
from ec_daemon.errors import ResourceExhausted
from tests.unit.cache_helpers import PAGE, FakeClock, allocate, make_cache, save, worker


def test_past_the_byte_cap_a_save_is_refused_before_anything_is_evicted():
    cache = make_cache(pages=16, pending_caps=PendingCaps(bytes=4 * PAGE, entries=100))
    writer = worker(cache, "W")
    for i in range(16):  # the cache is full of ready entries
        save(cache, writer, f"r{i}", 1)
    hostile = worker(cache, "H")
    allocate(cache, hostile, "a", 3)
    evicted = cache.counters["evictions"]
    with pytest.raises(ResourceExhausted, match="--session-pending-bytes 4096") as info:
        allocate(cache, hostile, "b", 2)
    assert "cache full" not in str(info.value)
    assert cache.counters["capped_saves"] == 1 and cache.counters["refused_saves"] == 0
    assert cache.counters["evictions"] == evicted == 3  # for "a" only
    assert cache.state_of("ns", "b") is None
    allocate(cache, hostile, "c", 1)  # exactly the cap
    cache.commit(hostile, ["a"])  # reported: room again
    allocate(cache, hostile, "b", 2)


def test_past_the_entry_cap_a_save_is_refused_and_a_pending_key_is_still_said_so():
    cache = make_cache(pages=16, pending_caps=PendingCaps(bytes=16 * PAGE, entries=2))
    w = worker(cache)
    allocate(cache, w, "a")
    allocate(cache, w, "b")
    with pytest.raises(ResourceExhausted, match="--session-pending-entries 2"):
        allocate(cache, w, "c")
    assert allocate(cache, w, "a").outcome.value == "already_pending"
    cache.abort(w, ["a"])
    allocate(cache, w, "c")


def test_an_ended_sessions_quarantine_is_charged_to_its_engine_until_released():
    clock = FakeClock()
    cache = make_cache(pages=16, clock=clock, quarantine=60.0,
                       pending_caps=PendingCaps(bytes=4 * PAGE, entries=100))
    first = worker(cache, "H")
    allocate(cache, first, "a", 3)
    cache.end_session(first)
    assert cache.quarantine.pages == 3
    again = worker(cache, "H")
    with pytest.raises(ResourceExhausted, match="3072 bytes in quarantine"):
        allocate(cache, again, "b", 2)
    allocate(cache, again, "b", 1)  # what the cap leaves
    other = worker(cache, "O")  # another engine is not charged
    allocate(cache, other, "c", 4)
    clock.now += 60
    cache.release_quarantine()
    cache.commit(again, ["b"])
    allocate(cache, again, "d", 4)
    assert cache.state_of("ns", "d") is State.PENDING


def test_a_strangers_quarantine_under_the_engines_id_is_not_charged_to_the_engine():
    """Another client of the socket names engine H's id without its token,
    allocates and ends: its quarantine is charged to the tokenless bucket,
    so H's own sessions keep their whole allowance."""
    cache = make_cache(pages=16, quarantine=60.0,
                       pending_caps=PendingCaps(bytes=4 * PAGE, entries=100))
    stranger = worker(cache, "H")
    allocate(cache, stranger, "a", 3)
    cache.end_session(stranger)
    assert cache.quarantine.pages == 3
    own = worker(cache, "H", token="cd" * 16)
    allocate(cache, own, "b", 4)
    assert cache.state_of("ns", "b") is State.PENDING
    with pytest.raises(ResourceExhausted, match="3072 bytes in quarantine"):
        allocate(cache, worker(cache, "H"), "c", 2)  # the stranger's bucket is charged
    # A worker that could not derive the token attaches without it and joins
    # its instance at its first step: from then on it is H's, not the stranger's.
    late = worker(cache, "H", rank=1)
    cache.join(late, own.engine_key)
    cache.commit(own, ["b"])
    allocate(cache, late, "d", 4)
    cache.end_session(late)
    with pytest.raises(ResourceExhausted, match="4096 bytes in quarantine"):
        allocate(cache, own, "e", 1)  # its quarantine is charged to H


def test_without_caps_nothing_is_refused():
    cache = make_cache(pages=16)
    w = worker(cache)
    for i in range(16):
        allocate(cache, w, f"p{i}")
    assert cache.table.pending_pages == 16


def test_the_daemons_own_writer_is_not_capped_nor_charged_for_a_clients_quarantine():
    from ec_daemon.core.records import Session

    cache = make_cache(pages=16, pending_caps=PendingCaps(bytes=2 * PAGE, entries=1))
    impostor = worker(cache, "ec-daemon")
    allocate(cache, impostor, "a", 2)
    cache.end_session(impostor)  # quarantined, charged to engine "ec-daemon"
    promoter = Session(session_id="", index=0, engine_id="ec-daemon", role="both", rank=0,
                       world_size=1, namespace="ns", client_name="second tier", created=0.0,
                       lease_deadline=float("inf"))
    allocate(cache, promoter, "p1", 3)
    allocate(cache, promoter, "p2", 3)
    cache.commit(promoter, ["p1", "p2"])


def test_an_instance_holds_one_cap_in_all_its_sessions_and_all_hold_the_total():
    """Issue 40, finding 2: the cap was per session, so two sessions of one
    client held two caps, and nothing bounded all of them together."""
    cache = make_cache(pages=32, pending_caps=PendingCaps(bytes=8 * PAGE, entries=100,
                                                          total_bytes=16 * PAGE))
    token = "f" * 32
    first, second = worker(cache, "X", token=token), worker(cache, "X", token=token)
    allocate(cache, first, "a", 5)
    with pytest.raises(ResourceExhausted, match="its engine instance holds 5120 bytes"):
        allocate(cache, second, "b", 4)
    allocate(cache, second, "b", 3)
    other = worker(cache, "Y", token="e" * 32)
    allocate(cache, other, "c", 8)
    with pytest.raises(ResourceExhausted, match="--total-pending-bytes 16384"):
        allocate(cache, worker(cache, "Z", token="d" * 32), "d", 1)
    cache.commit(other, ["c"])
    allocate(cache, worker(cache, "Z", token="d" * 32), "d", 1)


def test_tokenless_clients_share_one_bucket_whatever_ids_they_name():
    cache = make_cache(pages=64, pending_caps=PendingCaps(bytes=16 * PAGE, entries=100,
                                                          total_bytes=32 * PAGE))
    allocate(cache, worker(cache, "x1"), "a", 5)
    with pytest.raises(ResourceExhausted, match="without an engine token"):
        allocate(cache, worker(cache, "x2"), "b", 4)
    allocate(cache, worker(cache, "x2"), "b", 3)  # a quarter of the total: 8 pages
    allocate(cache, worker(cache, "engine", token="c" * 32), "c", 16)  # an engine's own


def test_a_worker_that_joins_its_instance_takes_its_pending_saves_along():
    cache = make_cache(pages=64, pending_caps=PendingCaps(bytes=8 * PAGE, entries=100,
                                                          total_bytes=32 * PAGE))
    token = "b" * 32
    w = worker(cache, "E")  # tokenless at Attach
    allocate(cache, w, "a", 6)
    cache.join(w, engine_key("E", token))  # it presented the token on its stream
    assert cache.quota.tokenless_pages == 0 and cache.quota.held_pages == 6
    allocate(cache, worker(cache, "E2"), "t", 8)  # the tokenless bucket is free again
    own = worker(cache, "E", token=token)
    with pytest.raises(ResourceExhausted, match="its engine instance holds 6144 bytes"):
        allocate(cache, own, "b", 3)  # the instance holds w's saves now
    allocate(cache, own, "b", 2)
