"""The second tier's publisher: the bounded queue of entries to write to the
store, and the thread that writes and announces them.

It is its own module because publishing is write-behind with its own life
cycle (a queue bounded in bytes, a thread at lower CPU priority, a job
dropped at stop counted), which neither the fetches nor the resolver share.
How an entry is written is its backend's (`Backend.publish`); the publisher
only queues, paces and counts. It holds the tier's common state (`common`)
and the backend, not the tier, and tells the resolver when a key is no longer
being published here (`on_done`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable

from ec_daemon.core.limits import PUBLISHER_NICE
from ec_daemon.remote.backend import Backend, Publication
from ec_daemon.remote.common import Common, Refused, RemoteError

log = logging.getLogger("ec_daemon.remote")



class Publisher:
    """The publish queue and its thread (`run`). Thread-safe: `publish`,
    `queued_bytes`, `wake` and `drain` may be called from any thread."""

    def __init__(self, common: Common, backend: Backend, *, queue_bytes: int,
                 on_done: Callable[[str, str], None]) -> None:
        """`on_done(namespace, mm_hash)`: called once for each key offered to
        `publish`, when it was dropped or its job ended (published, skipped
        or failed): another host waiting on this host stops waiting."""
        if queue_bytes <= 0:
            raise ValueError("queue_bytes must be positive")
        self.common = common
        self.backend = backend
        self.queue_bytes = queue_bytes
        self._on_done = on_done
        self._cond = threading.Condition()
        self._queue: deque[Publication] = deque()
        self._queued_bytes = 0

    def publish(self, entry: Publication) -> bool:
        """`RemoteTier.publish`: queue the entry, never blocking; False
        (nothing queued) when stopped, when the key's store node is down, or
        when the queue would exceed queue_bytes."""
        common = self.common
        breaker = common.breakers.get(self.backend.domain(entry.namespace, entry.mm_hash))
        if common.stopping.is_set() or breaker.rejecting():
            common.count(publish_drops=1)
            self._on_done(entry.namespace, entry.mm_hash)
            return False
        with self._cond:
            dropped = self._queued_bytes + entry.nbytes > self.queue_bytes
            if not dropped:
                self._queue.append(entry)
                self._queued_bytes += entry.nbytes
                self._cond.notify()
        if dropped:
            common.count(publish_drops=1)
            self._on_done(entry.namespace, entry.mm_hash)
        return not dropped

    @property
    def queued_bytes(self) -> int:
        """Payload bytes waiting to be published."""
        with self._cond:
            return self._queued_bytes

    def wake(self) -> None:
        """Wake the thread (the tier is stopping): it returns."""
        with self._cond:
            self._cond.notify_all()

    def run(self) -> None:
        """The publisher thread: until the tier stops, one entry at a time."""
        _background_priority()
        while True:
            with self._cond:
                while not self._queue and not self.common.stopping.is_set():
                    self._cond.wait()
                if self.common.stopping.is_set():
                    return
                entry = self._queue.popleft()
            try:
                self._publish_one(entry)
            except Exception:
                self.common.count(publish_errors=1)
                log.exception("publishing %s failed", entry.mm_hash)
            finally:
                with self._cond:
                    self._queued_bytes -= entry.nbytes
                # Published, skipped or failed: other hosts waiting for it stop
                # waiting on this host's claim (they find the value, or encode).
                self._on_done(entry.namespace, entry.mm_hash)

    def drain(self) -> None:
        """Drop what is queued, counted (after the thread stopped: `RemoteTier.stop`)."""
        with self._cond:
            entries = list(self._queue)
            self._queue.clear()
            self._queued_bytes -= sum(entry.nbytes for entry in entries)
        if entries:
            self.common.count(publish_drops=len(entries))

    def _publish_one(self, entry: Publication) -> None:
        """Write one entry through its backend, and count how it ended. A
        store error is counted and logged and ends the job (the backend told
        the breaker); any other exception propagates (`run`)."""
        common = self.common
        try:
            result = self.backend.publish(entry)
        except Refused:
            common.count(publish_drops=1)
            return
        except RemoteError as exc:
            common.count(publish_errors=1, errors=1)
            log.debug("publishing %s failed: %s", entry.mm_hash, exc)
            return
        if result == "stored":
            common.count(publishes=1, publish_bytes=entry.nbytes)
        elif result == "exists":
            common.count(publish_exists=1)
        else:  # (rewritten meanwhile, or a tensor the store's format cannot carry)
            common.count(publish_skips=1)


def _background_priority() -> None:
    """Lower this thread's CPU priority (Linux: per thread): publishing is
    write-behind and must yield the cores to the engines' saves and loads."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUBLISHER_NICE)
