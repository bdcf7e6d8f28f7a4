"""What the device check imports, read from the source: every module of this
tree the device run loads, followed import by import, and each import of
another distribution checked against what the device machine has.

The dry run (`make gpu-check DRY_RUN=1`) imports for real all it can in its
model of the device (Python 3.12, the device image's packages, the carried
wheels); but the device's torch and CuPy are CUDA builds that do not install
here without gigabytes of CUDA libraries, and a GPU test module skips itself
at `pytest.importorskip("torch")` before its other imports run. So this
module reads them instead: from the roots (the conftests, the GPU tests, the
benchmarks and the daemon the check starts) it follows this tree's imports
and lists every import of a module that is neither the standard library,
this tree, the device image's (`gpu_device.DEVICE_MODULES`) nor a carried
wheel's: what would stop the device run before its first GPU call.

Which imports count: a module's own top-level imports (what loading it
runs), not those under `if TYPE_CHECKING:` nor those in a `try` that handles
ImportError; and in test modules and conftests, the imports inside functions
too (every GPU test's body runs on the device). Imports inside the library's
functions are not followed: they run on paths the check may never take (the
daemon's second tier imports redis-py only with --remote).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ec_daemon", "ec_client", "ec_protocol", "tests", "benchmarks")
# The device run's entry points: pytest's conftests and the GPU tests, the
# benchmarks it runs, the backends it loads by name and the daemon it starts.
ROOTS = ("tests/conftest.py", "tests/gpu/conftest.py", "tests/gpu/test_*.py",
         "benchmarks/gpu_check.py", "benchmarks/gpu.py", "benchmarks/concurrency.py",
         "ec_client/copy/torch_backend.py", "ec_client/copy/cupy_backend.py",
         "ec_daemon/__main__.py")
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


@dataclass(frozen=True)
class Missing:
    """An import the device run makes of a module the device lacks."""

    module: str  # the imported name
    path: str  # where, relative to the tree
    line: int
    chain: tuple[str, ...]  # how the run reaches that file, from a root

    def __str__(self) -> str:
        via = " -> ".join(self.chain)
        return (f"{self.path}:{self.line} imports {self.module} (reached by {via}): "
                "not in the device image, not carried")


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The file of module `name` of this tree, or None."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runs_bodies(path: Path) -> bool:
    """Whether the run executes this file's functions too (tests, conftests)."""
    return path.name.startswith("test_") or path.name == "conftest.py"


def _guarded(node: ast.Try) -> bool:
    """A `try` whose ImportError handler goes on without the module (one
    that raises again only rewords the failure)."""
    for handler in node.handlers:
        names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        catches = handler.type is None or any(
            isinstance(n, ast.Name) and n.id in IMPORT_ERRORS for n in names)
        if catches and not any(isinstance(s, ast.Raise) for s in handler.body):
            return True
    return False


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, root: Path = ROOT) -> Iterator[tuple[str, int]]:
    """(module imported, line) of each import that counts (module docstring)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    bodies = _runs_bodies(path)

    def walk(nodes: Iterable[ast.stmt]) -> Iterator[tuple[str, int]]:
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name, node.lineno
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                yield base, node.lineno
                for alias in node.names:  # `from package import module`
                    yield f"{base}.{alias.name}", node.lineno
            elif isinstance(node, ast.Try):
                if not _guarded(node):
                    yield from walk(node.body)
                yield from walk([*node.orelse, *node.finalbody])
            elif isinstance(node, ast.If):
                if not _is_type_checking(node):
                    yield from walk(node.body)
                yield from walk(node.orelse)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if bodies:
                    yield from walk(node.body)
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body)
            elif isinstance(node, (ast.With, ast.For, ast.While)):
                yield from walk([*node.body, *getattr(node, "orelse", [])])

    yield from walk(tree.body)


def roots(root: Path = ROOT) -> list[Path]:
    found: list[Path] = []
    for pattern in ROOTS:
        found += sorted(root.glob(pattern))
    return found


def closure(root: Path = ROOT) -> tuple[dict[Path, tuple[str, ...]], list[tuple[str, Path, int]]]:
    """The files of this tree the run loads (each with how it is reached)
    and every import of another distribution: (module, file, line)."""
    reached: dict[Path, tuple[str, ...]] = {}
    outside: list[tuple[str, Path, int]] = []
    todo = [(p, (str(p.relative_to(root)),)) for p in roots(root)]
    while todo:
        path, chain = todo.pop()
        if path in reached:
            continue
        reached[path] = chain
        for name, line in imports(path, root):
            top = name.split(".")[0]
            if top in PACKAGES:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # a.b.c loads a and a.b too
                    target = module_file(".".join(parts[:i]), root)
                    if target is not None and target not in reached:
                        todo.append((target, (*chain, str(target.relative_to(root)))))
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                outside.append((name, path, line))
    return reached, outside


def missing(allowed: Iterable[str], root: Path = ROOT) -> list[Missing]:
    """Imports the device run makes of modules neither the device image nor
    the carried wheels provide (`allowed`: their top-level import names)."""
    have = set(allowed)
    reached, outside = closure(root)
    found = {}
    for name, path, line in outside:
        top = name.split(".")[0]
        if top not in have:
            key = (top, path)
            found.setdefault(key, Missing(top, str(path.relative_to(root)), line, reached[path]))
    return sorted(found.values(), key=lambda m: (m.path, m.line))


def loadable(root: Path = ROOT) -> list[str]:
    """The modules of this tree the run loads, by name (for the real imports)."""
    return sorted(module_name(p, root) for p in closure(root)[0])
