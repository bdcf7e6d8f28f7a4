"""The packages' import graph, read from the source (imports under
TYPE_CHECKING and inside functions count too): no module imports one that
imports it back, benchmarks included; the daemon never imports the client;
and each layer folder never imports the folders above it. And what the
source declares where: one name per idea, every bound of the daemon in
`core.limits` and of the client in `common.limits`, seams typed and wired
at construction, and every top-level folder one kind of room.

The daemon's layers, bottom up: the vocabulary (`errors`; sizes are the protocol's), durable
state, the cache core, then the data plane and the second tier side by side
(neither imports the other: the server hands the tier to the plane), and
serving on top. Each folder's `__init__` says why it sits where it does."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ec_daemon", "ec_protocol", "ec_client", "benchmarks")

DURABLE, CORE, PLANE = "ec_daemon.durable", "ec_daemon.core", "ec_daemon.plane"
REMOTE, SERVING = "ec_daemon.remote", "ec_daemon.serving"
REDIS, MOONCAKE = f"{REMOTE}.redis", f"{REMOTE}.mooncake"  # the second tier's backends
LIMITS = f"{CORE}.limits"  # every bound, declared once: a leaf every layer reads
# The daemon's modules outside its layer folders: each imports nothing of the
# daemon (`__main__` only starts `serving.cli`).
DAEMON_ROOT = {"ec_daemon", "ec_daemon.errors", "ec_daemon.__main__"}
# The client's layers: what both processes share, the two sides, the worker's
# copy backends; the vLLM shell is every module at ec_client's root.
COMMON, SCHEDULER_SIDE = "ec_client.common", "ec_client.scheduler_side"
WORKER_SIDE, COPY = "ec_client.worker_side", "ec_client.copy"
CLIENT_FOLDERS = (COMMON, SCHEDULER_SIDE, WORKER_SIDE, COPY)


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


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_worker_processes_never_import_the_schedulers_side():
    """The scheduler-to-worker contract lives in ec_client.common.contract."""
    graph = import_graph()
    assert sorted(m for m in reachable(graph, f"{WORKER_SIDE}.worker")
                  if within(m, SCHEDULER_SIDE)) == []


def test_scheduler_processes_never_import_the_workers_side_or_the_copy_backends():
    graph = import_graph()
    assert sorted(m for m in reachable(graph, f"{SCHEDULER_SIDE}.scheduler")
                  if within(m, WORKER_SIDE) or within(m, COPY)) == []


def within(module: str, folder: str) -> bool:
    return module == folder or module.startswith(folder + ".")


def imports_of(graph: dict[str, set[str]], folder: str,
               never: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules of `folder` that import any of `never`, with what they import."""
    return {module: sorted(t for t in targets if any(within(t, other) for other in never))
            for module, targets in graph.items()
            if within(module, folder) and any(within(t, other) for t in targets for other in never)}


def test_the_rule_check_sees_an_import_running_up():
    graph = {"p.low.a": {"p.low.b", "p.high"}, "p.low.b": set(), "p.high": {"p.low.a"}}
    assert imports_of(graph, "p.low", ("p.high",)) == {"p.low.a": ["p.high"]}
    assert imports_of(graph, "p.high", ("p.low.b",)) == {}


def test_every_daemon_module_sits_in_a_layer_folder():
    folders = (DURABLE, CORE, PLANE, REMOTE, SERVING)
    assert sorted(m for m in import_graph() if m.startswith("ec_daemon")
                  and m not in DAEMON_ROOT and not any(within(m, f) for f in folders)) == []


def test_the_daemons_root_modules_import_nothing_of_the_daemon():
    graph = import_graph()
    assert {m: sorted(t for t in graph[m] if within(t, "ec_daemon"))
            for m in DAEMON_ROOT - {"ec_daemon.__main__"}} == {
        m: [] for m in DAEMON_ROOT - {"ec_daemon.__main__"}}
    assert graph["ec_daemon.__main__"] == {f"{SERVING}.cli"}


