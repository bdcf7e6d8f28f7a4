"""A channel to the daemon: target parsing, deadlines, fast reconnects.

gRPC channels reconnect by themselves; the options below make a restarted
daemon reachable again within ~100 ms instead of gRPC's default backoff of
up to two minutes. `calls` counts blocking unary calls per thread, so a
caller (or a benchmark) can prove a code path made none.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from ec_client.protocol import grpc_target, rpc

DEFAULT_DEADLINE_SECONDS = 5.0
_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


class Transport:
    def __init__(self, uri: str, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS) -> None:
        """Raises ValueError for a malformed `uri` (nothing is connected yet)."""
        self.uri = uri
        self.target = grpc_target(uri)
        self.deadline_seconds = deadline_seconds
        self.calls: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(self.target, options=_OPTIONS)
        self._stub = rpc.ECDaemonStub(self._channel)

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """A unary call with a deadline. Raises grpc.RpcError; `RETRYABLE`
        codes mean the daemon is down or busy, others are the caller's bug."""
        with self._lock:
            self.calls[threading.get_ident()] += 1
        return getattr(self._stub, method)(request, timeout=timeout or self.deadline_seconds)

    def stream(self, requests: Iterator[Any]) -> Any:
        """Open the session stream (no deadline: it lives as long as the session)."""
        return self._stub.Session(requests)

    def calls_from_this_thread(self) -> int:
        return self.calls[threading.get_ident()]

    def close(self) -> None:
        self._channel.close()
