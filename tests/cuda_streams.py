"""Streams and events of an infinitely slow GPU, for the model of CUDA's rules
(tests/cuda_model.py): work queued on a stream runs only when the host
waits for it (an event, a stream, or `drain`), and a stream that waits for an
event runs the other stream up to it first. A host wait that made the
compute stream's queued work run is counted (`compute_host_waits`): the
copy path must let the compute stream wait on events, never the host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class RuleBroken(RuntimeError):
    """The copy path broke one of CUDA's rules."""


class Stream:
    def __init__(self, model: StreamModel, device: int, name: str) -> None:
        self.model = model
        self.device = device
        self.name = name
        # ("work", fn, host range or None) or ("wait", Event, None)
        self.ops: list[tuple[str, Any, tuple[int, int] | None]] = []
        self.done = 0  # ops[:done] have run

    def __repr__(self) -> str:
        return f"<stream {self.name} on device {self.device}>"


class Event:
    def __init__(self, stream: Stream, position: int) -> None:
        self.stream = stream
        self.position = position


class StreamModel:
    """The streams and events part of the model (`ModelRuntime` is one)."""

    index: int
    compute: Stream
    _streams: list[Stream]
    _running: set[str] | None
    _lock: threading.RLock
    compute_host_waits: int
    compute_host_waits_by_thread: dict[str, int]
    host_waits: int
    allocator: Any

    def broken(self, rule: str) -> RuleBroken:
        raise NotImplementedError

    def _on_device(self) -> None:
        raise NotImplementedError

    def _check_stream(self, stream: Stream) -> None:
        if stream.device != self.index:
            raise self.broken(f"{stream} used for device {self.index}'s memory: a copy runs "
                              "on the current stream of its own device")

    # ------------------------------------------------------------ streams

    def launch(self, fn: Callable[[], None], stream: Stream | None = None,
               uses: tuple[torch.Tensor, ...] = ()) -> None:
        """Queue a kernel (the test's producer or consumer) on `stream` that
        reads or writes `uses`."""
        stream = stream or self.compute
        stream.ops.append(("work", fn, None))
        for tensor in uses:
            self.allocator.used(tensor, stream)

    def _run(self, stream: Stream, upto: int) -> None:
        while stream.done < upto:
            kind, what, _ = stream.ops[stream.done]
            stream.done += 1
            if self._running is not None:
                self._running.add(stream.name)
            if kind == "wait":
                self._run(what.stream, what.position)
            else:
                what()

    def _host_wait(self, stream: Stream, upto: int) -> None:
        with self._lock:
            self.host_waits += 1
            self._running = set()
            try:
                self._run(stream, upto)
                if self.compute.name in self._running:
                    self.compute_host_waits += 1
                    thread = threading.current_thread().name
                    self.compute_host_waits_by_thread[thread] = \
                        self.compute_host_waits_by_thread.get(thread, 0) + 1
            finally:
                self._running = None

    def drain(self) -> None:
        """Run everything queued (the test's own synchronisation)."""
        with self._lock:
            for stream in [self.compute, *self._streams]:
                self._run(stream, len(stream.ops))

    def record(self, stream: Stream) -> Event:
        self._on_device()
        self._check_stream(stream)
        return Event(stream, len(stream.ops))

    def wait(self, stream: Stream, event: Event) -> None:
        self._on_device()
        self._check_stream(stream)
        stream.ops.append(("wait", event, None))

    def synchronize(self, event: Event) -> None:
        self._on_device()
        self._host_wait(event.stream, event.position)

    def synchronize_stream(self, stream: Stream) -> None:
        self._on_device()
        self._host_wait(stream, len(stream.ops))

