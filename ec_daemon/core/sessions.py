"""The session table: who is attached, indexed for the cache, with leases
and ghosts.

A session is one attached client component (`records.Session`). The stream
is its liveness: a broken stream ends it at once, and a lease (renewed by
any stream message) ends one whose client hangs. What a session holds is
released by `Cache.end_session`.

Ghosts: a scheduler session that ends without detaching (its lease ran out,
its stream broke, it could not keep up) may belong to an engine that is
still loading from its old view. Its view answers hits only while its
heartbeats are echoed within a fraction of the lease, so one lease after
the end it dispatches nothing more and its loads have landed. Until then it
stays a ghost: evictions in its namespace of entries it could have seen (ids
up to the last one announced to it) still await it, and the clock
acknowledges for it (`expired_ghosts`). A session whose stream never opened
was told nothing, so it leaves no ghost: a client that cannot use its
attachment (say, a region it cannot map) costs the other engines nothing.

A scheduler session is a view (subscribed to its namespace's events) and a
worker session counts as a rank of its engine that mapped the region only
from the moment its stream opens (`open`): clients open it once the region
is mapped (and, on a GPU, registered: seconds for a large region), so a
session's stream may open up to OPEN_GRACE_SECONDS after Attach whatever the
lease; the lease applies from then on.

Engine instances: a view counts only the worker ranks of its own engine
instance, keyed by `engine_key`: the engine id and a digest of the token the
instance's scheduler presented at Attach (its workers learn it from their
step metadata and present it too). Two engines configured with the same
engine id, or a client attaching a worker under another engine's id, thus
never raise each other's rank count, and their ghosts stay apart. A session
without a token has the tokenless key of its engine id (older clients).

Session ids are secret bearer tokens; session indexes are small numbers for
logs and stats, starting at a random value per daemon.

Sessions are capped in total and per engine instance (`--max-sessions`,
`--max-sessions-per-engine`): an Attach that never opens its stream still
lives OPEN_GRACE_SECONDS, so without a cap a loop of attaches grows the
daemon (and its Stats reply) without bound. One more is refused with
RESOURCE_EXHAUSTED naming the cap; the refused client retries, and gets in
once others end or expire. The per-engine cap counts by `engine_key` (a
worker that joins its instance after Attach moves with it).

Engines first. The daemon cannot verify a token (it never holds the users'
secret), so it trusts what it can see: an engine instance is its id and
token, and a *running* one has a live session whose stream is open (its
scheduler's view, or a rank that mapped the region). The places are shared
so that no client without a running engine's token can take the room a
running engine needs, and a new engine can take the room of attaches that
never became anything:

- every client that presents no token shares one bucket
  (`--max-tokenless-sessions`), whatever engine ids it names: 1,024
  attaches under 16 engine ids no longer lock every engine out;
- the last quarter of `--max-sessions` (RUNNING_SHARE) is kept for running
  instances (their re-attaches, their ranks joining): attaches of anything
  else stop short of it;
- an Attach presenting a token that finds no place ends the oldest session
  whose stream never opened and that is older than PREEMPTIBLE_SECONDS
  (tokenless ones first): a client's stream opens within a moment of its
  Attach (it maps the region first), so only attaches that never became
  anything are taken (`preempted_sessions`).

What is left: a client inventing tokens *and* keeping their streams open
(reading and heartbeating) is a running engine as far as the daemon can
tell; it is bounded per instance and in all, and visible in Stats.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

from ec_daemon.core.limits import OPEN_GRACE_SECONDS, PREEMPTIBLE_SECONDS, RUNNING_SHARE
from ec_daemon.core.records import Session
from ec_daemon.errors import NotFound, ResourceExhausted
from ec_protocol.protocol import CONSUMER, Role


def engine_key(engine_id: str, token: str) -> str:
    """The engine instance of `engine_id` whose scheduler presented `token`
    ("" for none). A digest, so the key can be logged and journalled without
    the token; its prefix never clashes with an engine id's characters."""
    digest = hashlib.sha256(token.encode()).hexdigest()[:32] if token else "-"
    return f"{digest}/{engine_id}"


