"""The package's layout: what its pure parts load, which parts talk to which, and no import cycle.

The directory is a pure state machine: importing it (its state and parts, and the wire protocol it
speaks) must load nothing of the node side (memory, the data plane, the node) and neither ucxx nor
CuPy, so that it runs where those are missing and stays testable on its own. Each such check
imports in a fresh interpreter, where nothing else was loaded before. The other checks read the
import statements of every module (function bodies included; ``if TYPE_CHECKING:`` blocks, which
never run, left out).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

PACKAGE = Path(__file__).resolve().parent.parent / "hoplite_gpu"

#: Packages of the node side (and heavy dependencies) the pure parts must not load.
NODE_SIDE = (
    "hoplite_gpu.memory",
    "hoplite_gpu.node",
    "hoplite_gpu.dataplane",
    "hoplite_gpu.collective",
    "hoplite_gpu.ray",
    "ucxx",
    "cupy",
    "torch",
    "ray",
)

#: The directory's pure parts and the protocol (the service and the child process are not pure:
#: they host the state over sockets), and the UCX choice with its probe and the settings made of
#: them (they run before ucxx loads, and where it is missing).
PURE = (
    "hoplite_gpu.directory.state",
    "hoplite_gpu.directory.events",
    "hoplite_gpu.directory.records",
    "hoplite_gpu.directory.config",
    "hoplite_gpu.directory.eventlog",
    "hoplite_gpu.directory.invariants",
    "hoplite_gpu.directory.membership",
    "hoplite_gpu.directory.catalog",
    "hoplite_gpu.directory.lookups",
    "hoplite_gpu.directory.scheduling",
    "hoplite_gpu.directory.reductions",
    "hoplite_gpu.directory.combine",
    "hoplite_gpu.directory.repair",
    "hoplite_gpu.directory.recovery",
    "hoplite_gpu.directory.reduce",
    "hoplite_gpu.directory.watches",
    "hoplite_gpu.directory.barriers",
    "hoplite_gpu.directory.outbox",
    "hoplite_gpu.directory.reduce_request",
    "hoplite_gpu.protocol",
    "hoplite_gpu.dataplane.ucx.choice",
    "hoplite_gpu.dataplane.ucx.probe",
    "hoplite_gpu.dataplane.ucx.settings",
)

#: Packages of the node side whose own import loads nothing (their names load on first use), so
#: that the pure modules inside them can be imported: importing ``hoplite_gpu.dataplane.ucx.choice``
#: runs both first. Any other module under them still counts as the node side.
LIGHT_PACKAGES = ("hoplite_gpu.dataplane", "hoplite_gpu.dataplane.ucx")


def _loaded_after_import(module: str) -> list[str]:
    """The names in ``sys.modules`` after a fresh interpreter imports ``module``."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def _node_side(loaded: list[str], allowed: tuple[str, ...] = ()) -> list[str]:
    """The modules of ``loaded`` on the node side, but for the names ``allowed`` and
    :data:`LIGHT_PACKAGES` (those packages' own ``__init__``, not their other modules)."""
    ok = {*allowed, *LIGHT_PACKAGES}
    return [
        m for m in loaded if m not in ok and any(m == bad or m.startswith(bad + ".") for bad in NODE_SIDE)
    ]


@pytest.mark.parametrize("module", PURE)
def test_the_pure_directory_and_protocol_load_nothing_of_the_node_side(module: str) -> None:
    loaded = _loaded_after_import(module)
    assert module in loaded
    assert _node_side(loaded, PURE) == [], f"importing {module} loads the node side"


@pytest.mark.parametrize("package", LIGHT_PACKAGES)
def test_the_light_packages_load_nothing_of_their_own(package: str) -> None:
    """What lets the pure modules live inside them: importing the package alone loads no module
    of the node side, not even one of its own."""
    loaded = _loaded_after_import(package)
    assert package in loaded
    assert _node_side(loaded) == [], f"importing {package} loads the node side"


def test_the_light_check_catches_a_module_of_the_node_side() -> None:
    """The exceptions are exact names: a node-side module under a light package still counts."""
    names = ["hoplite_gpu.dataplane", "hoplite_gpu.dataplane.ucx", "hoplite_gpu.dataplane.ucx.choice"]
    assert _node_side(names, PURE) == []
    assert _node_side([*names, "hoplite_gpu.dataplane.tcp"], PURE) == ["hoplite_gpu.dataplane.tcp"]
    assert _node_side(["hoplite_gpu.dataplane.ucx.plane"], PURE) == ["hoplite_gpu.dataplane.ucx.plane"]


