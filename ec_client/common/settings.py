"""The connector's settings: every key of vLLM's `ec_connector_extra_config`
that ec-daemon reads, declared once, with its parser, its default and what
it means. The connector parses them from here, and docs/vllm.md's table of them
is `markdown_table()` (a test keeps the two equal), so a key cannot be parsed
with one default and documented with another. An unknown `ec_daemon_*` key
is refused: a misspelt setting would otherwise be ignored without a word.
The table's shape is the daemon's (`ec_protocol.settings_table`): times are
seconds and say so (`ec_daemon_max_defer_seconds`), sizes take `256MiB` as
the daemon's flags do, a renamed key keeps its old name as a deprecated
alias (one warning naming the new), every number among the defaults is
`common.limits`'s, and `ConnectorSettings` is held to the table by a test.

No vLLM import: the table and the parsing are testable without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ec_client.common.limits import (
    DEFAULT_ANSWER_WAIT_SECONDS,
    DEFAULT_MAX_DEFER_SECONDS,
    DEFAULT_SAVE_QUEUE_BYTES,
    DEFAULT_STAGING_BYTES,
    DEFAULT_VERIFY_CHECKSUM,
    MAX_WEIGHTS_ID_CHARS,
)
from ec_protocol.protocol import SOCKET_ENV, default_socket_uri
from ec_protocol.settings_table import Alias, Setting, deprecated
from ec_protocol.sizes import format_size, parse_size
from ec_protocol.transport import DEFAULT_DEADLINE_SECONDS

PREFIX = "ec_daemon_"


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


def _size(value: Any) -> int:
    """Bytes as a number, or a size as the daemon's flags take it: `256MiB`."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"invalid size {value!r}: must be zero or more")
        return value
    return parse_size(str(value))


def _shown_size(n: int) -> str:
    return f"`{format_size(n).replace(' ', '')}`"


def key_of(setting: Setting) -> str:
    """The setting's extra-config key: `ec_daemon_` and its attribute, or vLLM's own."""
    return setting.key or PREFIX + setting.name


SETTINGS: tuple[Setting, ...] = (
    Setting("socket", _socket, lambda: None, "where the daemon serves",
            shown="`$EC_DAEMON_SOCKET`, else the daemon's default socket"),
    Setting("copy_backend", str, lambda: "auto",
            "`torch` (CUDA via torch), `cupy`, `cpu` (memcpy); `auto` = torch with CUDA, else "
            "cpu; or your own class as `package.module:ClassName` (the interface is "
            "`ec_client.copy.CopyBackend`, checked when the worker starts). It must copy the "
            "worker's device: `cpu` on a CUDA worker (or a CUDA backend on a CPU one) is "
            "refused at start"),
    Setting("deadline_seconds", _non_negative("ec_daemon_rpc_deadline_seconds"),
            lambda: DEFAULT_DEADLINE_SECONDS, "deadline of the worker's calls to the daemon",
            key="ec_daemon_rpc_deadline_seconds", aliases=(Alias("ec_daemon_rpc_deadline_s"),)),
    Setting("namespace", str, lambda: "",
            "extra text in the layout fingerprint, to keep otherwise identical models apart",
            shown='`""`'),
    Setting("save_queue_bytes", _size, lambda: DEFAULT_SAVE_QUEUE_BYTES,
            "memory held by encoder outputs waiting to be saved (outside vLLM's encoder "
            "budget); a full queue skips the save. A size: bytes, or `512MiB`, `1GiB`",
            shown=_shown_size(DEFAULT_SAVE_QUEUE_BYTES)),
    Setting("staging_bytes", _size, lambda: DEFAULT_STAGING_BYTES,
            "memory each worker rank holds for loads copied and verified a step before the "
            "step that uses them (on its device, outside vLLM's encoder budget); a hit that "
            "finds it full is encoded instead. A size: bytes, or `512MiB`, `1GiB`",
            shown=_shown_size(DEFAULT_STAGING_BYTES)),
    Setting("verify_checksum", _flag("ec_daemon_verify_checksum"),
            lambda: DEFAULT_VERIFY_CHECKSUM,
            "check each load against the checksum its writer recorded: a load whose bytes "
            "another process of the region rewrote is then refused (its request encodes the "
            "item), counted (`loads_checksum_mismatch`) and reported to the daemon, which "
            "hides the entry. Costs the loads more than 5% (docs/performance.md), so it is "
            "off; turn it on where processes that map the region are not trusted"),
    Setting("max_defer_seconds", _non_negative("ec_daemon_max_defer_seconds"),
            lambda: DEFAULT_MAX_DEFER_SECONDS,
            "how long a request is deferred at most while another engine of this host "
            "encodes the same image, or the daemon promotes it from the second tier; then "
            "this engine encodes it", aliases=(Alias("ec_daemon_max_defer_s"),)),
    Setting("answer_wait_seconds", _non_negative("ec_daemon_answer_wait_seconds"),
            lambda: DEFAULT_ANSWER_WAIT_SECONDS,
            "how long one scheduler step waits in all for the daemon's answers about images "
            "it misses (wanted only where another engine shares the namespace or a second "
            "tier is on); an answer takes a fraction of a millisecond, and a request whose "
            "answer comes later is deferred one step. `0` never waits",
            aliases=(Alias("ec_daemon_answer_wait_ms",
                           _non_negative("ec_daemon_answer_wait_ms", 1e-3)),)),
    Setting("weights_id", _weights_id, lambda: "",
            "names the weights in the namespace instead of reading the model's files: up to "
            f"{MAX_WEIGHTS_ID_CHARS} printable characters (a release tag, an image digest). "
            "Engines with the same value share entries, so change it with every new "
            "checkpoint. Set it where file mtimes are pinned (Nix store, `SOURCE_DATE_EPOCH` "
            "builds) or differ between hosts that should share",
            shown='`""` (read from the model\'s files)'),
    Setting("store_model_identity", str, lambda: "",
            "vLLM's own key, read the same way: the model's name in the keys of a Mooncake "
            "second tier shared with vLLM's `MooncakeECConnector` (`cross_encoder_cache`). Set "
            "the same value on both to share entries with it; unset, the keys also name the "
            "weights' identity and a digest of everything else the local layout tells apart "
            "(quantization, `ec_daemon_namespace`, processor and media options, "
            "`hf_overrides`, config path, code revision, model implementation, load format), "
            "and are shared among ec-daemon hosts with the same layout only. Set, the keys "
            "are vLLM's, which name none of those nor the weights: you vouch that every "
            "engine given the same value encodes alike (same checkpoint and all of the "
            "above), so change it with every new checkpoint or any of those",
            shown='`""` (the model, with its weights\' identity and a digest of its layout)',
            key="embedding_model_identity"),
    Setting("store_prefix", str, lambda: "",
            "vLLM's own key, read the same way: a prefix of those keys", shown='`""`',
            key="embedding_cache_prefix"),
    Setting("token_file", _optional_path, lambda: None,
            "a TCP daemon's client token, read from this file", shown="`$EC_DAEMON_TOKEN_FILE`"),
    Setting("tls_ca", _optional_path, lambda: None, "a TLS daemon's CA certificate (PEM)",
            shown="`$EC_DAEMON_TLS_CA`"),
)


