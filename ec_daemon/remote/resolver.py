"""The second tier's resolver: whether another host has or makes a wanted
key, asked off the daemon's event loop.

A wanted item the tier does not know held is *resolved* (`resolve`, on the
resolver thread, batched): the store is looked up where its absence is not
known here (`Backend.knows_absent`: Mooncake, which keeps no index), and a
key nobody holds is claimed across hosts (`claim_s`), so that when two hosts
miss one new image at once one encodes and the other waits for its value
(bounded by the claim) and promotes it. A key found absent is remembered for
NEGATIVE_S: a storm of misses is not a storm of lookups. What a round's
batched calls leave (a value's header, a claim already there) is settled key
by key on a pool and each key settled within RESOLVE_KEY_S: a read from a
Mooncake host that died takes about 1 s to fail, and one such key must not
hold up the others, nor its engine past its bound (the engine is told to
wait meanwhile: `convergence`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ec_daemon.core.events import Resolution
from ec_daemon.core.limits import (
    NEGATIVE_KEYS,
    NEGATIVE_S,
    POLL_S,
    RESOLVE_BATCH,
    RESOLVE_KEY_S,
    RESOLVE_WORKERS,
)
from ec_daemon.remote.backend import Backend
from ec_daemon.remote.common import Common, Refused, RemoteAuthError

log = logging.getLogger("ec_daemon.remote")


@dataclass
class _Resolving:
    key: tuple[str, str]
    done: Callable[[Resolution], None]
    claim: bool = True  # False: only looked up (no engine here would save it)
    deadline: float = 0.0  # (ELSEWHERE) waited for until then
    answer_by: float = 0.0  # told by then, settled or not (monotonic; RESOLVE_KEY_S)


class Resolver:
    """The resolver threads' queue, the keys found absent, the claims this
    host holds, and the pool that settles keys one at a time. Thread-safe."""

    def __init__(self, common: Common, backend: Backend, claim_s: float) -> None:
        """`claim_s`: a key nobody holds is claimed across hosts for this long
        (0: no claims)."""
        self.common = common
        self.backend = backend
        self.claim_s = claim_s
        self._resolve_pool = concurrent.futures.ThreadPoolExecutor(
            RESOLVE_WORKERS, thread_name_prefix="ec-remote-resolve")
        self._settling = 0  # keys being settled on the pool now
        # Resolutions: queued, waiting for another host; keys found absent;
        # claims this daemon holds (released once the value is published).
        self._resolve_cond = threading.Condition()
        self._resolving: list[_Resolving] = []
        self._elsewhere: list[_Resolving] = []
        self._absent: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._claimed: dict[tuple[str, str], float] = {}

    def wake(self) -> None:
        """The tier is stopping (`common.stopping` is set): the threads end."""
        with self._resolve_cond:
            self._resolve_cond.notify_all()

    def stop(self, deadline: float) -> None:
        """After the threads ended: tell what is still queued FAILED, and wait
        (until `deadline`, at least 1 s) for what runs on the pool, so that
        the store is not closed under it (that would crash its binding):
        each ends within about 1 s of its key's answer_by; one not started
        never starts."""
        with self._resolve_cond:
            pending, self._resolving, self._elsewhere = \
                self._resolving + self._elsewhere, [], []
        for item in pending:
            _tell(item, Resolution.FAILED)
        self._resolve_pool.shutdown(wait=False, cancel_futures=True)
        with self._resolve_cond:
            self._resolve_cond.wait_for(lambda: not self._settling,
                                        max(1.0, deadline - time.monotonic()))

    def resolve(self, namespace: str, mm_hash: str, done: Callable[[Resolution], None],
                claim: bool = True) -> bool:
        """Find out, off the caller's thread, whether another host has or
        makes the key, and claim it if nobody does (`claim`: an engine here
        would encode and save it; a claim nobody here fulfils would make the
        other hosts wait for nothing); `done(outcome)` is called once, from
        the resolver thread (FOUND: `available` now holds it). False
        (nothing started, `done` never called) when there is nothing to ask
        (no claim to take, and the key known absent without asking the
        store), for a key found absent a moment ago, a store that is down,
        or the tier stopping."""
        backend = self.backend
        if not backend.accepts(mm_hash):
            return False
        # (a namespace whose entries the store's format cannot carry: its
        # claim would make other hosts wait for a value never published)
        claim = claim and self.claim_s > 0 and backend.claimable(namespace)
        if not claim and backend.knows_absent(namespace, mm_hash):
            return False
        key = (namespace, mm_hash)
        breaker = self.common.breakers.get(backend.domain(namespace, mm_hash))
        if self.common.stopping.is_set() or breaker.rejecting():
            return False
        with self._resolve_cond:
            absent_until = self._absent.get(key)
            if absent_until is not None:
                if absent_until > time.monotonic():
                    self.common.count(lookup_cached=1)
                    return False
                del self._absent[key]
            self._resolving.append(_Resolving(key, done, claim,
                                              answer_by=time.monotonic() + RESOLVE_KEY_S))
            self._resolve_cond.notify()
        self.common.count(lookups=1)
        return True

    def run(self) -> None:
        while not self.common.stopping.is_set():
            with self._resolve_cond:
                while not self._resolving and not self.common.stopping.is_set():
                    if self._elsewhere:
                        self._resolve_cond.wait(POLL_S)
                        break
                    self._resolve_cond.wait()
                batch = self._resolving[:RESOLVE_BATCH]
                del self._resolving[:RESOLVE_BATCH]
                waiting, self._elsewhere = self._elsewhere, []
            if self.common.stopping.is_set():
                for item in batch + waiting:
                    _tell(item, Resolution.FAILED)
                return
            try:
                self._resolve_round(batch, waiting)
            except Exception:
                log.exception("resolving %d keys failed", len(batch) + len(waiting))
                for item in batch + waiting:
                    _tell(item, Resolution.FAILED)

    def _resolve_round(self, batch: list[_Resolving], waiting: list[_Resolving]) -> None:
        """One round: look the keys up (batched), claim the absent ones
        (batched), ask again about those another host claimed. What the batch
        cannot settle (a value's header to read, a claim already there) is
        settled one key at a time on the resolve pool, in parallel, each key
        told as soon as it is settled and at the latest by its `answer_by`
        (FAILED: the engine encodes): a key whose claim or value sits on a
        host that died holds up only itself."""
        items = batch + waiting
        for item in waiting:  # (told ELSEWHERE already: asked again within this bound)
            item.answer_by = time.monotonic() + RESOLVE_KEY_S
        held = self._held(items)
        claiming: list[_Resolving] = []
        apart: list[tuple[_Resolving, Callable[[], Resolution]]] = []
        still: list[_Resolving] = []
        for item, state in zip(items, held, strict=True):
            if state is None:
                _tell(item, Resolution.FAILED)
            elif state is True:  # (confirmed apart: it may sit on a host that died)
                apart.append((item, functools.partial(self._confirm_then_claim, item)))
            elif item.deadline or not item.claim:
                self._settle(item, Resolution.ABSENT, still)
            else:
                claiming.append(item)
        for item, outcome in zip(claiming, self._claims([i.key for i in claiming]),
                                 strict=True):
            if outcome is None:
                apart.append((item, functools.partial(self._claim_alone, item)))
            else:
                self._settle(item, outcome, still)
        self._settle_apart(apart, still)
        if still:
            with self._resolve_cond:
                self._elsewhere.extend(still)

    def _settle(self, item: _Resolving, outcome: Resolution, still: list[_Resolving]) -> None:
        """Tell `item` its outcome. A key waited for (another host's claim)
        that is still not found waits on (`still`) until its deadline."""
        now = time.monotonic()
        if outcome is Resolution.FOUND:
            self.common.count(lookup_hits=1)
        elif item.deadline:  # waited for another host's value: not there yet
            if now < item.deadline:
                still.append(item)
                return
            self.common.count(claim_timeouts=1)
            outcome = Resolution.ABSENT
        elif outcome is Resolution.ELSEWHERE:
            item.deadline = now + self.claim_s
            still.append(item)
        if outcome is Resolution.ABSENT:
            self._not_found(item.key)
        _tell(item, outcome)

    def _settle_apart(self, apart: list[tuple[_Resolving, Callable[[], Resolution]]],
                      still: list[_Resolving]) -> None:
        """Run each key's `settle` on the resolve pool and tell it as it ends;
        one not settled by its `answer_by` is told FAILED (a key waited for
        waits on), and what its call returns later is dropped."""
        if not apart:
            return
        running: dict[concurrent.futures.Future[Resolution], _Resolving] = {}
        for item, settle in apart:
            try:
                running[self._resolve_pool.submit(self._unless_late, item, settle)] = item
            except RuntimeError:  # (the pool was shut down: stopping)
                _tell(item, Resolution.FAILED)
        while running:
            first = min(item.answer_by for item in running.values())
            done, _ = concurrent.futures.wait(
                running, timeout=max(0.0, first - time.monotonic()),
                return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                item = running.pop(future)
                try:
                    outcome = future.result()
                except Exception:
                    log.exception("resolving %s failed", item.key[1])
                    outcome = Resolution.FAILED
                self._settle(item, outcome, still)
            now = time.monotonic()
            for future, item in list(running.items()):
                if now >= item.answer_by:
                    del running[future]
                    self.common.count(lookups_late=1)
                    self._settle(item, Resolution.FAILED, still)

    def _unless_late(self, item: _Resolving, settle: Callable[[], Resolution]) -> Resolution:
        """`settle()` on the pool, unless `item` was told already (it waited
        in the pool's queue past its `answer_by`) or the tier is stopping:
        no store call is made for it then."""
        with self._resolve_cond:
            if self.common.stopping.is_set() or time.monotonic() >= item.answer_by:
                return Resolution.FAILED
            self._settling += 1
        try:
            return settle()
        finally:
            with self._resolve_cond:
                self._settling -= 1
                self._resolve_cond.notify_all()

    def _confirm_then_claim(self, item: _Resolving) -> Resolution:
        """A key the store lists: FOUND once the backend confirmed it
        (Mooncake reads its header); else (gone meanwhile, unreadable)
        claimed as a key nobody holds."""
        if self.backend.confirm(*item.key):
            return Resolution.FOUND
        if item.deadline or not item.claim:
            return Resolution.ABSENT
        if time.monotonic() >= item.answer_by:  # (told already)
            return Resolution.FAILED
        outcome = self._claims([item.key])[0]
        return self._claim_alone(item) if outcome is None else outcome

    def _held(self, items: list[_Resolving]) -> list[bool | None]:
        """Whether the store lists each key (`Backend.lookup`: from memory,
        or one batched call per failure domain); None where it could not say."""
        try:
            return self.backend.lookup([item.key for item in items])
        except Exception:
            log.exception("looking up %d keys failed", len(items))
            return [None] * len(items)

    def _claims(self, keys: list[tuple[str, str]]) -> list[Resolution | None]:
        """Claim each key across hosts: CLAIMED, ELSEWHERE, FAILED (or
        ABSENT: claims are off), or None: to be claimed alone (`_claim_alone`).
        One batch per failure domain where the store claims in batches
        (Mooncake: 200 keys in 5 ms, where one at a time takes 0.45 ms each)."""
        out: list[Resolution | None] = [Resolution.ABSENT] * len(keys)
        if self.claim_s <= 0 or not keys:
            return out
        by_domain: dict[str, list[int]] = {}
        for i, (namespace, mm_hash) in enumerate(keys):
            by_domain.setdefault(self.backend.domain(namespace, mm_hash), []).append(i)
        for domain, indexes in by_domain.items():
            named = [keys[i] for i in indexes]
            try:
                mine = self.common.through(
                    domain, functools.partial(self.backend.claim_many, named, self.common.token,
                                              self.claim_s), answered=(RemoteAuthError,))
            except Refused:
                for i in indexes:
                    out[i] = Resolution.FAILED
                continue
            except RemoteAuthError as exc:  # (an ACL without EVAL): not the store failing
                self.claim_s = 0.0
                log.warning("cross-host claims are off: the store refused them (%s); every "
                            "host that misses a new item encodes it", exc)
                return [Resolution.ABSENT] * len(keys)
            except Exception as exc:
                self.common.count(errors=1)
                log.debug("claiming %d keys failed: %s", len(indexes), exc)
                for i in indexes:
                    out[i] = Resolution.FAILED
                continue
            for i, taken in zip(indexes, mine, strict=True):
                out[i] = None if taken is None else self._claimed_now(keys[i], taken)
        return out

    def _claim_alone(self, item: _Resolving) -> Resolution:
        """Claim one key the batch could not settle (its claim was already
        there: another host's, live or dead), within its `answer_by`."""
        namespace, mm_hash = item.key
        try:
            taken = self.common.through(self.backend.domain(namespace, mm_hash), lambda: (
                self.backend.claim(namespace, mm_hash, self.common.token, self.claim_s,
                                   deadline=item.answer_by)))
        except Refused:
            return Resolution.FAILED
        except Exception as exc:
            self.common.count(errors=1)
            log.debug("claiming %s failed: %s", mm_hash, exc)
            return Resolution.FAILED
        return self._claimed_now(item.key, bool(taken))

    def _claimed_now(self, key: tuple[str, str], taken: bool) -> Resolution:
        """Count a claim's outcome; remember one taken (released once its
        value is published)."""
        if not taken:
            self.common.count(claims_elsewhere=1)
            return Resolution.ELSEWHERE
        self.common.count(claims_taken=1)
        now = time.monotonic()
        with self._resolve_cond:
            if len(self._claimed) >= NEGATIVE_KEYS:  # (values that never came)
                self._claimed = {k: t for k, t in self._claimed.items() if t > now}
            self._claimed[key] = now + self.claim_s
        return Resolution.CLAIMED

    def _not_found(self, key: tuple[str, str]) -> None:
        with self._resolve_cond:
            self._absent[key] = time.monotonic() + NEGATIVE_S
            self._absent.move_to_end(key)
            while len(self._absent) > NEGATIVE_KEYS:
                self._absent.popitem(last=False)

    def release_claim(self, namespace: str, mm_hash: str) -> None:
        """The value is published: drop this host's claim on it, if any
        (best effort: it expires anyway)."""
        key = (namespace, mm_hash)
        with self._resolve_cond:
            until = self._claimed.pop(key, None)
            self._absent.pop(key, None)
        if until is None or until <= time.monotonic():
            return
        try:
            self.backend.release(namespace, mm_hash, self.common.token)
        except Exception as exc:
            log.debug("releasing the claim on %s failed: %s", mm_hash, exc)


def _tell(item: _Resolving, outcome: Resolution) -> None:
    try:
        item.done(outcome)
    except Exception:
        log.exception("resolution callback of %s failed", item.key[1])
