"""The model of torch's caching allocator's per-stream rules, for the model of
CUDA (tests/cuda_model.py).

torch documents (`Tensor.record_stream`, "CUDA semantics"): the caching
allocator knows only the stream a tensor was allocated on, and hands a block
freed by that stream's work at once to that stream's next allocation (its
stream order makes that safe there). Two rules follow for memory used on a
stream other than its own:

- **Allocate on the stream that writes first.** A block allocated on stream A
  may still be used by work A queued before the allocation (the kernels of
  the tensor that had it). Work on another stream that touches it must be
  ordered after that work (wait for an event A recorded after the
  allocation), or it races the block's previous owner. So a load's output is
  allocated on the copy stream, not on the compute stream the copy does not
  wait for.
- **record_stream before it is freed.** A tensor used by another stream's
  queued work must be recorded on that stream (`used_on`) before it is freed,
  or its block goes to the next allocation of its own stream while that work
  still reads it: the next load would overwrite the forward pass's input.

The model checks both at the moment they would bite: the first when the use
is queued, the second when the tensor is freed (a finalizer: CPython frees at
the last reference) while a stream that never recorded it still has work on
it queued. A tensor the test placed on the device (`place`) belongs to no
stream: only the second rule applies to it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.cuda_model import ModelRuntime
    from tests.cuda_streams import Stream


@dataclass
class Block:
    tensor: weakref.ref[Any]
    device: int
    stream: Stream | None  # allocated on (None: placed by the test)
    fence: int  # how many ops that stream had queued at the allocation
    recorded: set[str] = field(default_factory=set)  # streams it was recorded on
    uses: dict[str, tuple[Stream, int]] = field(default_factory=dict)  # after the last use


class Allocator:
    def __init__(self, model: ModelRuntime) -> None:
        self.model = model
        self.blocks: dict[int, Block] = {}  # storage address -> block

    def place(self, tensor: Any, device: int, stream: Stream | None = None) -> None:
        """`tensor`'s memory is device memory of `device`, allocated on
        `stream` (None: placed, ready for every stream)."""
        address = tensor.untyped_storage().data_ptr()
        fence = len(stream.ops) if stream is not None else 0
        self.blocks[address] = Block(weakref.ref(tensor), device, stream, fence)
        weakref.finalize(tensor, self._freed, address, self.blocks[address])

    def block_of(self, tensor: Any) -> Block | None:
        return self.blocks.get(tensor.untyped_storage().data_ptr())

    def find(self, pointer: int) -> tuple[Any, int] | None:
        """(tensor, offset) of the live allocation holding device `pointer`."""
        for block in self.blocks.values():
            tensor = block.tensor()
            if tensor is None:
                continue
            start = tensor.data_ptr()
            if start <= pointer < start + tensor.numel() * tensor.element_size():
                return tensor, pointer - start
        return None

    def used(self, tensor: Any, stream: Stream) -> None:
        """Work touching `tensor` was just queued on `stream`."""
        block = self.block_of(tensor)
        if block is None:
            return
        own = block.stream
        if own is not None and own is not stream and own.done < block.fence and not any(
                kind == "wait" and what.stream is own and what.position >= block.fence
                for kind, what, _ in stream.ops):
            self.model.broken(
                f"memory allocated on {own} used on {stream} before {stream} waited for the "
                f"work {own} queued before the allocation: the caching allocator may have "
                "handed it over while that work still uses it (allocate on the stream that "
                "writes first)")
        block.uses[stream.name] = (stream, len(stream.ops))

    def record(self, tensor: Any, stream: Stream) -> None:
        """record_stream(tensor, stream)."""
        block = self.block_of(tensor)
        if block is not None:
            block.recorded.add(stream.name)

    def _freed(self, address: int, block: Block) -> None:
        if self.blocks.get(address) is block:
            del self.blocks[address]
        for name, (stream, position) in block.uses.items():
            if stream is not block.stream and stream.done < position \
                    and name not in block.recorded:
                self.model.broken(
                    f"a tensor allocated on {block.stream} was freed while {stream} still had "
                    "work on it queued, and it was never recorded there (record_stream): its "
                    f"memory goes to the next allocation on {block.stream} meanwhile")