def test_durable_state_never_imports_the_core_plane_second_tier_or_serving():
    """But the core's limits, where every bound is declared (a leaf)."""
    graph = {module: targets - {LIMITS} for module, targets in import_graph().items()}
    assert imports_of(graph, DURABLE, (CORE, PLANE, REMOTE, SERVING)) == {}


def test_the_limits_every_layer_reads_import_nothing_of_the_daemon_but_its_errors():
    assert sorted(t for t in import_graph()[LIMITS] if within(t, "ec_daemon")) == \
        ["ec_daemon.errors"]


def test_the_core_never_imports_the_plane_second_tier_or_serving():
    assert imports_of(import_graph(), CORE, (PLANE, REMOTE, SERVING)) == {}


def test_the_data_plane_never_imports_serving_or_the_second_tier():
    assert imports_of(import_graph(), PLANE, (SERVING, REMOTE)) == {}


def test_the_second_tier_never_imports_the_data_plane_or_serving():
    assert imports_of(import_graph(), REMOTE, (PLANE, SERVING)) == {}


def test_the_second_tiers_parts_hold_what_they_share_never_the_tier_or_one_another():
    # The tier composes them; a part that reached for the tier (or another
    # part) would tie the threads' life cycles back together.
    graph = import_graph()
    parts = [f"{REMOTE}.{name}" for name in ("common", "publisher", "resolver")]
    assert {part: sorted(graph[part] & {f"{REMOTE}.tier", *parts}) for part in parts} == {
        f"{REMOTE}.common": [], f"{REMOTE}.publisher": [f"{REMOTE}.common"],
        f"{REMOTE}.resolver": [f"{REMOTE}.common"]}


def test_the_second_tiers_backends_never_import_each_other_nor_what_composes_them():
    graph = import_graph()
    above = (f"{REMOTE}.tier", f"{REMOTE}.publisher", f"{REMOTE}.resolver")
    assert imports_of(graph, REDIS, (MOONCAKE, *above)) == {}
    assert imports_of(graph, MOONCAKE, (REDIS, *above)) == {}


def test_only_the_tier_chooses_a_backend():
    """The URL's scheme chooses a backend in one place (`tier.open_tier`);
    the flag's check reads the URLs. No other part of the daemon names one."""
    graph = import_graph()
    naming = sorted(m for m, targets in graph.items()
                    if within(m, "ec_daemon") and not within(m, REDIS)
                    and not within(m, MOONCAKE)
                    and any(within(t, REDIS) or within(t, MOONCAKE) for t in targets))
    assert naming == [f"{REMOTE}.tier", f"{SERVING}.config"]


def test_the_protocol_never_imports_the_daemon_or_the_client():
    assert imports_of(import_graph(), "ec_protocol", ("ec_daemon", "ec_client")) == {}


def test_no_package_imports_the_benchmarks():
    graph = import_graph()
    for package in ("ec_daemon", "ec_protocol", "ec_client"):
        assert imports_of(graph, package, ("benchmarks",)) == {}


def test_every_client_module_below_the_shell_sits_in_a_layer_folder():
    """The root holds the vLLM shell only: its modules name vLLM or serve only it."""
    shell = {"ec_client", "ec_client.vllm_connector", "ec_client.vllm_scheduler_role",
             "ec_client.vllm_worker_role", "ec_client.vllm_metadata", "ec_client.vllm_engine",
             "ec_client.vllm_items", "ec_client.vllm_metrics", "ec_client.vllm_plugin",
             "ec_client.vllm_names",
             "ec_client.identity", "ec_client.vllm_namespace",
             "ec_client.engine_token", "ec_client.ranks"}
    assert sorted(m for m in import_graph() if m.startswith("ec_client") and m not in shell
                  and not any(within(m, f) for f in CLIENT_FOLDERS)) == []


def test_what_both_client_processes_share_never_imports_either_side():
    assert imports_of(import_graph(), COMMON, (SCHEDULER_SIDE, WORKER_SIDE, COPY)) == {}


def test_the_scheduler_side_never_imports_the_worker_side_or_the_copy_backends():
    assert imports_of(import_graph(), SCHEDULER_SIDE, (WORKER_SIDE, COPY)) == {}


