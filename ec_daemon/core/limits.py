"""Every bound the daemon keeps, and every default of its settings, declared
once.

What a peer may ask or make the daemon hold: every key, size, shape, name
and layout a client sends is bounded here, so no request can make the daemon
allocate memory it did not mean to (a huge key, a negative size, a shape that
does not match its bytes), and every stream message, watcher and item in the
making is capped here too; raising means nothing changed. How long the daemon
waits, how much it does at a time and how many threads it runs are bounds
too, each with the reason it is what it is. The defaults of the settings
(`serving.config`'s table, which takes them from here) sit in their own
section, and so do the second tier's bounds and the durable files'.

Every layer reads this module, the durable files below the core too: it
imports nothing of the daemon but its errors. A daemon module that declares a
number of its own fails a test (tests/unit/test_import_graph.py; the few
numbers that are no bound, a format's version or a kernel's constant, are
listed there, each with why). (Bounds the client shares, such as a batch's
length or a store namespace's, are in ec_protocol.protocol.)
"""

from __future__ import annotations

import re

from ec_daemon.errors import InvalidArgument
from ec_protocol.dtypes import entry_problem

# ------------------------------------------------------------ settings' defaults
# (serving.config's table takes each from here, and so does every constructor
# that takes one; docs/running.md's flag table is generated from that table)

DEFAULT_CPU_BYTES = 1 << 30
DEFAULT_PAGE_BYTES = 64 << 10
DEFAULT_SOCKET_MODE = 0o600  # owner-only: a group is granted by flag
DEFAULT_LEASE_SECONDS = 10.0
# --ack-wait-seconds by default: this many leases (an engine's step keeps its
# loads' pages this long and a lease more).
ACK_WAIT_LEASES = 3
DEFAULT_ALLOC_WAIT_SECONDS = 2.0
# A writer that vanished may still be copying (a frozen process resumed, a
# DMA in flight): its pages are reused only after this, by default.
DEFAULT_QUARANTINE_SECONDS = 300.0
# --session-pending-bytes by default: this part of --cpu-bytes (an engine
# instance's saver has at most two batches in flight, each within its save
# queue), at most DEFAULT_SESSION_PENDING_BYTES; --total-pending-bytes: this
# part of --cpu-bytes.
SESSION_PENDING_SHARE = 4
DEFAULT_SESSION_PENDING_BYTES = 512 << 20
TOTAL_PENDING_SHARE = 2
DEFAULT_SESSION_PENDING_ENTRIES = 128
DEFAULT_MAX_SESSIONS = 1024
DEFAULT_MAX_SESSIONS_PER_ENGINE = 64
DEFAULT_MAX_TOKENLESS_SESSIONS = 64
DEFAULT_MAX_WATCHERS = 64
DEFAULT_MAX_WATCHERS_PER_PEER = 16
DEFAULT_METRICS_PORT = 0  # off
DEFAULT_REMOTE_TTL_SECONDS = 3600.0
DEFAULT_REMOTE_CLAIM_SECONDS = 30.0
# A claimant says it encodes the item in the step it was told to (vLLM's
# steps take milliseconds to a second): a claim it said nothing of in this
# long goes to a waiting engine.
CLAIM_START_SECONDS = 2.0
DEFAULT_REMOTE_QUEUE_BYTES = 256 << 20
DEFAULT_REMOTE_INDEX_BYTES = 64 << 20
DEFAULT_REMOTE_PROMOTION_BYTES = 256 << 20

# ------------------------------------------------------------ entries and attach

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

# ------------------------------------------------------------ sessions and streams

# How long after Attach a session's stream may open, at least.
OPEN_GRACE_SECONDS = 60.0
# A session whose stream has not opened this long after Attach may be ended
# to make room for an engine presenting its token (`sessions.victim_for`).
PREEMPTIBLE_SECONDS = 10.0
# The last 1/RUNNING_SHARE of --max-sessions, and of --max-watchers, is kept
# for engine instances that run (a live session with its stream open).
RUNNING_SHARE = 4
# All tokenless clients together hold at most 1/TOKENLESS_SHARE of the total
# pending bytes (`quotas`).
TOKENLESS_SHARE = 4

