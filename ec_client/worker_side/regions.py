"""The region mappings of one worker process, by generation, reference-counted.

A load names the region generation it reads (with its path: see
`RegionInfo`), so a worker reads without a session: it maps that region on
first use and keeps the mapping while any copy uses it. A daemon restart
never unmaps a region under a running copy (torch or cupy may still be
reading it), and a load dispatched just before the restart still reads the
old region: an adopted one (a warm restart) is the same file, and a
replaced one is unlinked but stays readable through the mapping. A mapping
no copy uses is unmapped once a newer generation is current, it has been
retired for `RETIRE_SECONDS`, and the scheduler cannot load from it any
more: the latest step's metadata does not name it (`step`: the scheduler's
loads in flight and the region it answers hits for), or the worker has been
idle between steps for `RETIRE_SECONDS` (an idle engine dispatches nothing,
and a dead daemon's tmpfs memory is not pinned for long). So a load whose
copy starts long after the daemon died, behind a slow step, still finds it.

Releasing a mapping is not the caller's work: the copy backend's `detach`
synchronises its copy streams (a save's may wait for the compute stream),
joins its registrar and unregisters every chunk, which takes longer the
larger the region. So `prune`, which the engine's thread calls at every
load and step boundary, only takes a retired mapping out of use; a thread of
its own (`ec-regions-release`, started when first needed) detaches and
unmaps it, and `close` waits for it.

Thread-safe: loads run on the engine's thread, saves on the saver thread,
attach and detach on the link thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ec_client.common.contract import RegionInfo
from ec_client.copy.mapping import RegionMapping
from ec_protocol.stamps import StampTable

log = logging.getLogger(__name__)

# A retired mapping stays at least this long after it was retired (and
# while any copy uses it), for loads dispatched before the scheduler saw the
# daemon change.
RETIRE_SECONDS = 5.0


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
        self._keep: frozenset[int] = frozenset()  # named by the latest step's metadata
        self._in_step = False
        self._idle_since = clock()
        # Mappings out of use, for the release thread to detach and unmap.
        self._released: queue.Queue[_Mapped | None] = queue.Queue()
        self._releaser: threading.Thread | None = None
        self._releasing_now = threading.Condition()
        self._to_release = 0

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

    def step(self, keep: frozenset[int]) -> None:
        """A step began; its metadata names `keep`, the generations the
        scheduler may still load from: mapped while the engine works."""
        with self._lock:
            self._keep = keep
            self._in_step = True

    def step_done(self) -> None:
        """The step ended (the worker is idle until the next one)."""
        with self._lock:
            self._in_step = False
            self._idle_since = self._clock()
        self.prune()

    def prune(self) -> None:
        """Unmap retired mappings that no copy uses, whose grace is over and
        that the scheduler can no longer load from."""
        now = self._clock()
        with self._lock:
            keep = self._keep
            if not self._in_step and now - self._idle_since >= RETIRE_SECONDS:
                keep = frozenset()  # idle: the scheduler dispatches nothing
            done = [m for m in self._mapped.values() if m.users == 0 and m.retired_at is not None
                    and now - m.retired_at >= RETIRE_SECONDS
                    and m.info.generation not in keep]
            for mapped in done:
                del self._mapped[mapped.info.generation]
        for mapped in done:
            self._release(mapped)

    def close(self) -> None:
        """Unmap everything (the worker is shutting down), once the release
        thread has finished what it was given."""
        with self._lock:
            mapped, self._mapped = list(self._mapped.values()), {}
            releaser, self._releaser = self._releaser, None
        if releaser is not None:
            self._released.put(None)
            releaser.join()
        for m in mapped:
            self._unmap(m)

    def _release(self, mapped: _Mapped) -> None:
        """Detach and unmap `mapped` on the release thread, not this one."""
        with self._lock:
            if self._releaser is None:
                self._releaser = threading.Thread(target=self._releasing, daemon=True,
                                                  name="ec-regions-release")
                self._releaser.start()
        with self._releasing_now:
            self._to_release += 1
        self._released.put(mapped)

    def wait_released(self, timeout: float | None = None) -> bool:
        """Until every mapping taken out of use was detached and unmapped."""
        with self._releasing_now:
            return self._releasing_now.wait_for(lambda: self._to_release == 0, timeout)

    def _releasing(self) -> None:
        while (mapped := self._released.get()) is not None:
            try:
                self._unmap(mapped)
            except Exception:  # the next mapping is still released
                log.exception("ec-daemon: releasing region generation %016x failed",
                              mapped.info.generation)
            with self._releasing_now:
                self._to_release -= 1
                self._releasing_now.notify_all()

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
            self._release(fresh)
        return mapped

    def _unmap(self, mapped: _Mapped, *, registered: bool = True) -> None:
        try:
            if registered:
                self._on_unmap(mapped.mapping)
        finally:  # the mapping is closed even when the backend's detach failed
            mapped.stamps.release()
            mapped.mapping.close()