def test_the_worker_side_never_imports_the_scheduler_side():
    assert imports_of(import_graph(), WORKER_SIDE, (SCHEDULER_SIDE,)) == {}


def test_the_copy_backends_never_import_either_side():
    assert imports_of(import_graph(), COPY, (SCHEDULER_SIDE, WORKER_SIDE)) == {}


def test_nothing_below_the_vllm_shell_imports_it():
    """The shell is ec_client's root modules: no layer folder imports one."""
    graph = import_graph()
    shell = {m for m in graph if m.startswith("ec_client.")
             and not any(within(m, f) for f in CLIENT_FOLDERS)}
    offending = {m: sorted(graph[m] & shell) for m in graph
                 if any(within(m, f) for f in CLIENT_FOLDERS) and graph[m] & shell}
    assert offending == {}


# ------------------------------------------------------------------ one name per idea

LAYER_FOLDERS = ("durable", "core", "plane", "remote", "serving")
# A module name repeats only for a part every second-tier backend has alike
# (each backend's folder holds its own `backend`, `store` and `url`).
BACKEND_PARTS = {"backend", "store", "url"}
# A class name repeats only where one side declares, as a Protocol, the
# interface of what another implements (the caller names what it needs).
DECLARED_BY_CALLER = {"Reservation": ("ec_daemon.plane.second_tier", "ec_daemon.remote.budget")}


def daemon_module_names() -> dict[str, list[str]]:
    """Each module name of the daemon (no package faces) -> where it is."""
    names: dict[str, list[str]] = {}
    for module in modules():
        if within(module, "ec_daemon") and module.rsplit(".", 1)[0] != module \
                and not (ROOT / (module.replace(".", "/") + "/__init__.py")).exists():
            names.setdefault(module.rsplit(".", 1)[1], []).append(module)
    return names


def test_no_daemon_module_is_named_after_a_layer_folder():
    assert sorted(m for name, where in daemon_module_names().items() if name in LAYER_FOLDERS
                  for m in where) == []


def test_a_module_name_means_one_thing_in_the_daemon():
    repeated = {name: sorted(where) for name, where in daemon_module_names().items()
                if len(where) > 1}
    assert {name for name in repeated if name not in BACKEND_PARTS} == set(), repeated
    for name in repeated.keys() & BACKEND_PARTS:
        assert all(within(m, REMOTE) for m in repeated[name]), repeated[name]


