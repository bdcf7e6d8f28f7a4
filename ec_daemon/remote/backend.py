"""What the second tier needs of a store, declared once: `Store`, the calls
every backend answers, and its two kinds, `IndexedStore` (Redis, `store`:
values in ec-daemon's format, announced on an index the tier follows) and
`ProbedStore` (Mooncake, `mooncake`: vLLM's format, asked for each wanted
key, bytes moved between the region and the store by the store itself).

ABCs, not Protocols: a backend says which kind it is by subclassing one (a
backend missing a call cannot be built, instead of failing in the middle of
a promotion), and each kind declares `indexed` as a literal, so the tier's
`if store.indexed:` tells the type checker which calls it may make; nothing
probes a store for its methods. Every call may raise `RemoteError` and is
safe to call from several threads at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    from ec_daemon.remote.breaker import Breakers
    from ec_daemon.remote.budget import PromotionBudget

# What a publication from the region came to: written, already there
# (values are write-once), or not sent (the pages were reused meanwhile).
Published = Literal["stored", "exists", "rewritten"]


class RemoteError(Exception):
    """A store call failed (unreachable, timed out, refused); str() says which
    call and why."""


class RemotePeerError(RemoteError):
    """A transfer from or to another host of the store failed (a host that
    died, whose segment the store still lists): the store itself answered,
    so this does not count against its circuit breaker."""


class LocalWriteError(Exception):
    """Writing what the store returned into this host's region failed (the
    region's file refused the write, or the store was closed meanwhile): the
    store answered, so this does not count against its circuit breaker."""


class RemoteAuthError(RemoteError):
    """The store refused our credentials (a wrong or missing token): an
    operator's mistake, worth failing start-up for."""


class UnexpectedSize(Exception):
    """The stored value's size is outside what the caller allows (not the
    announced value: rewritten or forged); nothing past the allowed size was
    read. The store answered: this is not a store failure."""


@dataclass(frozen=True)
class Announcement:
    """Another daemon (or this one) published (namespace, mm_hash) of nbytes
    payload bytes at stamp_ms (the server's clock: its index entry's ID), for
    ttl_ms (None: a daemon that predates `t`; the reader assumes its own)."""

    namespace: str
    mm_hash: str
    nbytes: int
    stamp_ms: int
    ttl_ms: int | None


