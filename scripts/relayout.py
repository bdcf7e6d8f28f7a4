"""Move the packages' modules into their layer folders and rewrite every
reference to them across the repository (issue 31, "folders as layers").

Re-runnable and idempotent: a module already moved is left alone, and only
dotted names that start with an old path are rewritten, so running it again
after merging a branch written against the flat layout rewrites just that
branch's new references. No new path starts with an old one (checked below),
which is what makes a second run a no-op.

What it rewrites, in every tracked text file but this one:
- dotted names at word boundaries (`ec_daemon.cache`, `ec_daemon.cache.Cache`,
  imports, `python -m` strings, monkeypatch targets, entry points, docs);
- `from ec_daemon import cache, sizes` statements, split by new parent
  package (import order is then fixed with `ruff check --select I --fix`
  where .venv/bin/ruff exists);
- slash paths (`ec_daemon/config.py`), except in recorded benchmark
  output (docs/performance*.md), which names the files as they were then.

Usage: python scripts/relayout.py [--dry-run]   (from anywhere in the repo)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

# Old dotted path -> new dotted path. A package moves with everything in it.
MOVES: dict[str, str] = {
    # The daemon's durable state: the files that outlive the process.
    "ec_daemon.journal": "ec_daemon.durable.journal",
    "ec_daemon.index": "ec_daemon.durable.index",
    "ec_daemon.region": "ec_daemon.durable.region",
    # The cache core: the state machine, no I/O but the durable layer.
    "ec_daemon.records": "ec_daemon.core.records",
    "ec_daemon.limits": "ec_daemon.core.limits",
    "ec_daemon.allocator": "ec_daemon.core.allocator",
    "ec_daemon.eviction": "ec_daemon.core.eviction",
    "ec_daemon.events": "ec_daemon.core.events",
    "ec_daemon.sessions": "ec_daemon.core.sessions",
    "ec_daemon.quotas": "ec_daemon.core.quotas",
    "ec_daemon.cache": "ec_daemon.core.cache",
    "ec_daemon.invariants": "ec_daemon.core.invariants",
    "ec_daemon.stats": "ec_daemon.core.stats",
    # The data plane: the core's listeners and waits, on the event loop.
    "ec_daemon.convergence": "ec_daemon.plane.convergence",
    "ec_daemon.saves": "ec_daemon.plane.saves",
    "ec_daemon.promotions": "ec_daemon.plane.promotions",
    "ec_daemon.dataplane": "ec_daemon.plane.dataplane",
    "ec_daemon.watch": "ec_daemon.plane.watch",
    "ec_daemon.wakeups": "ec_daemon.plane.wakeups",
    # Serving: gRPC, the command line, settings, start-up. The top.
    "ec_daemon.service": "ec_daemon.serving.service",
    "ec_daemon.wire": "ec_daemon.serving.wire",
    "ec_daemon.auth": "ec_daemon.serving.auth",
    "ec_daemon.metrics": "ec_daemon.serving.metrics",
    "ec_daemon.adoption": "ec_daemon.serving.adoption",
    "ec_daemon.startup": "ec_daemon.serving.startup",
    "ec_daemon.server": "ec_daemon.serving.server",
    "ec_daemon.config": "ec_daemon.serving.config",
    "ec_daemon.cli": "ec_daemon.serving.cli",
    # The client. What an engine's scheduler and worker processes share.
    "ec_client.session": "ec_client.common.session",
    "ec_client.contract": "ec_client.common.contract",
    "ec_client.settings": "ec_client.common.settings",
    "ec_client.trust": "ec_client.common.trust",
    # The scheduler process's side.
    "ec_client.scheduler": "ec_client.scheduler_side.scheduler",
    "ec_client.view": "ec_client.scheduler_side.view",
    # A worker process's side (`StreamSaves` gets a name apart from `saver`).
    "ec_client.worker": "ec_client.worker_side.worker",
    "ec_client.saver": "ec_client.worker_side.saver",
    "ec_client.saves": "ec_client.worker_side.stream_saves",
    "ec_client.regions": "ec_client.worker_side.regions",
    # The worker's data path: the region mapping the copy backends copy through.
    # `ec_client.copy` itself stays: custom backends name their interface there.
    "ec_client.mapping": "ec_client.copy.mapping",
    # The vLLM shell stays at ec_client's root: `ec_client.vllm_connector` is
    # the path users give vLLM (ec_connector_module_path, the plugin entry point).
}

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
# Recorded output (profiles of an earlier layout): its slash paths stay as run.
KEEP_SLASH_PATHS = ("docs/performance.md", "docs/performance-archive.md")
TOPS = sorted({old.split(".")[0] for old in MOVES})
_TOP = "|".join(map(re.escape, TOPS))
DOTTED = re.compile(rf"(?<![\w.])(?:{_TOP})(?:\.\w+)+")
SLASHED = re.compile(rf"(?<![\w./-])(?:{_TOP})(?:/\w+)+(?=\.py\b|/)")
FROM_IMPORT = re.compile(
    rf"^(?P<indent>[ \t]*)from[ \t]+(?P<package>(?:{_TOP})(?:\.\w+)*)[ \t]+import[ \t]+"
    r"(?P<names>\([^)]*\)|[^\n]*?)(?P<comment>[ \t]*#[^\n]*)?$",
    re.MULTILINE)


def relocate(dotted: str) -> str:
    """The name's new path: its longest moved prefix replaced."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        new = MOVES.get(".".join(parts[:cut]))
        if new is not None:
            return ".".join([new, *parts[cut:]])
    return dotted


