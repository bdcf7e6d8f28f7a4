"""The `torch` backend: CUDA copies through torch between GPU tensors and
the region, registered as pinned host memory.

The mapping is registered with cudaHostRegister once per mapping, in chunks
(a region can be tens of GiB), so copies are true async DMA. Every copy runs
on a side stream, one cudaMemcpyAsync per extent:

- a save first waits for the event recorded when the output was produced
  (`prepare_save`, on the producing stream), and `record_stream` tells the
  caching allocator the side stream still reads the tensor. A non-contiguous
  output is made contiguous on the side stream after that wait (before it,
  the copy would read bytes not yet written), so the region holds its bytes
  in row-major order;
- a load records its destination on the consumer's current stream and makes
  that stream wait for the copy's event. The destination must be contiguous.

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
        check_extents(mapping, extents, source.numel() * source.element_size())
        try:
            with torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                source.record_stream(self._stream)
                # Only now, on this stream: its copy kernel reads what the
                # producer wrote (a temporary allocated here needs no record).
                data = _flat_bytes(source.contiguous())
                for offset, length, done in spans(extents):
                    host[offset:offset + length].copy_(data[done:done + length],
                                                       non_blocking=True)
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
        flat = _flat_bytes(out)
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


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view; raises TypeError for
    a non-contiguous one (its storage order is not its row-major order)."""
    if not tensor.is_contiguous():
        raise TypeError(f"tensor is not contiguous (shape {tuple(tensor.shape)}, "
                        f"strides {tensor.stride()})")
    return tensor.view(-1).view(torch.uint8)
