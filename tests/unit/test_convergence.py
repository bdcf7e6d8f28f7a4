"""Who encodes a missing item, who waits, and when a claim passes on."""

from __future__ import annotations

import pytest

from ec_client.scheduler_side.wants import ANSWER_SECONDS as scheduler_answer_seconds
from ec_daemon.core.events import AnswerEvent, Resolution, Verdict
from ec_daemon.core.limits import (
    CLAIM_START_SECONDS,
    MAX_ITEMS_MAKING,
    MAX_ITEMS_PER_INSTANCE,
    MAX_ITEMS_TOKENLESS,
)
from ec_daemon.plane.convergence import ANSWER_SECONDS, Convergence, Promoted
from ec_protocol.protocol import MAX_BATCH
from tests.unit.cache_helpers import FakeClock, allocate, drain, make_cache, save, scheduler, worker


def answers(session) -> dict[str, Verdict]:
    return {e.mm_hash: e.verdict for e in drain(session) if isinstance(e, AnswerEvent)}


class Promoter:
    """Records the promotions convergence starts: (key, nbytes)."""

    def __init__(self) -> None:
        self.started: list = []

    def start(self, key, nbytes, done) -> None:
        self.started.append((key, nbytes))


def setup(remote=None, resolve=None, call_later=None):
    clock = FakeClock()
    cache = make_cache(pages=64, clock=clock)
    promoter = Promoter()
    conv = Convergence(cache, remote_available=remote, promoter=promoter, resolve=resolve,
                       call_later=call_later, claim_seconds=30, promote_seconds=10,
                       clock=clock)
    return clock, cache, conv, promoter.started


def a_claims_b_waits():
    """Engine A holds the claim on "img", engine B waits for it; both streams
    drained."""
    _, cache, conv, _ = setup()
    a, b = scheduler(cache, "A"), scheduler(cache, "B")
    conv.want(a, ["img"])
    conv.want(b, ["img"])
    drain(a), drain(b)
    return cache, conv, a, b


def test_the_first_engine_encodes_and_the_others_wait_for_its_save():
    _, cache, conv, _ = setup()
    a, b, c = (scheduler(cache, engine) for engine in "ABC")
    for s in (a, b, c):
        drain(s)
    conv.want(a, ["img"])
    conv.want(b, ["img"])
    conv.want(c, ["img"])
    assert answers(a) == {"img": Verdict.ENCODE}
    assert answers(b) == {"img": Verdict.ENCODING}
    assert answers(c) == {"img": Verdict.ENCODING}
    # The claimant asks again (vLLM asks every step): still its to encode.
    conv.want(a, ["img"])
    assert answers(a) == {"img": Verdict.ENCODE}
    save(cache, worker(cache, "A"), "img")
    conv.ready(("ns", "img"))
    assert conv.making == {}
    conv.want(c, ["img"])
    assert answers(c) == {"img": Verdict.READY}
    assert conv.counters["claims"] == 1 and conv.counters["waits"] == 2


def test_a_claim_its_engine_never_starts_passes_on_and_a_started_one_is_kept():
    """Issue 40, finding 10: a view that wants an item and never encodes it
    held every waiter for the claim's whole bound. A claim lasts
    CLAIM_START_SECONDS until its engine says it encodes the item, then
    CLAIM_SECONDS."""
    clock, cache, conv, _ = setup()
    a, b, c, d = (scheduler(cache, engine) for engine in "ABCD")
    conv.want(a, ["idle"])
    conv.want(c, ["busy"])
    conv.started(c, ["busy", "unknown"])
    conv.started(b, ["idle"])  # (only the holder's word counts)
    conv.want(b, ["idle"])
    conv.want(d, ["busy"])
    for s in (a, b, c, d):
        drain(s)
    clock.now += CLAIM_START_SECONDS + 0.1
    conv.expire()
    assert answers(b) == {"idle": Verdict.ENCODE} and answers(d) == {}
    assert conv.making[("ns", "idle")].holder is b and conv.counters["handovers"] == 1
    conv.started(b, ["idle"])  # the heir encodes now: kept for CLAIM_SECONDS
    clock.now += 27  # (29.1 s after C said it encodes "busy")
    conv.expire()
    assert answers(d) == {} and conv.making[("ns", "busy")].holder is c
    clock.now += 2
    conv.expire()
    assert answers(d) == {"busy": Verdict.ENCODE}  # the claim's whole bound, then passed on
    assert conv.making[("ns", "idle")].holder is b