# ---------------------------------------------------------------- the import graph
def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere (a ``from X import y`` of a submodule
    ``X.y`` counts as importing ``X.y``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def _bound_names(path: Path) -> set[str]:
    """Names a module binds at its top level (and strings it names, for a module ``__getattr__``)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def test_every_import_of_the_package_names_a_module_and_a_name_of_it() -> None:
    """An import of a module that moved away fails only when it runs (mypy, with
    ``ignore_missing_imports``, lets it pass): every import of hoplite_gpu anywhere in the
    repository, function bodies included, names a module that exists, and a name it binds."""
    modules = _modules()
    root = PACKAGE.parent
    files = [*PACKAGE.rglob("*.py"), *(root / "tests").glob("*.py"), *(root / "bench").rglob("*.py")]
    files += [
        *(root / "docker").glob("*.py"),
        *(root / "examples").glob("*.py"),
        *(root / "docs").glob("*.py"),
    ]
    missing = []
    for path in files:
        name = next((m for m, p in modules.items() if p == path), "")
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names if a.name.startswith("hoplite_gpu")]
            elif isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("hoplite_gpu")
            ):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [(module, a.name) for a in node.names]
            else:
                continue
            for module, attr in targets:
                if module not in modules:
                    missing.append(f"{path.relative_to(root)}:{node.lineno}: no module {module}")
                elif attr is not None and f"{module}.{attr}" not in modules:
                    if attr != "*" and attr not in _bound_names(modules[module]):
                        missing.append(f"{path.relative_to(root)}:{node.lineno}: {module} has no {attr}")
    assert missing == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_anywhere_in_the_package() -> None:
    graph = _graph()
    assert "hoplite_gpu.node.fetch" in graph
    assert "hoplite_gpu.memory.node_memory" in graph["hoplite_gpu.memory"]
    assert _cycles(graph) == []


def test_the_rest_of_the_package_asks_memory_through_its_package() -> None:
    """Outside ``hoplite_gpu.memory`` only its package is imported, but for the kernels
    and the GPU inventory (``hoplite-gpu info``), the simulated device of tests and the CUDA views
    of the Ray backend's caller arrays."""
    allowed = {
        "hoplite_gpu.memory",
        "hoplite_gpu.memory.kernels",
        "hoplite_gpu.memory.placement",
        "hoplite_gpu.memory.cuda",
    }
    reaching = {
        (name, target)
        for name, targets in _graph().items()
        if not name.startswith("hoplite_gpu.memory")
        for target in targets
        if target.startswith("hoplite_gpu.memory.") and target not in allowed
    }
    assert reaching == set()
    users = {"hoplite_gpu.node.fetch", "hoplite_gpu.node.sources", "hoplite_gpu.node.puts"}
    for name in users | {"hoplite_gpu.node.vertex", "hoplite_gpu.dataplane.ucx.plane"}:
        assert _graph()[name] & {"hoplite_gpu.memory.kernels", "hoplite_gpu.memory.cuda"} == set()


def test_a_put_does_not_import_the_get_side() -> None:
    graph = _graph()
    assert graph["hoplite_gpu.node.puts"] & {"hoplite_gpu.node.fetch", "hoplite_gpu.node.sources"} == set()
    assert "hoplite_gpu.node.vertex" not in graph["hoplite_gpu.node.fetch"]


#: A module longer than this holds more than one thing: split it.
MAX_LINES = 600


def test_no_module_is_longer_than_a_read() -> None:
    long = {
        name: len(path.read_text().splitlines())
        for name, path in _modules().items()
        if len(path.read_text().splitlines()) > MAX_LINES
    }
    assert long == {}


def test_comments_carry_no_issue_numbers_or_dates() -> None:
    """Comments and docstrings say what and why; figures and their dates live in bench/README.md
    and bench/pages/."""
    import re

    dated = re.compile(r"\bissue \d+|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if dated.search(line)
    ]
    assert found == []


# ---------------------------------------------------------------- the directory's parts
#: Directory modules that name :class:`~hoplite_gpu.directory.state.DirectoryState`: the state
#: itself, the package that exports it, its hosts, and the invariant checker (a function of the
#: whole state, run after an event).
STATE_USERS = {
    "hoplite_gpu.directory",
    "hoplite_gpu.directory.state",
    "hoplite_gpu.directory.invariants",
    "hoplite_gpu.directory.service",
}


def _refers_to(value: object, target: object) -> bool:
    """Whether ``value`` is ``target``, a method bound to it, or a function closing over it."""
    if value is target or getattr(value, "__self__", None) is target:
        return True
    cells = getattr(value, "__closure__", None) or ()
    return any(cell.cell_contents is target for cell in cells)


def test_no_part_of_the_directory_holds_the_whole_state() -> None:
    """Each part of :class:`DirectoryState` is handed its records, the outbox and the parts it
    calls, never the state: nothing a part holds (attributes and slots) is the state, a method of
    it, or a function closing over it."""
    from hoplite_gpu.directory.state import DirectoryState

    state = DirectoryState()
    parts = {
        name: part
        for name, part in vars(state).items()
        if type(part).__module__.startswith("hoplite_gpu.directory.")
    }
    assert {"members", "catalog", "lookups", "reducer", "repair", "recovery", "barriers", "watches"} <= set(
        parts
    )
    holding = []
    for name, part in parts.items():
        held = dict(vars(part)) if hasattr(part, "__dict__") else {}
        for cls in type(part).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if hasattr(part, slot):
                    held[slot] = getattr(part, slot)
        holding += [f"{name}.{attr}" for attr, value in held.items() if _refers_to(value, state)]
    assert holding == []


def test_only_the_state_and_its_hosts_name_the_directory_state() -> None:
    """The parts of the directory do not name :class:`DirectoryState` at all (type hints
    included): what a part may reach is what its constructor and ``connect`` list."""
    naming = set()
    for name, path in _modules().items():
        if not name.startswith("hoplite_gpu.directory") or name in STATE_USERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Name) and node.id == "DirectoryState") or (
                isinstance(node, ast.ImportFrom) and any(a.name == "DirectoryState" for a in node.names)
            ):
                naming.add(name)
    assert naming == set()


