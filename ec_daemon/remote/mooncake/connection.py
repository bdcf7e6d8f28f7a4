"""The life of a Mooncake client: connected in the background, and told
apart across reconnections (`generation`: what was registered with an older
client is registered again).

`setup` blocks for up to 90 s when the master is unreachable, and holds the
interpreter's lock while it does (every thread of the daemon stops), so the
client connects on its own thread, calls `setup` only once the master and the
metadata server accept a connection, and keeps trying; until it is connected,
every call raises RemoteError (misses, dropped publications). Calls to a
master that does not answer end after MC_RPC_TIMEOUT_MS (set from the store's
timeout, unless set), not Mooncake's 30 s.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from ec_daemon.core.limits import SETUP_RETRY_S
from ec_daemon.remote.common import RemoteError
from ec_daemon.remote.mooncake.url import MooncakeSpec, servers

log = logging.getLogger("ec_daemon.remote")

# Mooncake's error codes (types.h), as the binding returns them.
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
INVALID_PARAMS = -600
ERROR_NAMES = {
    -1: "failed", -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS",
    -702: "INVALID_REPLICA", -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
    -1700: "TENANT_QUOTA_EXCEEDED",
}


def error(code: Any) -> str:
    """A binding's return code as a log line names it."""
    return f"{code} ({ERROR_NAMES.get(code, 'unknown')})" if isinstance(code, int) else repr(code)


def first(result: Any) -> Any:
    """The first code of a batched call's nested lists."""
    while isinstance(result, list) and result:
        result = result[0]
    return result


class Connection:
    """One MooncakeDistributedStore client, connected on a thread of its own.
    Thread-safe."""

    def __init__(self, spec: MooncakeSpec, *, timeout_s: float,
                 client_factory: Any = None) -> None:
        """`client_factory()`: a client to set up instead of the binding's
        (tests wrap the binding to count or fail its calls)."""
        self.spec = spec
        self.timeout_s = timeout_s
        self._factory = client_factory
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._client: Any = None
        self._generation = 0  # bumped on every (re)connection: registrations redone
        self._last_error = "not connected yet"
        self._thread = threading.Thread(target=self._connect_loop, name="ec-mooncake-setup",
                                        daemon=True)
        self._thread.start()

    @property
    def current(self) -> tuple[Any, int]:
        """The client now (None: not connected) and its generation; never raises."""
        return self._client, self._generation

    def _new_client(self) -> Any:
        if self._factory is not None:
            return self._factory()
        if self.spec.protocol == "tcp":
            # The transfer engine advertises its data address from this (else
            # the host's first interface, whatever local_hostname says).
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.spec.local_hostname)
        # A master that does not answer: calls end after this, not 30 s.
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(100, int(self.timeout_s * 1000))))
        from mooncake.store import MooncakeDistributedStore
        return MooncakeDistributedStore()

    def _connect_loop(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                if self._client is not None:
                    return
            unreachable = self._unreachable()
            if unreachable:
                if unreachable != self._last_error:
                    log.warning("Mooncake store %s: %s; trying again", self.spec.display,
                                unreachable)
                self._last_error = unreachable
                self._closed.wait(SETUP_RETRY_S)
                continue
            try:
                client = self._new_client()
                started = time.monotonic()
                code = client.setup(self.spec.local_hostname, self.spec.metadata,
                                    self.spec.segment_bytes, self.spec.buffer_bytes,
                                    self.spec.protocol, self.spec.device, self.spec.master)
            except Exception as exc:  # (an import error, a bad argument)
                self._last_error = f"setup: {type(exc).__name__}: {exc}"
                log.warning("Mooncake store %s: %s", self.spec.display, self._last_error)
                self._closed.wait(SETUP_RETRY_S)
                continue
            if code != 0:
                self._last_error = f"setup returned {error(code)} after " \
                                   f"{time.monotonic() - started:.1f}s (master unreachable?)"
                log.warning("Mooncake store %s: %s; trying again", self.spec.display,
                            self._last_error)
                self._closed.wait(SETUP_RETRY_S)
                continue
            with self._lock:
                if self._closed.is_set():
                    _close_quietly(client)
                    return
                self._client = client
                self._generation += 1
            log.info("Mooncake store %s: connected (metadata %s, %s, segment %d bytes)",
                     self.spec.display, self.spec.metadata, self.spec.protocol,
                     self.spec.segment_bytes)
            return

    def _unreachable(self) -> str:
        """Why `setup` would block now (a server that does not accept a
        connection), or "" (it holds the interpreter's lock while it blocks)."""
        for what, address in servers(self.spec):
            try:
                with socket.create_connection(address, timeout=self.timeout_s):
                    pass
            except OSError as exc:
                return f"{what} {address[0]}:{address[1]} unreachable ({exc})"
        return ""

    def ready(self) -> tuple[Any, int]:
        """The connected client and its generation; raises RemoteError while
        there is none (not connected yet, or closed)."""
        if self._closed.is_set():
            raise RemoteError(f"{self.spec.display}: store closed")
        client = self._client
        if client is None:
            raise RemoteError(f"{self.spec.display}: not connected ({self._last_error})")
        return client, self._generation

    def ping(self) -> None:
        client, _ = self.ready()
        code = client.health_check()
        if code != 0:
            raise RemoteError(f"{self.spec.display}: health check {code} "
                              "(1: closed, 2: master unreachable)")

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:
        log.debug("closing a Mooncake client failed", exc_info=True)
