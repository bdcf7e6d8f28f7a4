"""What the data plane asks of the second tier, declared where it is asked.

The plane never imports the tier (`ec_daemon.remote`): the server hands one
in, and the plane runs, and is tested, without one. `SecondTier` is the
whole contract, every call the plane makes, typed, so that mypy checks
`remote.tier.RemoteTier` against it where the server hands the tier in. The
values both sides name (`core.events.Resolution`, `Fetched`) sit below both.

The plane hands the tier the region (`durable.region.Region`) whenever the
tier reads or writes pages: a publication is read from them, a promotion
written into those the plane allocated for it (`fetch`, then `fetch_into`),
always through the daemon's own descriptor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ec_daemon.core.events import Extent, Fetched, Resolution
from ec_daemon.durable.region import Region


class Reservation(Protocol):
    """Promotion budget held for one value (`SecondTier.reserve`)."""

    nbytes: int  # the announced payload

    def release(self) -> None:
        """Return the bytes; idempotent."""


class SecondTier(Protocol):
    """Everything the data plane calls on the second tier. Calls that block
    on the network (`fetch`, `fetch_into`) run on the plane's pool; every
    other returns at once."""

    def follow(self, namespace: str, store_namespace: str) -> None:
        """A session of `namespace` attached: keep what the tier learns of it
        (`store_namespace`: the engine's name for it in a store shared with
        vLLM's own connector)."""

    def unfollow(self, namespace: str) -> None:
        """No local session uses `namespace` any more: forget its entries."""

    def available(self, namespace: str, mm_hash: str) -> int | None:
        """The entry's size when the tier is known to hold it; never asks the store."""

    def resolve(self, namespace: str, mm_hash: str, done: Callable[[Resolution], None],
                claim: bool) -> bool:
        """Find out off the caller's thread whether another host has or makes
        the key, claiming it across hosts if nobody does and `claim`;
        `done(outcome)` is called once, from another thread. False (nothing
        started, `done` never called) when there is nothing to ask."""

    def publish(self, namespace: str, mm_hash: str, shape: tuple[int, ...], dtype: str,
                region: Region, extents: Sequence[Extent],
                current: Callable[[], bool]) -> bool:
        """Queue a ready entry for the store, to be read from its pages in
        `region` (write-behind); never blocks. `current()` says whether the
        pages still hold the entry (they may be reused meanwhile). False when
        nothing was queued (stopped, the store down, the queue full)."""

    def reserve(self, namespace: str, mm_hash: str) -> Reservation | None:
        """The promotion budget for the key's value (before `fetch`); None
        when the tier no longer holds it or the budget is spent."""

    def fetch(self, namespace: str, mm_hash: str, nbytes: int) -> Fetched | None:
        """What the stored value of `nbytes` payload bytes is, enough to
        allocate its pages (blocks on the store); None when absent or refused
        (counted, logged). Never raises."""

    def fetch_into(self, namespace: str, mm_hash: str, found: Fetched, region: Region,
                   extents: Sequence[Extent]) -> bool:
        """Write the value `fetch` found into `extents` of `region`, verified
        before it may be served (blocks on the store); False when it failed
        (counted, logged): the pages hold nothing to serve. Never raises."""

    def forget(self, namespace: str, mm_hash: str) -> None:
        """The key could not be promoted: not offered again."""

    def snapshot(self) -> dict[str, float | int | bool]:
        """The tier's counters and gauges (`Stats`, /metrics)."""