def tokenless(key: str) -> bool:
    """Is `key` (`engine_key`) the bucket of clients that presented no token?"""
    return key.startswith("-/")


def engine_of(key: str) -> str:
    """The engine id of an `engine_key` (a key of an older journal is one)."""
    return key.partition("/")[2] or key


class SessionTable:
    """Live sessions by id and index, scheduler views and ghosts by namespace."""

    def __init__(self, lease_seconds: float, clock: Callable[[], float] = time.monotonic, *,
                 max_sessions: int | None = None, max_per_engine: int | None = None,
                 max_tokenless: int | None = None) -> None:
        """At most `max_sessions` live sessions, `max_per_engine` per engine
        instance, `max_tokenless` of clients without a token together (None:
        unbounded, for unit tests)."""
        self.lease_seconds = lease_seconds
        self.clock = clock
        self.max_sessions = max_sessions
        self.max_per_engine = max_per_engine
        self.max_tokenless = max_tokenless
        # engine instance (`Session.engine_key`) -> its live sessions: a
        # client that cannot present an engine's token cannot take its room
        self._per_engine: dict[str, int] = {}
        self._tokenless = 0
        # engine instance -> its live sessions whose stream is open (it runs)
        self._running: dict[str, int] = {}
        # live sessions whose stream has not opened, oldest first
        self._unopened: dict[Session, None] = {}
        self._by_id: dict[str, Session] = {}
        self._by_index: dict[int, Session] = {}
        self._views: dict[str, set[Session]] = defaultdict(set)
        self._ghosts: dict[str, set[Session]] = defaultdict(set)
        # engine instance (`engine_key`) -> its worker sessions whose stream
        # is open (in any namespace: a load names the region, not the namespace)
        self._ranks: dict[str, set[Session]] = defaultdict(set)
        self._next_index = secrets.randbits(31) + 1

    def create(self, *, engine_id: str, role: Role, rank: int | None, world_size: int,
               namespace: str, client_name: str, engine_token: str = "",
               in_place_of: Session | None = None) -> Session:
        """A new live session (`in_place_of`: the one `victim_for` chose, ended
        for it: its place is this one's, kept places included). Raises
        ResourceExhausted past the caps (nothing changed)."""
        key = engine_key(engine_id, engine_token)
        self._check_room(engine_id, key, in_place_of is not None)
        now = self.clock()
        session = Session(
            session_id=secrets.token_hex(16), index=self._take_index(), engine_id=engine_id,
            role=role, rank=rank, world_size=world_size, namespace=namespace,
            client_name=client_name, created=now,
            lease_deadline=now + max(self.lease_seconds, OPEN_GRACE_SECONDS),
            engine_key=key,
        )
        self._by_id[session.session_id] = session
        self._by_index[session.index] = session
        self._unopened[session] = None
        self._count(key)
        return session

    def _count(self, key: str) -> None:
        self._per_engine[key] = self._per_engine.get(key, 0) + 1
        self._tokenless += tokenless(key)

    def _uncount(self, key: str) -> None:
        _add(self._per_engine, key, -1)
        self._tokenless -= tokenless(key)

    def _check_room(self, engine_id: str, key: str, preempted: bool = False) -> None:
        held = self._per_engine.get(key, 0)
        if self.max_per_engine is not None and held >= self.max_per_engine:
            which = "" if tokenless(key) else " (this engine instance)"
            raise ResourceExhausted(
                f"session cap: engine {engine_id!r}{which} has {held} sessions attached "
                f"(--max-sessions-per-engine {self.max_per_engine}); attach again when one ends")
        if tokenless(key) and self.max_tokenless is not None \
                and self._tokenless >= self.max_tokenless:
            raise ResourceExhausted(
                f"session cap: {self._tokenless} sessions without an engine token attached "
                f"(--max-tokenless-sessions {self.max_tokenless}); present the engine's token, "
                "or attach again when one ends")
        if self.max_sessions is None:
            return
        if len(self._by_id) >= self.max_sessions:
            raise ResourceExhausted(
                f"session cap: {len(self._by_id)} sessions attached (--max-sessions "
                f"{self.max_sessions}); attach again when one ends (an attach that never opens "
                f"its stream ends after {OPEN_GRACE_SECONDS:.0f} s)")
        open_to_all = self.max_sessions - self.max_sessions // RUNNING_SHARE
        if len(self._by_id) >= open_to_all and not self._running.get(key) and not preempted:
            raise ResourceExhausted(
                f"session cap: {len(self._by_id)} sessions attached; the last "
                f"{self.max_sessions - open_to_all} of --max-sessions {self.max_sessions} are "
                "kept for engine instances already running (a session of theirs has its "
                "stream open); attach again when one ends")

    def victim_for(self, engine_id: str, token: str) -> Session | None:
        """The session to end so that an Attach of `engine_id` presenting
        `token` finds a place, when it would find none otherwise: the oldest
        whose stream never opened, older than PREEMPTIBLE_SECONDS, tokenless
        ones first. None when it needs none or none may be ended (then the
        Attach is refused as usual)."""
        key = engine_key(engine_id, token)
        if not token or self.max_sessions is None:
            return None
        if self.max_per_engine is not None \
                and self._per_engine.get(key, 0) >= self.max_per_engine:
            return None  # its own cap: ending another's session would not help
        try:
            self._check_room(engine_id, key)
            return None
        except ResourceExhausted:
            pass
        old = self.clock() - PREEMPTIBLE_SECONDS
        oldest = None
        for session in self._unopened:
            if session.created > old:
                break  # (in order of creation: the rest are younger)
            if session.engine_key == key:
                continue
            if tokenless(session.engine_key):
                return session
            oldest = oldest or session
        return oldest

    def open(self, session: Session) -> None:
        """`session`'s stream opened: a view from now on, or a rank that mapped
        the region."""
        session.streaming = True
        self._unopened.pop(session, None)
        _add(self._running, session.engine_key, 1)
        self.renew(session)
        if session.is_scheduler:
            self._views[session.namespace].add(session)
        else:
            self._ranks[session.engine_key].add(session)

    def join(self, worker: Session, key: str) -> str:
        """Worker `worker` belongs to engine instance `key` from now on;
        returns the key it counted under before."""
        before, worker.engine_key = worker.engine_key, key
        if worker.streaming and worker.alive and before != key:
            _discard(self._ranks, before, worker)
            self._ranks[key].add(worker)
            _add(self._running, before, -1)
            _add(self._running, key, 1)
        if worker.session_id in self._by_id and before != key:
            # its place under --max-sessions-per-engine moves with it (the
            # cap is checked at Attach only: an attached session stays)
            self._uncount(before)
            self._count(key)
        return before

    def get(self, session_id: str) -> Session:
        """The live session; raises NotFound (the client must re-attach)."""
        session = self._by_id.get(session_id)
        if session is None:
            raise NotFound("unknown session (it ended, expired, or belongs to an earlier "
                           "daemon): attach again")
        return session

    def find(self, session_id: str) -> Session | None:
        """The live session, or None."""
        return self._by_id.get(session_id)

    def remove(self, session: Session, *, ghost: bool = False) -> None:
        """End `session`; a scheduler session whose stream opened becomes a
        ghost for one lease when `ghost` (it did not detach)."""
        if self._by_id.pop(session.session_id, None) is not None:
            self._uncount(session.engine_key)
            if session.streaming:
                _add(self._running, session.engine_key, -1)
        session.alive = False
        self._unopened.pop(session, None)
        self._by_index.pop(session.index, None)
        if not session.is_scheduler:
            _discard(self._ranks, session.engine_key, session)
            return
        _discard(self._views, session.namespace, session)
        if ghost and session.streaming:
            session.ghost_until = self.clock() + self.lease_seconds
            self._ghosts[session.namespace].add(session)

    def previous_daemon(self, namespace: str, key: str, seen_upto: int) -> Session:
        """A ghost for one lease standing for the view of engine instance
        `key` (`engine_key`) of the daemon whose region was adopted: it may
        still be loading from it (the engine re-attaches within a lease and
        re-declares its loads). It may have seen every entry up to `seen_upto`."""
        now = self.clock()
        ghost = Session(session_id="", index=0, engine_id=engine_of(key), engine_key=key,
                        role=CONSUMER,
                        rank=None, world_size=1, namespace=namespace,
                        client_name="a view of the previous daemon", created=now,
                        lease_deadline=now, alive=False, streaming=True, seen_upto=seen_upto,
                        ghost_until=now + self.lease_seconds)
        self._ghosts[namespace].add(ghost)
        return ghost

    def drop_ghost(self, ghost: Session) -> None:
        """`ghost` awaits nothing any more (its engine came back)."""
        _discard(self._ghosts, ghost.namespace, ghost)

    def expired_ghosts(self) -> list[Session]:
        """Ghosts whose lease is over, removed from the table."""
        now = self.clock()
        done = [g for gs in self._ghosts.values() for g in gs
                if g.ghost_until is not None and g.ghost_until <= now]
        for ghost in done:
            _discard(self._ghosts, ghost.namespace, ghost)
        return done

    def subscribers(self, namespace: str) -> set[Session]:
        """Live scheduler sessions of `namespace` (they hold a view of it)."""
        return self._views.get(namespace, set())

    def awaited(self, namespace: str, entry_id: int) -> set[Session]:
        """Whom the eviction of entry `entry_id` in `namespace` awaits: the
        namespace's live views, and its ghosts that could have seen it."""
        awaited = set(self.subscribers(namespace))
        ghosts = self._ghosts.get(namespace)
        if ghosts:
            awaited.update(g for g in ghosts if g.seen_upto >= entry_id)
        return awaited

    def mapped_ranks(self, key: str) -> tuple[int, int]:
        """Distinct worker ranks of engine instance `key` whose stream is open
        (they mapped the region), and the largest world size they attached
        with (0 with none)."""
        ranks = self._ranks.get(key, ())
        return len({s.rank for s in ranks}), max((s.world_size for s in ranks), default=0)

    def running(self, key: str) -> bool:
        """Does engine instance `key` run: a live session of it has its stream open?"""
        return bool(self._running.get(key))

    def views_of(self, key: str) -> list[Session]:
        """Engine instance `key`'s live scheduler sessions whose stream is open."""
        return [s for views in self._views.values() for s in views if s.engine_key == key]

    def ghosts(self) -> Iterator[Session]:
        return (g for gs in list(self._ghosts.values()) for g in gs)

    def in_use(self, namespace: str) -> bool:
        """Does any live session or ghost belong to `namespace`?"""
        return bool(self._views.get(namespace) or self._ghosts.get(namespace)) or any(
            s.namespace == namespace for s in self._by_id.values())

    def renew(self, session: Session) -> None:
        session.lease_deadline = self.clock() + self.lease_seconds

    def expired(self) -> list[Session]:
        now = self.clock()
        return [s for s in self._by_id.values() if s.lease_deadline < now]

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def _take_index(self) -> int:
        while True:
            index = self._next_index
            self._next_index = self._next_index % 0xFFFF_FFFF + 1  # 1 .. 2**32-1
            if index not in self._by_index:
                return index


def _add(table: dict[str, int], key: str, n: int) -> None:
    left = table.get(key, 0) + n
    if left:
        table[key] = left
    else:
        table.pop(key, None)


def _discard(table: dict[str, set[Session]], key: str, session: Session) -> None:
    members = table.get(key)
    if members is None:
        return
    members.discard(session)
    if not members:
        del table[key]
