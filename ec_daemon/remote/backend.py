"""What the second tier asks of a store, declared once: `Backend`, each call
a part of the tier's work that a kind of store does its own way. Redis
(`redis.backend`) keeps values in ec-daemon's format and an index of
announcements every daemon follows, so what it holds is known here ahead of
any lookup; Mooncake (`mooncake.backend`) keeps vLLM's format and no index,
so a wanted key is looked up in the store and a value's header read before
its payload. The tier's other parts (`tier`, `publisher`, `resolver`) call
only this interface and never ask which store they have: a strategy per
backend, not a branch per kind.

An ABC, not a Protocol: a backend says what it is by subclassing it, and one
missing a call cannot be built, instead of failing in the middle of a
promotion. Every call is safe from several threads at once. Keys are the
daemon's (namespace, mm_hash): a backend names them in its store its own way.
The errors a store call raises are `common`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, NamedTuple, Protocol

from ec_daemon.core.events import Fetched
from ec_daemon.remote.common import Common

Extent = tuple[int, int]  # (byte offset in the region, byte length)
Bytes = bytes | bytearray | memoryview  # what a region is written from

# How a publication ended: written, already there (values are write-once),
# not sent or not announced (the pages were reused meanwhile), or not sent
# (an entry the store's format cannot carry).
Published = Literal["stored", "exists", "rewritten", "unfit"]


class RegionPages(Protocol):
    """The daemon's region as the tier reads and writes it
    (`durable.region.Region`): through the daemon's own descriptor with
    pread and pwrite, never a mapping, so a client that truncates the file
    costs a short read, never a SIGBUS."""

    size: int

    def read(self, extents: Iterable[Extent]) -> list[bytes]:
        """The bytes under `extents` (a cut file reads as zeros there)."""

    def write(self, extents: Iterable[Extent], parts: Iterable[Bytes]) -> None:
        """Write the concatenation of `parts` across `extents`, in order."""


class Publication(NamedTuple):
    """A ready entry of this host to publish from its pages: `current()`
    says whether the pages still hold it (asked once its bytes are read,
    and once they are sent)."""

    namespace: str
    mm_hash: str
    shape: tuple[int, ...]
    dtype: str
    region: RegionPages
    extents: tuple[Extent, ...]
    current: Callable[[], bool]

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.extents)


class Backend(ABC):
    """How the tier uses one store. Calls that talk to the store go through
    their key's circuit breaker (`Common.through`) and are counted; those
    that say they never raise count and log what went wrong themselves."""

    common: Common  # the tier's breakers, budget and counters, which it shares

    # ------------------------------------------------------------ keys

    @property
    @abstractmethod
    def timeout_s(self) -> float:
        """The longest one store call waits."""

    @property
    def wait_s(self) -> float:
        """The longest a thread of the backend (`threads`) waits on the store
        before it sees the tier stopping (0: it runs none)."""
        return 0.0

    @abstractmethod
    def describe(self) -> str:
        """What the tier does with this store, in a line of the start-up log."""

    @abstractmethod
    def domain(self, namespace: str, mm_hash: str) -> str:
        """The failure domain (a node's address) of a key: one circuit
        breaker each. Never touches the network."""

    def accepts(self, mm_hash: str) -> bool:
        """Whether an item can be keyed in this store at all (default: every one)."""
        return True

    def claimable(self, namespace: str) -> bool:
        """Whether entries of a namespace can be published here, so that a
        claim on one is fulfilled (default: all of them)."""
        return True

    # ------------------------------------------------------------ follow

    @abstractmethod
    def follow(self, namespace: str, store_namespace: str) -> None:
        """A local session uses `namespace` (`store_namespace`: its engine's
        name for it in a store shared with vLLM's own connector, or "")."""

    @abstractmethod
    def unfollow(self, namespace: str) -> None:
        """No local session uses `namespace` any more: forget what is known of it."""

    def threads(self) -> list[tuple[str, Callable[[], None]]]:
        """The threads the backend runs while the tier does (name, target),
        each returning once `Common.stopping` is set (default: none)."""
        return []

    @abstractmethod
    def gauges(self) -> dict[str, int]:
        """`index_entries`, `index_bytes` and `followed_namespaces` now."""

    # ------------------------------------------------------------ lookup

    @abstractmethod
    def available(self, namespace: str, mm_hash: str) -> int | None:
        """The value's payload size when the store is known to hold it;
        never touches the network."""

    @abstractmethod
    def forget(self, namespace: str, mm_hash: str) -> None:
        """The key could not be promoted: no longer known held."""

    @abstractmethod
    def knows_absent(self, namespace: str, mm_hash: str) -> bool:
        """Whether a key `available` does not hold is known absent without
        asking the store (an index of everything published is followed)."""

    @abstractmethod
    def lookup(self, keys: Sequence[tuple[str, str]]) -> list[bool | None]:
        """Whether the store lists each key now (None: it could not say:
        counted); may block on the store. A listed key is `confirm`ed."""

    @abstractmethod
    def confirm(self, namespace: str, mm_hash: str) -> bool:
        """A key `lookup` listed: True once `available` holds it (what is
        known of the value is remembered a while); False when it is gone or
        unreadable. May block about a second (a host that died)."""

    # ------------------------------------------------------------ claims

    @abstractmethod
    def claim_many(self, keys: Sequence[tuple[str, str]], token: str,
                   ttl_s: float) -> list[bool | None]:
        """Claim each key across hosts for ttl_s unless another token holds
        it: True (`token` holds it now), False (another does), or None (not
        settled in the batch: `claim` it alone). Raises RemoteError."""

    @abstractmethod
    def claim(self, namespace: str, mm_hash: str, token: str, ttl_s: float,
              deadline: float) -> bool:
        """`claim_many` for one key, settled: no store read starts after
        `deadline` (monotonic; a claim not confirmed by then counts as
        taken). Raises RemoteError."""

    @abstractmethod
    def release(self, namespace: str, mm_hash: str, token: str) -> None:
        """Drop the claim on the key if `token` holds it. Raises RemoteError."""

    # ------------------------------------------------------------ publish

    @abstractmethod
    def publish(self, entry: Publication) -> Published:
        """Write a ready entry from its pages to the store, and announce it
        where others learn of it. Raises Refused (its domain's breaker),
        RemoteError (counted against the breaker), or anything else for an
        entry that could not be read."""

    # ------------------------------------------------------------ fetch

    @abstractmethod
    def promotion_bytes(self, namespace: str, mm_hash: str, nbytes: int) -> int:
        """What a promotion of a payload of `nbytes` holds at most between
        its fetch and its write (reserved before `fetch`)."""

    def trim(self) -> int:
        """Free what the backend keeps of the promotion budget while idle;
        the bytes freed (default: nothing)."""
        return 0

    @abstractmethod
    def fetch(self, namespace: str, mm_hash: str, nbytes: int) -> Fetched | None:
        """What the stored value of `nbytes` payload bytes is (blocks on the
        store): enough to allocate its pages, and what `fetch_into` needs.
        None (counted, logged, the key forgotten where it must be) when it
        is absent, refused or the store cannot say. Never raises."""

    @abstractmethod
    def fetch_into(self, namespace: str, mm_hash: str, found: Fetched, region: RegionPages,
                   extents: Sequence[Extent]) -> bool:
        """Write the value `fetch` found into `extents` of `region`, verified
        before it may be served; False (counted, logged, the key forgotten)
        when it failed: the pages then hold nothing to serve. Never raises."""

    @abstractmethod
    def close(self) -> None:
        """Release the store's connections (the tier's threads have ended)."""
