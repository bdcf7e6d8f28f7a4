"""The CUDA copy path, written once over a narrow seam to the CUDA runtime.

`CudaBackend` is the `torch` and the `cupy` backend: they differ only in the
`CudaRuntime` they hand it (`torch_backend.TorchRuntime`,
`cupy_backend.CupyRuntime`). The CPU test suite hands it a model of CUDA's
rules instead (tests/cuda_model.py), so every rule below is checked on every
CI run, not only when a GPU happens to be lent. The rules, as CUDA, torch and
CuPy document them:

- the current device is per host thread and starts at 0: every entry point
  makes the worker's device current first (`use_device`), else a rank above
  0 would create a context on GPU 0 and copy there;
- one cudaMemcpyAsync range lies inside one host registration or outside all
  of them: copies are split at the registration chunks (`pinning.pieces`),
  after joining extents that continue each other (one copy per contiguous
  run); the runs of registered memory go in one cudaMemcpyBatchAsync where
  the runtime has it (CUDA 12.8+), else one call each (`copy_batch`);
- host memory is never handed over as a device array (`cupy.asarray` of host
  memory copies it to the device, and the copy would land there), and a
  load's output lives on the worker's device (`device_bytes` refuses both);
- a save's copy waits, on the copy stream, for the event recorded after the
  output was produced, on the current stream of the library that made it
  (`producer_stream`); a non-contiguous output is made contiguous on the copy
  stream after that wait;
- a load's output is allocated on the copy stream (`empty`), so nothing the
  compute stream queued can still be using its memory when the copy writes
  it (torch's caching allocator hands out a block freed on a stream at once
  to that stream's next allocation), and it is recorded on the compute
  stream (`used_on`: record_stream) before the host returns it, so its
  memory is not handed to the next load while the forward pass still reads
  it; the compute stream waits for the copy's event and is never
  synchronised by the host. The host waits once for a step's loads
  (`load_all`), because the stamps must be read after the bytes landed;
- a refused registration leaves no CUDA error pending and falls back to
  unpinned copies (`pinning`).

Beyond CUDA's rules, the CPU never touches the region's pages: any worker
can truncate the file, and a mapped page past its end is a SIGBUS
(`ec_client.copy.mapping`). Registered chunks are only DMA'd by the GPU
(pinned pages never fault). A chunk not registered (yet, or ever: the
registration was refused) is not copied as pageable memory, which CUDA
would read or write with the CPU: it goes through a page-locked bounce
buffer of this process's own (`bounce`), filled with pread for a load and
drained with pwrite for a save. A
read the cut made short fails that load (`RegionCut`). Whether every page
the copies used was still the file's is the canary's to say, after the
copies landed (`RegionMapping.intact`, checked by the worker and the saver).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, Protocol

from ec_client.copy import Extents, Load, check_extents
from ec_client.copy.bounce import BOUNCE_BYTES, Bounce, Copy
from ec_client.copy.mapping import RegionMapping
from ec_client.copy.pinning import REGISTER_CHUNK_BYTES, Pinning, pieces


class CudaRuntime(Protocol):
    """Every CUDA call the copy path makes, and nothing else. Streams and
    events are the runtime's own objects; `host` is what `host_bytes` made;
    device buffers are what `device_bytes` made."""

    name: str
    device: str  # where outputs live, as torch names devices: "cuda:1"
    # Whether `empty` allocates for the stream it is given and `used_on`
    # records later uses (torch's caching allocator). Without it an output's
    # memory may still be read by queued compute work, so its load waits.
    orders_allocations: bool

    def use_device(self) -> None:
        """Make the worker's device current on the calling thread."""

    def host_bytes(self, mapping: RegionMapping) -> Any:
        """The mapping as host memory the runtime copies to and from (no copy)."""

    def register(self, host: Any, offset: int, length: int) -> None:
        """cudaHostRegister of host[offset:offset+length]. Raises
        `pinning.PinRefused`, leaving no CUDA error pending on this thread."""

    def unregister(self, host: Any, offset: int) -> None:
        """cudaHostUnregister of the registration starting at host[offset]."""

    def check_device(self, array: Any) -> None:
        """Raise TypeError unless `array` is device memory of the worker's device."""

    def device_bytes(self, array: Any) -> Any:
        """A contiguous device array's bytes, flat. Raises TypeError for host
        memory, another device's array, or a non-contiguous one."""

    def nbytes(self, array: Any) -> int:
        """The logical size of `array` in bytes (what its shape and dtype hold)."""

    def contiguous(self, array: Any, stream: Any) -> Any:
        """`array`, or a row-major copy of it made on `stream`."""

    def new_stream(self) -> Any:
        """A non-blocking stream on the worker's device."""

    def current_stream(self) -> Any:
        """The calling thread's current stream on the worker's device: the
        compute stream that consumes loads."""

    def producer_stream(self, array: Any) -> Any:
        """The calling thread's current stream of the library that made
        `array` (torch's for a tensor, CuPy's for a CuPy array): the one
        its producer wrote it on."""

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, length: int,
             stream: Any) -> None:
        """cudaMemcpyAsync of `length` bytes on `stream`; one side is host."""

    def copy_batch(self, copies: Sequence[Copy], stream: Any) -> bool:
        """Queue `copies` (independent; host sides registered) on `stream` in
        one call (cudaMemcpyBatchAsync) and return True, or queue nothing and
        return False (the runtime has no batch: the caller copies one by one)."""

    def record(self, stream: Any) -> Any:
        """A new event recorded on `stream`."""

    def wait(self, stream: Any, event: Any) -> None:
        """`stream` waits for `event` (on the device; the host goes on)."""

    def synchronize(self, event: Any) -> None:
        """The host waits for `event`."""

    def synchronize_stream(self, stream: Any) -> None:
        """The host waits for everything queued on `stream`."""

    def pinned_host(self, nbytes: int) -> tuple[Any, memoryview]:
        """Page-locked host memory of this process's own (cudaHostAlloc):
        the `host` its copies name, and its bytes for the CPU to pread into
        and pwrite from (writable, flat)."""

    def empty(self, shape: tuple[int, ...], dtype: str, stream: Any) -> Any:
        """An uninitialised array on the worker's device, allocated for work
        on `stream`."""

    def used_on(self, array: Any, stream: Any) -> None:
        """`array`'s memory is used by `stream` (torch's record_stream): the
        allocator does not reuse it before that work is done."""


