"""The session table: ids and indexes, leases, views by namespace, ghosts."""

import pytest

from ec_daemon.core.sessions import (
    OPEN_GRACE_SECONDS,
    PREEMPTIBLE_SECONDS,
    SessionTable,
    engine_key,
)
from ec_daemon.errors import NotFound, ResourceExhausted
from tests.unit.cache_helpers import FakeClock

TOKENLESS_E = engine_key("E", "")

LEASE = 10.0


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def table(clock):
    return SessionTable(LEASE, clock=clock)


def view(table, ns="ns", engine="E", *, stream=True):
    """A scheduler session; with `stream` its stream opened (a view)."""
    session = table.create(engine_id=engine, role="both", rank=None, world_size=1,
                           namespace=ns, client_name="test")
    if stream:
        table.open(session)
    return session


def rank(table, ns="ns", engine="E", r=0, *, stream=True, token=""):
    """A worker session; with `stream` its stream opened (it mapped the region)."""
    session = table.create(engine_id=engine, role="both", rank=r, world_size=2, namespace=ns,
                           client_name="test", engine_token=token)
    if stream:
        table.open(session)
    return session


def test_create_and_get(table, clock):
    a, b = view(table), rank(table)
    assert table.get(a.session_id) is a and table.get(b.session_id) is b
    assert len(a.session_id) == 32 and a.session_id != b.session_id  # secret bearer tokens
    assert a.index != b.index and 0 < a.index < 2**32
    assert a.alive and a.lease_deadline == clock.now + LEASE and a.created == clock.now
    assert (a.is_scheduler, b.is_scheduler) == (True, False)
    assert set(table) == {a, b} and len(table) == 2


def test_unknown_and_ended_sessions_are_not_found(table):
    with pytest.raises(NotFound, match="attach again"):
        table.get("no-such-session")
    a = view(table)
    table.remove(a)
    assert not a.alive
    with pytest.raises(NotFound):
        table.get(a.session_id)
    assert len(table) == 0


def test_indexes_wrap_and_skip_those_in_use(table):
    table._next_index = 0xFFFF_FFFF
    last = view(table)
    assert last.index == 0xFFFF_FFFF
    table._next_index = last.index  # the next free one wraps past 2**32-1 to 1
    assert view(table).index == 1


def test_only_scheduler_sessions_subscribe_to_their_namespace(table):
    a, b, other = view(table), view(table, engine="F"), view(table, ns="other")
    rank(table)
    view(table, stream=False)  # attached, its stream not open: told nothing yet
    assert table.subscribers("ns") == {a, b} and table.subscribers("other") == {other}
    assert table.awaited("ns", 1) == {a, b}
    assert table.subscribers("none") == set() == table.awaited("none", 1)


def test_a_view_removed_as_a_ghost_is_awaited_for_one_lease_but_sent_nothing(table, clock):
    a, b = view(table), view(table, engine="F")
    a.seen_upto = 7  # entries 1..7 were announced to it
    table.remove(a, ghost=True)
    assert a.is_ghost and not a.alive and a.ghost_until == clock.now + LEASE
    assert table.subscribers("ns") == {b}  # no events go to it
    assert table.awaited("ns", 7) == {a, b}  # evictions of what it saw still wait for it
    assert table.awaited("ns", 8) == {b}  # not of entries it never heard of
    assert list(table.ghosts()) == [a]
    clock.now += LEASE - 0.5
    assert table.expired_ghosts() == []
    clock.now += 0.5
    assert table.expired_ghosts() == [a]
    assert table.awaited("ns", 1) == {b} and list(table.ghosts()) == []
    assert table.expired_ghosts() == []  # handed out once


def test_a_view_whose_stream_never_opened_leaves_no_ghost(table):
    a = view(table, stream=False)
    table.remove(a, ghost=True)
    assert not a.is_ghost and not a.alive
    assert table.awaited("ns", 1) == set() and list(table.ghosts()) == []
    assert not table.in_use("ns")