@dataclass(frozen=True)
class Head:
    """What a stored value says of itself before its payload is read
    (`ProbedStore.head`)."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    sidecar: bytes | None  # ec-daemon's header (its checksum), absent for vLLM's values


class Store(ABC):
    """What the tier asks of every store. Keys are (namespace, mm_hash): the
    daemon's namespace for an indexed store, the engine's store namespace
    for a probed one (`RemoteTier.store_name`)."""

    indexed: ClassVar[bool]  # True: IndexedStore; False: ProbedStore
    timeout_s: float  # the longest one call to the store waits

    @abstractmethod
    def domain(self, namespace: str, mm_hash: str) -> str:
        """The failure domain (a node's address) of a key: one circuit
        breaker each. Never touches the network."""

    def accepts(self, mm_hash: str) -> bool:
        """Whether an item can be keyed here at all (default: every one)."""
        return True

    def claimable(self, namespace: str) -> bool:
        """Whether entries of a daemon namespace can be published here, so
        that a claim on one is fulfilled (default: all of them)."""
        return True

    @abstractmethod
    def present(self, keys: Sequence[tuple[str, str]]) -> list[bool]:
        """Whether each value is in the store now, in the order of `keys`;
        RemoteError when a node holding any of them does not answer."""

    @abstractmethod
    def claim(self, namespace: str, mm_hash: str, token: str, ttl_s: float,
              deadline: float | None = None) -> bool:
        """Take the claim on the key (one encode of a value across hosts) for
        ttl_s, unless another token holds it. True when `token` holds it after
        the call (taken now, or held already: claiming again extends it);
        False when another token holds it. `deadline` (monotonic): the latest
        a store read may start (a store whose calls are bounded otherwise
        ignores it). `token`: 1 to MAX_TOKEN_CHARS ASCII characters, unique to
        the claimant."""

    def claim_many(self, keys: Sequence[tuple[str, str]], token: str,
                   ttl_s: float) -> list[bool | None]:
        """`claim` for many keys at once: True, False, or None (not settled
        in the batch: the caller claims that key alone, with a deadline).
        Default: one `claim` each; a store that claims in batches overrides it."""
        return [self.claim(namespace, mm_hash, token, ttl_s) for namespace, mm_hash in keys]

    @abstractmethod
    def release(self, namespace: str, mm_hash: str, token: str) -> None:
        """Drop the claim on the key if `token` holds it; another token's
        claim stays. No claim, or an expired one, is not an error."""

    @abstractmethod
    def ping(self) -> None:
        """Raise RemoteError (RemoteAuthError for credentials) unless the store answers."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; calls after close raise RemoteError."""


class IndexedStore(Store):
    """A store that keeps values in ec-daemon's own format (`values`) and an
    index of announcements every daemon follows: what is there is known
    ahead of any lookup."""

    indexed: ClassVar[Literal[True]] = True

    @abstractmethod
    def put(self, namespace: str, mm_hash: str, parts: Sequence[bytes | memoryview],
            ttl_s: float) -> None:
        """Store the concatenation of `parts` under the key, atomically, for ttl_s."""

    @abstractmethod
    def get(self, namespace: str, mm_hash: str,
            size: tuple[int, int] | None = None) -> list[bytes | memoryview] | None:
        """The value's bytes, in one or more consecutive parts; None when
        absent or expired. With `size` (least, most): raises UnexpectedSize
        when the stored value is not within it, having read no more than
        one byte past `most`. (Parts of one read may come from two writers
        when a key is rewritten meanwhile: values.decode refuses such a mix.)"""

    @abstractmethod
    def announce(self, namespace: str, mm_hash: str, nbytes: int, ttl_s: float) -> None:
        """Tell every follower of the index that the key is in the store."""

    @abstractmethod
    def read_index(self, cursor: str | None, block_s: float, count: int,
                   breakers: Breakers | None = None) -> tuple[list[Announcement], str]:
        """Announcements after `cursor` (None: the oldest kept), waiting up
        to block_s for one, at most `count` per shard; and the next cursor.
        With `breakers`, shards whose domain's breaker refuses are skipped and
        failures are reported to the breakers instead of raised."""

    @abstractmethod
    def clock_ms(self, breakers: Breakers | None = None) -> int | None:
        """The store's time in ms; None when no node answers or none is known
        yet (with `breakers`: failures reported to them, not raised)."""


class ProbedStore(Store):
    """A store without an index (it is asked for each wanted key) that moves
    bytes between the daemon's region and itself: published from the pages
    in place, promoted straight into the pages a promotion allocated."""

    indexed: ClassVar[Literal[False]] = False

    @property
    @abstractmethod
    def mapped(self) -> bool:
        """Whether `use_region` gave it the region (nothing is published before)."""

    @abstractmethod
    def use_region(self, fd: int, size: int) -> None:
        """Publish from and promote into the region (`fd`, `size` bytes).
        Called once, at start-up, before the first publication."""

    @abstractmethod
    def use_budget(self, budget: PromotionBudget) -> None:
        """Count the store's transfer buffers against the promotion budget."""

    @abstractmethod
    def promotion_bytes(self, nbytes: int) -> int:
        """What a promotion of a payload of `nbytes` reserves of the budget."""

    @abstractmethod
    def trim(self) -> int:
        """Free idle transfer buffers (their budget returned); the bytes freed."""

    @abstractmethod
    def head(self, namespace: str, mm_hash: str) -> Head | None:
        """The value's shape, dtype and size; None when absent. Raises
        values.BadValue for a value that must not be served."""

    @abstractmethod
    def get_into(self, namespace: str, mm_hash: str, head: Head,
                 extents: Sequence[tuple[int, int]]) -> bool:
        """Read the value's payload into `extents` of the region, verified on
        its way in; False when the value is gone. Raises values.BadValue (the
        pages may hold unverified bytes: the caller aborts them),
        LocalWriteError or RemoteError."""

    @abstractmethod
    def put_entry(self, namespace: str, mm_hash: str, shape: tuple[int, ...], dtype: str,
                  extents: Sequence[tuple[int, int]],
                  current: Callable[[], bool] | None = None) -> Published:
        """Publish an entry from its pages (`current()`: they still hold it).
        Raises RemoteError, or ValueError for an entry the store's format
        cannot carry."""

    @abstractmethod
    def forget(self, namespace: str, mm_hash: str) -> None:
        """Remove a value (and what the store keeps beside it) that failed
        its verification: the next host that encodes it publishes it anew."""


# A store of either kind: `store.indexed` tells them apart (for the type checker too).
AnyStore = IndexedStore | ProbedStore
