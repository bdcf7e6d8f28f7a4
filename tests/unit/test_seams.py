"""The daemon's seams stay typed and made whole (issue 41): no object is
wired after it is made (a hook assigned onto another object, a lambda left
as a placeholder to be replaced), no outcome is compared as a string, and
the second tier the server hands the plane implements every call the plane
declares (`plane.second_tier.SecondTier`), with the same parameters."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from ec_daemon.plane.second_tier import SecondTier
from ec_daemon.remote.tier import RemoteTier

ROOT = Path(__file__).resolve().parents[2]


def _methods(cls: ast.ClassDef) -> set[str]:
    return {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


def hooks(root: Path) -> list[str]:
    """Assignments that wire an object after it is made: a lambda or one of
    the class's own methods assigned onto another object's attribute, any
    `on_*` attribute of another object, or a lambda kept in an attribute of
    one's own (a placeholder for a hook)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        owners = {id(n): c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                  for n in ast.walk(c)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            owner = owners.get(id(node))
            own_method = (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
                          and value.value.id == "self" and owner is not None
                          and value.attr in _methods(owner))
            lam = isinstance(value, ast.Lambda)
            for target in targets:
                if not isinstance(target, ast.Attribute):
                    continue
                mine = isinstance(target.value, ast.Name) and target.value.id == "self"
                if (lam or (not mine and (own_method or target.attr.startswith("on_")))):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_daemon_object_is_wired_after_it_is_made() -> None:
    assert hooks(ROOT / "ec_daemon") == []


def test_the_hook_finder_sees_hooks(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "class Plane:\n"
        "    def __init__(self, cache, convergence):\n"
        "        self.later = lambda: None\n"
        "        cache.on_reclaim = self.wake\n"
        "        convergence.resolve = self._resolve\n"
        "        convergence.call_later = lambda s, fn: None\n"
        "        cache.page_bytes = self.page_bytes\n"  # (data: no hook)
        "        self.tier = cache.tier\n"
        "    def wake(self): ...\n"
        "    def _resolve(self): ...\n")
    assert [line.split(": ", 1)[1] for line in hooks(tmp_path)] == [
        "self.later = lambda: None", "cache.on_reclaim = self.wake",
        "convergence.resolve = self._resolve", "convergence.call_later = lambda s, fn: None"]


def string_outcomes(root: Path) -> list[str]:
    """Comparisons of an enum's `.value` with a string (`outcome.value ==
    "found"`): the enum is compared instead."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "value" for s in sides) and any(
                    isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_outcome_is_compared_as_a_string() -> None:
    assert string_outcomes(ROOT / "ec_daemon") == []


def test_the_outcome_finder_sees_a_string_comparison(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text('if outcome.value == "found":\n    pass\n'
                                   'if outcome is Resolution.FOUND:\n    pass\n')
    assert len(string_outcomes(tmp_path)) == 1


def test_the_tier_implements_every_call_the_plane_declares_as_declared() -> None:
    declared = {name for name, member in vars(SecondTier).items()
                if callable(member) and not name.startswith("_")}
    assert len(declared) >= 9  # follow, unfollow, available, resolve, publish, reserve, ...
    for name in sorted(declared):
        wanted = inspect.signature(getattr(SecondTier, name))
        implemented = inspect.signature(getattr(RemoteTier, name))
        assert list(implemented.parameters) == list(wanted.parameters), name
        assert [p.kind for p in implemented.parameters.values()] == \
            [p.kind for p in wanted.parameters.values()], name


# Where the daemon names its own dependencies: the core, the plane, the
# durable files, and the second tier's backend-agnostic parts. (The serving
# layer takes protobuf messages, which have no types; the backends take the
# Redis and Mooncake clients, which have none either; values take any buffer,
# which Python 3.11 cannot name.)
TYPED = ("core", "plane", "durable", "remote/backend.py", "remote/tier.py", "remote/common.py",
         "remote/publisher.py", "remote/resolver.py", "remote/budget.py", "remote/breaker.py")


def untyped_parameters(root: Path, where: tuple[str, ...] = TYPED) -> list[str]:
    """Parameters annotated `Any` in `where` (folders or files under `root`)."""
    found = []
    for part in where:
        for path in sorted((root / part).rglob("*.py") if (root / part).is_dir()
                           else [root / part]):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                    if arg is not None and arg.annotation is not None and any(
                            isinstance(n, ast.Name) and n.id == "Any"
                            for n in ast.walk(arg.annotation)):
                        found.append(f"{path.relative_to(root)}:{node.lineno}: "
                                     f"{node.name}({arg.arg})")
    return found


def test_the_daemon_names_the_type_of_every_dependency_it_takes() -> None:
    assert untyped_parameters(ROOT / "ec_daemon") == []


def test_the_parameter_finder_sees_any(tmp_path: Path) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "m.py").write_text(
        "class Cache:\n"
        "    def __init__(self, stamps: Any, index: Index | None, **fields: Any): ...\n")
    assert untyped_parameters(tmp_path, ("core",)) == [
        "core/m.py:2: __init__(stamps)", "core/m.py:2: __init__(fields)"]