def test_mapped_ranks_count_distinct_streaming_ranks_of_one_engine(table):
    assert table.mapped_ranks(TOKENLESS_E) == (0, 0)
    r0 = rank(table, r=0)
    stale = table.create(engine_id="E", role="both", rank=3, world_size=4, namespace="ns",
                         client_name="test")  # attached, never mapped: it counts for nothing
    rank(table, engine="F", r=1)  # another engine's
    assert table.mapped_ranks(TOKENLESS_E) == (1, 2)  # of a world of 2
    other_ns = rank(table, ns="other", r=1)  # its namespace differs (its weights were
    assert table.mapped_ranks(TOKENLESS_E) == (2, 2)  # identified apart): it still maps the region
    table.remove(other_ns)
    r1 = rank(table, r=1)
    again = rank(table, r=1)  # a second session of rank 1 (a re-attach) counts once
    assert table.mapped_ranks(TOKENLESS_E) == (2, 2)
    table.remove(r1)
    assert table.mapped_ranks(TOKENLESS_E) == (2, 2)
    table.remove(again)
    table.remove(r0)
    table.remove(stale)
    assert table.mapped_ranks(TOKENLESS_E) == (0, 0)


def test_ranks_count_per_engine_instance_whatever_engine_id_they_share(table):
    """Two engines configured with one engine id, each with its own token, and
    a stranger attaching under that id: each counts only its own ranks."""
    a, b = engine_key("E", "a" * 32), engine_key("E", "b" * 32)
    assert len({a, b, TOKENLESS_E}) == 3 and "a" * 32 not in a  # a digest, not the token
    rank(table, r=0, token="a" * 32)
    rank(table, r=1, token="b" * 32)
    stranger = rank(table, r=1)  # no token: the tokenless instance of E
    assert table.mapped_ranks(a) == (1, 2)
    assert table.mapped_ranks(b) == (1, 2)
    assert table.mapped_ranks(TOKENLESS_E) == (1, 2)
    assert table.join(stranger, a) == TOKENLESS_E  # it presented a's token (it knew it)
    assert table.mapped_ranks(a) == (2, 2) and table.mapped_ranks(TOKENLESS_E) == (0, 0)
    table.remove(stranger)
    assert table.mapped_ranks(a) == (1, 2)


def test_a_session_has_a_grace_to_open_its_stream_then_the_lease(table, clock):
    """Its client maps (and on a GPU registers) the region first: seconds."""
    a = table.create(engine_id="E", role="both", rank=0, world_size=1, namespace="ns",
                     client_name="test")
    clock.now += OPEN_GRACE_SECONDS - 1
    assert table.expired() == []
    table.open(a)
    clock.now += LEASE + 0.1
    assert table.expired() == [a]


def test_a_detached_view_and_a_worker_never_become_ghosts(table):
    a, w = view(table), rank(table)
    table.remove(a)
    table.remove(w, ghost=True)  # workers hold no view
    assert not a.is_ghost and not w.is_ghost
    assert table.awaited("ns", 1) == set() and list(table.ghosts()) == []


def test_expired_lists_sessions_past_their_lease_and_renew_extends_it(table, clock):
    a, b = view(table), rank(table)
    clock.now += LEASE
    assert table.expired() == []  # the deadline itself is still inside the lease
    table.renew(b)
    clock.now += 0.1
    assert table.expired() == [a]
    assert b.lease_deadline == clock.now - 0.1 + LEASE
    table.remove(a, ghost=True)
    assert table.expired() == []  # ghosts are not live sessions


def test_in_use_counts_live_sessions_and_ghosts(table, clock):
    assert not table.in_use("ns")
    w = rank(table)
    assert table.in_use("ns") and not table.in_use("other")
    table.remove(w)
    assert not table.in_use("ns")
    a = view(table)
    table.remove(a, ghost=True)
    assert table.in_use("ns")  # only a ghost
    clock.now += LEASE
    table.expired_ghosts()
    assert not table.in_use("ns")