def test_a_claim_passes_to_a_waiter_when_its_engine_ends():
    cache, conv, a, b = a_claims_b_waits()
    cache.end_session(a)
    conv.session_ended(a)
    assert answers(b) == {"img": Verdict.ENCODE}
    assert conv.making[("ns", "img")].holder is b
    assert conv.counters["handovers"] == 1


def test_a_claim_past_its_bound_passes_on_and_consumers_never_hold_one():
    clock, cache, conv, _ = setup()
    a = scheduler(cache, "A")
    c = scheduler(cache, "C", role="consumer")
    b = scheduler(cache, "B")
    conv.want(a, ["img"])
    conv.want(c, ["img"])
    conv.want(b, ["img"])
    for s in (a, b, c):
        drain(s)
    clock.now += 31
    conv.expire()
    # The consumer waited first but cannot save: the claim goes to B.
    assert answers(b) == {"img": Verdict.ENCODE}
    assert answers(c) == {}
    clock.now += 31
    conv.expire()
    # No waiter left that can save: every waiter encodes; nothing is recorded.
    assert answers(c) == {"img": Verdict.ENCODE}
    assert conv.making == {}
    # A consumer alone is told to encode but holds no claim.
    conv.want(c, ["other"])
    assert answers(c) == {"other": Verdict.ENCODE} and conv.making == {}


def test_an_item_being_saved_is_waited_for_and_an_aborted_save_passes_on():
    _, cache, conv, _ = setup()
    w = worker(cache, "W")
    allocate(cache, w, "img")
    a, b = scheduler(cache, "A"), scheduler(cache, "B")
    conv.want(a, ["img"])
    conv.want(b, ["img"])
    assert answers(a) == {"img": Verdict.ENCODING}
    assert answers(b) == {"img": Verdict.ENCODING}
    conv.expire()  # the save is still pending: nothing moves
    assert answers(a) == {} and answers(b) == {}
    cache.abort(w, ["img"])
    conv.expire()
    assert answers(a) == {"img": Verdict.ENCODE}
    assert answers(b) == {}


def test_a_remote_item_is_promoted_once_however_many_engines_want_it():
    available = {("ns", "far"): 4096}
    _, cache, conv, started = setup(lambda ns, h: available.get((ns, h)))
    a, b = scheduler(cache, "A"), scheduler(cache, "B")
    drain(a), drain(b)
    conv.want(a, ["far"])
    conv.want(b, ["far"])
    conv.want(a, ["far"])
    assert started == [(("ns", "far"), 4096)]
    assert answers(a) == {"far": Verdict.PROMOTING}
    assert answers(b) == {"far": Verdict.PROMOTING}
    conv.promotion_ended(("ns", "far"), Promoted.WRITTEN, 4096)
    assert conv.making == {}
    assert conv.counters["promotions"] == 1 and conv.counters["promoted_bytes"] == 4096


def test_a_failed_promotion_makes_one_waiter_encode_and_the_rest_wait():
    _, cache, conv, _ = setup(lambda ns, h: 10)
    a, b = scheduler(cache, "A"), scheduler(cache, "B")
    conv.want(a, ["far"])
    conv.want(b, ["far"])
    drain(a), drain(b)
    conv.promotion_ended(("ns", "far"), Promoted.FAILED, 0)
    assert answers(a) == {"far": Verdict.ENCODE}
    assert answers(b) == {}
    assert conv.making[("ns", "far")].kind is Verdict.ENCODING
    assert conv.counters["promotion_failures"] == 1


