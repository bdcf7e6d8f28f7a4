"""The Redis store of the second tier: one node or a cluster, through
redis-py, and the calls its backend (`backend`) makes of it: values, claims,
and the index (`shards`).

It puts a value with a TTL, gets it back (in parts: large values are read in
chunks, which is twice as fast as one GET of 8+ MiB through redis-py), says
whether values are there, claims keys, and says which failure domain (node)
a key lives on, so a dead node costs only its keys. Every call is bounded by
socket timeouts and raises `RemoteError` (never a client library's
exception); nothing here retries or backs off, the tier's breakers do.

Keys (`ecd1:` is the key scheme's version)::

    ecd1:v:{<fp>:<mm_hash>}   a value (values.py), with the TTL; the hash tag
                              spreads values over every slot of a cluster
    ecd1:c:{<fp>:<mm_hash>}   a claim on the value: its holder's token, a short TTL
    ecd1:i:{<k>}              index shard k of INDEX_SHARDS: a stream of announcements (`shards`)

<fp> is the first 16 hex digits of the namespace's sha256.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    MovedError,
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.retry import Retry

from ec_daemon.core.limits import (
    CHUNK_BYTES,
    FIRST_READ_BYTES,
    MAX_TOKEN_CHARS,
    MAX_VALUE_BYTES,
    SOCKET_READ_BYTES,
    STORE_TIMEOUT_S,
)
from ec_daemon.remote.common import RemoteAuthError, RemoteError, UnexpectedSize
from ec_daemon.remote.redis.resp import (
    FastConnection,
    FastSSLConnection,
    command,
    read_bulk,
    set_command,
)
from ec_daemon.remote.redis.url import StoreSpec, address, parse_url, read_credentials

log = logging.getLogger("ec_daemon.remote")

KEY_PREFIX = "ecd1"
INDEX_SHARDS = 16


@functools.lru_cache(maxsize=1024)
def fingerprint(namespace: str) -> str:
    """16 hex digits of the namespace's sha256: short keys, any namespace."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]


def value_key(namespace: str, mm_hash: str) -> str:
    return f"{KEY_PREFIX}:v:{{{fingerprint(namespace)}:{mm_hash}}}"


def claim_key(namespace: str, mm_hash: str) -> str:
    """The claim on a value: the value key's hash tag, so in a cluster the
    claim lives on the node that will hold the value."""
    return f"{KEY_PREFIX}:c:{{{fingerprint(namespace)}:{mm_hash}}}"


def index_key(shard: int) -> str:
    return f"{KEY_PREFIX}:i:{{{shard}}}"


def shard_of(key: str) -> int:
    """The announcement stream a value key's announcement goes to, alone."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % INDEX_SHARDS


def open_store(url: str, *, token_file: str = "",
               timeout_s: float = STORE_TIMEOUT_S) -> RedisStore:
    """A store for `url`. Connects lazily: a store that is down at start is
    not an error here (ping() tells). Raises ValueError for a bad URL or an
    unreadable token file."""
    spec = parse_url(url)
    username, password = read_credentials(token_file)
    return RedisStore(spec, username=username, password=password, timeout_s=timeout_s)


def failed(what: str, exc: BaseException) -> RemoteError:
    auth = (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError,
            NoPermissionError)
    text = f"{what}: {type(exc).__name__}: {exc}"
    if isinstance(exc, auth) or "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
        return RemoteAuthError(text)
    return RemoteError(text)


ERRORS = (RedisError, RedisClusterException, OSError)


class _Script:
    """A Lua script, run by EVALSHA (EVAL when the node does not have it yet):
    claims need EVAL and EVALSHA in the daemons' ACL."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


