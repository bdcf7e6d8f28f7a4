"""A mooncake:// --remote URL, checked before anything starts, and whether
Mooncake's binding loads.

``mooncake://MASTER:PORT?metadata=...&protocol=tcp|rdma&device=&segment=SIZE
&buffer=SIZE&local_hostname=HOST``: the master, the transfer engine's
metadata server (its URL, or P2PHANDSHAKE), and what this daemon lends the
store.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from ec_protocol.sizes import parse_size

ACCEPTED_URLS = ("mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata"
                 "|P2PHANDSHAKE&protocol=tcp|rdma&device=NAME&segment=SIZE&buffer=SIZE"
                 "&local_hostname=HOST")
DEFAULT_SEGMENT = "1GiB"  # the daemon's share of the store's memory
DEFAULT_BUFFER = "64MiB"  # the client's buffer for small values (claims, checksums)


@dataclass(frozen=True)
class MooncakeSpec:
    """A parsed mooncake:// URL."""

    host: str
    port: int
    metadata: str
    protocol: str
    device: str
    segment_bytes: int
    buffer_bytes: int
    local_hostname: str

    @property
    def master(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def display(self) -> str:
        return f"mooncake://{self.master}"


def check_backend() -> None:
    """Raise ValueError, saying how to install it, unless Mooncake's binding
    loads (at start: not on the connecting thread later)."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        hint = " (apt-get install libibverbs1)" if "ibverbs" in str(exc) else ""
        raise ValueError(f"the Mooncake backend cannot load: {exc}{hint}; install it with "
                         f"pip install 'ec-daemon[mooncake]'") from None


def parse_url(url: str) -> MooncakeSpec:
    """Parse a mooncake:// --remote URL; ValueError naming the accepted form."""

    def bad(reason: str) -> ValueError:
        return ValueError(f"invalid remote store URL {url!r}: {reason}; accepted: "
                          f"{ACCEPTED_URLS}")

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "mooncake":
        raise bad("not a mooncake:// URL")
    netloc, _, query = rest.partition("?")
    netloc, slash, path = netloc.partition("/")
    if slash and path:
        raise bad("no path is accepted")
    if "@" in netloc:
        raise bad("no credentials go in the URL")
    try:
        parts = urlsplit("//" + netloc)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise bad(str(exc)) from None
    if not host or port is None:
        raise bad("the master's HOST:PORT is required")
    options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    known = {"metadata", "protocol", "device", "segment", "buffer", "local_hostname"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise bad(f"unknown option(s) {', '.join(unknown)}")
    metadata = unquote(options.get("metadata", ""))
    if not metadata:
        raise bad("metadata= is required: the metadata server's URL "
                  "(http://HOST:PORT/metadata, etcd://HOST:PORT) or P2PHANDSHAKE")
    protocol = options.get("protocol", "tcp").lower()
    if protocol not in ("tcp", "rdma"):
        raise bad(f"protocol must be tcp or rdma, got {protocol!r}")
    try:
        segment = parse_size(options.get("segment", DEFAULT_SEGMENT))
        buffer = parse_size(options.get("buffer", DEFAULT_BUFFER))
    except ValueError as exc:
        raise bad(str(exc)) from None
    if segment <= 0 or buffer <= 0:
        raise bad("segment and buffer must be positive sizes")
    return MooncakeSpec(host=host, port=port, metadata=metadata, protocol=protocol,
                        device=options.get("device", ""), segment_bytes=segment,
                        buffer_bytes=buffer,
                        local_hostname=options.get("local_hostname", "") or _local_ip(host))


def _local_ip(master_host: str) -> str:
    """The address this host reaches the master from (a UDP socket's
    route: nothing is sent); loopback for a master on loopback."""
    if master_host in ("localhost",) or master_host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def servers(spec: MooncakeSpec) -> list[tuple[str, tuple[str, int]]]:
    """The servers `setup` talks to: the master, and the metadata server when
    it has an address (not P2PHANDSHAKE)."""
    servers = [("master", (spec.host, spec.port))]
    try:
        parts = urlsplit(spec.metadata)
        host, port = parts.hostname, parts.port
    except ValueError:
        return servers
    default = {"http": 80, "https": 443, "etcd": 2379}.get(parts.scheme.lower())
    if host and default is not None:
        servers.append(("metadata server", (host, port or default)))
    return servers
