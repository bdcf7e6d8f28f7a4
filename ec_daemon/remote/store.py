"""The Redis backend of the second tier (`backend.IndexedStore`): one node or
a cluster.

It does what an indexed store does and nothing more: put a value with a
TTL, get it back (in parts: large values are read in chunks, which is twice
as fast as one GET of 8+ MiB through redis-py), announce it on an index,
read that index, claim keys, and say which failure domain (node) a key lives
on, so a dead node costs only its keys. Every call is bounded by socket
timeouts and raises `RemoteError` (never a client library's exception);
nothing here retries or backs off, the tier's breakers do.

Keys (`ecd1:` is the key scheme's version)::

    ecd1:v:{<fp>:<mm_hash>}   a value (values.py), with the TTL; the hash tag
                              spreads values over every slot of a cluster
    ecd1:c:{<fp>:<mm_hash>}   a claim on the value: its holder's token, a short TTL
    ecd1:i:{<k>}              index shard k of INDEX_SHARDS: a stream of
                              announcements (ns, h, n, t, e), trimmed to the TTL

<fp> is the first 16 hex digits of the namespace's sha256. A publisher
announces on a shard that lives on the same node as the value (in a cluster),
so the node that holds a value holds its announcement: losing it costs
exactly its keys.

Time is the server's: an announcement carries its TTL (`t`, ms) and is dated
by its stream entry ID (the milliseconds of the node's clock at the XADD), and
each XADD trims its shard by the ID the previous XADD on that shard returned,
less the TTL; no host's clock is trusted. (`e`, the expiry by the publisher's
clock, is still written for daemons that predate `t`.)

URLs: ``redis://HOST:PORT`` (one node), ``rediss://`` (TLS),
``redis+cluster://HOST:PORT[,HOST:PORT...]`` (seed nodes of a cluster),
``rediss+cluster://`` (TLS). TLS options go in the query string:
``?ca_certs=FILE&certfile=FILE&keyfile=FILE&check_hostname=false``. Credentials
never go in the URL (it shows in process lists): the token file holds the
password on its first line, or a user name and a password on two lines (an
ACL user).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import redis
from redis._parsers import BaseParser
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, PythonRespSerializer, SSLConnection
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    InvalidResponse,
    MovedError,
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.retry import Retry

from ec_daemon.core import limits
from ec_daemon.remote.backend import (
    Announcement,
    IndexedStore,
    RemoteAuthError,
    RemoteError,
    UnexpectedSize,
)
from ec_daemon.remote.breaker import CLOSED, Breakers

log = logging.getLogger("ec_daemon.remote")

KEY_PREFIX = "ecd1"
INDEX_SHARDS = 16
FIRST_READ_BYTES = (1 << 20) + (64 << 10)  # one round trip reads up to this (1 MiB + header)
CHUNK_BYTES = 1 << 20  # larger values: pipelined GETRANGEs of this size
SOCKET_READ_BYTES = 256 << 10  # redis-py reads 64 KiB at a time by default: 8% slower
SMALL_PART_BYTES = 16 << 10  # a put joins smaller parts of a value into one send
REPLY_SLACK_BYTES = 4096  # a reply read into a buffer: room for its framing or an error line
ACCEPTED_URLS = ("redis://HOST:PORT, rediss://HOST:PORT (TLS), "
                 "redis+cluster://HOST:PORT[,HOST:PORT...] (cluster seed nodes), "
                 "rediss+cluster://HOST:PORT[,HOST:PORT...]; TLS options: "
                 "?ca_certs=FILE&certfile=FILE&keyfile=FILE&check_hostname=false")
# Bounds on index entries: larger ones are ignored (the index is writable by
# anyone who can write to the store; a daemon must not hold what they say).
MAX_NAMESPACE_BYTES = limits.MAX_NAMESPACE_BYTES
MAX_HASH_BYTES = limits.MAX_KEY_BYTES
MAX_VALUE_BYTES = 1 << 40
MAX_TOKEN_CHARS = 128  # a claim's token: 1 to this many ASCII characters
_TLS_OPTIONS = ("ca_certs", "certfile", "keyfile", "check_hostname")


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


def _shard_of(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % INDEX_SHARDS


@dataclass(frozen=True)
class StoreSpec:
    """A parsed --remote URL."""

    cluster: bool
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    tls_options: dict[str, str] = field(default_factory=dict)

    @property
    def display(self) -> str:
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        return f"{scheme}://" + ",".join(_address(h, p) for h, p in self.nodes)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_url(url: str) -> StoreSpec:
    """Parse a --remote URL; ValueError (naming the accepted forms) otherwise."""

    def bad(reason: str) -> ValueError:
        shown = re.sub(r"//[^@/]*@", "//***@", url)  # never echo a password
        return ValueError(f"invalid remote store URL {shown!r}: {reason}; "
                          f"accepted: {ACCEPTED_URLS}")

    scheme, sep, rest = url.partition("://")
    if not sep:
        raise bad("no scheme")
    schemes = {"redis": (False, False), "rediss": (False, True),
               "redis+cluster": (True, False), "rediss+cluster": (True, True)}
    if scheme.lower() not in schemes:
        raise bad(f"unknown scheme {scheme!r}")
    cluster, tls = schemes[scheme.lower()]
    netloc, _, query = rest.partition("?")
    netloc, slash, path = netloc.partition("/")
    if slash and path:
        raise bad("no path or database number is accepted")
    if "@" in netloc:
        raise bad("credentials do not go in the URL (it shows in process lists); "
                  "use the token file")
    if not netloc:
        raise bad("no host")
    nodes = []
    for item in netloc.split(","):
        try:
            parts = urlsplit("//" + item)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise bad(f"bad address {item!r} ({exc})") from None
        if not host:
            raise bad(f"bad address {item!r}")
        nodes.append((host, port or 6379))
    if len(nodes) > 1 and not cluster:
        raise bad("several addresses need redis+cluster:// (or rediss+cluster://)")
    options: dict[str, str] = {}
    for name, values in parse_qs(query, keep_blank_values=True, strict_parsing=False).items():
        if name not in _TLS_OPTIONS:
            raise bad(f"unknown option {name!r}")
        if not tls:
            raise bad(f"option {name!r} needs TLS (rediss://)")
        options[name] = values[-1]
    if options.get("check_hostname", "true").lower() not in ("true", "false", "1", "0", "yes",
                                                               "no"):
        raise bad("check_hostname must be true or false")
    return StoreSpec(cluster=cluster, tls=tls, nodes=tuple(nodes), tls_options=options)


def read_credentials(token_file: str) -> tuple[str | None, str | None]:
    """(username, password) from a token file: the password alone on the
    first line, or a user name then a password on two lines. ValueError when
    the file cannot be read or is empty."""
    if not token_file:
        return None, None
    try:
        lines = [line.strip() for line in Path(token_file).read_text().splitlines()]
    except OSError as exc:
        raise ValueError(f"cannot read remote token file {token_file}: {exc.strerror}") from None
    lines = [line for line in lines if line]
    if len(lines) == 1:
        return None, lines[0]
    if len(lines) == 2:
        return lines[0], lines[1]
    raise ValueError(f"remote token file {token_file} must hold a password (one line) or a "
                     f"user name and a password (two lines), found {len(lines)} lines")


def open_store(url: str, *, token_file: str = "", timeout_s: float = 2.0) -> RedisStore:
    """A store for `url`. Connects lazily: a store that is down at start is
    not an error here (ping() tells). Raises ValueError for a bad URL or an
    unreadable token file."""
    spec = parse_url(url)
    username, password = read_credentials(token_file)
    return RedisStore(spec, username=username, password=password, timeout_s=timeout_s)


def _failed(what: str, exc: BaseException) -> RemoteError:
    auth = (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError,
            NoPermissionError)
    text = f"{what}: {type(exc).__name__}: {exc}"
    if isinstance(exc, auth) or "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
        return RemoteAuthError(text)
    return RemoteError(text)


_ERRORS = (RedisError, RedisClusterException, OSError)


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


class RedisStore(IndexedStore):
    """A Redis node or cluster through redis-py (RESP2, no client retries,
    socket timeouts on every call). Thread-safe: redis-py clients share a
    connection pool; pipelines are per call."""

    def __init__(self, spec: StoreSpec, *, username: str | None = None,
                 password: str | None = None, timeout_s: float = 2.0) -> None:
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
        # Index key -> milliseconds of the ID our last XADD there returned
        # (the server's clock, by which the next XADD trims).
        self._added_ms: dict[str, int] = {}
        self._connection_class = _SSLConnection if spec.tls else _Connection
        self._single: redis.Redis | None = None
        if not spec.cluster:
            host, port = spec.nodes[0]
            self._single = redis.Redis(connection_pool=redis.ConnectionPool(
                connection_class=self._connection_class, host=host, port=port,
                retry=Retry(NoBackoff(), 0), **kwargs))

    def __repr__(self) -> str:
        return f"RedisStore({self.spec.display})"

    # -- clients

    def _client(self) -> redis.Redis | RedisCluster:
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
                            url=f"redis://{_address(*first)}",
                            startup_nodes=[ClusterNode(h, p) for h, p in others],
                            connection_class=self._connection_class,
                            require_full_coverage=False, retry=Retry(NoBackoff(), 0),
                            **self._kwargs)
                    except _ERRORS as exc:
                        raise _failed(f"connect to {self.spec.display}", exc) from None
        return self._cluster

    def domain(self, namespace: str, mm_hash: str) -> str:
        return self._domain_of(value_key(namespace, mm_hash))

    def _node(self, key: str) -> tuple[str, redis.Redis]:
        """The node serving `key`: its address and a client to it alone
        (which follows no redirection)."""
        client = self._client()
        if isinstance(client, RedisCluster):
            node = client.get_node_from_key(key)
            return str(node.name), client.get_redis_connection(node)
        return _address(*self.spec.nodes[0]), client

    def _domain_of(self, key: str) -> str:
        if self._single is not None or self._cluster is None:
            return _address(*self.spec.nodes[0]) if self._single is not None \
                else self.spec.display
        try:
            node = self._cluster.get_node_from_key(key)
        except _ERRORS:
            return self.spec.display
        return str(node.name)

    # -- values

    def put(self, namespace: str, mm_hash: str, parts: Sequence[bytes | memoryview],
            ttl_s: float) -> None:
        key = value_key(namespace, mm_hash)
        command = _set_command(key, parts, max(1, int(ttl_s * 1000)))
        try:
            try:
                self._call(key, command, lambda connection: connection.read_response())
            except (MovedError, AskError):
                # The key's slot moved (a cluster resharding): redis-py follows
                # the redirection and learns the new owner, at the cost of a copy.
                self._client().set(key, b"".join(parts), px=max(1, int(ttl_s * 1000)))
        except _ERRORS as exc:
            raise _failed(f"put {key}", exc) from None

    def _call(self, key: str, command: Sequence[bytes | memoryview],
              read: Callable[[Any], Any]) -> Any:
        """Send a packed command on a connection to `key`'s node; the reply,
        as `read(connection)` reads it. An error reply raises its
        ResponseError; any other failure drops the connection."""
        _, client = self._node(key)
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
            client = self._client()
            # Most values fit in the first read: one command, one round trip.
            # One byte past `most` says the value is longer than allowed.
            first_end = min(FIRST_READ_BYTES, most + 1)
            first: bytes | memoryview | None
            try:
                first = self._call(key, [_command(b"GETRANGE", key.encode(), b"0",
                                                  b"%d" % (first_end - 1))],
                                   functools.partial(_read_bulk, most=first_end))
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
        except _ERRORS as exc:
            raise _failed(f"get {key}", exc) from None

    def present(self, keys: Sequence[tuple[str, str]]) -> list[bool]:
        names = [value_key(namespace, mm_hash) for namespace, mm_hash in keys]
        if not names:
            return []
        found = [False] * len(names)
        domain = self.spec.display
        try:
            client = self._client()
            # One pipeline of EXISTS per node, each node's keys in one round trip.
            by_domain: dict[str, tuple[redis.Redis, list[int]]] = {}
            for i, key in enumerate(names):
                address, node = self._node(key)
                by_domain.setdefault(address, (node, []))[1].append(i)
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
        except _ERRORS as exc:
            raise _failed(f"present ({len(names)} keys) on {domain}", exc) from None
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
        except _ERRORS as exc:
            raise _failed(f"claim {key}", exc) from None

    def release(self, namespace: str, mm_hash: str, token: str) -> None:
        _check_token(token)
        key = claim_key(namespace, mm_hash)
        try:
            self._run(_RELEASE, key, token)
        except _ERRORS as exc:
            raise _failed(f"release {key}", exc) from None

    def _run(self, script: _Script, key: str, *args: str | bytes) -> Any:
        """Run `script` on `key`'s node, with `args` as ARGV; its reply."""

        def run(client: redis.Redis | RedisCluster) -> Any:
            try:
                return client.evalsha(script.sha, 1, key, *args)
            except NoScriptError:  # (not run on this node since its start)
                return client.eval(script.text, 1, key, *args)

        try:
            return run(self._node(key)[1])
        except (MovedError, AskError):  # (a resharding: redis-py follows it)
            return run(self._client())

    # -- the index

    def _shard_for(self, key: str) -> int:
        """The index shard for a value key: in a cluster, one on the value's
        node when there is one (so a node's loss costs exactly its keys)."""
        shard = _shard_of(key)
        if self._cluster is None:
            return shard
        node = self._domain_of(key)
        local = [k for k in range(INDEX_SHARDS) if self._domain_of(index_key(k)) == node]
        return local[shard % len(local)] if local else shard

    def announce(self, namespace: str, mm_hash: str, nbytes: int, ttl_s: float) -> None:
        try:
            client = self._client()
            key = index_key(self._shard_for(value_key(namespace, mm_hash)))
            ttl_ms = max(1, int(ttl_s * 1000))
            # Trimmed by the server's clock (the ID the shard's previous XADD
            # returned): a host whose clock runs ahead must not trim the
            # others' announcements. The first XADD here trims nothing. (A Lua
            # script could trim by its own XADD's ID, in the same one round
            # trip, but would need EVAL in every daemon's ACL.)
            previous = self._added_ms.get(key)
            pipe = client.pipeline(transaction=False)
            pipe.xadd(key, {"ns": namespace, "h": mm_hash, "n": nbytes, "t": ttl_ms,
                            "e": f"{time.time() + ttl_s:.3f}"},
                      minid=None if previous is None else max(0, previous - ttl_ms),
                      approximate=True)
            # An index nobody writes to any more goes away a minute after its last entry.
            pipe.pexpire(key, ttl_ms + 60_000)
            entry_id, _ = pipe.execute()
            self._added_ms[key] = _stamp_ms(entry_id)
        except _ERRORS as exc:
            raise _failed(f"announce {namespace!r} {mm_hash!r}", exc) from None

    def read_index(self, cursor: str | None, block_s: float, count: int,
                   breakers: Breakers | None = None) -> tuple[list[Announcement], str]:
        positions = _parse_cursor(cursor)
        if self._single is None and self._cluster is None and breakers is not None:
            # No cluster client yet: connecting is the seeds' domain's call.
            seeds = breakers.get(self.spec.display)
            if not seeds.allow():
                self._closed.wait(max(0.05, min(block_s, seeds.retry_in())))
                return [], _cursor(positions)
            try:
                self._client()
            except RemoteError as exc:
                seeds.failure(exc)
                self._closed.wait(block_s)
                return [], _cursor(positions)
            seeds.success()
        client = self._client()
        # Shards by failure domain; one node answers for all of its shards.
        by_domain: dict[str, list[int]] = {}
        for shard in range(INDEX_SHARDS):
            by_domain.setdefault(self._domain_of(index_key(shard)), []).append(shard)
        # One node: one XREAD BLOCK over every shard. A cluster refuses
        # multi-key reads across slots: non-blocking reads, then a pause.
        blocking = self._single is not None
        found: list[Announcement] = []
        waited = False
        pause = block_s
        for domain, shards in by_domain.items():
            breaker = breakers.get(domain) if breakers is not None else None
            if breaker is not None and not breaker.allow():
                pause = min(pause, max(0.05, breaker.retry_in()))
                continue
            # A probe (half-open) answers at once: other calls wait for its verdict.
            block_ms = None
            if blocking and (breaker is None or breaker.state == CLOSED):
                block_ms = max(1, int(min(block_s, self.timeout_s / 2) * 1000))
            try:
                replies = self._read_shards(client, shards, positions, count, block_ms)
            except _ERRORS as exc:
                failure = _failed(f"read index on {domain}", exc)
                if breaker is None:
                    raise failure from None
                breaker.failure(failure)
                pause = min(pause, 0.1)  # count failures quickly: the breaker decides
                continue
            if breaker is not None:
                breaker.success()
            waited = waited or block_ms is not None
            for reply in replies:
                for stream, entries in reply or ():
                    shard = _shard_from_key(stream)
                    for entry_id, fields in entries:
                        positions[shard] = entry_id.decode()
                        announcement = _announcement(entry_id, fields)
                        if announcement is not None:
                            found.append(announcement)
        if not found and not waited:
            self._closed.wait(pause)
        return found, _cursor(positions)

    def clock_ms(self, breakers: Breakers | None = None) -> int | None:
        if self._single is None and self._cluster is None:
            return None  # not connected yet: read_index connects
        domains = dict.fromkeys(self._domain_of(index_key(k)) for k in range(INDEX_SHARDS))
        for domain in domains:
            breaker = breakers.get(domain) if breakers is not None else None
            if breaker is not None and not breaker.allow():
                continue
            try:
                if self._single is not None:
                    seconds, micros = self._single.time()
                else:
                    assert self._cluster is not None
                    node = self._cluster.get_node(node_name=domain)
                    if node is None:
                        if breaker is not None:
                            breaker.success()  # (not asked: a node that left the cluster)
                        continue
                    seconds, micros = self._cluster.time(target_nodes=node)
            except _ERRORS as exc:
                failure = _failed(f"time on {domain}", exc)
                if breaker is None:
                    raise failure from None
                breaker.failure(failure)
                continue
            if breaker is not None:
                breaker.success()
            return int(seconds) * 1000 + int(micros) // 1000
        return None

    def _read_shards(self, client: redis.Redis | RedisCluster, shards: list[int],
                     positions: list[str], count: int, block_ms: int | None) -> list[Any]:
        if len(shards) > 1 and self._single is not None:
            streams: dict[Any, Any] = {index_key(k): positions[k] for k in shards}
            return [client.xread(streams, count=count, block=block_ms)]
        pipe = client.pipeline(transaction=False)
        for k in shards:
            pipe.xread({index_key(k): positions[k]}, count=count)
        return list(pipe.execute())

    # -- the rest

    def ping(self) -> None:
        try:
            self._client().ping()
        except RemoteError:
            raise
        except _ERRORS as exc:
            raise _failed(f"ping {self.spec.display}", exc) from None

    def close(self) -> None:
        self._closed.set()
        try:
            if self._single is not None:
                self._single.close()
            with self._lock:
                if self._cluster is not None:
                    self._cluster.close()
        except _ERRORS as exc:
            log.debug("closing %s: %s", self.spec.display, exc)


