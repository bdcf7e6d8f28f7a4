"""The region mappings of one worker process, by generation, reference-counted.

A load names the region generation it reads (with its path: see
`RegionInfo`), so a worker reads without a session: it maps that region on
first use and keeps the mapping while any copy uses it. A daemon restart
never unmaps a region under a running copy (torch or cupy may still be
reading it), and a load dispatched just before the restart still reads the
old region: an adopted one (a warm restart) is the same file, and a
replaced one is unlinked but stays readable through the mapping. A mapping
no copy uses is unmapped once a newer generation is current, it has been
retired for `RETIRE_SECONDS` (a dead daemon's tmpfs memory is not pinned for
long), and the scheduler no longer names it among the generations its loads
in flight read (`keep_loading`, from every step's metadata): a load whose
copy starts long after its dispatch, in a slow step, still finds it.

Thread-safe: loads run on the engine's thread, saves on the saver thread,
attach and detach on the link thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ec_client.mapping import RegionMapping
from ec_protocol.stamps import StampTable

# A retired mapping stays at least this long after it was retired (and
# while any copy uses it), for loads dispatched before the scheduler saw the
# daemon change.
RETIRE_SECONDS = 5.0


@dataclass(frozen=True)
class RegionInfo:
    """What a worker needs to map and check a region (from AttachReply.region)."""

    path: str
    size: int
    generation: int
    page_bytes: int
    data_offset: int


class _Mapped:
    def __init__(self, info: RegionInfo, mapping: RegionMapping) -> None:
        self.info = info
        self.mapping = mapping
        self.stamps = StampTable(mapping.view[:info.data_offset], info.page_bytes,
                                 info.data_offset)
        self.users = 0
        self.retired_at: float | None = None


class Regions:
    def __init__(self, on_map: Callable[[RegionMapping], None] = lambda m: None,
                 on_unmap: Callable[[RegionMapping], None] = lambda m: None,
                 open_mapping: Callable[[RegionInfo], RegionMapping] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`on_map`/`on_unmap` register a mapping with the copy backend."""
        self._on_map = on_map
        self._on_unmap = on_unmap
        self._open = open_mapping or (lambda i: RegionMapping(i.path, i.size, i.generation))
        self._clock = clock
        self._lock = threading.Lock()
        self._mapped: dict[int, _Mapped] = {}
        self.current: int | None = None  # generation of the attached daemon
        self._loading: frozenset[int] = frozenset()  # named by loads in flight

    @contextmanager
    def use(self, info: RegionInfo) -> Iterator[tuple[RegionMapping, StampTable]]:
        """The mapping of `info`'s generation (mapped now if need be) and its
        stamp table, kept mapped until the block ends. Raises OSError when
        the region cannot be mapped (its daemon is gone and the file removed)."""
        mapped = self._acquire(info)
        try:
            yield mapped.mapping, mapped.stamps
        finally:
            with self._lock:
                mapped.users -= 1
            self.prune()

    def make_current(self, info: RegionInfo | None) -> None:
        """The daemon attached (`info`) or went away (None): map the new
        region now, retire the others."""
        now = self._clock()
        with self._lock:
            # Current before it is mapped, and un-retired if it was mapped
            # before (a re-attach to the same daemon): else it is unmapped
            # after RETIRE_SECONDS and mapped again on a later load's path.
            self.current = info.generation if info is not None else None
            for generation, mapped in self._mapped.items():
                if generation == self.current:
                    mapped.retired_at = None
                elif mapped.retired_at is None:
                    mapped.retired_at = now
        if info is not None:
            with self.use(info):
                pass
        self.prune()

    def keep_loading(self, generations: frozenset[int]) -> None:
        """The generations the scheduler's loads in flight read (the latest
        step's metadata): mapped however long ago they were retired."""
        if generations != self._loading:
            self._loading = generations
            self.prune()

    def prune(self) -> None:
        """Unmap retired mappings that no copy uses, no load in flight names,
        and whose grace is over."""
        now = self._clock()
        with self._lock:
            loading = self._loading
            done = [m for m in self._mapped.values() if m.users == 0 and m.retired_at is not None
                    and now - m.retired_at >= RETIRE_SECONDS
                    and m.info.generation not in loading]
            for mapped in done:
                del self._mapped[mapped.info.generation]
        for mapped in done:
            self._unmap(mapped)

    def close(self) -> None:
        """Unmap everything (the worker is shutting down)."""
        with self._lock:
            mapped, self._mapped = list(self._mapped.values()), {}
        for m in mapped:
            self._unmap(m)

    def generations(self) -> list[int]:
        with self._lock:
            return sorted(self._mapped)

    def _acquire(self, info: RegionInfo) -> _Mapped:
        with self._lock:
            mapped = self._mapped.get(info.generation)
            if mapped is not None:
                mapped.users += 1
                return mapped
        fresh = _Mapped(info, self._open(info))  # outside the lock: it may fault pages in
        try:
            self._on_map(fresh.mapping)
        except BaseException:
            self._unmap(fresh, registered=False)
            raise
        with self._lock:
            mapped = self._mapped.setdefault(info.generation, fresh)
            mapped.users += 1
            if info.generation != self.current and mapped.retired_at is None:
                mapped.retired_at = self._clock()
        if mapped is not fresh:  # another thread mapped it meanwhile
            self._unmap(fresh)
        return mapped

    def _unmap(self, mapped: _Mapped, *, registered: bool = True) -> None:
        if registered:
            self._on_unmap(mapped.mapping)
        mapped.stamps.release()
        mapped.mapping.close()
