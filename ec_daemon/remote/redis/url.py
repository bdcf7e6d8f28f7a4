"""A Redis --remote URL and its token file, checked before anything starts.

URLs: ``redis://HOST:PORT`` (one node), ``rediss://`` (TLS),
``redis+cluster://HOST:PORT[,HOST:PORT...]`` (seed nodes of a cluster),
``rediss+cluster://`` (TLS). TLS options go in the query string:
``?ca_certs=FILE&certfile=FILE&keyfile=FILE&check_hostname=false``. Credentials
never go in the URL (it shows in process lists): the token file holds the
password on its first line, or a user name and a password on two lines (an
ACL user).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ACCEPTED_URLS = ("redis://HOST:PORT, rediss://HOST:PORT (TLS), "
                 "redis+cluster://HOST:PORT[,HOST:PORT...] (cluster seed nodes), "
                 "rediss+cluster://HOST:PORT[,HOST:PORT...]; TLS options: "
                 "?ca_certs=FILE&certfile=FILE&keyfile=FILE&check_hostname=false")
_TLS_OPTIONS = ("ca_certs", "certfile", "keyfile", "check_hostname")


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
        return f"{scheme}://" + ",".join(address(h, p) for h, p in self.nodes)


def address(host: str, port: int) -> str:
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