# KEYS[1]: the claim key; ARGV[1]: the token; ARGV[2]: the TTL in ms.
_CLAIM = _Script("""\
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
""")
# KEYS[1]: the claim key; ARGV[1]: the token.
_RELEASE = _Script("""\
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")


def _check_token(token: str) -> None:
    if not (isinstance(token, str) and 0 < len(token) <= MAX_TOKEN_CHARS and token.isascii()):
        raise ValueError(f"a claim token is 1 to {MAX_TOKEN_CHARS} ASCII characters, "
                         f"got {token!r:.60}")


class RedisStore:
    """A Redis node or cluster through redis-py (RESP2, no client retries,
    socket timeouts on every call). Thread-safe: redis-py clients share a
    connection pool; pipelines are per call."""

    def __init__(self, spec: StoreSpec, *, username: str | None = None,
                 password: str | None = None, timeout_s: float = STORE_TIMEOUT_S) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._cluster: RedisCluster | None = None
        kwargs: dict[str, Any] = {
            "username": username, "password": password, "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s, "protocol": 2, "client_name": "ec-daemon",
            "socket_read_size": SOCKET_READ_BYTES,
        }
        if spec.tls:
            options = spec.tls_options
            kwargs.update(ssl_cert_reqs="required",
                          ssl_ca_certs=options.get("ca_certs") or None,
                          ssl_certfile=options.get("certfile") or None,
                          ssl_keyfile=options.get("keyfile") or None,
                          ssl_check_hostname=options.get("check_hostname", "true").lower()
                          in ("true", "1", "yes"))
        self._kwargs = kwargs
        self._connection_class = FastSSLConnection if spec.tls else FastConnection
        self._single: redis.Redis | None = None
        if not spec.cluster:
            host, port = spec.nodes[0]
            self._single = redis.Redis(connection_pool=redis.ConnectionPool(
                connection_class=self._connection_class, host=host, port=port,
                retry=Retry(NoBackoff(), 0), **kwargs))

    def __repr__(self) -> str:
        return f"RedisStore({self.spec.display})"

    @property
    def single(self) -> redis.Redis | None:
        """The one node's client (None: a cluster)."""
        return self._single

    @property
    def cluster(self) -> RedisCluster | None:
        """The cluster's client, once connected (None: one node, or not yet)."""
        return self._cluster

    def pause(self, seconds: float) -> None:
        """Wait `seconds`, or until the store is closed."""
        self._closed.wait(seconds)

    # -- clients

    def client(self) -> redis.Redis | RedisCluster:
        """The client of the node, or of the cluster (connected on first use)."""
        if self._closed.is_set():
            raise RemoteError(f"{self.spec.display}: store closed")
        if self._single is not None:
            return self._single
        if self._cluster is None:
            with self._lock:
                if self._cluster is None:
                    # `url` (not host/port) makes redis-py build each node's pool
                    # from these kwargs, our connection class included.
                    first, *others = self.spec.nodes
                    try:
                        self._cluster = RedisCluster(
                            url=f"redis://{address(*first)}",
                            startup_nodes=[ClusterNode(h, p) for h, p in others],
                            connection_class=self._connection_class,
                            require_full_coverage=False, retry=Retry(NoBackoff(), 0),
                            **self._kwargs)
                    except ERRORS as exc:
                        raise failed(f"connect to {self.spec.display}", exc) from None
        return self._cluster

    def domain(self, namespace: str, mm_hash: str) -> str:
        return self.domain_of(value_key(namespace, mm_hash))

    def node(self, key: str) -> tuple[str, redis.Redis]:
        """The node serving `key`: its address and a client to it alone
        (which follows no redirection)."""
        client = self.client()
        if isinstance(client, RedisCluster):
            node = client.get_node_from_key(key)
            return str(node.name), client.get_redis_connection(node)
        return address(*self.spec.nodes[0]), client

    def domain_of(self, key: str) -> str:
        """The failure domain (node) of any key; never touches the network."""
        if self._single is not None or self._cluster is None:
            return address(*self.spec.nodes[0]) if self._single is not None \
                else self.spec.display
        try:
            node = self._cluster.get_node_from_key(key)
        except ERRORS:
            return self.spec.display
        return str(node.name)

    # -- values

    def put(self, namespace: str, mm_hash: str, parts: Sequence[bytes | memoryview],
            ttl_s: float) -> None:
        key = value_key(namespace, mm_hash)
        packed = set_command(key, parts, max(1, int(ttl_s * 1000)))
        try:
            try:
                self._call(key, packed, lambda connection: connection.read_response())
            except (MovedError, AskError):
                # The key's slot moved (a cluster resharding): redis-py follows
                # the redirection and learns the new owner, at the cost of a copy.
                self.client().set(key, b"".join(parts), px=max(1, int(ttl_s * 1000)))
        except ERRORS as exc:
            raise failed(f"put {key}", exc) from None

    def _call(self, key: str, command: Sequence[bytes | memoryview],
              read: Callable[[Any], Any]) -> Any:
        """Send a packed command on a connection to `key`'s node; the reply,
        as `read(connection)` reads it. An error reply raises its
        ResponseError; any other failure drops the connection."""
        _, client = self.node(key)
        pool = client.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command(command)
            return read(connection)
        except ResponseError:
            raise  # (the connection is fine: the server answered)
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    def get(self, namespace: str, mm_hash: str,
            size: tuple[int, int] | None = None) -> list[bytes | memoryview] | None:
        key = value_key(namespace, mm_hash)
        least, most = size if size is not None else (0, MAX_VALUE_BYTES)
        try:
            client = self.client()
            # Most values fit in the first read: one command, one round trip.
            # One byte past `most` says the value is longer than allowed.
            first_end = min(FIRST_READ_BYTES, most + 1)
            first: bytes | memoryview | None
            try:
                first = self._call(key, [command(b"GETRANGE", key.encode(), b"0",
                                                  b"%d" % (first_end - 1))],
                                   functools.partial(read_bulk, most=first_end))
            except (MovedError, AskError):  # (a cluster resharding: see put)
                first = cast(bytes, client.getrange(key, 0, first_end - 1))
            if not first:
                return None
            stored = len(first)
            if stored == first_end:  # more to read: how much, before reading it
                stored = int(client.strlen(key))
                if not stored:
                    return None  # expired meanwhile
            if not least <= stored <= most:
                raise UnexpectedSize(f"{key} holds {stored} bytes, expected {least}..{most}")
            parts: list[bytes | memoryview] = [first]
            if len(first) < stored:
                pipe = client.pipeline(transaction=False)
                for start in range(len(first), stored, CHUNK_BYTES):
                    pipe.getrange(key, start, min(start + CHUNK_BYTES, stored) - 1)
                parts += pipe.execute()
            return parts
        except ERRORS as exc:
            raise failed(f"get {key}", exc) from None

    def present(self, keys: Sequence[tuple[str, str]]) -> list[bool]:
        names = [value_key(namespace, mm_hash) for namespace, mm_hash in keys]
        if not names:
            return []
        found = [False] * len(names)
        domain = self.spec.display
        try:
            client = self.client()
            # One pipeline of EXISTS per node, each node's keys in one round trip.
            by_domain: dict[str, tuple[redis.Redis, list[int]]] = {}
            for i, key in enumerate(names):
                where, node = self.node(key)
                by_domain.setdefault(where, (node, []))[1].append(i)
            for domain, (node, indices) in by_domain.items():  # noqa: B007 (named on failure)
                pipe = node.pipeline(transaction=False)
                for i in indices:
                    pipe.exists(names[i])
                for i, reply in zip(indices, pipe.execute(raise_on_error=False), strict=True):
                    if isinstance(reply, (MovedError, AskError)):  # (a resharding: see put)
                        reply = client.exists(names[i])
                    elif isinstance(reply, BaseException):
                        raise reply
                    found[i] = bool(reply)
        except ERRORS as exc:
            raise failed(f"present ({len(names)} keys) on {domain}", exc) from None
        return found

    # -- claims

    def claim(self, namespace: str, mm_hash: str, token: str, ttl_s: float,
              deadline: float | None = None) -> bool:
        """One atomic script on the key's node (`deadline` does not apply:
        the call is bounded by the socket timeout). ValueError for a bad token."""
        _check_token(token)
        key = claim_key(namespace, mm_hash)
        ttl_ms = max(1, int(ttl_s * 1000))
        try:
            return bool(self._run(_CLAIM, key, token, b"%d" % ttl_ms) == 1)
        except ERRORS as exc:
            raise failed(f"claim {key}", exc) from None

    def release(self, namespace: str, mm_hash: str, token: str) -> None:
        _check_token(token)
        key = claim_key(namespace, mm_hash)
        try:
            self._run(_RELEASE, key, token)
        except ERRORS as exc:
            raise failed(f"release {key}", exc) from None

    def _run(self, script: _Script, key: str, *args: str | bytes) -> Any:
        """Run `script` on `key`'s node, with `args` as ARGV; its reply."""

        def run(client: redis.Redis | RedisCluster) -> Any:
            try:
                return client.evalsha(script.sha, 1, key, *args)
            except NoScriptError:  # (not run on this node since its start)
                return client.eval(script.text, 1, key, *args)

        try:
            return run(self.node(key)[1])
        except (MovedError, AskError):  # (a resharding: redis-py follows it)
            return run(self.client())

    # -- the rest

    def ping(self) -> None:
        try:
            self.client().ping()
        except RemoteError:
            raise
        except ERRORS as exc:
            raise failed(f"ping {self.spec.display}", exc) from None

    def close(self) -> None:
        self._closed.set()
        try:
            if self._single is not None:
                self._single.close()
            with self._lock:
                if self._cluster is not None:
                    self._cluster.close()
        except ERRORS as exc:
            log.debug("closing %s: %s", self.spec.display, exc)


