"""A channel to the daemon: target parsing, deadlines, fast reconnects, auth.

gRPC channels reconnect by themselves; the options below make a restarted
daemon reachable again within ~100 ms instead of gRPC's default backoff of
up to two minutes. `calls` counts blocking unary calls per thread, so a
caller (or a benchmark) can prove a code path made none. For a TCP daemon,
the token (`token_file`, or $EC_DAEMON_TOKEN_FILE) goes on every call, and a
CA file (`tls_ca`, or $EC_DAEMON_TLS_CA) switches the channel to TLS.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from ec_protocol.protocol import grpc_target, rpc

DEFAULT_DEADLINE_SECONDS = 5.0
_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),  # a restarted daemon (warm) is worth it at once
    ("grpc.enable_retries", 0),
    # The daemon caps its stream messages at ~1 MiB; leave room regardless.
    ("grpc.max_receive_message_length", 64 << 20),
]


TOKEN_FILE_ENV = "EC_DAEMON_TOKEN_FILE"
TLS_CA_ENV = "EC_DAEMON_TLS_CA"


class Transport:
    def __init__(self, uri: str, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS, *,
                 token_file: str | None = None, tls_ca: str | None = None) -> None:
        """Raises ValueError for a malformed `uri` and OSError for unreadable
        token or CA files (nothing is connected yet)."""
        self.uri = uri
        self.target = grpc_target(uri)
        self.deadline_seconds = deadline_seconds
        self.calls: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()
        token_file = token_file or os.environ.get(TOKEN_FILE_ENV)
        tls_ca = tls_ca or os.environ.get(TLS_CA_ENV)
        self.metadata: tuple[tuple[str, str], ...] = ()
        if token_file:
            with open(token_file) as f:
                self.metadata = (("authorization", f"Bearer {f.read().strip()}"),)
        if tls_ca and not self.target.startswith("unix"):
            with open(tls_ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            self.channel = grpc.secure_channel(self.target, credentials, options=_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(self.target, options=_OPTIONS)
        self._stub = rpc.ECDaemonStub(self.channel)

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """A unary call with a deadline. Raises grpc.RpcError; `RETRYABLE`
        codes mean the daemon is down or busy, others are the caller's bug."""
        with self._lock:
            self.calls[threading.get_ident()] += 1
        return getattr(self._stub, method)(request, timeout=timeout or self.deadline_seconds,
                                           metadata=self.metadata)

    def stream(self, requests: Iterator[Any]) -> Any:
        """Open the session stream (no deadline: it lives as long as the session)."""
        return self._stub.Session(requests, metadata=self.metadata)

    def calls_from_this_thread(self) -> int:
        return self.calls[threading.get_ident()]

    def close(self) -> None:
        self.channel.close()
