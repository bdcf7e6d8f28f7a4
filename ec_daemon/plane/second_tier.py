"""What the data plane asks of the second tier, declared where it is asked.

The plane never imports the tier (`ec_daemon.remote`): the server hands one
in, and the plane runs, and is tested, without one. `SecondTier` is the
whole contract, every call the plane makes, typed, so that mypy checks
`remote.tier.RemoteTier` against it where the server hands the tier in. The
values both sides name (`core.events.Resolution`) sit below both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ec_daemon.core.events import Extent, Resolution
from ec_daemon.durable.region import Region


class Reservation(Protocol):
    """Promotion budget held for one value (`SecondTier.reserve`)."""

    nbytes: int  # the announced payload

    def release(self) -> None:
        """Return the bytes; idempotent."""


class Fetched(Protocol):
    """A verified value fetched from the second tier (`SecondTier.fetch`)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    def write_into(self, region_file: Region, extents: Sequence[Extent]) -> bool:
        """Write the payload across `extents`; False when it failed (counted)."""


class SecondTier(Protocol):
    """Everything the data plane calls on the second tier. Calls that block
    on the network (`fetch`) run on the plane's pool; every other returns at
    once."""

    def follow(self, namespace: str, store_namespace: str = "") -> None:
        """A session of `namespace` attached: keep what the tier learns of it
        (`store_namespace`: the engine's name for it in a store shared with
        vLLM's own connector)."""

    def unfollow(self, namespace: str) -> None:
        """No local session uses `namespace` any more: forget its entries."""

    def available(self, namespace: str, mm_hash: str) -> int | None:
        """The entry's size when the tier is known to hold it; never asks the store."""

    def resolve(self, namespace: str, mm_hash: str, done: Callable[[Resolution], None],
                claim: bool = True) -> bool:
        """Find out off the caller's thread whether another host has or makes
        the key, claiming it across hosts if nobody does and `claim`;
        `done(outcome)` is called once, from another thread. False (nothing
        started, `done` never called) when there is nothing to ask."""

    def publish(self, namespace: str, mm_hash: str, shape: tuple[int, ...], dtype: str,
                nbytes: int, read: Callable[[], Any],
                release: Callable[[], None] | None = None,
                current: Callable[[], bool] | None = None,
                extents: list[Extent] | None = None) -> bool:
        """Queue a ready entry for the store (write-behind); never blocks.
        False when nothing was queued (stopped, the store down, the queue full)."""

    def reserve(self, namespace: str, mm_hash: str) -> Reservation | None:
        """The promotion budget for the key's value (before `fetch`); None
        when the tier no longer holds it or the budget is spent."""

    def fetch(self, namespace: str, mm_hash: str, nbytes: int | None = None) -> Fetched | None:
        """The verified value (blocks on the store); None when absent or refused."""

    def forget(self, namespace: str, mm_hash: str) -> None:
        """The key could not be promoted: not offered again."""

    def snapshot(self) -> dict[str, float | int | bool]:
        """The tier's counters and gauges (`Stats`, /metrics)."""