# Streams: one message carries at most this many events and bytes, well
# under gRPC's default 4 MiB receive limit whatever the events hold. The
# bytes also bound what a call whose client stopped reading holds: gRPC
# cannot end a call with a write in flight, so the message it is blocked
# writing stays until the client reads or disconnects (`serving.streams`).
MAX_SESSION_EVENTS_PER_MESSAGE = 4096
MAX_WATCH_EVENTS_PER_MESSAGE = 1024
MAX_MESSAGE_BYTES = 64 << 10
# Events a session's outbox may hold beyond its snapshot before the session
# is detached as a reader that cannot keep up (it re-attaches afresh).
OUTBOX_MIN_EVENTS = 1 << 16
# A session stream's first message is waited for this long at most.
OPEN_TIMEOUT_SECONDS = 10.0
# Calls blocked writing are looked at this often (`serving.streams`).
STREAM_UPKEEP_SECONDS = 1.0

# Watch: events a watcher may have waiting past its snapshot (one more drops
# it).
WATCH_BUFFER_EVENTS = 1 << 16

# ------------------------------------------------------------ saves and the cache

# Saves waiting for pages at once (Allocate calls and stream allocations),
# of one session (a client saves SAVE_BATCH at a time: past it one is refused
# at once, so a misbehaving client cannot make every page coming back wake
# thousands), of all tokenless clients together, and in all.
WAITING_PER_SESSION = 64
MAX_WAITING_SAVES_TOKENLESS = 256
MAX_WAITING_SAVES = 1024
# A save waits this part of --alloc-wait-seconds for hidden pages to come
# back before it evicts more ready entries instead.
HIDDEN_PATIENCE_FRACTION = 0.1
# Evict at least 1/64 of the cache at a time: each eviction round costs one
# event message to every view and one acknowledgement back from each, so
# batching the victims divides that traffic (measured: benchmarks/concurrency).
EVICTION_BATCH_DIVISOR = 64

# Items being made at once (claims, promotions), those one engine instance's
# views take part in (claim or wait for), and all tokenless views' together;
# beyond, wants are answered ENCODE unrecorded.
MAX_ITEMS_MAKING = 1 << 16
MAX_ITEMS_PER_INSTANCE = 1 << 12
MAX_ITEMS_TOKENLESS = 1 << 14
# A claimant's save normally lands within an encoder step and a copy; past
# this its claim goes to a waiting engine (views give up sooner on their own).
CLAIM_SECONDS = 30.0
# A promotion is a store read and a copy; past this its waiters encode.
PROMOTE_SECONDS = 10.0
# A want whose resolution runs longer is answered PROMOTING (wait) meanwhile:
# well within the view's bound on an answer (ec_client.scheduler_side.wants
# ANSWER_SECONDS).
ANSWER_SECONDS = 0.25
# Promotions running at once (each a store read and a copy into the region).
PROMOTION_THREADS = 4

# Entries a loader reported as changed (`plane.verify`): checked at most this
# many at once; one found whole is not checked again for WHOLE_SECONDS, and
# at most WHOLE_REMEMBERED are remembered so.
MAX_MISMATCH_CHECKS = 4
WHOLE_SECONDS = 60.0
WHOLE_REMEMBERED = 4096

# Stats lists this many sessions one by one (each up to ~1.5 KiB on the wire:
# 128 stay far below gRPC's 4 MiB), and this many namespaces (each up to ~4.1
# KiB), the ones holding the most bytes; the rest are counted.
LISTED_SESSIONS = 128
LISTED_NAMESPACES = 64
# A Prometheus scrape waits this long for the loop's snapshot.
SNAPSHOT_TIMEOUT_SECONDS = 5.0

# ------------------------------------------------------------ the daemon's files

# Ids are reserved this many at a time (one 8-byte write per block).
ID_BLOCK = 1 << 16
# No daemon reserves ids beyond this (a million saves a second for 146,000
# years): a larger reservation in an index is corruption, and ids continued
# from any reservation up to it never reach 2^64 (`adoption`).
MAX_IDS_RESERVED = 1 << 62
# Compact the journal when it is this many times the live records, and past
# COMPACT_MIN_BYTES.
COMPACT_RATIO = 2
COMPACT_MIN_BYTES = 1 << 20
# A journal record longer than this is corrupt (the longest real one is far shorter).
MAX_RECORD_BYTES = 1 << 24
# A half-created region untouched this long (pre-faulting keeps touching it)
# belongs to a daemon that died starting.
CREATING_STALE_SECONDS = 30.0
# Names tried for a new region before giving up (each taken one is skipped).
PUBLISH_ATTEMPTS = 16
# Pre-faulting allocates this much at a time, and says how far it got for
# regions at least PROGRESS_MIN_BYTES large.
PREFAULT_CHUNK_BYTES = 256 << 20
PROGRESS_MIN_BYTES = 1 << 30
# How long a start waits for tmpfs space that a previous daemon's clients
# still hold (they unmap a retired region within a few seconds).
SHM_WAIT_SECONDS = 20.0
# SIGTERM: calls in flight may finish this long.
SHUTDOWN_GRACE_SECONDS = 5.0

