"""The protocol's shared constants and the generated stubs, in one place.

Both packages import the generated module through here. PROTOCOL_VERSION is
checked at Attach; RETRYABLE says which statuses a client may retry after
reconnecting (the daemon restarted or is briefly overloaded) rather than
treat as its own mistake.

Saves on the session stream (ClientMessage.allocations and reports) did not
change the version: a daemon that takes them says so at Attach
(AttachReply.stream_saves), and a client sends them only then, so a new
client saves by Allocate and Report calls against a daemon of protocol 3
that would drop them unread (proto3 ignores unknown fields), and an older
client's calls still work against a new daemon. A bump would instead have
cut both off from each other at Attach for a change that breaks neither.

So the unary save path (Allocate and Report) stays, on both sides, for
exactly these, and goes with them:
- the daemon's handlers: clients of protocol 3 released before stream saves
  (a host's daemon upgraded before its engines keeps taking their saves), and
  the tools that save without a session stream (the fuzz suite's calls,
  the integration tests' raw clients); they go when protocol 3 is no longer
  accepted at Attach;
- the client's: a newer client against a daemon of protocol 3 that does not
  take stream saves (engines upgraded before their host's daemon: a rolling
  upgrade), its only use in production. `WorkerDelegate(stream_saves=False)`
  forces it so the tests keep that fallback working and the save benchmark
  has its baseline; it goes with the next protocol version, whose daemons all
  take saves on the stream.
Producers' claims (wants and releases from a producer's scheduler session)
came the same way: AttachReply.producer_claims.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final, Literal

import grpc

try:
    from ec_protocol._proto.ec_daemon.v1 import ec_daemon_pb2 as pb
    from ec_protocol._proto.ec_daemon.v1 import ec_daemon_pb2_grpc as rpc
except ImportError as exc:  # a source checkout that was never built
    raise ImportError(
        "ec_client's protocol stubs are missing: run `make proto` (or reinstall the package)"
    ) from exc

PROTOCOL_VERSION = 3
# The most items of one kind a request or stream message may carry.
MAX_BATCH = 4096
SOCKET_ENV = "EC_DAEMON_SOCKET"

# AttachRequest.store_namespace: the engine's namespace in a store shared
# with vLLM's own connector, whose keys are "<store_namespace>@id:<mm_hash>".
MAX_STORE_NAMESPACE_CHARS = 1024
STORE_KEY_MARKER = "@id:"

# SchedulerComponent.engine_token: a secret of one engine instance (16
# random bytes, hex), shared by its scheduler and its workers only.
ENGINE_TOKEN_BYTES = 16
ENGINE_TOKEN_RE = re.compile(rf"^[0-9a-f]{{{2 * ENGINE_TOKEN_BYTES}}}$")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

# What an engine does with the cache (AttachRequest.role), by the one name
# each role has in code, logs and stats; a role given as plain text works as
# well (the values are those strings).
Role = Literal["producer", "consumer", "both"]
PRODUCER: Final = "producer"
CONSUMER: Final = "consumer"
BOTH: Final = "both"
SAVING_ROLES: frozenset[Role] = frozenset({PRODUCER, BOTH})
LOADING_ROLES: frozenset[Role] = frozenset({CONSUMER, BOTH})
ROLE_NAMES: dict[pb.Role, Role] = {pb.ROLE_PRODUCER: PRODUCER, pb.ROLE_CONSUMER: CONSUMER,
                                   pb.ROLE_BOTH: BOTH}
ROLES: dict[str, pb.Role] = {name: value for value, name in ROLE_NAMES.items()}

# Which side of an engine a session is (AttachRequest's `component`).
Component = Literal["scheduler", "worker"]
SCHEDULER: Final = "scheduler"
WORKER: Final = "worker"

__all__ = [
    "BOTH",
    "CONSUMER",
    "ENGINE_TOKEN_BYTES",
    "ENGINE_TOKEN_RE",
    "LOADING_ROLES",
    "MAX_BATCH",
    "MAX_STORE_NAMESPACE_CHARS",
    "PRODUCER",
    "PROTOCOL_VERSION",
    "RETRYABLE",
    "ROLES",
    "ROLE_NAMES",
    "SAVING_ROLES",
    "SCHEDULER",
    "SOCKET_ENV",
    "STORE_KEY_MARKER",
    "WORKER",
    "Component",
    "Layout",
    "Role",
    "default_socket_uri",
    "engine_token_problem",
    "grpc_target",
    "pb",
    "rpc",
    "store_namespace_problem",
]


def engine_token_problem(token: str) -> str | None:
    """Why the daemon would refuse `token` as an engine token (None: fine; an
    empty one is no token)."""
    if token and not ENGINE_TOKEN_RE.match(token):
        return f"engine_token must be {2 * ENGINE_TOKEN_BYTES} lowercase hex digits"
    return None


def default_socket_uri() -> str:
    """`$EC_DAEMON_SOCKET`, else a socket in the user's runtime directory
    ($XDG_RUNTIME_DIR/ec-daemon/ec.sock, or /tmp/ec-daemon-$UID/ec.sock)."""
    if os.environ.get(SOCKET_ENV):
        return os.environ[SOCKET_ENV]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "ec-daemon" if runtime else Path(f"/tmp/ec-daemon-{os.getuid()}")
    return f"unix://{folder / 'ec.sock'}"


def unix_path(uri: str) -> str | None:
    """The filesystem path of a unix:// URI, None for TCP addresses."""
    if uri.startswith("unix://"):
        return uri[len("unix://"):]
    if uri.startswith("unix:"):
        return uri[len("unix:"):]
    return None


