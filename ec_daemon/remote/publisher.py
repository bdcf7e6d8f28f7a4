"""The second tier's publisher: the bounded queue of entries to write to the
store, and the thread that writes and announces them.

It is its own module because publishing is write-behind with its own life
cycle (a queue bounded in bytes, a thread at lower CPU priority, every job's
`release` called exactly once, even when dropped at stop), which neither the
fetches nor the follower share. It holds the core (`core`), not the tier, and
tells the resolver when a key is no longer being published here (`on_done`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ec_daemon.remote.backend import ProbedStore, Published, RemoteError
from ec_daemon.remote.core import TierCore, tell_breaker
from ec_daemon.remote.values import encode

log = logging.getLogger("ec_daemon.remote")

# Niceness of the publisher thread (write-behind, below the daemon's loop).
PUBLISHER_NICE = 10


@dataclass
class _Job:
    namespace: str
    mm_hash: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    read: Callable[[], Any]
    release: Callable[[], None] | None
    current: Callable[[], bool] | None
    extents: list[tuple[int, int]] | None = None


# How a publication's store calls ended (`Publisher._send`): "unfit", an
# entry the store's format cannot carry, was not sent.
_Sent = Published | Literal["unfit"]


class Publisher:
    """The publish queue and its thread (`run`). Thread-safe: `publish`,
    `queued_bytes`, `wake` and `drain` may be called from any thread."""

    def __init__(self, core: TierCore, *, ttl_s: float, queue_bytes: int,
                 on_done: Callable[[str, str], None]) -> None:
        """`on_done(namespace, mm_hash)`: called once for each key offered to
        `publish`, when it was dropped or its job ended (published, skipped
        or failed): another host waiting on this host stops waiting."""
        self.core = core
        self.ttl_s = ttl_s
        self.queue_bytes = queue_bytes
        self._on_done = on_done
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._queued_bytes = 0

    def publish(self, namespace: str, mm_hash: str, shape: tuple[int, ...], dtype: str,
                nbytes: int, read: Callable[[], Any],
                release: Callable[[], None] | None = None,
                current: Callable[[], bool] | None = None,
                extents: list[tuple[int, int]] | None = None) -> bool:
        """`RemoteTier.publish`: queue the key, never blocking; False
        (nothing queued, `release` not called) when stopped, when the key's
        store node is down, or when the queue would exceed queue_bytes."""
        core = self.core
        breaker = core.breakers.get(core.store.domain(namespace, mm_hash))
        if core.stopping.is_set() or breaker.rejecting():
            core.count(publish_drops=1)
            self._on_done(namespace, mm_hash)
            return False
        with self._cond:
            if self._queued_bytes + nbytes > self.queue_bytes:
                dropped = True
            else:
                dropped = False
                self._queue.append(_Job(namespace, mm_hash, tuple(shape), dtype, nbytes,
                                        read, release, current, extents))
                self._queued_bytes += nbytes
                self._cond.notify()
        if dropped:
            core.count(publish_drops=1)
            self._on_done(namespace, mm_hash)
        return not dropped

    @property
    def queued_bytes(self) -> int:
        """Payload bytes waiting to be published."""
        with self._cond:
            return self._queued_bytes

    def wake(self) -> None:
        """Wake the thread (the core is stopping): it returns."""
        with self._cond:
            self._cond.notify_all()

    def run(self) -> None:
        """The publisher thread: until the core stops, one job at a time."""
        _background_priority()
        while True:
            with self._cond:
                while not self._queue and not self.core.stopping.is_set():
                    self._cond.wait()
                if self.core.stopping.is_set():
                    return
                job = self._queue.popleft()
            try:
                self._publish_one(job)
            except Exception:
                self.core.count(publish_errors=1)
                log.exception("publishing %s failed", job.mm_hash)
            finally:
                with self._cond:
                    self._queued_bytes -= job.nbytes
                _release(job)
                # Published, skipped or failed: other hosts waiting for it stop
                # waiting on this host's claim (they find the value, or encode).
                self._on_done(job.namespace, job.mm_hash)

    def drain(self) -> None:
        """Drop what is queued (counted), releasing each job (after the
        thread stopped: `RemoteTier.stop`)."""
        with self._cond:
            jobs = list(self._queue)
            self._queue.clear()
            self._queued_bytes -= sum(job.nbytes for job in jobs)
        if jobs:
            self.core.count(publish_drops=len(jobs))
        for job in jobs:
            _release(job)

    def _publish_one(self, job: _Job) -> None:
        core = self.core
        store = core.store
        if not store.indexed:
            self._put_entry(store, job)
            return
        payload = job.read()
        if payload is None:
            core.count(publish_skips=1)
            return
        parts = encode(job.namespace, job.mm_hash, job.shape, job.dtype, payload)
        if sum(len(part) for part in parts[1:]) != job.nbytes:
            raise ValueError(f"read() returned {sum(len(p) for p in parts[1:])} bytes, "
                             f"expected {job.nbytes}")
        if job.current is not None and not job.current():
            core.count(publish_skips=1)  # rewritten before the checksum was taken
            return

        def send() -> _Sent:
            started = time.monotonic()
            store.put(job.namespace, job.mm_hash, parts, self.ttl_s)
            core.latency.labels("put").observe(time.monotonic() - started)
            if job.current is not None and not job.current():
                return "rewritten"  # perhaps sent rewritten: not announced
            announced = time.monotonic()
            # The announcement must not outlive the value: its TTL runs from the put.
            store.announce(job.namespace, job.mm_hash, job.nbytes,
                           self.ttl_s - (announced - started))
            core.latency.labels("announce").observe(time.monotonic() - announced)
            return "stored"

        self._send(job, send)

    def _put_entry(self, store: ProbedStore, job: _Job) -> None:
        """Publish to a store without an index, from the pages in place."""
        core = self.core
        extents = job.extents
        if extents is None or not store.mapped or not store.accepts(job.mm_hash):
            core.count(publish_skips=1)
            return

        def send() -> _Sent:
            started = time.monotonic()
            try:
                result = store.put_entry(core.store_name(job.namespace), job.mm_hash,
                                         job.shape, job.dtype, extents, job.current)
            except ValueError as exc:  # (a tensor the store's format cannot carry)
                log.debug("not publishing %s: %s", job.mm_hash, exc)
                return "unfit"
            core.latency.labels("put").observe(time.monotonic() - started)
            return result

        self._send(job, send)

    def _send(self, job: _Job, send: Callable[[], _Sent]) -> None:
        """Make a publication's store calls (`send`) through its key's
        circuit breaker, and count how it ended. A store error counts
        against the breaker (a transfer from a host that is gone does not:
        `tell_breaker`), is counted and logged, and ends the job; any other
        exception counts against it too and propagates (`run`)."""
        core = self.core
        breaker = core.breakers.get(core.store.domain(job.namespace, job.mm_hash))
        if not breaker.allow():
            core.count(publish_drops=1)
            return
        try:
            result = send()
        except RemoteError as exc:
            tell_breaker(breaker, exc)
            core.count(publish_errors=1, errors=1)
            log.debug("publishing %s failed: %s", job.mm_hash, exc)
            return
        except BaseException as exc:
            tell_breaker(breaker, exc)
            raise
        breaker.success()
        if result == "stored":
            core.count(publishes=1, publish_bytes=job.nbytes)
        elif result == "exists":
            core.count(publish_exists=1)
        else:  # (rewritten meanwhile, or a tensor the store's format cannot carry)
            core.count(publish_skips=1)


def _background_priority() -> None:
    """Lower this thread's CPU priority (Linux: per thread): publishing is
    write-behind and must yield the cores to the engines' saves and loads."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUBLISHER_NICE)


def _release(job: _Job) -> None:
    if job.release is None:
        return
    try:
        job.release()
    except Exception:
        log.exception("release callback of %s failed", job.mm_hash)
