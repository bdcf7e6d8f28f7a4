"""The one shape of a settings table, the daemon's flags and the connector's
extra-config keys alike (as Redis's `config.c` declares each setting in one
line): a `Setting` names its value's attribute, how text parses into it, its
default, its help and the default as the docs show it; each table's owner
spells the outside name (`--lease-seconds` and `EC_DAEMON_LEASE_SECONDS`,
`ec_daemon_max_defer_seconds`) from the attribute, or takes `key` where the
outside already has a name (vLLM's own `embedding_cache_prefix`).

A renamed setting keeps its old name working as an `Alias`: given, it logs
one warning naming the new one (once per process), and a value in another
unit (`ec_daemon_answer_wait_ms`) is converted by the alias's own parser.
Each table's dataclass is written by hand, so mypy and readers see its
types; `field_mismatches` is what its test holds it to, so an attribute is
declared in the table and nowhere else. A leaf: no daemon or client import.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ec_protocol.settings")

_warned: set[str] = set()


@dataclass(frozen=True)
class Alias:
    """An old name of a setting, still accepted."""

    name: str  # as the table spells its own names (a flag's, a key's)
    # Where the old name took another unit: its value -> the new name's text.
    convert: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Setting:
    name: str  # the attribute of the table's dataclass
    parse: Callable[[Any], Any]
    default: Callable[[], Any]  # what `parse` is handed when nothing is given
    help: str
    metavar: str = ""
    shown: str = ""  # the default as the docs show it, where `default()` is not it
    env: str = ""  # an environment variable other than the table's own spelling
    key: str = ""  # the outside name, where it is not spelled from `name`
    switch: bool = False  # a flag whose bare form means "true" (`--fresh-start`)
    aliases: tuple[Alias, ...] = ()


def deprecated(old: str, new: str) -> None:
    """Log, once per process, that `old` is read as `new`."""
    if old not in _warned:
        _warned.add(old)
        log.warning("%s is deprecated: it is read as %s, its new name", old, new)


def field_mismatches(settings: Iterable[Setting], cls: type) -> list[str]:
    """How `cls`'s fields differ from the table's names, in order: [] when
    each setting is one field and each field one setting."""
    names = [setting.name for setting in settings]
    fields = [field.name for field in dataclasses.fields(cls)]
    problems = [f"{name}: in the table, not a field of {cls.__name__}"
                for name in names if name not in fields]
    problems += [f"{name}: a field of {cls.__name__}, not in the table"
                 for name in fields if name not in names]
    if not problems and names != fields:
        problems.append(f"{cls.__name__}'s fields are not in the table's order")
    if len(set(names)) != len(names):
        problems.append("a name is declared twice in the table")
    return problems
