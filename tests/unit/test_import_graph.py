"""The packages' import graph, read from the source: no module imports one
that imports it back (imports under TYPE_CHECKING and inside functions
count too), and the daemon never imports the client."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ec_daemon", "ec_protocol", "ec_client")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "_proto" in path.parts:  # generated
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of these packages it imports anywhere in its source."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets.add(node.module)  # `from package import module` names a module too
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import one another (strongly connected, > 1)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_daemon_never_imports_the_client():
    graph = import_graph()
    assert {m: sorted(t for t in targets if t.startswith("ec_client"))
            for m, targets in graph.items()
            if m.startswith("ec_daemon") and any(t.startswith("ec_client") for t in targets)} == {}


def test_worker_processes_never_import_the_schedulers_side():
    """The scheduler-to-worker contract lives in ec_client.contract."""
    graph = import_graph()
    seen, todo = set(), ["ec_client.worker"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    assert "ec_client.scheduler" not in seen
