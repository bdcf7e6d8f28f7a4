"""How the tier uses a Redis store (`backend.Backend`): values in ec-daemon's
own format (`values`), announced on an index every daemon follows.

- lookup: what other hosts published is known ahead of any want, from the
  announcements followed (`follower` reads the index's shards into `announcements`),
  so a key they do not hold is known absent without asking the store;
- claim: a Lua script on the key's node (`store`);
- publish: the pages read (pread), checksummed as a value, put with the TTL,
  then announced, unless the pages were reused meanwhile;
- fetch: the whole value read and verified before any page is allocated for
  it (its header says its shape), and held until written (`Fetched.payload`,
  within the promotion budget); fetch_into writes it with pwritev.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from ec_daemon.core.events import Fetched
from ec_daemon.core.limits import INDEX_BATCH, INDEX_BLOCK_S, STORE_TIMEOUT_S
from ec_daemon.remote.backend import Backend, Extent, Publication, Published, RegionPages
from ec_daemon.remote.common import Common, Refused, RemoteError, UnexpectedSize
from ec_daemon.remote.redis.announcements import Announcements
from ec_daemon.remote.redis.follower import Follower
from ec_daemon.remote.redis.shards import IndexShards
from ec_daemon.remote.redis.store import RedisStore, open_store
from ec_daemon.remote.values import BadValue, decode, encode, size_bounds

log = logging.getLogger("ec_daemon.remote")


def open_backend(url: str, common: Common, *, token_file: str = "",
                 timeout_s: float = STORE_TIMEOUT_S,
                 ttl_s: float, index_bytes: int) -> RedisBackend:
    """The backend of a redis:// (rediss://, +cluster) `url`; connects lazily.
    Raises ValueError for a bad URL or an unreadable token file."""
    return RedisBackend(common, open_store(url, token_file=token_file, timeout_s=timeout_s),
                        ttl_s=ttl_s, index_bytes=index_bytes)


class RedisBackend(Backend):
    def __init__(self, common: Common, store: RedisStore, *, ttl_s: float, index_bytes: int,
                 block_s: float = INDEX_BLOCK_S, index_batch: int = INDEX_BATCH) -> None:
        """`ttl_s`: how long a published value and its announcement stay;
        `index_bytes` bounds the announcements followed; `block_s`: how long
        one read of the index waits; `index_batch`: the most one returns."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.common = common
        self.store = store
        self.shards = IndexShards(store)
        self.ttl_s = ttl_s
        self.block_s = block_s
        self._lock = threading.Lock()  # guards the announcements
        self._announcements = Announcements(max_bytes=index_bytes,
                                            ttl_ms=max(1, int(ttl_s * 1000)))
        self._follower = Follower(common, self.shards, self._announcements, self._lock,
                                  block_s=block_s, batch=index_batch)

    def __repr__(self) -> str:
        return f"RedisBackend({self.store.spec.display})"

    # ------------------------------------------------------------ keys

    @property
    def timeout_s(self) -> float:
        return self.store.timeout_s

    @property
    def wait_s(self) -> float:
        return self.block_s

    def describe(self) -> str:
        return (f"publishing saves (ttl {self.ttl_s:.0f}s), promoting what other hosts "
                "published")

    def domain(self, namespace: str, mm_hash: str) -> str:
        return self.store.domain(namespace, mm_hash)

    # ------------------------------------------------------------ follow

    def follow(self, namespace: str, store_namespace: str) -> None:
        """Keep announcements of `namespace` (those made before are read
        again); the store keys by the daemon's namespaces alone."""
        with self._lock:
            self._announcements.follow(namespace)

    def unfollow(self, namespace: str) -> None:
        with self._lock:
            self._announcements.unfollow(namespace)

    def threads(self) -> list[tuple[str, Callable[[], None]]]:
        return [("ec-remote-index", self._follower.run)]

    def gauges(self) -> dict[str, int]:
        with self._lock:
            return {"index_entries": self._announcements.entries,
                    "index_bytes": self._announcements.bytes,
                    "followed_namespaces": self._announcements.namespaces}

    # ------------------------------------------------------------ lookup

    def available(self, namespace: str, mm_hash: str) -> int | None:
        with self._lock:
            return self._announcements.get(namespace, mm_hash)

    def forget(self, namespace: str, mm_hash: str) -> None:
        with self._lock:
            self._announcements.forget(namespace, mm_hash)

    def knows_absent(self, namespace: str, mm_hash: str) -> bool:
        return True  # (what other hosts published is announced: not there, not held)

    def lookup(self, keys: Sequence[tuple[str, str]]) -> list[bool | None]:
        return [self.available(*key) is not None for key in keys]

    def confirm(self, namespace: str, mm_hash: str) -> bool:
        return self.available(namespace, mm_hash) is not None

    # ------------------------------------------------------------ claims

    def claim_many(self, keys: Sequence[tuple[str, str]], token: str,
                   ttl_s: float) -> list[bool | None]:
        return [self.store.claim(namespace, mm_hash, token, ttl_s) for namespace, mm_hash in keys]

    def claim(self, namespace: str, mm_hash: str, token: str, ttl_s: float,
              deadline: float) -> bool:
        """One atomic script on the key's node (bounded by the socket timeout)."""
        return self.store.claim(namespace, mm_hash, token, ttl_s)

    def release(self, namespace: str, mm_hash: str, token: str) -> None:
        self.store.release(namespace, mm_hash, token)

    # ------------------------------------------------------------ publish

    def publish(self, entry: Publication) -> Published:
        """The pages read and checksummed as a value, put for ttl_s, then
        announced. Not announced when the pages were reused before the value
        was sent ("rewritten": the stored value fails its checksum, or holds
        the entry)."""
        namespace, mm_hash = entry.namespace, entry.mm_hash
        parts = encode(namespace, mm_hash, entry.shape, entry.dtype,
                       entry.region.read(entry.extents))
        if not entry.current():
            return "rewritten"  # (reused before the checksum was taken)

        def send() -> Published:
            started = time.monotonic()
            self.common.timed("put", lambda: self.store.put(namespace, mm_hash, parts,
                                                            self.ttl_s))
            if not entry.current():
                return "rewritten"  # perhaps sent rewritten: not announced
            # The announcement must not outlive the value: its TTL runs from the put.
            ttl_s = self.ttl_s - (time.monotonic() - started)
            self.common.timed("announce", lambda: self.shards.announce(
                namespace, mm_hash, entry.nbytes, ttl_s))
            return "stored"

        return self.common.through(self.domain(namespace, mm_hash), send)

    # ------------------------------------------------------------ fetch

    def promotion_bytes(self, namespace: str, mm_hash: str, nbytes: int) -> int:
        """The most a value of `nbytes` payload bytes takes, its header's too."""
        return size_bounds(namespace, mm_hash, nbytes)[1]

    def fetch(self, namespace: str, mm_hash: str, nbytes: int) -> Fetched | None:
        """The value read whole and verified (header and checksum); a stored
        value of another size is refused having read no more than such a
        value takes. Read once more when it does not verify: a rewrite or an
        expiry may have raced the chunked read."""
        common = self.common
        size = size_bounds(namespace, mm_hash, nbytes)
        domain = self.domain(namespace, mm_hash)
        for attempt in (1, 2):
            try:
                parts = common.through(domain, lambda: common.timed(
                    "get", lambda: self.store.get(namespace, mm_hash, size)))
            except Refused:
                common.count(fetch_refused=1)
                return None
            except UnexpectedSize as exc:  # (the store answered: not its failure)
                self._bad_value(namespace, mm_hash, BadValue(f"not the announced value: {exc}"))
                return None
            except RemoteError as exc:
                common.count(errors=1)
                log.debug("fetch of %s failed: %s", mm_hash, exc)
                return None
            except Exception:
                common.count(errors=1)
                log.exception("fetch of %s failed", mm_hash)
                return None
            if parts is None:
                common.count(remote_misses=1)
                self.forget(namespace, mm_hash)
                return None
            try:
                value = decode(parts, namespace=namespace, mm_hash=mm_hash)
                if value.nbytes != nbytes:
                    raise BadValue(f"not the announced value: {value.nbytes} payload bytes, "
                                   f"{nbytes} announced")
            except BadValue as exc:
                if attempt == 1:
                    continue  # a rewrite or an expiry may have raced the read: once more
                self._bad_value(namespace, mm_hash, exc)
                return None
            common.count(remote_hits=1, fetch_bytes=value.nbytes)
            return Fetched(value.shape, value.dtype, value.nbytes, payload=value.parts)
        return None

    def fetch_into(self, namespace: str, mm_hash: str, found: Fetched, region: RegionPages,
                   extents: Sequence[Extent]) -> bool:
        """The verified payload `fetch` read, written across `extents` (pwritev)."""
        try:
            region.write(extents, found.payload)
        except (OSError, ValueError) as exc:
            self.common.count(errors=1)
            self.forget(namespace, mm_hash)
            log.warning("promotion of %s failed here: %s", mm_hash, exc)
            return False
        return True

    def _bad_value(self, namespace: str, mm_hash: str, exc: BadValue) -> None:
        self.common.bad_value(namespace, mm_hash, exc)
        self.forget(namespace, mm_hash)

    def close(self) -> None:
        self.store.close()