def _check_moves() -> None:
    """No new path may start with an old one: a second run would move it again."""
    for new in MOVES.values():
        if relocate(new) != new:
            sys.exit(f"relayout: {new} starts with a moved path; pick another folder name")


def _split_from_import(match: re.Match[str]) -> str:
    """`from ec_daemon import cache, sizes`: one statement per new parent package."""
    package = match["package"]
    names = [n.strip() for n in match["names"].strip("()").replace("\n", " ").split(",")]
    groups: dict[str, list[str]] = {}
    renamed = False
    for name in filter(None, names):
        base, _, alias = (part.strip() for part in name.partition(" as "))
        parent, _, leaf = relocate(f"{package}.{base}").rpartition(".")
        if leaf != base and not alias:
            alias, renamed = base, True  # a renamed module keeps the name its importer uses
        groups.setdefault(parent, []).append(f"{leaf} as {alias}" if alias else leaf)
    if len(groups) == 1 and not renamed:  # keep the statement's own layout
        start, end = (i - match.start() for i in match.span("package"))
        return match[0][:start] + next(iter(groups)) + match[0][end:]
    lines = [f"{match['indent']}from {parent} import {', '.join(group)}"
             for parent, group in groups.items()]
    return "\n".join(lines) + (match["comment"] or "")


def rewrite(text: str, slash_paths: bool) -> str:
    text = FROM_IMPORT.sub(_split_from_import, text)
    text = DOTTED.sub(lambda m: relocate(m[0]), text)
    if slash_paths:
        text = SLASHED.sub(lambda m: relocate(m[0].replace("/", ".")).replace(".", "/"), text)
    return text


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True,
                          capture_output=True, text=True).stdout


def move_files(dry_run: bool) -> None:
    for old, new in MOVES.items():
        old_path, new_path = (Path(*name.split(".")) for name in (old, new))
        is_package = (ROOT / old_path).is_dir()
        source = ROOT / old_path if is_package else ROOT / old_path.with_suffix(".py")
        target = ROOT / new_path if source.is_dir() else ROOT / new_path.with_suffix(".py")
        if not source.exists() or target.exists():
            continue
        print(f"move {source.relative_to(ROOT)} -> {target.relative_to(ROOT)}")
        if dry_run:
            continue
        for folder in reversed(target.relative_to(ROOT).parents[:-1]):
            if not (ROOT / folder / "__init__.py").exists():
                sys.exit(f"relayout: create the package {folder}/ (its __init__.py says why) first")
        _git("mv", str(source), str(target))


def rewrite_files(dry_run: bool) -> list[Path]:
    changed = []
    for name in _git("ls-files", "-z").split("\0"):
        path = ROOT / name
        if not name or name == SELF or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # images
        new = rewrite(text, slash_paths=name not in KEEP_SLASH_PATHS)
        if new != text:
            print(f"rewrite {name}")
            changed.append(path)
            if not dry_run:
                path.write_text(new)
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="say what would change")
    args = parser.parse_args()
    _check_moves()
    move_files(args.dry_run)
    changed = rewrite_files(args.dry_run)
    ruff = ROOT / ".venv" / "bin" / "ruff"
    python_files = [str(p) for p in changed if p.suffix == ".py"]
    if python_files and ruff.exists() and not args.dry_run:
        subprocess.run([str(ruff), "check", "--quiet", "--select", "I", "--fix", *python_files],
                       cwd=ROOT, check=False)


if __name__ == "__main__":
    main()