def defined_classes() -> dict[str, list[str]]:
    """Each class name defined at the top of a daemon or protocol module -> where."""
    found: dict[str, list[str]] = {}
    for module, path in modules().items():
        if within(module, "ec_daemon") or within(module, "ec_protocol"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(module)
    return found


def test_a_class_name_means_one_thing_in_the_daemon_and_the_protocol():
    """(Layout was a model's fingerprint in the protocol and a region's
    geometry in adoption; Found, Header and Snapshot were two things each.)"""
    repeated = {name: tuple(sorted(where)) for name, where in defined_classes().items()
                if len(where) > 1}
    assert repeated == DECLARED_BY_CALLER


# A class name the client repeats from the daemon: each copy backend's module
# names its class `Backend`, as `ec_client.copy.get_backend` finds it (and as
# users' own backends are documented), beside the daemon's second-tier Backend.
# And the plain values of one protocol message at each side's edge (the
# client's `common.wire`, the daemon's `core.events`), named as the message
# is in the protocol: one idea, one name on both sides of the socket.
WIRE_MESSAGES = {"Verdict", "ReportStatus", "SaveAllocate", "SaveReport", "Heartbeat"}
CLIENT_REPEATS = {"Backend"} | WIRE_MESSAGES


def client_classes() -> dict[str, list[str]]:
    """Each public class name of the client -> where, beside the daemon's and protocol's."""
    found = {name: list(where) for name, where in defined_classes().items()}
    for module, path in modules().items():
        if within(module, "ec_client"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    found.setdefault(node.name, []).append(module)
    return found


def test_a_class_name_means_one_thing_across_the_client_the_daemon_and_the_protocol():
    """(The client's readback refusal was `Refused`, as the daemon's breaker's is.)"""
    repeated = {name for name, where in client_classes().items()
                if len(where) > 1 and any(within(m, "ec_client") for m in where)}
    assert repeated == CLIENT_REPEATS


def test_a_claim_is_the_right_to_encode_and_nothing_else_in_the_client():
    """The glossary's claim is the right to encode an item (`Wants.claim`,
    a producer's); a view protecting the entry of a hit until the step's
    end is a hit (`ReadyView.hit`: it was `claim` too)."""
    named = sorted(f"{module}.{node.name}" for module, path in modules().items()
                   if within(module, "ec_client")
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.FunctionDef) and "claim" in node.name)
    assert named == ["ec_client.scheduler_side.wants.claim"]


# ------------------------------------------------------------------ every bound in core.limits

# The numbers a daemon module may declare itself, each set with why none of
# them is a bound. Any other number a module declares (a module-level
# UPPER_CASE constant, a class field's default, a parameter's default) that
# is not 0, 1 or -1 is a bound or a default, and goes in core.limits.
NOT_BOUNDS = {
    "ec_daemon/durable/journal.py": (
        {"FORMAT_VERSION", "VERSION_AT", "HEADER_BYTES", "IDS_AT"},
        "the index file's format: its version and where its header's fields sit"),
    "ec_daemon/durable/stamp_file.py": ({"LOST"}, "a stamp value no entry id takes"),
    "ec_daemon/remote/values.py": (
        {"FORMAT_VERSION", "ALGORITHM_XXH3_64"},
        "the value format's version and checksum algorithm, written into every value"),
    "ec_daemon/remote/redis/store.py": (
        {"INDEX_SHARDS"}, "the key scheme: every daemon of a fleet uses the same shards"),
    "ec_daemon/remote/redis/announcements.py": (
        {"ENTRY_BYTES", "_SIZE_BITS"},
        "what an entry takes in memory, measured (its bound is --remote-index-bytes), and "
        "how its int is packed"),
    "ec_daemon/remote/mooncake/codec.py": ({"MAGIC"}, "vLLM's value format"),
    "ec_daemon/remote/mooncake/connection.py": (
        {"OBJECT_NOT_FOUND", "OBJECT_ALREADY_EXISTS", "TRANSFER_FAIL", "INVALID_PARAMS"},
        "Mooncake's error codes, as its binding returns them"),
    "ec_daemon/serving/startup.py": ({"UNIX_PATH_MAX"}, "the kernel's limit on a socket path"),
    "ec_daemon/serving/wire.py": ({"U64_MAX"}, "protobuf's uint64"),
    "ec_daemon/serving/cli.py": ({"_fail(code)"}, "an exit status"),
}
UPPER = re.compile(r"^_?[A-Z][A-Z0-9_]*$")


def _number(node: ast.AST | None) -> float | None:
    """The value of an expression made of numbers alone (and arithmetic), or None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp | ast.BinOp):
        try:
            return float(eval(compile(ast.Expression(node), "<bound>", "eval")))
        except Exception:
            return None
    return None


# The client's counterpart: numbers that are formats or APIs, not bounds.
CLIENT_NOT_BOUNDS = {
    "ec_client/copy/batch.py": (
        {"SRC_ACCESS_ORDER_STREAM", "FIRST_VERSION", "NO_FAIL_INDEX"},
        "CUDA's batched-copy API: an enum value, the driver version it came in, its no-failure"),
    "ec_client/copy/cupy_backend.py": ({"_H2D", "_D2H"}, "CUDA's cudaMemcpyKind values"),
    "ec_client/copy/torch_backend.py": ({"_HOST_REGISTER_DEFAULT"}, "cudaHostRegisterDefault"),
    "ec_client/identity.py": (
        {"ID_CHARS", "CONTENT_MAX_BYTES", "SAMPLES", "SAMPLE_BYTES"},
        "the weights identity's format: every engine of every host computes it alike"),
    "ec_client/engine_token.py": ({"SECRET_BYTES"}, "the engine secret file's format"),
}
CLIENT_LIMITS = "ec_client/common/limits.py"


def declared_numbers(root: Path,
                     not_bounds: dict[str, tuple[set[str], str]] = NOT_BOUNDS,
                     package: str = "ec_daemon",
                     limits: str = "ec_daemon/core/limits.py") -> list[str]:
    """Each number a module of `package` declares itself, outside its
    `limits` and `not_bounds`, as 'path: name' ('path: Class.field',
    'path: function(parameter)')."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if "_proto" in path.parts or relative == limits:
            continue
        allowed = not_bounds.get(relative, (set(), ""))[0]
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module-level constants
            for target, value in _assignments(node):
                if UPPER.match(target) and _number(value) is not None and target not in allowed:
                    found.append(f"{relative}: {target}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):  # fields' defaults
                for item in node.body:
                    for target, value in _assignments(item):
                        if _number(value) not in (None, 0, 1, -1):
                            found.append(f"{relative}: {node.name}.{target}")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # parameters' defaults
                args = node.args
                positional = args.posonlyargs + args.args
                pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults,
                              strict=True),
                         *((a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults,
                                                  strict=True) if d is not None)]
                for arg, default in pairs:
                    name = f"{node.name}({arg.arg})"
                    if _number(default) not in (None, 0, 1, -1) and name not in allowed:
                        found.append(f"{relative}: {name}")
    return found