def test_wants_are_per_namespace_and_info_counts_engines():
    _, cache, conv, _ = setup()
    a = scheduler(cache, "A", ns="m1")
    b = scheduler(cache, "B", ns="m2")
    conv.want(a, ["img"])
    conv.want(b, ["img"])
    assert answers(a) == {"img": Verdict.ENCODE}
    assert answers(b) == {"img": Verdict.ENCODE}  # another model's item: its own claim
    assert conv.info("m1").engines == 1 and not conv.info("m1").remote_tier
    scheduler(cache, "C", ns="m1")
    assert conv.info("m1").engines == 2


def test_a_released_claim_passes_to_a_waiter_at_once_and_the_releaser_waits_for_nothing():
    """The claimant's request did not run (no KV room) or was aborted: the
    waiter encodes now, not after its bound."""
    cache, conv, a, b = a_claims_b_waits()
    conv.release(a, ["img", "never-wanted"])
    assert answers(b) == {"img": Verdict.ENCODE} and answers(a) == {}
    assert conv.making[("ns", "img")].holder is b
    assert conv.counters["releases"] == 1
    conv.release(a, ["img"])  # not its claim any more: nothing changes
    assert conv.making[("ns", "img")].holder is b and answers(b) == {}
    conv.want(a, ["img"])  # its request came back: it waits for B's encode
    assert answers(a) == {"img": Verdict.ENCODING}
    conv.release(a, ["img"])  # and a waiter that releases is no longer handed the claim
    cache.end_session(b)
    conv.session_ended(b)
    assert answers(a) == {} and ("ns", "img") not in conv.making


def test_a_lone_claim_released_is_forgotten():
    _, cache, conv, _ = setup()
    a = scheduler(cache, "A")
    conv.want(a, ["img"])
    conv.release(a, ["img"])
    assert conv.making == {}
    conv.want(a, ["img"])
    assert answers(a) == {"img": Verdict.ENCODE} and conv.counters["claims"] == 2


def test_waiters_are_answered_ready_when_the_item_lands():
    """A waiter whose item became ready and was evicted before it asked
    again must encode it, not wait out its bound for an answer."""
    cache, conv, a, b = a_claims_b_waits()
    save(cache, worker(cache, "A"), "img")
    conv.ready(("ns", "img"))
    assert answers(b) == {"img": Verdict.READY}
    assert answers(a) == {}  # the claimant saved it: it was no waiter


def test_a_claimant_that_steps_aside_hands_over_only_when_someone_waits():
    """Its request did not run this step (no KV room, or it waits for
    another item): a waiter encodes now and the claimant waits for it; with
    nobody waiting the claim stays (no churn)."""
    _, cache, conv, _ = setup()
    a, b = scheduler(cache, "A"), scheduler(cache, "B")
    conv.want(a, ["img"])
    drain(a)
    conv.step_aside(a, ["img", "unknown"])
    assert conv.making[("ns", "img")].holder is a and answers(a) == {}
    conv.want(b, ["img"])
    drain(b)
    conv.step_aside(a, ["img"])
    assert answers(b) == {"img": Verdict.ENCODE} and answers(a) == {"img": Verdict.ENCODING}
    making = conv.making[("ns", "img")]
    assert making.holder is b and making.waiters == [a]
    conv.step_aside(a, ["img"])  # not its claim any more
    assert conv.making[("ns", "img")].holder is b and answers(b) == {}


def test_a_save_given_up_hands_over_only_its_own_engines_claim():
    _, conv, a, b = a_claims_b_waits()
    conv.save_given_up(("ns", "img"), b.engine_key)  # B encoded it anyway, skipped its save
    assert conv.making[("ns", "img")].holder is a and answers(b) == {}
    conv.save_given_up(("ns", "img"), a.engine_key)
    assert conv.making[("ns", "img")].holder is b and answers(b) == {"img": Verdict.ENCODE}