class _Connection(Connection):
    """Sends large arguments to the socket as they are. With hiredis installed
    redis-py packs every command through hiredis, which copies a payload
    twice (10x the CPU of a 32 MiB put); reads still use the hiredis parser."""

    def _construct_command_packer(self, packer: Any) -> Any:
        return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


class _SSLConnection(SSLConnection):
    __doc__ = _Connection.__doc__

    def _construct_command_packer(self, packer: Any) -> Any:
        return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


def _command(*args: bytes) -> bytes:
    """A command of small arguments in RESP."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


def _read_bulk(connection: Any, most: int) -> memoryview | None:
    """The reply to the one command in flight on `connection`, a bulk string
    of at most `most` bytes, read from its socket straight into a buffer of
    its own (hiredis copies a reply twice on its way to a bytes object, and
    a promotion copies it once more: a 1 MiB promotion took 1.0-1.4x the
    time of a plain GET). None for a nil reply; an error reply raises its ResponseError; a
    longer string or any other reply raises InvalidResponse. Reads nothing
    past the reply (the server sends nothing else meanwhile)."""
    sock = connection._sock
    buffer = bytearray(most + REPLY_SLACK_BYTES)
    view = memoryview(buffer)
    got = 0
    while (end := buffer.find(b"\r\n", 0, got)) < 0:
        if got == len(buffer):
            raise InvalidResponse("a reply line longer than the buffer")
        got += _received(sock, view[got:])
    kind, line = buffer[:1], bytes(buffer[1:end])
    if kind == b"-":
        raise BaseParser.parse_error(line.decode(errors="replace"))
    if kind != b"$" or not re.fullmatch(rb"-?[0-9]{1,20}", line):
        raise InvalidResponse(f"expected a bulk string, got {bytes(buffer[:end][:40])!r}")
    length = int(line)
    if length < 0:
        return None
    start = end + 2
    if length > most or start + length + 2 > len(buffer):
        raise InvalidResponse(f"a bulk string of {length} bytes, more than the {most} asked")
    while got < start + length + 2:
        got += _received(sock, view[got:start + length + 2])
    if buffer[start + length:start + length + 2] != b"\r\n":
        raise InvalidResponse("a bulk string not ended by CRLF")
    return view[start:start + length]


def _received(sock: Any, into: memoryview) -> int:
    count = int(sock.recv_into(into))
    if not count:
        raise ConnectionError("the store closed the connection")
    return count


def _set_command(key: str, parts: Sequence[bytes | memoryview], ttl_ms: int
                 ) -> list[bytes | memoryview]:
    """SET key value PX ttl_ms in RESP, the value being the concatenation of
    `parts`, sent as they are: redis-py needs a value in one buffer (a copy of
    the payload), or a MULTI, SET, APPEND and EXEC (4 commands, 0.1 ms more
    CPU per MiB). Parts under SMALL_PART_BYTES are joined to their neighbours
    (fewer sends)."""
    name = key.encode()
    views = [memoryview(part).cast("B") for part in parts]
    ttl = b"%d" % ttl_ms
    pieces: list[bytes | memoryview] = [
        b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(name), name, sum(map(len, views)))]
    for view in [*views, memoryview(b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(ttl), ttl))]:
        if len(view) < SMALL_PART_BYTES and isinstance(pieces[-1], bytes):
            pieces[-1] += view
        else:
            pieces.append(view if len(view) >= SMALL_PART_BYTES else bytes(view))
    return pieces


def _parse_cursor(cursor: str | None) -> list[str]:
    if cursor:
        positions = cursor.split(",")
        if len(positions) == INDEX_SHARDS:
            return positions
    return ["0-0"] * INDEX_SHARDS


def _cursor(positions: list[str]) -> str:
    return ",".join(positions)


def _shard_from_key(stream: bytes | str) -> int:
    name = stream.decode() if isinstance(stream, bytes) else stream
    return int(name.rsplit("{", 1)[1].rstrip("}"))


def _stamp_ms(entry_id: bytes | str) -> int:
    """The milliseconds part of a stream entry ID (the server's clock)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0])


def _announcement(entry_id: bytes | str, fields: dict[bytes, bytes]) -> Announcement | None:
    """An index entry, or None when it is malformed or out of bounds
    (anyone who can write to the store can write the index)."""
    try:
        namespace, mm_hash = fields[b"ns"], fields[b"h"]
        if len(namespace) > MAX_NAMESPACE_BYTES or not 0 < len(mm_hash) <= MAX_HASH_BYTES:
            return None
        nbytes = int(fields[b"n"])
        ttl_ms = int(fields[b"t"]) if b"t" in fields else None
        if not 0 < nbytes <= MAX_VALUE_BYTES or (ttl_ms is not None and ttl_ms <= 0):
            return None
        return Announcement(namespace=namespace.decode(), mm_hash=mm_hash.decode(),
                            nbytes=nbytes, stamp_ms=_stamp_ms(entry_id), ttl_ms=ttl_ms)
    except (KeyError, ValueError):
        return None