def _assignments(node: ast.AST) -> list[tuple[str, ast.AST | None]]:
    if isinstance(node, ast.Assign):
        return [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [(node.target.id, node.value)]
    return []


def test_every_bound_of_the_daemon_is_declared_in_its_limits():
    assert declared_numbers(ROOT) == []


def test_what_is_no_bound_is_listed_only_where_it_is():
    everything = set(declared_numbers(ROOT, not_bounds={}))
    listed = {f"{path}: {name}" for path, (names, _) in NOT_BOUNDS.items() for name in names}
    assert listed - everything == set()


def test_the_bound_finder_sees_a_bound_declared_elsewhere(tmp_path: Path):
    folder = tmp_path / "ec_daemon" / "plane"
    folder.mkdir(parents=True)
    (folder / "saves.py").write_text(
        "WAITING = 64\nNAME = 'x'\nTABLE = {1: 2}\nSHIFTED = 1 << 20\n"
        "class Box:\n    size: int = 8\n    count: int = 0\n"
        "def wait(seconds: float = 2.5, tries: int = 1) -> None: ...\n")
    assert declared_numbers(tmp_path) == ["ec_daemon/plane/saves.py: WAITING",
                                          "ec_daemon/plane/saves.py: SHIFTED",
                                          "ec_daemon/plane/saves.py: Box.size",
                                          "ec_daemon/plane/saves.py: wait(seconds)"]


def test_every_bound_of_the_client_is_declared_in_its_limits():
    """(MAX_WANTS, MAX_PENDING_TOUCHES, INFLIGHT_TTL_SECONDS, ANSWER_SECONDS,
    the saver's, the session's: 36 numbers in 16 modules before issue 41)"""
    assert declared_numbers(ROOT, CLIENT_NOT_BOUNDS, "ec_client", CLIENT_LIMITS) == []


def test_what_is_no_bound_of_the_client_is_listed_only_where_it_is():
    everything = set(declared_numbers(ROOT, {}, "ec_client", CLIENT_LIMITS))
    listed = {f"{path}: {name}" for path, (names, _) in CLIENT_NOT_BOUNDS.items()
              for name in names}
    assert listed - everything == set()


def test_the_clients_limits_and_the_settings_shape_are_leaves():
    graph = import_graph()
    assert graph["ec_client.common.limits"] == graph["ec_protocol.settings_table"] == set()


def test_every_default_of_a_client_setting_is_the_limits_and_declared_nowhere_else():
    """The connector's table writes no number of its own among its defaults,
    and each DEFAULT_ of the client's limits is one of its settings'."""
    source = (ROOT / "ec_client" / "common" / "settings.py").read_text()
    table = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.AnnAssign)
                 and getattr(node.target, "id", "") == "SETTINGS")
    written = [ast.unparse(call) for call in ast.walk(table)
               if isinstance(call, ast.Lambda) and _number(call.body) is not None]
    assert written == []
    from ec_client.common import limits

    defaults = {name for name in vars(limits) if name.startswith("DEFAULT_")}
    assert defaults and {name for name in defaults if name not in source} == set()


