"""Page-locking one region mapping for CUDA, chunk by chunk, in the background.

cudaHostRegister costs about 0.1 s per GB in every worker process; done
before a worker's session stream opens, a large region would outlast the
daemon's open grace, and done on the engine's thread it would stall a step.
So a mapping is registered by a thread of its own, in `REGISTER_CHUNK_BYTES`
chunks, while copies go on: a chunk not registered yet is copied unpinned.

CUDA requires one cudaMemcpyAsync range to lie inside one registration or
outside all of them, so copies are split at chunk boundaries (`pieces`, which
first joins extents that continue each other: one copy per contiguous run), and
a chunk is never (un)registered while a copy of it runs (`using`): the
registrar takes a chunk only when no copy holds it, and new copies of that
chunk wait the ~0.1 s it takes. A refused registration clears its CUDA error
and rolls back every chunk of the mapping (copies go on unpinned, as vLLM's
CPU connector does); that is counted (`pin_refused`) and logged once per
process. An unregistration CUDA refuses is logged and the chunk counted as
released: a mapping is always closed, and the registrar never dies of it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from ec_client.common.limits import REGISTER_CHUNK_BYTES

log = logging.getLogger(__name__)

_refusal_logged = False


class PinRefused(RuntimeError):
    """cudaHostRegister refused a range; no CUDA error is left pending."""


class Registrar(Protocol):
    """What pinning needs of a CUDA runtime (`ec_client.copy.cuda.CudaRuntime`)."""

    def use_device(self) -> None: ...

    def register(self, host: Any, offset: int, length: int) -> None: ...

    def unregister(self, host: Any, offset: int) -> None: ...


def chunks_of(offset: int, length: int, chunk_bytes: int) -> range:
    """The chunks that bytes [offset, offset+length) of a mapping touch."""
    if length <= 0:
        return range(0)
    return range(offset // chunk_bytes, (offset + length - 1) // chunk_bytes + 1)


def runs(extents: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """`extents` with each one that starts where the previous one ended
    joined to it (the buffer holds them back to back, so it continues too)."""
    start = end = -1
    for offset, length in extents:
        if length <= 0:
            continue
        if offset == end:
            end += length
            continue
        if end > start >= 0:
            yield start, end - start
        start, end = offset, offset + length
    if end > start >= 0:
        yield start, end - start


def pieces(extents: Iterable[tuple[int, int]],
           chunk_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(region offset, length, offset in the buffer) of each piece of
    `extents` (the buffer holds them back to back): one per contiguous run,
    split so that no piece crosses a chunk boundary."""
    done = 0
    for offset, length in runs(extents):
        end = offset + length
        while offset < end:
            cut = min(end, (offset // chunk_bytes + 1) * chunk_bytes)
            yield offset, cut - offset, done
            done += cut - offset
            offset = cut


class Pinning:
    """The registration state of one mapping. Thread-safe."""

    def __init__(self, runtime: Registrar, host: Any, size: int, stats: Counter[str], *,
                 chunk_bytes: int = REGISTER_CHUNK_BYTES, name: str = "ec-pin") -> None:
        self.chunk_bytes = chunk_bytes
        self._runtime = runtime
        self._host = host
        self._size = size
        self._stats = stats
        count = -(-size // chunk_bytes)
        self._cond = threading.Condition()
        self._users = [0] * count
        self._busy: int | None = None  # the chunk being (un)registered
        self._registered = [False] * count
        self._stop = False
        self.refused = False
        self.done = threading.Event()  # the registrar finished (or gave up)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def pinned(self) -> bool:
        """Every chunk is registered."""
        with self._cond:
            return all(self._registered)

    def registered(self, offset: int) -> bool:
        """Whether the chunk holding byte `offset` is registered (stable while
        a copy holds it: `using`)."""
        with self._cond:
            return self._registered[offset // self.chunk_bytes]

    @contextmanager
    def using(self, extents: Iterable[tuple[int, int]]) -> Iterator[None]:
        """Hold the chunks `extents` touch for a copy (until it has landed):
        none of them is (un)registered meanwhile."""
        held = sorted({c for offset, length in extents
                       for c in chunks_of(offset, length, self.chunk_bytes)})
        with self._cond:
            self._cond.wait_for(lambda: self._busy not in held)
            for c in held:
                self._users[c] += 1
        try:
            yield
        finally:
            with self._cond:
                for c in held:
                    self._users[c] -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Stop registering and unregister what was. The caller makes sure no
        copy is queued any more (the copy stream is synchronised)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if any(self._registered):
            self._runtime.use_device()
            self._unregister_all()

    # ---------------------------------------------------------- registrar

    def _run(self) -> None:
        try:
            self._runtime.use_device()  # this thread's CUDA calls go to the worker's device
            for chunk in range(len(self._registered)):
                if not self._take(chunk):
                    return
                try:
                    start = chunk * self.chunk_bytes
                    length = min(self.chunk_bytes, self._size - start)
                    self._runtime.register(self._host, start, length)
                    self._registered[chunk] = True
                except PinRefused as exc:
                    self._give(chunk)
                    self._refuse(chunk, exc)
                    return
                self._give(chunk)
        except Exception:  # never let a registrar failure reach a copy
            log.exception("ec-daemon: pinning the region failed; copies stay unpinned")
            self._refuse(None, None)
        finally:
            self.done.set()

    def _take(self, chunk: int) -> bool:
        """Make `chunk` busy once no copy holds it; False when stopping."""
        with self._cond:
            self._busy = chunk
            self._cond.wait_for(lambda: self._stop or self._users[chunk] == 0)
            if self._stop:
                self._busy = None
                self._cond.notify_all()
                return False
            return True

    def _give(self, chunk: int) -> None:
        with self._cond:
            self._busy = None
            self._cond.notify_all()

    def _refuse(self, chunk: int | None, exc: BaseException | None) -> None:
        """Roll back every registered chunk (each once no copy holds it)."""
        global _refusal_logged
        self.refused = True
        self._stats["pin_refused"] += 1
        for c, registered in enumerate(self._registered):
            if registered and self._take(c):
                try:
                    self._unregister(c)
                finally:
                    self._give(c)
        if not _refusal_logged:
            _refusal_logged = True
            log.warning("ec-daemon: cudaHostRegister refused the region (chunk %s: %s); copies "
                        "to and from it are unpinned (slower, still correct). Pinning needs "
                        "the region on tmpfs (/dev/shm) and enough lockable memory.",
                        chunk, exc)

    def _unregister_all(self) -> None:
        for c, registered in enumerate(self._registered):
            if registered:
                self._unregister(c)

    def _unregister(self, chunk: int) -> None:
        """cudaHostUnregister of `chunk`; a refusal is logged, and the chunk
        is no longer ours either way (CUDA keeps nothing we could retry)."""
        try:
            self._runtime.unregister(self._host, chunk * self.chunk_bytes)
        except Exception as exc:  # the runtime's error type: CuPy raises its own
            log.warning("ec-daemon: cudaHostUnregister of chunk %d failed: %s", chunk, exc)
        self._registered[chunk] = False
