"""vLLM's Mooncake key scheme and value format (`mooncake_store_embedding`,
key scheme v3), which ec-daemon keeps, so engines behind vLLM's own
connector and behind ec-daemon share one set of entries::

    <store namespace>@id:<mm_hash>          the value: vLLM's 24-byte header
                                            (<IIQQ: magic, dtype code, tokens,
                                            hidden) then the payload
    <store namespace>@id:<mm_hash>@ecd1     beside it, ec-daemon's own header
                                            (values.py: the key, shape, dtype,
                                            size and an xxh3 checksum of the
                                            header and payload), no payload
    <store namespace>@id:<mm_hash>@ecd1-claim
                                            a claim: "<token> <expiry ms>"

vLLM's format carries 2-D float32, float16 and bfloat16 tensors: every
encoder output vLLM makes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ec_daemon.remote.values import BadValue
from ec_protocol.dtypes import ELEMENT_BYTES

KEY_VERSION = "v3"  # vLLM's EMBEDDING_CACHE_KEY_VERSION: the value format below
MAGIC = 0x4D4F4F4E
HEADER = struct.Struct("<IIQQ")  # magic, dtype code, tokens, hidden
DTYPE_CODES = {"float32": 0, "float16": 11, "bfloat16": 12}
CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}
ITEM_BYTES = {name: ELEMENT_BYTES[name] for name in DTYPE_CODES}
SIDECAR = "@ecd1"
CLAIM = "@ecd1-claim"


def storable(shape: Sequence[int], dtype: str) -> bool:
    """Whether vLLM's value format can carry an entry: a 2-D tensor of
    float32, float16 or bfloat16 (every encoder output vLLM makes)."""
    return len(shape) == 2 and dtype in DTYPE_CODES


def value_key(store_namespace: str, mm_hash: str) -> str:
    return f"{store_namespace}@id:{mm_hash}"


def vllm_header(shape: Sequence[int], dtype: str) -> bytes:
    return HEADER.pack(MAGIC, DTYPE_CODES[dtype], int(shape[0]), int(shape[1]))


def claimable(namespace: str) -> bool:
    """Whether entries of a daemon namespace ("model|dtype|widths|variant")
    can be published here: its dtype is one vLLM's format carries."""
    parts = namespace.split("|")
    return len(parts) > 1 and parts[1] in DTYPE_CODES


def accepts(mm_hash: str) -> bool:
    """Whether an item can be keyed here: a name with "@" could be another
    item's checksum or claim ("<hash>@ecd1")."""
    return "@" not in mm_hash


def parse_header(raw: bytes) -> tuple[tuple[int, int], str]:
    """The shape and dtype vLLM's 24-byte header says; raises BadValue for
    one that is not of its format."""
    magic, code, tokens, hidden = HEADER.unpack(raw)
    if magic != MAGIC:
        raise BadValue(f"not vLLM's embedding format (magic {magic:#x})")
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise BadValue(f"unknown dtype code {code} in vLLM's header")
    if not 0 < tokens < 1 << 32 or not 0 < hidden < 1 << 32:
        raise BadValue(f"implausible shape ({tokens}, {hidden}) in vLLM's header")
    return (tokens, hidden), dtype