# ---------------------------------------------------------------- the node's seam
NODE = PACKAGE / "node"


def _node_private_names() -> set[str]:
    """The private names of :class:`~hoplite_gpu.node.Node`: the methods and class-level names
    of it and of its parts (its base classes defined in :mod:`hoplite_gpu.node`), and every
    ``self._x`` they assign or read."""
    classes = {
        cls.name: cls
        for path in NODE.glob("*.py")
        for cls in ast.walk(ast.parse(path.read_text()))
        if isinstance(cls, ast.ClassDef)
    }
    names: set[str] = set()
    todo, seen = ["Node"], set()
    while todo:
        cls = classes[todo.pop()]
        seen.add(cls.name)
        todo += [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in classes and b.id not in seen]
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
        for found in ast.walk(cls):
            if isinstance(found, ast.Attribute) and ast.unparse(found.value) == "self":
                names.add(found.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_uses(path: Path, private: set[str]) -> list[str]:
    """``expr._name`` in ``path`` for a ``_name`` of ``private`` and an ``expr`` other than
    ``self`` or ``cls`` (a module's own objects reach their own private names through those)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or node.attr not in private:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"))
    return [use for _, use in sorted(found)]


def test_the_node_private_names_are_found() -> None:
    private = _node_private_names()
    assert {"_io", "_store", "_session", "_check_open", "_check_member", "_data"} <= private
    assert "put" not in private and "__init__" not in private


def test_nothing_outside_the_node_package_uses_a_private_name_of_the_node() -> None:
    """Applications built on the node (collective groups, weights, coding, Ray, torch), the
    benchmarks and the examples call its public methods only: a private name of
    :class:`~hoplite_gpu.node.Node` (or one spelled like it) used on anything but ``self`` or
    ``cls`` outside :mod:`hoplite_gpu.node` is reported."""
    private = _node_private_names()
    root = PACKAGE.parent
    files = [p for p in PACKAGE.rglob("*.py") if NODE not in p.parents]
    files += [*(root / "bench").rglob("*.py"), *(root / "examples").rglob("*.py")]
    found = [use for path in sorted(files) for use in _private_uses(path, private)]
    assert found == []