def test_a_client_without_the_engines_token_cannot_take_its_sessions_room(clock):
    """Attaches under engine A's id with no token (any client of the socket)
    fill the tokenless bucket; A's processes, which present its token, still
    attach; and a worker that joins its instance after Attach (it learnt the
    token from a step) moves its place to its instance."""
    table = SessionTable(LEASE, clock=clock, max_per_engine=2)
    token = "ab" * 16
    squatters = [rank(table, engine="A", r=r) for r in range(2)]
    with pytest.raises(ResourceExhausted, match="engine 'A' has 2 sessions"):
        rank(table, engine="A", r=2)
    own = [rank(table, engine="A", r=r, token=token) for r in range(2)]
    with pytest.raises(ResourceExhausted, match=r"engine 'A' \(this engine instance\) has 2"):
        rank(table, engine="A", r=2, token=token)
    table.remove(own[1])
    table.remove(squatters[1])
    late = rank(table, engine="A", r=1)  # no token at Attach: counted tokenless
    table.join(late, own[0].engine_key)  # learnt it: its place moves to its instance
    rank(table, engine="A", r=3)  # the tokenless bucket has room again
    with pytest.raises(ResourceExhausted, match=r"\(this engine instance\) has 2"):
        rank(table, engine="A", r=2, token=token)
    table.remove(late)
    table.remove(late)  # twice: counted once
    rank(table, engine="A", r=1, token=token)


def test_sessions_are_capped_in_total_and_per_engine_and_freed_as_they_end(clock):
    table = SessionTable(LEASE, clock=clock, max_sessions=4, max_per_engine=3)
    a1, _ = rank(table, engine="A", r=0), rank(table, engine="A", r=1)
    view(table, engine="B")
    # The last quarter is kept for instances already running (a stream open):
    with pytest.raises(ResourceExhausted, match="the last 1 of --max-sessions 4 are kept"):
        view(table, engine="C")
    rank(table, engine="A", r=2)  # A runs: it takes the kept place
    with pytest.raises(ResourceExhausted, match="engine 'A' has 3 sessions.*"
                                                r"--max-sessions-per-engine 3"):
        rank(table, engine="A", r=3)
    with pytest.raises(ResourceExhausted, match=r"4 sessions attached \(--max-sessions 4\)"):
        view(table, engine="D")
    assert len(table) == 4
    table.remove(a1)
    table.remove(a1)  # twice: counted once
    rank(table, engine="A", r=0)
    with pytest.raises(ResourceExhausted):
        view(table, engine="D")
    clock.now += OPEN_GRACE_SECONDS + 1  # every session expires
    for session in table.expired():
        table.remove(session)
    view(table, engine="D")
    rank(table, engine="A", r=0)
    rank(table, engine="A", r=1)


def test_tokenless_clients_share_one_bucket_and_a_token_takes_an_unopened_place(clock):
    """Issue 40, finding 6, on the table: tokenless attaches under any number
    of ids share --max-tokenless-sessions; an engine presenting its token that
    finds no place is given that of the oldest attach that never opened its
    stream, once PREEMPTIBLE_SECONDS old (tokenless first), never its own."""
    table = SessionTable(LEASE, clock=clock, max_sessions=8, max_per_engine=4,
                         max_tokenless=2)
    first = view(table, engine="x1", stream=False)
    view(table, engine="x2", stream=False)
    with pytest.raises(ResourceExhausted, match="--max-tokenless-sessions 2"):
        view(table, engine="x3", stream=False)
    invented = [rank(table, engine="hog", r=0, token=f"{n:032x}", stream=False)
                for n in range(4)]
    assert len(table) == 6  # 8 less the running share
    assert table.victim_for("new", "f" * 32) is None  # none old enough yet
    clock.now += PREEMPTIBLE_SECONDS + 1
    assert table.victim_for("new", "f" * 32) is first  # the oldest tokenless
    assert table.victim_for("new", "") is None  # a tokenless Attach takes no place
    table.remove(first)
    table.create(engine_id="new", role="both", rank=0, world_size=1, namespace="ns",
                 client_name="t", engine_token="f" * 32, in_place_of=first)
    assert table.victim_for("hog", f"{0:032x}") is not invented[0]  # never its own
