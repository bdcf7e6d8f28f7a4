"""The `torch` backend: CUDA copies through torch between GPU tensors and
the region, registered as pinned host memory.

The mapping is registered with cudaHostRegister once per mapping, in chunks
(a region can be tens of GiB), so copies are true async DMA. Every copy runs
on a side stream, one cudaMemcpyAsync per extent:

- a save first waits for the event recorded when the output was produced
  (`prepare_save`, on the producing stream), and `record_stream` tells the
  caching allocator the side stream still reads the tensor;
- a load records its destination on the consumer's current stream and makes
  that stream wait for the copy's event.

Both return only after their event completed, so a save or load is reported
to the daemon only once its bytes have landed.
"""

from __future__ import annotations

from typing import Any

import torch

from ec_client.copy import Extents, check_extents, spans
from ec_client.mapping import RegionMapping

REGISTER_CHUNK_BYTES = 1 << 30
_HOST_REGISTER_DEFAULT = 0


class Backend:
    name = "torch"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the torch copy backend needs CUDA; use the cpu backend")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self.device)
        self._host: dict[int, torch.Tensor] = {}  # id(mapping) -> uint8 view of it
        self._registered: dict[int, list[tuple[int, int]]] = {}

    def attach(self, mapping: RegionMapping) -> None:
        host = torch.frombuffer(mapping.view, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        chunks: list[tuple[int, int]] = []
        base = host.data_ptr()
        for start in range(0, mapping.size, REGISTER_CHUNK_BYTES):
            length = min(REGISTER_CHUNK_BYTES, mapping.size - start)
            err = cudart.cudaHostRegister(base + start, length, _HOST_REGISTER_DEFAULT)
            if int(err) != 0:
                self._unregister(chunks)
                raise RuntimeError(f"cudaHostRegister failed ({err}) at offset {start}")
            chunks.append((base + start, length))
        self._host[id(mapping)] = host
        self._registered[id(mapping)] = chunks

    def detach(self, mapping: RegionMapping) -> None:
        torch.cuda.synchronize(self.device)
        self._unregister(self._registered.pop(id(mapping), []))
        self._host.pop(id(mapping), None)

    def prepare_save(self, source: Any) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(source.device))
        return event

    def save(self, source: Any, mapping: RegionMapping, extents: Extents,
             ready: Any = None) -> None:
        host = self._host[id(mapping)]
        data = source.contiguous().view(-1).view(torch.uint8)
        check_extents(mapping, extents, data.numel())
        try:
            with torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                for offset, length, done in spans(extents):
                    host[offset:offset + length].copy_(data[done:done + length],
                                                       non_blocking=True)
                data.record_stream(self._stream)
                landed = torch.cuda.Event()
                landed.record(self._stream)
        except BaseException:
            # Copies already queued must land before the caller aborts the save
            # (its pages are then reused at once).
            self._stream.synchronize()
            raise
        landed.synchronize()

    def load(self, mapping: RegionMapping, extents: Extents, out: Any) -> Any:
        host = self._host[id(mapping)]
        flat = out.view(-1).view(torch.uint8)
        check_extents(mapping, extents, flat.numel())
        consumer = torch.cuda.current_stream(out.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(consumer)  # `out` was allocated there
            for offset, length, done in spans(extents):
                flat[done:done + length].copy_(host[offset:offset + length], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self._stream)
        out.record_stream(self._stream)
        consumer.wait_event(landed)
        landed.synchronize()
        return out

    def _unregister(self, chunks: list[tuple[int, int]]) -> None:
        cudart = torch.cuda.cudart()
        for pointer, _ in chunks:
            cudart.cudaHostUnregister(pointer)

