"""The second tier's stores are used through one declared interface
(`ec_daemon.remote.backend.Backend`), never by probing them: no `hasattr`
anywhere in the daemon, and `getattr` only where the daemon reflects over
another library's declared fields (protobuf messages, argparse, grpc's status
codes). Each backend implements the whole interface, and nothing outside the
backends asks which kind of store it has."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from ec_daemon.remote.backend import Backend

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


def test_each_backend_implements_the_whole_interface() -> None:
    from ec_daemon.remote.mooncake.backend import MooncakeBackend
    from ec_daemon.remote.redis.backend import RedisBackend

    for backend in (RedisBackend, MooncakeBackend):
        assert issubclass(backend, Backend)
        assert not inspect.isabstract(backend), backend.__abstractmethods__
    declared = {name for name, member in vars(Backend).items()
                if callable(member) and not name.startswith("_")}
    assert {"lookup", "confirm", "claim", "claim_many", "release", "publish", "fetch",
            "fetch_into", "follow", "threads"} <= declared


def kind_branches(root: Path) -> list[str]:
    """Each line of the second tier outside its backends' folders (and the
    interface, `backend.py`) that names a kind of store: an `indexed` flag, a
    value type of one backend, or a test of a backend's class."""
    found = []
    remote = root / "ec_daemon" / "remote"
    for path in sorted(remote.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if path.parent != remote or path.name == "backend.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(word in code for word in ("indexed", "StoredValue", "isinstance(store",
                                             "isinstance(backend", "RedisBackend",
                                             "MooncakeBackend")):
                found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_nothing_outside_the_backends_asks_which_store_it_has() -> None:
    assert kind_branches(ROOT) == []


def test_the_kind_finder_sees_a_branch(tmp_path: Path) -> None:
    remote = tmp_path / "ec_daemon" / "remote"
    (remote / "redis").mkdir(parents=True)
    (remote / "tier.py").write_text("if store.indexed:\n    pass\n")
    (remote / "redis" / "backend.py").write_text("indexed = True\n")
    assert kind_branches(tmp_path) == ["ec_daemon/remote/tier.py:1: if store.indexed:"]
