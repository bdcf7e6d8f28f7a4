"""Every daemon setting, declared once.

Each `Setting` names its flag, type, default, environment variable and help
(every number among the defaults is `core.limits`'s, where each is declared);
the CLI builds its flags and env-var fallbacks from this table, `stats`
reports the values, and docs/running.md's flag table is `markdown_table()`
(`python -m ec_daemon.serving.config` prints it; a test keeps the two equal), so a flag
cannot be parsed with one default and documented with another. Sizes accept
binary and decimal units (`512MiB`, `64GiB`, `1G`, plain bytes); times are
seconds, and a flag says so (`--remote-ttl-seconds`). A renamed flag keeps
its old name and variable as a deprecated alias (one warning naming the
new). The table's shape is the client's too (`ec_protocol.settings_table`),
and `DaemonConfig` is held to the table by a test.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ec_daemon.core import limits
from ec_protocol.protocol import default_socket_uri, grpc_target
from ec_protocol.settings_table import Alias, Setting, deprecated
from ec_protocol.sizes import format_size, parse_size


def _size(n: int) -> Callable[[], str]:
    """A size default as flags take it: `1GiB`."""
    return lambda: format_size(n).replace(" ", "")


def _number(n: float) -> Callable[[], str]:
    """A count or seconds default as flags take it: `10`, `0.25`."""
    return lambda: f"{n:g}"


def _positive_size(text: str) -> int:
    value = parse_size(text)
    if value <= 0:
        raise ValueError(f"invalid size {text!r}: must be greater than zero")
    return value


def _derived_size(text: str) -> int:
    """A positive size, or "" for the default derived from --cpu-bytes (0 here)."""
    return _positive_size(text) if text.strip() else 0


def _derived_seconds(text: str) -> float:
    """Positive seconds, or "" for the default derived from another flag (0 here)."""
    return _positive_float(text) if text.strip() else 0.0


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"invalid value {text!r}: must be greater than zero")
    return value


def _nonnegative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(f"invalid value {text!r}: must be zero or more")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"invalid number {text!r}: use a whole number") from None
    if value <= 0:
        raise ValueError(f"invalid number {text!r}: must be greater than zero")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise ValueError(f"invalid port {text!r}: use 1..65535, or 0 for off")
    return value


def _socket_uri(text: str) -> str:
    grpc_target(text)  # raises ValueError naming the accepted forms
    return text


def _mode(text: str) -> int:
    from ec_daemon.serving.auth import parse_mode

    return parse_mode(text)


def _remote_url(text: str) -> str:
    if text.lower().startswith("mooncake://"):
        from ec_daemon.remote.mooncake.url import check_backend
        from ec_daemon.remote.mooncake.url import parse_url as parse_mooncake

        parse_mooncake(text)  # raises ValueError naming the accepted form
        check_backend()  # before anything is started: the binding loads here
    elif text:
        from ec_daemon.remote.redis.url import parse_url

        parse_url(text)  # raises ValueError naming the accepted forms
    return text


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(f"invalid value {text!r}: choose one of {', '.join(choices)}")
        return text.lower()

    return parse


def _bool(text: str) -> bool:
    value = text.lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"invalid value {text!r}: use true or false")
    return value in ("true", "1", "yes")


def flag(setting: Setting, name: str = "") -> str:
    """`--lease-seconds`: the flag of a setting (or of its old `name`)."""
    return "--" + (name or setting.name).replace("_", "-")


def env_var(setting: Setting, name: str = "") -> str:
    """`EC_DAEMON_LEASE_SECONDS`: the environment variable of a setting (or of its old `name`)."""
    if setting.env and not name:
        return setting.env
    return "EC_DAEMON_" + (name or setting.name).upper()


SETTINGS: tuple[Setting, ...] = (
    Setting("cpu_bytes", _positive_size, _size(limits.DEFAULT_CPU_BYTES),
            "size of the shared region (the cache capacity)", "SIZE"),
    Setting("socket", _socket_uri, default_socket_uri,
            "where to serve: unix:///path (default) or host:port for TCP", "URI",
            shown="`unix://$XDG_RUNTIME_DIR/ec-daemon/ec.sock`, else "
                  "`unix:///tmp/ec-daemon-$UID/ec.sock`"),
    Setting("socket_mode", _mode, lambda: f"{limits.DEFAULT_SOCKET_MODE:04o}",
            "permissions of the socket and the region (0660 with --group to share)", "MODE"),
    Setting("group", str, lambda: "",
            "group owning the socket and the region (a name or gid)", "GROUP"),
    Setting("token_file", str, lambda: "",
            "file with a shared token every call must carry (required for TCP)", "FILE"),
    Setting("read_token_file", str, lambda: "",
            "file with a second, read-only token for routers: calls carrying it may only "
            "Watch, Stats, Lookup and check health (needs --token-file)", "FILE"),
    Setting("tls_cert", str, lambda: "", "TLS certificate (PEM) for a TCP socket", "FILE"),
    Setting("tls_key", str, lambda: "", "TLS private key (PEM) for a TCP socket", "FILE"),
    Setting("shm_dir", str, lambda: "/dev/shm",
            "directory of the region file (a tmpfs)", "DIR"),
    Setting("page_bytes", _positive_size, _size(limits.DEFAULT_PAGE_BYTES),
            "allocation granularity; an entry spans whole pages", "SIZE"),
    Setting("lease_seconds", _positive_float, _number(limits.DEFAULT_LEASE_SECONDS),
            "a session whose stream is silent this long is ended", "S"),
    Setting("ack_wait_seconds", _derived_seconds, lambda: "",
            "how long an eviction waits for a live scheduler view's acknowledgement; a view "
            "that withholds it longer is ended (its engine re-attaches) and awaited one lease "
            "more as a ghost, so a view that never acknowledges cannot pin the cache; a load "
            "in flight keeps its pages this long and a lease more (at least --lease-seconds)",
            "S", shown=f"{limits.ACK_WAIT_LEASES} x `--lease-seconds`"),
    Setting("alloc_wait_seconds", _positive_float, _number(limits.DEFAULT_ALLOC_WAIT_SECONDS),
            "how long a save may wait for evicted pages to be reclaimed", "S"),
    Setting("quarantine_seconds", _positive_float, _number(limits.DEFAULT_QUARANTINE_SECONDS),
            "pages of a save whose writer vanished stay unused this long (a frozen writer "
            "that wakes up must not overwrite a newer entry)", "S"),
    Setting("session_pending_bytes", _derived_size, lambda: "",
            "bytes one engine instance (its id and token) may hold as saves allocated and not "
            "yet reported, in all its sessions, counting those its ended sessions left in "
            "quarantine; one more is refused (RESOURCE_EXHAUSTED): a worker's saver has at most "
            "two batches in flight, each within its save queue (256 MiB by default)", "SIZE",
            shown=f"a quarter of `--cpu-bytes`, at most "
                  f"`{_size(limits.DEFAULT_SESSION_PENDING_BYTES)()}`"),
    Setting("total_pending_bytes", _derived_size, lambda: "",
            "bytes all sessions together may hold as saves allocated and not yet reported or "
            "left in quarantine (clients without an engine token: a quarter of it together); "
            "one more is refused (RESOURCE_EXHAUSTED), so the rest of the cache stays the "
            "ready entries'", "SIZE", shown="half of `--cpu-bytes`"),
    Setting("session_pending_entries", _positive_int,
            _number(limits.DEFAULT_SESSION_PENDING_ENTRIES),
            "saves one session may hold allocated and not yet reported (a saver asks for 16 "
            "at a time); one more is refused (RESOURCE_EXHAUSTED)", "N"),
    Setting("max_sessions", _positive_int, _number(limits.DEFAULT_MAX_SESSIONS),
            "sessions attached at once (an attach that never opens its stream counts for "
            "60 s, or until an engine presenting its token needs the place after 10 s); the "
            "last quarter is kept for engine instances already running; one more Attach is "
            "refused (RESOURCE_EXHAUSTED)", "N"),
    Setting("max_sessions_per_engine", _positive_int,
            _number(limits.DEFAULT_MAX_SESSIONS_PER_ENGINE),
            "sessions of one engine instance (its id and token) attached at once (its "
            "scheduler and one per worker rank, with room for re-attaches); one more Attach "
            "is refused (RESOURCE_EXHAUSTED)",
            "N"),
    Setting("max_tokenless_sessions", _positive_int,
            _number(limits.DEFAULT_MAX_TOKENLESS_SESSIONS),
            "sessions of clients that present no engine token, together, whatever engine ids "
            "they name (tools, older clients); one more Attach is refused "
            "(RESOURCE_EXHAUSTED), and engines presenting their token never compete for "
            "these", "N"),
    Setting("check_invariants", _bool, lambda: "false",
            "verify the bookkeeping after every call (slow; for testing)", "BOOL"),
    Setting("max_watchers", _positive_int, _number(limits.DEFAULT_MAX_WATCHERS),
            "Watch calls (routers) open at once; more are refused", "N"),
    Setting("max_watchers_per_peer", _positive_int, _number(limits.DEFAULT_MAX_WATCHERS_PER_PEER),
            "Watch calls open at once from one peer (a TCP address; every client of the "
            "Unix socket counts as one)", "N"),
    Setting("warm_restart", _bool, lambda: "true",
            "keep an index of the cache beside the region, so the next daemon on this socket "
            "adopts it (false: every start is empty, and the region goes at exit)", "BOOL"),
    Setting("fresh_start", _bool, lambda: "false",
            "start with an empty cache: remove the region a previous daemon on this socket "
            "left instead of adopting it", "BOOL", switch=True),
    Setting("on_exit", _choice("keep", "remove"), lambda: "keep",
            "keep: leave the region for the next daemon on this socket to adopt (a warm "
            "restart); remove: delete it at exit (frees its memory)", "WHAT"),
    Setting("metrics_port", _port, _number(limits.DEFAULT_METRICS_PORT),
            "serve Prometheus metrics on this port (0: off)", "PORT"),
    Setting("metrics_address", str, lambda: "127.0.0.1",
            "address of the metrics endpoint (0.0.0.0 to scrape from other hosts)", "ADDR"),
    Setting("remote", _remote_url, lambda: "",
            "a second tier shared by the daemons of many hosts: redis://HOST:PORT, "
            "rediss://HOST:PORT (TLS), redis+cluster://HOST:PORT[,HOST:PORT...], or "
            "mooncake://MASTER:PORT?metadata=http://HOST:PORT/metadata (Mooncake Store; "
            "options: protocol=tcp|rdma, device=, segment=SIZE, buffer=SIZE) (empty: off)",
            "URL"),
    Setting("remote_ttl_seconds", _positive_float, _number(limits.DEFAULT_REMOTE_TTL_SECONDS),
            "how long an entry published to the second tier stays there (Redis; Mooncake "
            "keeps entries until it evicts them)", "S", aliases=(Alias("remote_ttl"),)),
    Setting("remote_claim_seconds", _nonnegative_float,
            _number(limits.DEFAULT_REMOTE_CLAIM_SECONDS),
            "a new item missed here and in the second tier is claimed across hosts for this "
            "long: one host encodes it, the others wait for its value at most this long "
            "(0: no claims, every host that misses encodes)", "S"),
    Setting("remote_token_file", str, lambda: "",
            "file with the second tier's AUTH password (one line; or a user name and a "
            "password on two lines)", "FILE"),
    Setting("remote_queue_bytes", _positive_size, _size(limits.DEFAULT_REMOTE_QUEUE_BYTES),
            "entries waiting to be published, at most this many bytes (more are dropped)",
            "SIZE"),
    Setting("remote_index_bytes", _positive_size, _size(limits.DEFAULT_REMOTE_INDEX_BYTES),
            "memory of the index of what the other hosts published (about 250 bytes an "
            "entry; beyond, the oldest entries are forgotten: they are encoded here instead)",
            "SIZE"),
    Setting("remote_promotion_bytes", _positive_size,
            _size(limits.DEFAULT_REMOTE_PROMOTION_BYTES),
            "bytes of fetched entries held at once between their fetch and their write into "
            "the region, and Mooncake's transfer buffers (in use or pooled); a promotion "
            "beyond, or of a larger entry, does not start (the engine encodes)", "SIZE"),
    Setting("log_level", _choice("debug", "info", "warning", "error"), lambda: "info",
            "debug, info, warning or error", "LEVEL"),
    Setting("log_format", _choice("text", "json"), lambda: "text",
            "text, or json (one object per line)", "FORMAT"),
)


def markdown_table() -> str:
    """docs/running.md's table of every setting: flag, env var, default, meaning."""
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    for setting in SETTINGS:
        shown = flag(setting) if setting.switch else f"{flag(setting)} {setting.metavar}".rstrip()
        default = setting.shown or (f"`{setting.default()}`" if setting.default() else "none")
        meaning = setting.help.replace("|", "\\|") + _was(setting)
        rows.append(f"| `{shown}` | `{env_var(setting)}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def _was(setting: Setting) -> str:
    """What the docs and --help add for a renamed setting: its old names."""
    if not setting.aliases:
        return ""
    old = ", ".join(f"`{flag(setting, a.name)}` (`{env_var(setting, a.name)}`)"
                    for a in setting.aliases)
    return f" (was {old}: still read, with a warning)"


class _Flag(argparse.Action):
    """Stores a flag's value; given by an old name, says the new one once."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string is not None and option_string != self.option_strings[0]:
            deprecated(option_string, self.option_strings[0])
        setattr(namespace, self.dest, values)


def _from_environment(setting: Setting) -> str | None:
    value = os.environ.get(env_var(setting))
    for alias in setting.aliases:
        if not value and os.environ.get(env_var(setting, alias.name)):
            deprecated(env_var(setting, alias.name), env_var(setting))
            value = os.environ[env_var(setting, alias.name)]
    return value


def add_arguments(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """Add the flags of SETTINGS (or of `names`) with env-var defaults; a
    renamed setting's old flag and variable still work, with a warning."""
    for setting in SETTINGS:
        if names is not None and setting.name not in names:
            continue
        default = _from_environment(setting) or setting.default()
        switch: dict[str, Any] = {"nargs": "?", "const": "true"} if setting.switch else {}
        parser.add_argument(
            flag(setting), *(flag(setting, alias.name) for alias in setting.aliases),
            dest=setting.name, default=default, metavar=setting.metavar or None,
            action=_Flag, help=f"{setting.help} (env {env_var(setting)}; default {default})"
            f"{_was(setting).replace('`', '')}", **switch,
        )


@dataclass(frozen=True)
class DaemonConfig:
    cpu_bytes: int
    socket: str
    socket_mode: int
    group: str
    token_file: str
    read_token_file: str
    tls_cert: str
    tls_key: str
    shm_dir: str
    page_bytes: int
    lease_seconds: float
    ack_wait_seconds: float
    alloc_wait_seconds: float
    quarantine_seconds: float
    session_pending_bytes: int
    total_pending_bytes: int
    session_pending_entries: int
    max_sessions: int
    max_sessions_per_engine: int
    max_tokenless_sessions: int
    check_invariants: bool
    max_watchers: int
    max_watchers_per_peer: int
    warm_restart: bool
    fresh_start: bool
    on_exit: str
    metrics_port: int
    metrics_address: str
    remote: str
    remote_ttl_seconds: float
    remote_claim_seconds: float
    remote_token_file: str
    remote_queue_bytes: int
    remote_index_bytes: int
    remote_promotion_bytes: int
    log_level: str
    log_format: str


def from_namespace(args: argparse.Namespace) -> DaemonConfig:
    """Parse and check the raw flag values. Raises ValueError naming the flag."""
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        raw = getattr(args, setting.name)
        try:
            values[setting.name] = setting.parse(raw) if isinstance(raw, str) else raw
        except ValueError as exc:
            raise ValueError(f"{flag(setting)}: {exc}") from None
    # Defaults that scale with the cache (`core.quotas`) or the lease (`core.limits`).
    if not values["session_pending_bytes"]:
        values["session_pending_bytes"] = min(values["cpu_bytes"] // limits.SESSION_PENDING_SHARE,
                                              limits.DEFAULT_SESSION_PENDING_BYTES)
    if not values["total_pending_bytes"]:
        values["total_pending_bytes"] = values["cpu_bytes"] // limits.TOTAL_PENDING_SHARE
    if not values["ack_wait_seconds"]:  # an engine's step keeps its loads' pages a lease more
        values["ack_wait_seconds"] = limits.ACK_WAIT_LEASES * values["lease_seconds"]
    config = DaemonConfig(**values)
    if config.cpu_bytes < config.page_bytes:
        raise ValueError(
            f"--cpu-bytes ({format_size(config.cpu_bytes)}) is smaller than one page "
            f"(--page-bytes {format_size(config.page_bytes)})"
        )
    if config.ack_wait_seconds < config.lease_seconds:
        raise ValueError("--ack-wait-seconds must be at least --lease-seconds (a load in "
                         "flight is protected for the wait and one lease more: less would "
                         "cut an engine's steps shorter than its lease allows)")
    if config.quarantine_seconds < config.lease_seconds:
        raise ValueError("--quarantine-seconds must be at least --lease-seconds (a vanished "
                         "writer is noticed only after its lease)")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    return config


if __name__ == "__main__":
    print(markdown_table(), end="")
