"""The second tier's stores are told apart by their declared interface
(`ec_daemon.remote.backend`), never by probing them: no `hasattr` anywhere in
the daemon, and `getattr` only where the daemon reflects over another
library's declared fields (protobuf messages, argparse, grpc's status codes).
Each backend implements its kind of store whole."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from ec_daemon.remote.backend import IndexedStore, ProbedStore, Store

ROOT = Path(__file__).resolve().parents[2]
# Modules that may call getattr, and why (none of them touches a store or a value).
GETATTR_ALLOWED = {
    "ec_daemon/serving/cli.py": "prints a reply's protobuf fields by their descriptors",
    "ec_daemon/serving/config.py": "reads each declared setting from argparse's namespace",
    "ec_daemon/serving/wire.py": "maps an error's code name to grpc.StatusCode",
}


def probes(root: Path) -> list[str]:
    """Each hasattr call in the daemon's source, and each getattr call
    outside GETATTR_ALLOWED, as 'path:line: source'."""
    found = []
    for path in sorted((root / "ec_daemon").rglob("*.py")):
        if "_proto" in path.parts:  # generated
            continue
        relative = path.relative_to(root).as_posix()
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id == "hasattr" or \
                    (node.func.id == "getattr" and relative not in GETATTR_ALLOWED):
                found.append(f"{relative}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_no_store_or_value_is_probed() -> None:
    assert probes(ROOT) == []


def test_the_finder_sees_a_probe(tmp_path: Path) -> None:
    package = tmp_path / "ec_daemon"
    for folder in ("remote", "plane", "serving"):
        (package / folder).mkdir(parents=True)
    (package / "remote" / "tier.py").write_text(
        "def f(store):\n    return hasattr(store, 'read_index')\n")
    (package / "plane" / "promotions.py").write_text("x = getattr(value, 'write_into', None)\n")
    (package / "serving" / "cli.py").write_text("y = getattr(reply, 'name')\n")
    assert probes(tmp_path) == [
        "ec_daemon/plane/promotions.py:1: getattr(value, 'write_into', None)",
        "ec_daemon/remote/tier.py:2: hasattr(store, 'read_index')"]


def test_each_backend_implements_its_kind_of_store() -> None:
    from ec_daemon.remote.mooncake import MooncakeStore
    from ec_daemon.remote.store import RedisStore

    assert issubclass(RedisStore, IndexedStore) and RedisStore.indexed is True
    assert issubclass(MooncakeStore, ProbedStore) and MooncakeStore.indexed is False
    for backend in (RedisStore, MooncakeStore):
        assert not inspect.isabstract(backend), backend.__abstractmethods__
    # The kinds share every call the tier makes of any store.
    shared = {name for name, member in vars(Store).items()
              if callable(member) and not name.startswith("_")}
    assert {"domain", "present", "claim", "claim_many", "release", "ping", "close",
            "accepts", "claimable"} <= shared