def _given(setting: Setting, extra: dict[str, Any]) -> tuple[str, Any]:
    """The key the extra config gives the setting by ("" for none), and its
    value (an old key's converted to the new key's unit, with one warning
    naming the new key)."""
    given = [name for name in (key_of(setting), *(a.name for a in setting.aliases))
             if name in extra]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} are one setting: give only "
                         f"{key_of(setting)}")
    if not given:
        return "", setting.default()
    if given[0] == key_of(setting):
        return given[0], extra[given[0]]
    alias = next(a for a in setting.aliases if a.name == given[0])
    deprecated(alias.name, key_of(setting))
    return alias.name, alias.convert(extra[alias.name]) if alias.convert else extra[alias.name]


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
        and for an `ec_daemon_*` key that is not one of `SETTINGS` (nor an old name of one)."""
        known = {key_of(setting) for setting in SETTINGS}
        old = {alias.name for setting in SETTINGS for alias in setting.aliases}
        unknown = sorted(k for k in extra if k.startswith(PREFIX) and k not in known | old)
        if unknown:
            raise ValueError(f"unknown ec-daemon extra-config key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        values = {}
        for setting in SETTINGS:
            name = key_of(setting)
            try:
                name, raw = _given(setting, extra)
                name = name or key_of(setting)
                values[setting.name] = setting.parse(raw)
            except (TypeError, ValueError) as exc:
                if str(exc).startswith((f"{name} ", f"{name}:")):
                    raise
                raise ValueError(f"{name}: {exc}") from exc
        return cls(**values)

    @property
    def transport(self) -> dict[str, Any]:
        return {"deadline_seconds": self.deadline_seconds, "token_file": self.token_file,
                "tls_ca": self.tls_ca}


def markdown_table() -> str:
    """docs/vllm.md's table of the keys."""
    rows = ["| extra-config key | default | meaning |", "|---|---|---|"]
    for setting in SETTINGS:
        value = setting.default()
        default = setting.shown or (f"`{str(value).lower()}`" if isinstance(value, bool)
                                    else f"`{value:g}`" if isinstance(value, float)
                                    else f"`{value}`")
        was = ", ".join(f"`{alias.name}`" for alias in setting.aliases)
        was = f" (was {was}: still read, with a warning)" if was else ""
        rows.append(f"| `{key_of(setting)}` | {default} | {setting.help}{was} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
