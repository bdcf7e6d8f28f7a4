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

A region another process cut (truncated) is never copied through again:
after each batch of copies their users ask `intact` (`check_loads` for a
step's loads), which reads the file's canary with pread
(`RegionMapping.intact`, `ec_protocol.stamps`), and `use` reads it too
before it hands a mapping out. A mapping whose canary
changed is damaged: its copies failed or were given up, it is taken out of
use at once (released, with its CUDA registration, once no copy holds it),
and the next use maps and registers the file anew, once the daemon has
repaired it (a new canary; until then `use` raises `RegionDamaged`, an
OSError). A mapping made for a region that had no canary (an older daemon's)
is replaced the same way, without failing anything, once a daemon says the
region has one.

Thread-safe: loads run on the engine's thread, saves on the saver thread,
attach and detach on the link thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ec_client.common.contract import RegionInfo
from ec_client.common.limits import RETIRE_SECONDS
from ec_client.copy.mapping import RegionDamaged, RegionMapping
from ec_protocol.stamps import StampReader

log = logging.getLogger(__name__)



class _Mapped:
    def __init__(self, info: RegionInfo, mapping: RegionMapping) -> None:
        self.info = info
        self.mapping = mapping
        # Read with pread through the file's descriptor: never its pages.
        self.stamps = StampReader(mapping.fd, info.page_bytes, info.data_offset,
                                  (info.size - info.data_offset) // info.page_bytes)
        self.users = 0
        self.retired_at: float | None = None

    def stale_for(self, info: RegionInfo) -> bool:
        """Not to be used for `info` any more: its canary changed (read now:
        one pread, so a copy does not go through a file cut since the last
        one), or it was mapped without one and `info` says the region has
        one now."""
        return not self.mapping.intact() or (bool(info.canary) and self.mapping.canary is None)


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
        # Mappings replaced while a copy still held them (a damaged one, or
        # one without a canary), released once none does.
        self._replaced: list[_Mapped] = []
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
    def use(self, info: RegionInfo) -> Iterator[tuple[RegionMapping, StampReader]]:
        """The mapping of `info`'s generation (mapped now if need be) and its
        stamp table, kept mapped until the block ends. Raises OSError when
        the region cannot be mapped: its daemon is gone and the file removed,
        or `RegionDamaged`, it was cut and is not repaired yet."""
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
            try:
                with self.use(info):
                    pass
            except RegionDamaged as exc:  # mapped on first use, once repaired
                log.warning("ec-daemon: %s", exc)
        self.prune()

    def intact(self, mapping: RegionMapping) -> bool:
        """After copies through `mapping` landed: whether every page they
        used was still the file's (its canary is the one it was made with).
        False: what they copied may not be the file's (fail or give them up);
        the mapping is taken out of use now, for good."""
        if mapping.intact():
            return True
        log.error("ec-daemon: region %s (generation %016x) was cut by another process "
                  "(truncated: its canary changed); the copies through it fail, and it is "
                  "mapped again once the daemon has repaired it", mapping.path,
                  mapping.generation)
        self._replace(mapping)
        return False

    def check_loads(self, mappings: Sequence[RegionMapping],
                    errors: Sequence[Exception | None]) -> list[Exception | None]:
        """`errors` of a step's loads (`CopyBackend.load_all`, one per load,
        in `mappings`' order), with a `RegionDamaged` for each load whose
        mapping is not `intact` (each mapping's canary read once)."""
        damaged = {id(m) for m in {id(m): m for m in mappings}.values() if not self.intact(m)}
        return [error if error is not None or id(m) not in damaged else RegionDamaged(
                    f"region {m.path} was cut (truncated) by another process during the "
                    "copy: the bytes may not be the entry's")
                for m, error in zip(mappings, errors, strict=True)]

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
            done = [m for m in self._mapped.values() if m.users == 0 and (
                m.mapping.damaged or (m.retired_at is not None
                                      and now - m.retired_at >= RETIRE_SECONDS
                                      and m.info.generation not in keep))]
            for mapped in done:
                del self._mapped[mapped.info.generation]
            done += [m for m in self._replaced if m.users == 0]
            self._replaced = [m for m in self._replaced if m.users > 0]
        for mapped in done:
            self._release(mapped)

    def close(self) -> None:
        """Unmap everything (the worker is shutting down), once the release
        thread has finished what it was given."""
        with self._lock:
            mapped, self._mapped = [*self._mapped.values(), *self._replaced], {}
            self._replaced = []
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

    def _replace(self, mapping: RegionMapping) -> None:
        """Take `mapping` out of use (the next use maps the file anew)."""
        with self._lock:
            mapped = self._mapped.get(mapping.generation)
            if mapped is not None and mapped.mapping is mapping:
                del self._mapped[mapping.generation]
                self._replaced.append(mapped)
        self.prune()

    def _acquire(self, info: RegionInfo) -> _Mapped:
        with self._lock:
            mapped = self._mapped.get(info.generation)
            if mapped is not None and mapped.stale_for(info):
                del self._mapped[info.generation]
                self._replaced.append(mapped)  # released once no copy holds it
                mapped = None
            if mapped is not None:
                mapped.users += 1
                return mapped
        self.prune()  # a replaced mapping no copy holds goes now
        fresh = _Mapped(info, self._open(info))
        try:
            if info.canary:
                # Before anything is registered or copied: a file cut and not
                # repaired yet (its canary reads 0) is not mapped.
                canary = fresh.mapping.watch_canary()
                if canary != info.canary:
                    log.info("ec-daemon: region %s has canary %016x, not the %016x it was "
                             "announced with: the daemon repaired it since", info.path, canary,
                             info.canary)
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
