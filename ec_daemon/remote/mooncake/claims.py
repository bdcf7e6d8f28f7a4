"""Claims across hosts in a Mooncake store: one encode of a new item.

Mooncake has no atomic "set if absent": a put on an existing key succeeds
without writing. A claim is therefore taken by a put and confirmed by reading
the claim back (the master orders the puts: one token wins); it carries its
expiry by the claimant's clock, so a claim whose host died is taken over
once it expired (clocks off by more than the slack cost an extra encode or a
bounded wait, never a wrong hit). A claim is put on the claimant's own
segment: the master would place it on any, a dead host's among them until
it forgets that host, and the put then fails after about 1 s.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from ec_daemon.core.limits import CLAIM_READ_S, CLAIM_SLACK_MS, UNREACHABLE_READ_S
from ec_daemon.remote.common import RemoteError
from ec_daemon.remote.mooncake.codec import CLAIM, value_key
from ec_daemon.remote.mooncake.connection import (
    OBJECT_ALREADY_EXISTS,
    TRANSFER_FAIL,
    Connection,
    error,
)


class Claims:
    """The claims of one client (`Connection`), keyed by store namespace.
    Thread-safe."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._lock = threading.Lock()
        self._placement: tuple[int, Any] | None = None  # (generation, claims' ReplicateConfig)

    def claim(self, store_namespace: str, mm_hash: str, token: str, ttl_s: float,
              deadline: float | None = None) -> bool:
        """Take the key's claim for ttl_s unless another live token holds it
        (a put, then the claim read back: the master keeps the first put).
        `deadline` (monotonic): no store read starts after it (one already
        running may end up to about 1 s later, a host that is gone), and the
        claim counts as taken, unconfirmed. Default: CLAIM_READ_S from now."""
        key = value_key(store_namespace, mm_hash) + CLAIM
        client, generation = self.connection.ready()
        if deadline is None:
            deadline = time.monotonic() + CLAIM_READ_S
        for _attempt in range(2):
            expires = int(time.time() * 1000 + ttl_s * 1000)
            code = client.put(key, f"{token} {expires}".encode(),
                              self._claim_placement(client, generation))
            if code == TRANSFER_FAIL:
                break  # (placed on a host that is gone: not confirmed)
            if code not in (0, OBJECT_ALREADY_EXISTS):
                raise RemoteError(f"put {key}: {error(code)}")
            raw = self._read_claim(client, key, deadline)
            if not raw:
                if client.is_exist(key) == 1:
                    # There but unreadable for a while (a claim being written
                    # is readable within milliseconds): its bytes sit on a
                    # host that is gone (the master forgets its segment only
                    # later). Taken over.
                    client.remove(key, True)
                if time.monotonic() >= deadline:
                    break
                continue  # (or released meanwhile: once more)
            holder, _, stamp = bytes(raw).decode(errors="replace").partition(" ")
            if holder == token:
                return True
            try:
                held_until = int(stamp)
            except ValueError:
                held_until = 0  # (not a claim we wrote: taken over)
            if time.time() * 1000 < held_until + CLAIM_SLACK_MS:
                return False
            if time.monotonic() >= deadline:
                break
            if bytes(client.get(key) or b"") == bytes(raw):  # (not taken over meanwhile)
                client.remove(key, True)  # its host died or gave up: take it over
        # Not confirmed either way (a claim that cannot be written or read back,
        # a holder that keeps vanishing, the deadline): encoding here costs at
        # most a duplicate encode, waiting could cost the engine its bound.
        return True

    def _claim_placement(self, client: Any, generation: int) -> Any:
        """Where this host's claims are put: its own segment. Placed by the
        master, a claim lands on any mounted segment, a dead host's among
        them until the master forgets it (client_ttl), and its put then fails
        after about 1 s; on our own segment it lives exactly as long as its
        claimant. (Default placement for a host that mounts no segment.)"""
        with self._lock:
            if self._placement is not None and self._placement[0] == generation:
                return self._placement[1]
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        if self.connection.spec.segment_bytes > 0:
            with contextlib.suppress(Exception):  # (a client without it: the default)
                config.preferred_segment = str(client.get_hostname())
        with self._lock:
            self._placement = (generation, config)
        return config

    @staticmethod
    def _read_claim(client: Any, key: str, deadline: float) -> bytes:
        """The claim's bytes, read right after a put of it; b"" when it is
        listed but unreadable (its host is gone), or reads as nothing, until
        `deadline`. A claim another host is writing at the same moment reads
        as nothing, and is not even listed, until its put completes (our own
        put of it then returned 0 without writing)."""
        while True:
            started = time.monotonic()
            raw = client.get(key)
            now = time.monotonic()
            if raw or now >= deadline:
                return bytes(raw) if raw else b""
            if client.is_exist(key) == 1:
                # Listed but unreadable: a put completing right now (readable
                # within milliseconds), or a host that is gone (a read of it
                # then fails after about 1 s: given up on at once).
                if now - started >= UNREACHABLE_READ_S:
                    return b""
                time.sleep(0.02)
                continue
            time.sleep(0.005)

    def claim_many(self, keys: Sequence[tuple[str, str]], token: str,
                   ttl_s: float) -> list[bool | None]:
        """`claim` for many keys at once: True (taken), False (another live
        token holds it), None (not settled here: claim it alone, `claim`).
        Keys whose claim is already there are not read in the batch (a dead
        host's claim would hold the whole batch's read for about 1 s): None.
        The others: one batched put on this host's segment and one batched
        read back; a claim unreadable or expired there is None too."""
        if not keys:
            return []
        client, generation = self.connection.ready()
        names = [value_key(ns, h) + CLAIM for ns, h in keys]
        there = client.batch_is_exist(names)
        if not isinstance(there, list) or len(there) != len(names):
            raise RemoteError(f"batch_is_exist of {len(names)} claims failed: {there!r}"[:200])
        out: list[bool | None] = [None] * len(keys)
        fresh = [i for i, state in enumerate(there) if state == 0]
        if not fresh:
            return out
        expires = int(time.time() * 1000 + ttl_s * 1000)
        mine = f"{token} {expires}".encode()
        code = client.put_batch([names[i] for i in fresh], [mine] * len(fresh),
                                self._claim_placement(client, generation))
        if code not in (0, OBJECT_ALREADY_EXISTS):
            return out
        raws = client.get_batch([names[i] for i in fresh])
        if not isinstance(raws, list) or len(raws) != len(fresh):
            raise RemoteError(f"get_batch of {len(fresh)} claims failed: {raws!r}"[:200])
        now_ms = time.time() * 1000
        for i, raw in zip(fresh, raws, strict=True):
            holder, _, stamp = bytes(raw).decode(errors="replace").partition(" ") if raw \
                else ("", "", "")
            if holder == token:
                out[i] = True
            elif holder and stamp.isdigit() and now_ms < int(stamp) + CLAIM_SLACK_MS:
                out[i] = False
        return out

    def release(self, store_namespace: str, mm_hash: str, token: str) -> None:
        """Drop the claim if `token` holds it."""
        key = value_key(store_namespace, mm_hash) + CLAIM
        client, _ = self.connection.ready()
        raw = client.get(key)
        if raw and bytes(raw).decode(errors="replace").partition(" ")[0] == token:
            client.remove(key, True)