def test_every_top_level_folder_is_product_tests_benchmarks_deployment_or_the_protocol():
    """(scripts/, a one-time migration, was a fourth kind of room until issue 41.)"""
    folders = {path.name for path in ROOT.iterdir() if path.is_dir()
               and not path.name.startswith(".") and path.name != "__pycache__"}
    kinds = {"ec_daemon": "product", "ec_client": "product", "ec_protocol": "protocol",
             "proto": "protocol", "tests": "tests", "benchmarks": "benchmarks",
             "deploy": "deployment", "docs": "product"}
    git = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True,
                         check=True).stdout.split()
    tracked = {name.split("/", 1)[0] for name in git if "/" in name}
    assert folders & tracked <= kinds.keys(), sorted((folders & tracked) - kinds.keys())


def test_every_default_of_a_setting_is_the_limits_and_declared_nowhere_else():
    """The settings table takes each number among its defaults from
    core.limits (it writes none of its own), and each of the limits'
    defaults is a setting's."""
    source = (ROOT / "ec_daemon" / "serving" / "config.py").read_text()
    table = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.AnnAssign)
                 and getattr(node.target, "id", "") == "SETTINGS")
    number = re.compile(r"\s*\d+(\.\d+)?\s*[A-Za-z]*\s*")  # `10`, `0.25`, `64MiB`
    written = [ast.unparse(call.args[2]) for call in ast.walk(table)
               if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "Setting"
               and isinstance(call.args[2], ast.Lambda)
               and isinstance(call.args[2].body, ast.Constant)
               and number.fullmatch(str(call.args[2].body.value))]
    assert written == []
    from ec_daemon.core import limits

    defaults = {name for name in vars(limits) if name.startswith("DEFAULT_")}
    assert {name for name in defaults if f"limits.{name}" not in source} == set()


# The client's edge: the one module that converts protobuf messages to and
# from plain values, as `ec_daemon.serving.wire` is the daemon's.
CLIENT_WIRE = "ec_client.common.wire"
STUBS = {"pb", "rpc"}  # what ec_protocol.protocol re-exports of the generated modules


def protobuf_users(root: Path = ROOT, package: str = "ec_client") -> list[str]:
    """The modules of `package` that import the generated stubs (through
    `ec_protocol.protocol`'s `pb`/`rpc`, or `ec_protocol._proto` itself)."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and (
                    node.module.startswith("ec_protocol._proto") or (
                        node.module == "ec_protocol.protocol"
                        and STUBS & {alias.name for alias in node.names})):
                found.append(name)
                break
            if isinstance(node, ast.Import) and any(
                    alias.name.startswith("ec_protocol._proto") for alias in node.names):
                found.append(name)
                break
    return found


def test_protobuf_stays_at_the_clients_edge():
    assert protobuf_users() == [CLIENT_WIRE]


def test_the_edge_check_sees_protobuf_used_inside(tmp_path: Path):
    inside = tmp_path / "ec_client" / "scheduler_side"
    inside.mkdir(parents=True)
    (inside / "wants.py").write_text("from ec_protocol.protocol import MAX_BATCH, pb\n")
    (inside / "view.py").write_text("from ec_protocol.protocol import MAX_BATCH\n")
    (tmp_path / "ec_client" / "stubs.py").write_text(
        "import ec_protocol._proto.ec_daemon.v1.ec_daemon_pb2\n")
    assert protobuf_users(tmp_path) == ["ec_client.scheduler_side.wants", "ec_client.stubs"]