# ------------------------------------------------------------ the second tier

# One store call waits this long at most.
STORE_TIMEOUT_S = 2.0
# A failure domain's breaker opens after this many failures in a row, and
# lets a probe through after a backoff doubling from BREAKER_BASE_S to
# BREAKER_MAX_S; a probe that never reports is given up after BREAKER_PROBE_S.
BREAKER_THRESHOLD = 3
BREAKER_BASE_S = 0.5
BREAKER_MAX_S = 30.0
BREAKER_PROBE_S = 60.0
# A breaker unused this long (a node that left) stops counting in the stats.
RECENT_S = 120.0
# A value refused is logged at most once per key this often.
BAD_VALUE_LOG_S = 60.0
# Niceness of the publisher thread (write-behind, below the daemon's loop).
PUBLISHER_NICE = 10
# The resolver: a key found absent (and not claimable) is not looked up again
# this soon, and at most NEGATIVE_KEYS are remembered so; keys another host
# claimed are asked about again this often; a round resolves at most
# RESOLVE_BATCH keys (one batched lookup), on each of RESOLVER_THREADS.
NEGATIVE_S = 1.0
NEGATIVE_KEYS = 65536
POLL_S = 0.05
RESOLVE_BATCH = 64
RESOLVER_THREADS = 4
# What a round cannot settle in its batched calls is settled one key at a time
# on this many threads: a key whose value or claim sits on a host that died
# takes about 1 s per read to fail (until the store forgets that host).
RESOLVE_WORKERS = 16
# A wanted key is settled within this (FAILED when not: the engine encodes).
# Its engine is told to wait meanwhile (ANSWER_SECONDS) and waits within its
# own bound (max_defer_seconds, 10 s): long enough for a busy host's reads
# and a round queued behind another, while a read from a host that died
# (about 1 s to fail) still ends in an encode within it.
RESOLVE_KEY_S = 2.0
# A value's dtype name in ec-daemon's value format.
MAX_DTYPE_BYTES = 64

# Redis: what one read of the index waits and returns at most; the
# announcements are swept and the store's clock read this often, and read
# again this late after a read that found some (each read costs 0.3 ms of
# CPU: let them gather); entries forgotten (not promotable) remembered
# against a re-read of their announcement, at most this many.
INDEX_BLOCK_S = 0.5
INDEX_BATCH = 1000
INDEX_UPKEEP_S = 5.0
FOLLOW_PAUSE_S = 0.02
MAX_FORGOTTEN = 4096
# Redis values: one round trip reads up to FIRST_READ_BYTES (1 MiB and a
# header), larger values in pipelined GETRANGEs of CHUNK_BYTES; the sockets
# read SOCKET_READ_BYTES at a time (redis-py's 64 KiB default is 8% slower); a
# put joins parts smaller than SMALL_PART_BYTES into one send; a reply read
# into a buffer gets REPLY_SLACK_BYTES of room for its framing or an error
# line. Values and announcements larger than MAX_VALUE_BYTES are refused, and
# a claim's token is 1 to MAX_TOKEN_CHARS ASCII characters.
FIRST_READ_BYTES = (1 << 20) + (64 << 10)
CHUNK_BYTES = 1 << 20
SOCKET_READ_BYTES = 256 << 10
SMALL_PART_BYTES = 16 << 10
REPLY_SLACK_BYTES = 4096
MAX_VALUE_BYTES = 1 << 40
MAX_TOKEN_CHARS = 128

# Mooncake: setup is tried again this often while the master or the metadata
# server does not answer; a key found is taken as present FOUND_S; a claim
# past its expiry by CLAIM_SLACK_MS (by our clock) is taken over, one put but
# read as nothing CLAIM_READ_S is its host's that is gone (or a failed put),
# and a listed object whose read fails after UNREACHABLE_READ_S sits on a
# host that is gone.
SETUP_RETRY_S = 2.0
FOUND_S = 30.0
CLAIM_SLACK_MS = 2000
CLAIM_READ_S = 1.0
UNREACHABLE_READ_S = 0.5
# Mooncake's transfer buffers: the smallest; kept for the next call, at most
# POOL_BYTES in all (each counted against --remote-promotion-bytes); a value
# larger than MAX_BOUNCE_BYTES (header and payload) is not moved; a
# promotion's bytes are verified and written COPY_CHUNK at a time.
SMALL_BUFFER_BYTES = 64 << 10
POOL_BYTES = 128 << 20
MAX_BOUNCE_BYTES = 1 << 30
COPY_CHUNK = 1 << 20


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