def test_a_client_naming_the_producers_id_without_its_token_takes_no_claim_away():
    """Issue 40, finding 11: claims were matched by engine id, so a tokenless
    client naming the producer's id and reporting its save aborted took the
    claim away (the waiting engine encoded it too). The instance decides."""
    _, cache, conv, _ = setup()
    producer = cache.attach(engine_id="P", role="both", rank=None, world_size=1,
                            namespace="ns", client_name="t", engine_token="a" * 32)
    cache.views.open(producer)
    waiter = scheduler(cache, "W")
    conv.want(producer, ["img"])
    conv.want(waiter, ["img"])
    drain(producer), drain(waiter)
    stranger = worker(cache, "P")  # the producer's id, no token
    conv.save_given_up(("ns", "img"), stranger.engine_key)
    assert conv.making[("ns", "img")].holder is producer and answers(waiter) == {}
    own = worker(cache, "P", token="a" * 32)
    conv.save_given_up(("ns", "img"), own.engine_key)
    assert conv.making[("ns", "img")].holder is waiter
    assert answers(waiter) == {"img": Verdict.ENCODE}


def test_one_client_cannot_fill_the_table_of_items_being_made():
    """Issue 40, finding 8: one view claiming 65,536 items filled the whole
    table (every other engine's want then went unrecorded) and every session
    end walked it. An engine instance takes part in at most
    MAX_ITEMS_PER_INSTANCE items and the tokenless views together in
    MAX_ITEMS_TOKENLESS; another engine's claim is still recorded and
    waited for, and a session's end passes on its own items only."""
    _, cache, conv, _ = setup()
    hog = cache.attach(engine_id="hog", role="both", rank=None, world_size=1,
                       namespace="ns", client_name="t", engine_token="b" * 32)
    cache.views.open(hog)
    for start in range(0, MAX_ITEMS_MAKING, MAX_BATCH):
        conv.want(hog, [f"item-{i}" for i in range(start, start + MAX_BATCH)])
    assert len(conv.making) == conv.items_of(hog) == MAX_ITEMS_PER_INSTANCE
    assert set(answers(hog).values()) == {Verdict.ENCODE}
    tokenless = [scheduler(cache, f"t{n}") for n in range(MAX_ITEMS_TOKENLESS
                                                          // MAX_ITEMS_PER_INSTANCE + 1)]
    for n, view in enumerate(tokenless):
        for start in range(0, MAX_ITEMS_PER_INSTANCE, MAX_BATCH):
            conv.want(view, [f"t{n}-{i}" for i in range(start, start + MAX_BATCH)])
    assert sum(conv.items_of(v) for v in tokenless) == MAX_ITEMS_TOKENLESS
    a = cache.attach(engine_id="A", role="both", rank=None, world_size=1, namespace="ns",
                     client_name="t", engine_token="c" * 32)
    cache.views.open(a)
    b = cache.attach(engine_id="B", role="both", rank=None, world_size=1, namespace="ns",
                     client_name="t", engine_token="d" * 32)
    cache.views.open(b)
    for s in (a, b):
        drain(s)
    conv.want(a, ["fresh"])
    conv.want(b, ["fresh"])
    assert answers(a) == {"fresh": Verdict.ENCODE}
    assert answers(b) == {"fresh": Verdict.ENCODING}  # recorded: B waits for A's save
    made = len(conv.making)
    cache.end_session(tokenless[0])
    conv.session_ended(tokenless[0])
    assert len(conv.making) == made - MAX_ITEMS_PER_INSTANCE  # its own claims went
    assert conv.items_of(hog) == MAX_ITEMS_PER_INSTANCE and conv.items_of(a) == 1


def resolving_setup(call_later=None):
    """A second tier that must be asked (`resolve`): the keys asked about."""
    asked: list = []
    clock, cache, conv, started = setup(
        remote=lambda ns, h: None, resolve=lambda key, claim: asked.append((key, claim)) or True,
        call_later=call_later)
    return clock, cache, conv, started, asked


def test_a_cold_item_is_answered_only_once_the_second_tier_resolved_it():
    _, cache, conv, started, asked = resolving_setup()
    a, b = scheduler(cache, "A"), scheduler(cache, "B")
    drain(a), drain(b)
    conv.want(a, ["img"])
    assert asked == [(("ns", "img"), True)] and answers(a) == {}  # nothing yet: resolving
    conv.want(b, ["img"])
    assert answers(b) == {"img": Verdict.PROMOTING} and len(asked) == 1  # asked once
    conv.resolved(("ns", "img"), Resolution.CLAIMED)  # nobody has it: this host encodes
    assert answers(a) == {"img": Verdict.ENCODE} and answers(b) == {}
    assert conv.making[("ns", "img")].holder is a and started == []


def test_a_resolved_item_found_in_the_store_is_promoted_and_the_first_engine_told_so():
    _, cache, conv, started, _ = resolving_setup()
    a = scheduler(cache, "A")
    drain(a)
    conv.want(a, ["img"])
    conv.resolved(("ns", "img"), Resolution.FOUND, 4096)
    assert started == [(("ns", "img"), 4096)]
    assert answers(a) == {"img": Verdict.PROMOTING}


def test_an_item_another_host_claimed_is_waited_for_within_the_claim_then_encoded_here():
    clock, cache, conv, started, _ = resolving_setup()
    a = scheduler(cache, "A")
    drain(a)
    conv.want(a, ["img"])
    conv.resolved(("ns", "img"), Resolution.ELSEWHERE)
    assert answers(a) == {"img": Verdict.PROMOTING} and started == []
    clock.now += 29  # within the claim's bound: still waiting
    conv.expire()
    assert answers(a) == {}
    clock.now += 2  # past it: encoded here
    conv.expire()
    assert answers(a) == {"img": Verdict.ENCODE}


def test_a_failed_resolution_hands_the_item_to_an_engine_that_can_save():
    _, cache, conv, _, _ = resolving_setup()
    c = scheduler(cache, "C", role="consumer")
    b = scheduler(cache, "B")
    drain(c), drain(b)
    conv.want(c, ["img"])  # a consumer asks first: it cannot save
    conv.want(b, ["img"])
    drain(b)
    conv.resolved(("ns", "img"), Resolution.FAILED)
    assert answers(b) == {"img": Verdict.ENCODE}
    assert answers(c) == {"img": Verdict.ENCODING}  # told to wait for B's save
    assert conv.making[("ns", "img")].holder is b


def test_a_resolution_after_the_item_landed_or_its_engine_ended_changes_nothing():
    _, cache, conv, started, _ = resolving_setup()
    a = scheduler(cache, "A")
    drain(a)
    conv.want(a, ["img"])
    cache.end_session(a)
    conv.session_ended(a)
    conv.resolved(("ns", "img"), Resolution.CLAIMED)
    assert answers(a) == {}  # (it ended: told nothing)
    conv.want(b := scheduler(cache, "B"), ["other"])
    save(cache, worker(cache, "B"), "other")
    conv.ready(("ns", "other"))
    conv.resolved(("ns", "other"), Resolution.FOUND, 4096)
    assert started == [] and ("ns", "other") not in conv.making
    assert {e.mm_hash for e in drain(b) if isinstance(e, AnswerEvent)} == {"other"}


def test_a_consumer_only_engine_never_claims_across_hosts():
    """A claim nobody here fulfils (a consumer encodes but never saves) would
    make the other hosts wait for a value that never comes."""
    _, cache, conv, _, asked = resolving_setup()
    c = scheduler(cache, "C", role="consumer")
    drain(c)
    conv.want(c, ["img"])
    assert asked == [(("ns", "img"), False)]


def test_a_stale_resolution_does_not_answer_a_later_making_of_the_same_key():
    """A resolution that outlived its Making (expired, handed over,
    released) must not land on a new Making of the same key as well as that
    Making's own resolution: two promotions of one key (or an ENCODE for a
    key another host is making). A Making takes one outcome, only while it
    is being resolved."""
    clock, cache, conv, started, asked = resolving_setup()
    a, b = scheduler(cache, "A"), scheduler(cache, "B")
    drain(a), drain(b)
    conv.want(a, ["img"])  # resolution 1 (a slow store: past the promotion bound)
    clock.now += 11
    conv.expire()
    assert answers(a) == {"img": Verdict.ENCODE}
    conv.release(a, ["img"])  # its request was aborted
    assert ("ns", "img") not in conv.making
    conv.want(b, ["img"])  # resolution 2
    assert len(asked) == 2
    conv.resolved(("ns", "img"), Resolution.FOUND, 4096)  # resolution 1's answer, late
    conv.resolved(("ns", "img"), Resolution.FOUND, 4096)  # resolution 2's
    assert len(started) == 1, started


def test_an_item_another_host_claimed_is_promoted_when_its_value_appears():
    """"elsewhere" is not the resolution's last word: the value (or the end
    of the claim) follows, and is taken."""
    _, cache, conv, started, _ = resolving_setup()
    a = scheduler(cache, "A")
    drain(a)
    conv.want(a, ["img"])
    conv.resolved(("ns", "img"), Resolution.ELSEWHERE)
    assert answers(a) == {"img": Verdict.PROMOTING}
    conv.resolved(("ns", "img"), Resolution.FOUND, 4096)
    assert started == [(("ns", "img"), 4096)] and answers(a) == {}
    conv.resolved(("ns", "img"), Resolution.FOUND, 4096)  # (nothing more of that resolution)
    assert len(started) == 1


@pytest.mark.parametrize(("outcome", "b_told"), [
    (Resolution.FOUND, {}),  # B was told PROMOTING when it asked
    (Resolution.ELSEWHERE, {}),
    (Resolution.CLAIMED, {"img": Verdict.ENCODE}),  # the claim passes to B
], ids=["found", "elsewhere", "claimed"])
def test_an_engine_that_released_an_item_being_resolved_is_not_answered(outcome, b_told):
    _, cache, conv, _, _ = resolving_setup()
    a, b = scheduler(cache, "A"), scheduler(cache, "B")
    drain(a), drain(b)
    conv.want(a, ["img"])  # resolving: A's answer waits for it
    conv.want(b, ["img"])
    assert answers(b) == {"img": Verdict.PROMOTING}
    conv.release(a, ["img"])  # A's request was aborted meanwhile
    conv.resolved(("ns", "img"), outcome, 4096)
    assert answers(a) == {}
    assert answers(b) == b_told


def resolving_slowly():
    """`resolving_setup` whose timers (`call_later`) are kept, to be run as
    the loop would run them: (delay, fn) pairs."""
    timers: list = []
    _, cache, conv, started, _ = resolving_setup(
        call_later=lambda seconds, fn: timers.append((seconds, fn)))
    a = scheduler(cache, "A")
    drain(a)
    conv.want(a, ["img"])
    assert answers(a) == {} and [s for s, _ in timers] == [ANSWER_SECONDS]
    return conv, started, a, timers


@pytest.mark.parametrize(("outcome", "then"), [
    (Resolution.FOUND, {}),  # promoted: its ready event follows; told PROMOTING once
    (Resolution.ELSEWHERE, {}),
    (Resolution.CLAIMED, {"img": Verdict.ENCODE}),
    (Resolution.FAILED, {"img": Verdict.ENCODE}),
])
def test_a_slow_resolution_tells_the_engine_to_wait_and_the_outcome_still_decides(
        outcome, then):
    """A store slower than the view's bound on an answer (a busy host): the
    want is answered PROMOTING meanwhile, so the engine defers (within its
    own bound) rather than encode for want of an answer; the outcome then
    decides, and is told only when it changes what the engine does."""
    conv, started, a, timers = resolving_slowly()
    assert scheduler_answer_seconds / 2 > ANSWER_SECONDS
    timers[0][1]()  # the resolution still runs
    assert answers(a) == {"img": Verdict.PROMOTING}
    assert conv.counters["slow_resolutions"] == 1
    conv.resolved(("ns", "img"), outcome, 4096)
    assert answers(a) == then
    assert started == ([(("ns", "img"), 4096)] if outcome is Resolution.FOUND else [])


def test_a_resolution_that_ends_in_time_is_answered_once_and_its_timer_does_nothing():
    conv, _, a, timers = resolving_slowly()
    conv.resolved(("ns", "img"), Resolution.FOUND, 4096)
    assert answers(a) == {"img": Verdict.PROMOTING}
    timers[0][1]()
    assert answers(a) == {} and conv.counters["slow_resolutions"] == 0


def test_a_slow_resolution_of_an_engine_that_released_the_item_tells_it_nothing():
    conv, _, a, timers = resolving_slowly()
    conv.release(a, ["img"])
    timers[0][1]()
    assert answers(a) == {} and conv.counters["slow_resolutions"] == 0
