"""One encode per item across the engines of a host, and promotions from the
second tier: who makes a missing item, and who waits for it.

vLLM asks the connector (`ensure_cache_available`) before it schedules a
request with media. A view that does not hold an item sends a *want* (a
stream message, never a wait) and defers the request until the answer. The
first engine that wants a cold item is told to encode it (it holds the
claim); engines that want it later are told to wait, and hit when the
claimant's save lands (a ready event). An item another host published is
promoted from the second tier instead: one fetch per key however many
engines ask. A claim whose engine ended, a failed promotion, or one past its
bound is handed to a waiting engine that can save; views bound every wait
themselves too, so a lost answer costs an encode, never a stuck request.

Across hosts: a cold item the local index does not hold is first *resolved*
by the second tier (`resolve`, off the loop): the store may hold it (a store
without an index is asked), another host may have claimed it (then this
host waits for its value, bounded by the claim, and promotes it), or this
host claims it and its engine encodes. The first engine's answer waits for
the resolution (it is the one `ensure` waits a few ms for), so a fast store
costs no deferred step; a resolution still running after ANSWER_SECONDS is
answered PROMOTING meanwhile (wait), so a slow store (a busy host) costs the
engine a deferral within its own bound, not an encode its unanswered want
would turn into, and the outcome still decides (a hand-over tells it ENCODE).

Why claims and not a lock: an engine that is told to wait loses nothing it
would not have spent encoding, and the daemon, which sees every save and
every session end, is the one place that knows when to pass a claim on.

A claim lasts CLAIM_SECONDS once its engine says it is encoding the item
(`started`: vLLM allocated the encoder output, in the step that was told
ENCODE), and CLAIM_START_SECONDS until then: an engine that wants an item
and never encodes it (a client that only wants, a request that never runs
and is not yielded) no longer holds every other engine's request for it
for their whole bound (10 s, a request without media failing meanwhile);
a waiting engine is told to encode within seconds.

What a client can hold, and what it costs the loop: the items a view claims
or waits for are indexed by session, so a session's end touches its own
items only, and bounds come due from a heap, so upkeep touches only the
items past their bound (plane.making keeps them so). One engine
instance's views take part in at most MAX_ITEMS_PER_INSTANCE items, all
tokenless views together in at most MAX_ITEMS_TOKENLESS, and the table
holds MAX_ITEMS_MAKING; beyond, a want
is answered ENCODE unrecorded (that engine encodes; nobody waits for it).
A claim is passed on only by its own engine instance's give-up (id and
token), never by another client naming the same engine id.

Not thread-safe: the daemon's event loop is the only caller.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from ec_daemon.core.cache import Cache
from ec_daemon.core.events import AnswerEvent, NamespaceInfoEvent, Resolution, Verdict
from ec_daemon.core.limits import (
    ANSWER_SECONDS,
    CLAIM_SECONDS,
    CLAIM_START_SECONDS,
    MAX_ITEMS_MAKING,
    PROMOTE_SECONDS,
)
from ec_daemon.core.records import Key, Session, State
from ec_daemon.plane.making import Making, Makings

log = logging.getLogger(__name__)

COUNTERS = ("wants", "claims", "waits", "handovers", "releases", "promotions",
            "promotion_failures", "promoted_bytes", "slow_resolutions")


class Promoted(enum.Enum):
    """How a promotion ended (`Promoter.start`'s `done`)."""

    WRITTEN = "written"  # fetched, written and committed: the entry is ready
    SAVING = "saving"  # a worker here is saving the key: its waiters wait for that save
    READY = "ready"  # the key became ready meanwhile (saved here)
    FAILED = "failed"  # not promoted: a waiting engine encodes it


# Told once how a promotion of a key ended, and the bytes it promoted.
PromotionDone = Callable[[Key, Promoted, int], None]


class Promoter(Protocol):
    """Who fetches a key another host published into this host's region
    (`promotions.Promotions`)."""

    def start(self, key: Key, nbytes: int, done: PromotionDone) -> None:
        """Promote `key` (`nbytes` announced); `done` is called once, on the loop."""


class Convergence:
    def __init__(self, cache: Cache, *,
                 remote_available: Callable[[str, str], int | None] | None = None,
                 promoter: Promoter | None = None,
                 resolve: Callable[[Key, bool], bool] | None = None,
                 call_later: Callable[[float, Callable[[], None]], object] | None = None,
                 claim_seconds: float = CLAIM_SECONDS,
                 claim_start_seconds: float = CLAIM_START_SECONDS,
                 promote_seconds: float = PROMOTE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """With a second tier (all None without one): `remote_available(namespace,
        mm_hash)`, the entry's size when the tier holds it (a local index, no
        network), else None; `promoter` fetches what it holds; `resolve(key,
        claim)` asks the tier about a key off the loop, claiming it across
        hosts if `claim` (an engine here would save it), True when started
        (the outcome comes back to `resolved`, on the loop); `call_later(
        seconds, fn)` calls `fn()` on the loop after `seconds`."""
        self.cache = cache
        self.remote_available = remote_available
        self.promoter = promoter
        self.resolve = resolve
        self.call_later = call_later
        self.claim_seconds = claim_seconds
        self.claim_start_seconds = claim_start_seconds
        self.promote_seconds = promote_seconds
        self.clock = clock
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        # The items in the making, indexed by session and due by their bounds.
        self._items = Makings()

    def info(self, namespace: str) -> NamespaceInfoEvent:
        return NamespaceInfoEvent(len(self.cache.sessions.subscribers(namespace)),
                                  self.remote_available is not None)

    def want(self, session: Session, mm_hashes: Iterable[str]) -> None:
        """Answer each item `session`'s view wants (on its stream)."""
        for mm_hash in mm_hashes:
            self.counters["wants"] += 1
            verdict = self._verdict(session, (session.namespace, mm_hash))
            if verdict is None:  # answered once the second tier resolved it
                log.debug("session %d wants %s: resolving", session.index, mm_hash)
                continue
            log.debug("session %d wants %s: %s", session.index, mm_hash, verdict.value)
            session.send(AnswerEvent(mm_hash, verdict))

    def resolved(self, key: Key, outcome: Resolution, nbytes: int | None = None) -> None:
        """The second tier resolved `key`: FOUND (promote `nbytes`),
        ELSEWHERE (another host encodes: wait for its value, FOUND or a final
        outcome follows), anything else: an engine here encodes.

        Only a Making being resolved takes an outcome: one that outlived its
        Making (made meanwhile, handed over past its bound, released) must
        not start a second promotion, or an encode, for a later Making of the
        same key. (Resolutions are known by key alone: a later Making's own
        resolution may be the one that lands; either answers it, once.)"""
        making = self.making.get(key)
        if making is None or not making.resolving:
            return
        # (its value, or the end of its claim, follows)
        making.resolving = outcome is Resolution.ELSEWHERE
        first, making.unanswered = making.unanswered, None
        if outcome is Resolution.FOUND and nbytes is not None \
                and nbytes <= self.cache.capacity_bytes:
            self._postpone(key, making, self.promote_seconds)
            self._promote(key, nbytes)
        elif outcome is Resolution.ELSEWHERE:
            self._postpone(key, making, self.claim_seconds)
        else:
            self._hand_over(key, making,
                            f"the second tier does not hold it ({outcome.value})", quiet=True)
            after = self.making.get(key)
            if first is None or not first.alive or after is None or after.holder is first:
                return  # (told ENCODE just now)
            first.send(AnswerEvent(key[1], Verdict.ENCODING))
            return
        if first is not None and first.alive:
            first.send(AnswerEvent(key[1], Verdict.PROMOTING))

    def answer_meanwhile(self, key: Key, making: Making) -> None:
        """`making`'s resolution is still running: its first engine, if it
        still wants an answer, is told to wait (PROMOTING) rather than left
        to give up on an answer and encode; the outcome follows (`resolved`:
        a promotion, or a hand-over telling it ENCODE)."""
        if self.making.get(key) is not making or not making.resolving:
            return
        first, making.unanswered = making.unanswered, None
        if first is None or not first.alive:
            return
        self.counters["slow_resolutions"] += 1
        self.counters["waits"] += 1
        log.debug("session %d wants %s: still resolving, told to wait", first.index, key[1])
        first.send(AnswerEvent(key[1], Verdict.PROMOTING))

    def ready(self, key: Key) -> None:
        """`key` became ready (saved or promoted): its waiters saw the ready
        event, and are answered READY too (should the entry be evicted before
        they ask again, they encode it rather than wait for nothing)."""
        making = self._items.remove(key)
        if making is None:
            return
        for waiter in making.waiters:
            if waiter.alive:
                waiter.send(AnswerEvent(key[1], Verdict.READY))

    def release(self, session: Session, mm_hashes: Iterable[str]) -> None:
        """`session`'s engine no longer makes nor waits for these items: a
        claim it holds passes on at once, and it waits for nothing."""
        namespace = session.namespace
        for mm_hash in mm_hashes:
            key = (namespace, mm_hash)
            making = self.making.get(key)
            if making is None:
                continue
            if making.unanswered is session:  # (it no longer wants the answer)
                making.unanswered = None
            if making.holder is session:
                self.counters["releases"] += 1
                self._hand_over(key, making, "its engine no longer needs it")
            elif session in making.waiters:
                self._items.drop_waiter(key, making, session)

    def step_aside(self, session: Session, mm_hashes: Iterable[str]) -> None:
        """`session`'s engine did not run the requests it claimed these items
        for this step: a claim that another engine waits for passes to it,
        and `session` waits in its place; one nobody waits for stays."""
        namespace = session.namespace
        for mm_hash in mm_hashes:
            key = (namespace, mm_hash)
            making = self.making.get(key)
            if making is None or making.holder is not session \
                    or not any(w.alive and w.can_save for w in making.waiters):
                continue
            self.counters["releases"] += 1
            self._hand_over(key, making, "its claimant's request did not run this step",
                            quiet=True)  # (an engine under KV pressure: every step)
            after = self.making.get(key)
            if after is not None:
                self._items.add_waiter(key, after, session)
                session.send(AnswerEvent(mm_hash, Verdict.ENCODING))

    def promotion_ended(self, key: Key, ended: Promoted, nbytes: int) -> None:
        """A promotion of `key` ended (`Promoter.start`'s `done`): its waiters
        hit (WRITTEN: its ready event went out), wait for the worker saving
        it (SAVING), or one of them encodes it (FAILED)."""
        if ended is Promoted.WRITTEN:
            self.counters["promotions"] += 1
            self.counters["promoted_bytes"] += nbytes
            self.ready(key)
        elif ended is Promoted.SAVING:
            self._await_save(key)
        elif ended is Promoted.FAILED:
            self.counters["promotion_failures"] += 1
            making = self.making.get(key)
            if making is not None and making.kind is Verdict.PROMOTING:
                self._hand_over(key, making, "its promotion failed")

    def started(self, session: Session, mm_hashes: Iterable[str]) -> None:
        """`session`'s engine encodes these items now: the claims it holds on
        them last until their saves land (or CLAIM_SECONDS)."""
        namespace = session.namespace
        for mm_hash in mm_hashes:
            key = (namespace, mm_hash)
            making = self.making.get(key)
            if making is None or making.holder is not session or making.started:
                continue
            making.started = True
            self._postpone(key, making, self.claim_seconds)

    def save_given_up(self, key: Key, instance: str) -> None:
        """A save of `key` by engine instance `instance` (`Session.engine_key`)
        was aborted, refused or skipped: if that instance was making it (or it
        was the save being waited for), a waiting engine encodes it now. A
        client naming the engine's id without its token takes nothing away."""
        making = self.making.get(key)
        if making is not None and making.kind is Verdict.ENCODING and (
                making.holder is None or making.holder.engine_key == instance):
            self._hand_over(key, making, "its save was given up")

    def _await_save(self, key: Key) -> None:
        """A promotion found a worker saving `key`: its waiters wait for that."""
        making = self.making.get(key)
        if making is not None and making.kind is Verdict.PROMOTING:
            making.kind = Verdict.ENCODING
            if making.holder is None:
                self._items.landing_on(key)
            self._postpone(key, making, self.claim_seconds)

    def session_ended(self, session: Session) -> None:
        """A view ended: its claims pass on, it waits for nothing (its own
        items only are looked at)."""
        if not session.is_scheduler:
            return
        for key in self._items.keys_of(session):
            making = self.making.get(key)
            if making is None:
                continue
            if making.unanswered is session:
                making.unanswered = None
            if making.holder is session:
                self._hand_over(key, making, "its engine's session ended")
            elif session in making.waiters:
                self._items.drop_waiter(key, making, session)

    def expire(self) -> None:
        """Upkeep: claims and promotions past their bound, and saves that
        were given up, pass on (only those are looked at)."""
        for key, making in self._items.due(self.clock()):
            self._hand_over(key, making, "it was not made in time")
        for key, landing in self._items.landing():
            if self.cache.state_of(*key) is None:
                self._hand_over(key, landing, "the save it waited for was aborted")

    @property
    def making(self) -> dict[Key, Making]:
        """The items in the making, by key (read it; `Makings` changes it)."""
        return self._items.making

    def items_of(self, session: Session) -> int:
        """How many items `session` holds or waits for."""
        return self._items.items_of(session)

    # ------------------------------------------------------------ helpers

    def _verdict(self, session: Session, key: Key) -> Verdict | None:
        state = self.cache.state_of(*key)
        if state is State.READY:
            return Verdict.READY
        making = self.making.get(key)
        if making is not None:
            if making.holder is session:
                return Verdict.ENCODE
            if session not in making.waiters:
                if self._items.full(session):
                    return Verdict.ENCODE  # (unrecorded: it encodes, nobody waits for it)
                self._items.add_waiter(key, making, session)
            self.counters["waits"] += 1
            return making.kind
        if (state is State.HIDDEN or len(self.making) >= MAX_ITEMS_MAKING
                or self._items.full(session)):
            return Verdict.ENCODE  # (a hidden key's save is refused until it is reclaimed)
        now = self.clock()
        if state is State.PENDING:  # encoded already; its copy is landing
            until = now + self.claim_seconds
            self._items.put(key, Making(Verdict.ENCODING, None, until, [session]))
            self.counters["waits"] += 1
            return Verdict.ENCODING
        nbytes = self.remote_available(*key) if self.remote_available is not None else None
        if nbytes is not None and nbytes <= self.cache.capacity_bytes:
            self._items.put(key, Making(Verdict.PROMOTING, None, now + self.promote_seconds,
                                        [session]))
            self._promote(key, nbytes)
            return Verdict.PROMOTING
        if self.resolve is not None and self.resolve(key, session.can_save):
            making = Making(Verdict.PROMOTING, None, now + self.promote_seconds, [session],
                            resolving=True, unanswered=session)
            self._items.put(key, making)
            if self.call_later is not None:
                self.call_later(ANSWER_SECONDS, lambda: self.answer_meanwhile(key, making))
            return None
        if session.can_save:
            self._items.put(key, Making(Verdict.ENCODING, session, now + self.claim_start_seconds))
            self.counters["claims"] += 1
        return Verdict.ENCODE

    def _promote(self, key: Key, nbytes: int) -> None:
        """Fetch `key` from the second tier (`promoter`); its end comes back
        to `promotion_ended`."""
        if self.promoter is not None:
            self.promoter.start(key, nbytes, self.promotion_ended)

    def _postpone(self, key: Key, making: Making, seconds: float) -> None:
        """`making` is due `seconds` from now."""
        making.deadline = self.clock() + seconds
        self._items.push(key, making)

    def _hand_over(self, key: Key, making: Making, why: str, *, quiet: bool = False) -> None:
        """The claim goes to the first live waiter that can save; with none,
        every waiter encodes."""
        self._items.remove(key)
        waiters = [w for w in making.waiters if w.alive]
        heir = next((w for w in waiters if w.can_save), None)
        if heir is None:
            for waiter in waiters:
                waiter.send(AnswerEvent(key[1], Verdict.ENCODE))
            return
        waiters.remove(heir)
        self._items.put(key, Making(Verdict.ENCODING, heir,
                                    self.clock() + self.claim_start_seconds, waiters))
        self.counters["handovers"] += 1
        (log.debug if quiet else log.info)("session %d encodes %s now (%s)", heir.index,
                                            key[1], why)
        heir.send(AnswerEvent(key[1], Verdict.ENCODE))