class _Mapped:
    def __init__(self, mapping: RegionMapping, host: Any, pinning: Pinning) -> None:
        self.mapping = mapping
        self.host = host
        self.pinning = pinning




class CudaBackend:
    """A copy backend (`ec_client.copy.CopyBackend`) over a `CudaRuntime`.
    Thread-safe: saves run on the saver's thread, loads on the engine's,
    attach and detach on the session link's."""

    def __init__(self, runtime: CudaRuntime, *,
                 chunk_bytes: int = REGISTER_CHUNK_BYTES,
                 bounce_bytes: int = BOUNCE_BYTES) -> None:
        self.runtime = runtime
        self.bounce_bytes = bounce_bytes
        self.name = runtime.name
        self.device = runtime.device
        # Keys present from the start: the registrar thread only changes
        # values, so a reader summing the counter never sees it grow.
        self.stats: Counter[str] = Counter(pin_refused=0)
        self.chunk_bytes = chunk_bytes
        runtime.use_device()
        # Saves and loads on streams of their own: a load queued behind a
        # save would make the host wait for the save's producer (compute) too.
        self._save_stream = runtime.new_stream()
        self._load_stream = runtime.new_stream()
        self._lock = threading.Lock()
        self._mapped: dict[int, _Mapped] = {}  # id(mapping) ->
        # Outputs `empty` allocated for the copy stream, by id: nothing else
        # uses their memory yet, so their loads need not wait for the compute
        # stream. (Not a WeakSet: it would compare tensors with `==`.)
        self._fresh: dict[int, weakref.ref[Any]] = {}
        # The copy streams' bounce buffers (save, load), made on first need.
        self._bounces: dict[str, Bounce] = {}

    # ------------------------------------------------------------ mappings

    def attach(self, mapping: RegionMapping) -> None:
        """Start registering `mapping` in the background; copies meanwhile
        are unpinned (and correct)."""
        self.runtime.use_device()
        host = self.runtime.host_bytes(mapping)
        pinning = Pinning(self.runtime, host, mapping.size, self.stats,
                          chunk_bytes=self.chunk_bytes,
                          name=f"ec-pin-{mapping.generation:x}")
        with self._lock:
            self._mapped[id(mapping)] = _Mapped(mapping, host, pinning)
        pinning.start()

    def detach(self, mapping: RegionMapping) -> None:
        """Unregister `mapping` (no copy of it may be running: `Regions`
        detaches only unused mappings)."""
        with self._lock:
            mapped = self._mapped.pop(id(mapping), None)
        if mapped is None:
            return
        self.runtime.use_device()
        self.runtime.synchronize_stream(self._save_stream)
        self.runtime.synchronize_stream(self._load_stream)
        mapped.pinning.close()

    def pinned(self, mapping: RegionMapping) -> bool:
        """Whether all of `mapping` is registered (copies are true async DMA)."""
        with self._lock:
            mapped = self._mapped.get(id(mapping))
        return mapped is not None and mapped.pinning.pinned

    def pinning(self, mapping: RegionMapping) -> Pinning:
        """The registration state of an attached mapping."""
        return self._entry(mapping).pinning

    # ------------------------------------------------------------- copies

    def prepare_save(self, source: Any) -> Any:
        """On the producing thread: the event after which `source` is written."""
        self.runtime.use_device()
        self.runtime.check_device(source)
        return self.runtime.record(self.runtime.producer_stream(source))

    def save(self, source: Any, mapping: RegionMapping, extents: Extents,
             ready: Any = None) -> None:
        rt = self.runtime
        rt.use_device()
        rt.check_device(source)
        check_extents(mapping, extents, rt.nbytes(source))
        mapped = self._entry(mapping)
        stream = self._save_stream
        with mapped.pinning.using(extents):
            try:
                if ready is not None:
                    rt.wait(stream, ready)
                rt.used_on(source, stream)
                # Only now, on the copy stream: it reads what the producer wrote.
                # Held until the copies landed: freed earlier, its memory could
                # be handed to a load's output while they still read it.
                contiguous = rt.contiguous(source, stream)
                data = rt.device_bytes(contiguous)
                rest = self._queue([((mapped.host, offset, data, done, length), mapped.pinning,
                                     offset, mapped.mapping)
                                    for offset, length, done in pieces(extents, self.chunk_bytes)],
                                   stream)
                if rest:
                    self._bounce("save").save(rest, stream)
                landed = rt.record(stream)
            except BaseException:
                # What was queued lands before the caller may abort the save
                # (its pages are reused at once).
                rt.synchronize_stream(stream)
                raise
            rt.synchronize(landed)
        del contiguous

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A load's output on the worker's device, allocated on the copy
        stream (so its load waits for nothing on the compute stream)."""
        self.runtime.use_device()
        out = self.runtime.empty(tuple(shape), dtype, self._load_stream)
        if not self.runtime.orders_allocations:
            return out
        key = id(out)
        try:
            with self._lock:
                self._fresh[key] = weakref.ref(out, lambda _: self._fresh.pop(key, None))
        except TypeError:  # not weakly referenceable: treated as the caller's
            pass
        return out

    def load(self, mapping: RegionMapping, extents: Extents, out: Any) -> Any:
        """Copy `extents` into `out` (contiguous, on the worker's device) and
        return it once the bytes landed; the compute stream waits for the copy
        on the device."""
        error = self.load_all([(mapping, extents, out)])[0]
        if error is not None:
            raise error
        return out

    def load_all(self, loads: Sequence[Load]) -> list[Exception | None]:
        """A step's loads: every copy queued on the copy stream (registered
        runs in one batch), one host wait for all of them, the compute
        stream ordered after them on the device."""
        rt = self.runtime
        rt.use_device()
        errors: list[Exception | None] = [None] * len(loads)
        # load index, mapped, extents, out, bytes
        queued: list[tuple[int, _Mapped, Extents, Any, Any]] = []
        for i, (mapping, extents, out) in enumerate(loads):
            try:
                data = rt.device_bytes(out)
                check_extents(mapping, extents, rt.nbytes(out))
                queued.append((i, self._entry(mapping), extents, out, data))
            except (TypeError, ValueError) as exc:
                errors[i] = exc
        if not queued:
            return errors
        stream = self._load_stream
        consumer = rt.current_stream()
        with ExitStack() as held:
            # One hold per mapping, on all its extents at once: holding one
            # load's chunks while waiting for another's could wait for the
            # registrar, which waits for the first hold to end.
            by_mapping: dict[int, tuple[_Mapped, list[tuple[int, int]]]] = {}
            for _, mapped, extents, _, _ in queued:
                by_mapping.setdefault(id(mapped), (mapped, []))[1].extend(extents)
            for mapped, extents in by_mapping.values():
                held.enter_context(mapped.pinning.using(extents))
            try:
                if not all([self._take_fresh(out) for _, _, _, out, _ in queued]):
                    # The caller's memory may still be read by queued compute work.
                    rt.wait(stream, rt.record(consumer))
                rest = self._queue([((data, done, mapped.host, offset, length), mapped.pinning,
                                     offset, (i, mapped.mapping))
                                    for i, mapped, extents, _, data in queued
                                    for offset, length, done in pieces(extents, self.chunk_bytes)],
                                   stream)
                if rest:
                    for i, error in self._bounce("load").load(rest, stream).items():
                        errors[i] = error
                landed = rt.record(stream)
            except BaseException:
                # Queued copies land before their chunks may be unregistered.
                rt.synchronize_stream(stream)
                raise
            for _, _, _, out, _ in queued:
                rt.used_on(out, consumer)
            rt.wait(consumer, landed)
            rt.synchronize(landed)  # the stamps are read after the bytes landed
        return errors

    def loaded_bytes(self, out: Any) -> None:
        """Outputs live on the device: nothing of them on the host."""
        return None

    def _queue(self, copies: Sequence[tuple[Copy, Pinning, int, Any]],
               stream: Any) -> list[tuple[Copy, Any]]:
        """Queue the copies (each with the pinning of its host side, the
        offset there, and a tag) of registered chunks on `stream`, in one
        batch where the runtime can, else one call each. Returns the others
        (chunks not registered), with their tags, for the bounce buffer."""
        pinned = [copy for copy, pinning, offset, _ in copies if pinning.registered(offset)]
        rest = [(copy, tag) for copy, pinning, offset, tag in copies
                if not pinning.registered(offset)]
        if len(pinned) < 2 or not self.runtime.copy_batch(pinned, stream):
            for copy in pinned:
                self.runtime.copy(*copy, stream)
        return rest

    def _bounce(self, which: str) -> Bounce:
        """The bounce buffer of the `which` ("save", "load") copy stream."""
        with self._lock:
            bounce = self._bounces.get(which)
            if bounce is None:
                bounce = self._bounces[which] = Bounce(self.runtime, self.bounce_bytes)
            return bounce

    def _take_fresh(self, out: Any) -> bool:
        """Whether `out` came from `empty` and was not loaded into since."""
        with self._lock:
            ref = self._fresh.pop(id(out), None)
        return ref is not None and ref() is out

    def _entry(self, mapping: RegionMapping) -> _Mapped:
        with self._lock:
            mapped = self._mapped.get(id(mapping))
        if mapped is None:
            raise ValueError(f"region generation {mapping.generation:x} is not attached to "
                             f"the {self.name} backend")
        return mapped
