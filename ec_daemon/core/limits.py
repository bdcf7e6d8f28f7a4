"""Every bound the daemon puts on what a peer may ask or make it hold.

Every key, size, shape, name and layout a client sends is bounded here, so
no request can make the daemon allocate memory it did not mean to (a huge
key, a negative size, a shape that does not match its bytes), and every
stream message, watcher and item in the making is capped here too. Raising
means nothing changed. The second tier's formats take their name bounds from
here, so a name the daemon accepts is one every host can publish and read.
(Bounds the client shares, such as a batch's length or a store namespace's,
are in ec_protocol.protocol; the flags' defaults are in config.)
"""

from __future__ import annotations

import re

from ec_daemon.errors import InvalidArgument
from ec_protocol.dtypes import entry_problem

# Entries: a key (vLLM's mm_hash) and its shape; its element type is one of
# ec_protocol.dtypes (the loaders' table). The second tier's value format
# carries these shapes whole (`remote.values`: no host publishes more dims
# than a save may have); vLLM's Mooncake values carry 2 dims only (tokens,
# hidden: `remote.mooncake.codec.storable`), so other entries stay local there.
MAX_KEY_BYTES = 512
MAX_DIMS = 8
# A layout's dtype (the model's, in its namespace).
DTYPE_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")

# Attach: who the client is, and the layout its namespace is made of.
MAX_ID_CHARS = 256  # engine id, client name, layout variant
MAX_MODEL_CHARS = 512
MAX_WORLD_SIZE = 4096
MAX_MODALITIES = 64
MAX_MODALITY_CHARS = 64
MAX_ROW_BYTES = 1 << 32
# A namespace (model|dtype|row_bytes|variant), in UTF-8 bytes: what the
# second tier's value and index formats carry.
MAX_NAMESPACE_BYTES = 4096

# Streams: one message carries at most this many events and bytes, well
# under gRPC's default 4 MiB receive limit whatever the events hold. The
# bytes also bound what a call whose client stopped reading holds: gRPC
# cannot end a call with a write in flight, so the message it is blocked
# writing stays until the client reads or disconnects (`serving.streams`).
MAX_SESSION_EVENTS_PER_MESSAGE = 4096
MAX_WATCH_EVENTS_PER_MESSAGE = 1024
MAX_MESSAGE_BYTES = 64 << 10

# Watch: events a watcher may have waiting past its snapshot (one more drops
# it), and Watch calls at once, in all and from one peer.
WATCH_BUFFER_EVENTS = 1 << 16
MAX_WATCHERS = 64
MAX_WATCHERS_PER_PEER = 16

# Saves waiting for pages at once (Allocate calls and stream allocations),
# of all tokenless clients together, and in all (per session:
# ec_daemon.plane.saves.WAITING_PER_SESSION); one more is refused at once.
MAX_WAITING_SAVES_TOKENLESS = 256
MAX_WAITING_SAVES = 1024

# Items being made at once (claims, promotions), those one engine instance's
# views take part in (claim or wait for), and all tokenless views' together;
# beyond, wants are answered ENCODE unrecorded.
MAX_ITEMS_MAKING = 1 << 16
MAX_ITEMS_PER_INSTANCE = 1 << 12
MAX_ITEMS_TOKENLESS = 1 << 14


def validate_mm_hash(mm_hash: str) -> None:
    if not mm_hash:
        raise InvalidArgument("mm_hash is empty")
    if len(mm_hash.encode()) > MAX_KEY_BYTES:
        raise InvalidArgument(f"mm_hash is longer than {MAX_KEY_BYTES} bytes")


def validate_save(mm_hash: str, nbytes: int, shape: tuple[int, ...], dtype: str) -> None:
    """Raise unless an entry described so may be saved: one a loader can read
    back (a dtype of `ec_protocol.dtypes`, bytes exactly its shape's elements
    times the element's size). Adoption refuses records that fail it too."""
    validate_mm_hash(mm_hash)
    if nbytes <= 0:
        raise InvalidArgument(f"nbytes must be positive, got {nbytes}")
    if not shape or len(shape) > MAX_DIMS or any(d <= 0 for d in shape):
        raise InvalidArgument(f"shape must have 1..{MAX_DIMS} positive dims, got {shape}")
    problem = entry_problem(nbytes, shape, dtype)
    if problem is not None:
        raise InvalidArgument(problem)


def validate_layout_namespace(namespace: str) -> str:
    """Raise unless a namespace made from a layout is short enough."""
    if len(namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise InvalidArgument(f"the layout makes a namespace longer than {MAX_NAMESPACE_BYTES} "
                              "bytes (model, modalities and variant together)")
    return namespace

