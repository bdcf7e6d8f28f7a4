"""The connector's settings: every key of vLLM's `ec_connector_extra_config`
that ec-daemon reads, declared once, with its parser, its default and what
it means. The connector parses them from here, and docs/vllm.md's table of them
is `markdown_table()` (a test keeps the two equal), so a key cannot be parsed
with one default and documented with another. An unknown `ec_daemon_*` key
is refused: a misspelt setting would otherwise be ignored without a word.

No vLLM import: the table and the parsing are testable without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ec_protocol.protocol import SOCKET_ENV, default_socket_uri
from ec_protocol.transport import DEFAULT_DEADLINE_SECONDS

PREFIX = "ec_daemon_"
MAX_WEIGHTS_ID_CHARS = 128
DEFAULT_SAVE_QUEUE_BYTES = 256 << 20
# Loads staged a step before their use, per worker rank (on its device,
# outside vLLM's encoder budget): docs/architecture.md, "Staged loads".
DEFAULT_STAGING_BYTES = 256 << 20
# Each load checked against its entry's checksum: off, since it costs more
# than 5% of a load (docs/performance.md, 2b: the cpu backend's load of 1-64
# MiB takes 1.3-1.5x as long with it; a CUDA worker reads the pages on the
# host after its copy: benchmarks/gpu.py's `verify_cost`). Turn it on where
# other processes that map the region (any engine's workers, a --group) are
# not trusted.
DEFAULT_VERIFY_CHECKSUM = False
# How long a request is deferred at most for another engine's encode or a
# promotion.
DEFAULT_MAX_DEFER_SECONDS = 10.0
# How long `ensure` may wait in all, per step, for the answers to the items it
# just wanted: an answer takes a fraction of a millisecond; an unanswered want
# defers its request a step.
DEFAULT_ANSWER_WAIT_SECONDS = 0.005


def _socket(value: Any) -> str:
    return str(value or os.environ.get(SOCKET_ENV) or default_socket_uri())


def _weights_id(value: Any) -> str:
    text = str(value or "")
    if len(text) > MAX_WEIGHTS_ID_CHARS or not text.isprintable():
        raise ValueError(f"ec_daemon_weights_id must be at most {MAX_WEIGHTS_ID_CHARS} "
                         f"printable characters, got {text!r}")
    return text


def _non_negative(name: str, scale: float = 1.0) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        number = float(value)
        if not number >= 0:  # (NaN too)
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        return number * scale
    return parse


def _flag(name: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return parse


def _optional_path(value: Any) -> str | None:
    return str(value) if value else None


@dataclass(frozen=True)
class Key:
    name: str  # in the extra config
    attribute: str  # of ConnectorSettings
    parse: Callable[[Any], Any]
    default: Any  # handed to `parse` when the key is absent
    shown: str  # the default as docs/vllm.md shows it
    meaning: str


KEYS: tuple[Key, ...] = (
    Key("ec_daemon_socket", "socket", _socket, None,
        "`$EC_DAEMON_SOCKET`, else the daemon's default socket", "where the daemon serves"),
    Key("ec_daemon_copy_backend", "copy_backend", str, "auto", "`auto`",
        "`torch` (CUDA via torch), `cupy`, `cpu` (memcpy); `auto` = torch with CUDA, else cpu; "
        "or your own class as `package.module:ClassName` (the interface is "
        "`ec_client.copy.CopyBackend`, checked when the worker starts). It must copy the "
        "worker's device: `cpu` on a CUDA worker (or a CUDA backend on a CPU one) is refused "
        "at start"),
    Key("ec_daemon_rpc_deadline_s", "deadline_seconds",
        _non_negative("ec_daemon_rpc_deadline_s"), DEFAULT_DEADLINE_SECONDS,
        f"`{DEFAULT_DEADLINE_SECONDS:g}`", "deadline of the worker's calls to the daemon"),
    Key("ec_daemon_namespace", "namespace", str, "", '`""`',
        "extra text in the layout fingerprint, to keep otherwise identical models apart"),
    Key("ec_daemon_save_queue_bytes", "save_queue_bytes", int, DEFAULT_SAVE_QUEUE_BYTES,
        f"`{DEFAULT_SAVE_QUEUE_BYTES}` ({DEFAULT_SAVE_QUEUE_BYTES >> 20} MiB)",
        "memory held by encoder outputs waiting to be saved (outside vLLM's encoder budget); "
        "a full queue skips the save"),
    Key("ec_daemon_staging_bytes", "staging_bytes", int, DEFAULT_STAGING_BYTES,
        f"`{DEFAULT_STAGING_BYTES}` ({DEFAULT_STAGING_BYTES >> 20} MiB)",
        "memory each worker rank holds for loads copied and verified a step before the step "
        "that uses them (on its device, outside vLLM's encoder budget); a hit that finds it "
        "full is encoded instead"),
    Key("ec_daemon_verify_checksum", "verify_checksum", _flag("ec_daemon_verify_checksum"),
        DEFAULT_VERIFY_CHECKSUM, f"`{str(DEFAULT_VERIFY_CHECKSUM).lower()}`",
        "check each load against the checksum its writer recorded: a load whose bytes another "
        "process of the region rewrote is then refused (its request encodes the item), "
        "counted (`loads_checksum_mismatch`) and reported to the daemon, which hides the "
        "entry. Costs the loads more than 5% (docs/performance.md), so it is off; turn it on "
        "where processes that map the region are not trusted"),
    Key("ec_daemon_max_defer_s", "max_defer_seconds", _non_negative("ec_daemon_max_defer_s"),
        DEFAULT_MAX_DEFER_SECONDS, f"`{DEFAULT_MAX_DEFER_SECONDS:g}`",
        "how long a request is deferred at most while another engine of this host encodes "
        "the same image, or the daemon promotes it from the second tier; then this engine "
        "encodes it"),
    Key("ec_daemon_answer_wait_ms", "answer_wait_seconds",
        _non_negative("ec_daemon_answer_wait_ms", 1e-3), DEFAULT_ANSWER_WAIT_SECONDS * 1000,
        f"`{DEFAULT_ANSWER_WAIT_SECONDS * 1000:g}`",
        "how long one scheduler step waits in all for the daemon's answers about images it "
        "misses (wanted only where another engine shares the namespace or a second tier is "
        "on); an answer takes a fraction of a millisecond, and a request whose answer comes "
        "later is deferred one step. `0` never waits"),
    Key("ec_daemon_weights_id", "weights_id", _weights_id, "", '`""` (read from the model\'s '
        "files)",
        "names the weights in the namespace instead of reading the model's files: up to 128 "
        "printable characters (a release tag, an image digest). Engines with the same value "
        "share entries, so change it with every new checkpoint. Set it where file mtimes are "
        "pinned (Nix store, `SOURCE_DATE_EPOCH` builds) or differ between hosts that should "
        "share"),
    Key("embedding_model_identity", "store_model_identity", str, "",
        '`""` (the model, with its weights\' identity and a digest of its layout)',
        "vLLM's own key, read the same way: the model's name in the keys of a Mooncake "
        "second tier shared with vLLM's `MooncakeECConnector` (`cross_encoder_cache`). Set "
        "the same value on both to share entries with it; unset, the keys also name the "
        "weights' identity and a digest of everything else the local layout tells apart "
        "(quantization, `ec_daemon_namespace`, processor and media options, `hf_overrides`, "
        "config path, code revision, model implementation, load format), and are shared "
        "among ec-daemon hosts with the same layout only. Set, the keys are vLLM's, which "
        "name none of those nor the weights: you vouch that every engine given the same "
        "value encodes alike (same checkpoint and all of the above), so change it with "
        "every new checkpoint or any of those"),
    Key("embedding_cache_prefix", "store_prefix", str, "", '`""`',
        "vLLM's own key, read the same way: a prefix of those keys"),
    Key("ec_daemon_token_file", "token_file", _optional_path, None, "`$EC_DAEMON_TOKEN_FILE`",
        "a TCP daemon's client token, read from this file"),
    Key("ec_daemon_tls_ca", "tls_ca", _optional_path, None, "`$EC_DAEMON_TLS_CA`",
        "a TLS daemon's CA certificate (PEM)"),
)


@dataclass(frozen=True)
class ConnectorSettings:
    socket: str
    copy_backend: str
    deadline_seconds: float
    namespace: str
    save_queue_bytes: int
    staging_bytes: int
    verify_checksum: bool
    max_defer_seconds: float
    answer_wait_seconds: float
    weights_id: str
    store_model_identity: str
    store_prefix: str
    token_file: str | None
    tls_ca: str | None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorSettings:
        """Raises ValueError naming the key for a value that does not parse
        and for an `ec_daemon_*` key that is not one of `KEYS`."""
        known = {key.name for key in KEYS}
        unknown = sorted(k for k in extra if k.startswith(PREFIX) and k not in known)
        if unknown:
            raise ValueError(f"unknown ec-daemon extra-config key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        values = {}
        for key in KEYS:
            raw = extra.get(key.name, key.default)
            try:
                values[key.attribute] = key.parse(raw)
            except (TypeError, ValueError) as exc:
                if key.name in str(exc):
                    raise
                raise ValueError(f"{key.name}: {exc}") from exc
        return cls(**values)

    @property
    def transport(self) -> dict[str, Any]:
        return {"deadline_seconds": self.deadline_seconds, "token_file": self.token_file,
                "tls_ca": self.tls_ca}


def markdown_table() -> str:
    """docs/vllm.md's table of the keys."""
    rows = ["| extra-config key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{key.name}` | {key.shown} | {key.meaning} |" for key in KEYS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