def grpc_target(uri: str) -> str:
    """What grpc.*_channel and add_*_port take for `uri`.

    Accepts unix:///abs/path, unix:relative, tcp://host:port and host:port.
    Raises ValueError for anything else.
    """
    path = unix_path(uri)
    if path is not None:
        if not path:
            raise ValueError(f"invalid socket {uri!r}: empty path")
        return f"unix:{path}" if not path.startswith("/") else f"unix://{path}"
    address = uri[len("tcp://"):] if uri.startswith("tcp://") else uri
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid socket {uri!r}: use unix:///path/to.sock or host:port")
    return address


def store_namespace_problem(value: str) -> str | None:
    """Why the daemon refuses `value` as a store namespace, or None. Printable
    ASCII without whitespace (what vLLM's namespaces are made of: letters,
    digits, `@:/.-_#=`...), at most MAX_STORE_NAMESPACE_CHARS, and never
    STORE_KEY_MARKER: namespace "a@id:b"'s key of item "c" would be namespace
    "a"'s key of item "b@id:c"."""
    if len(value) > MAX_STORE_NAMESPACE_CHARS:
        return f"store_namespace is longer than {MAX_STORE_NAMESPACE_CHARS} characters"
    for at, char in enumerate(value):
        if not "!" <= char <= "~":
            return (f"store_namespace must be printable ASCII without whitespace, "
                    f"got {char!a} at {at}")
    if STORE_KEY_MARKER in value:
        return (f"store_namespace must not contain {STORE_KEY_MARKER!r} (its keys would be "
                f"those of another namespace)")
    return None


class Layout:
    """Layout fingerprint of an engine: model, dtype, row width per modality
    (bytes) and anything else that changes bytes. Equal layouts share a
    namespace in the daemon."""

    __slots__ = ("dtype", "model", "row_bytes", "store_namespace", "variant")

    def __init__(self, model: str, dtype: str, row_bytes: dict[str, int],
                 variant: str = "", store_namespace: str = "") -> None:
        self.model = model
        self.dtype = dtype
        self.row_bytes = dict(row_bytes)
        self.variant = variant
        # Not part of the fingerprint: the engine's name for its namespace in a
        # store shared with vLLM's own connector (AttachRequest.store_namespace).
        self.store_namespace = store_namespace

    def to_pb(self) -> pb.Layout:
        return pb.Layout(model=self.model, dtype=self.dtype, row_bytes=self.row_bytes,
                         variant=self.variant)

    def __repr__(self) -> str:
        return (f"Layout(model={self.model!r}, dtype={self.dtype!r}, "
                f"row_bytes={self.row_bytes!r}, variant={self.variant!r})")
