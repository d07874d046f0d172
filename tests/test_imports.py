"""The package's import structure: every module imports on its own, kvpass's modules import one another
without cycles, and the graph passes (``kvpass/rewrites``) and ops (``kvpass/kernels``) never reach into
the runtime, so either can be read, tested and changed without it.

The graph is read with ``ast`` from the source (every ``import`` statement, function-local ones and those
under ``if TYPE_CHECKING:`` included: a type-only cycle is a cycle of the design all the same). Importing ``kvpass.a.b`` also runs
``kvpass/__init__`` and ``kvpass/a/__init__``; those implicit edges are left out, as Python resolves
them from ``sys.modules`` and they only order the work.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvpass"

# Modules the graph passes and ops must not import: they are the runtime built on top of them.
RUNTIME = ("kvpass.runtime", "kvpass.api", "kvpass.decode_step", "kvpass.eval", "kvpass.cli")
LAYERS_BELOW_RUNTIME = ("kvpass.rewrites", "kvpass.kernels")
# (importer, imported): dependencies that must stay, with the reason. Keep this short.
ALLOWED_RUNTIME_IMPORTS: dict[tuple[str, str], str] = {}
# (importer, imported): function-level imports that close a cycle, left out of the cycle check, with the
# reason. Each must stay function-level (checked): at module level the cycle would be a real import loop.
ALLOWED_CYCLE_EDGES: dict[tuple[str, str], str] = {
    ("kvpass.runtime.hf_compat", "kvpass.api"):
        "KVPassModel.to() / from_pretrained rebuild through kvpass.apply (the one place a model is checked and "
        "built), which imports the model class; imported inside those methods",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, type_only: bool = True):
    """Every Import / ImportFrom node; ``type_only=False`` skips the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _function_level(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a function body."""
    inside: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return inside


def imports_of(name: str, path: Path, modules: dict[str, Path], lazy: bool | None = None) -> set[str]:
    """The kvpass modules ``name`` imports (``from kvpass.x import y`` counts as kvpass.x.y when y is a
    module, else as kvpass.x). lazy: None every import, True only function-level ones, False only the rest."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    in_functions = _function_level(tree) if lazy is not None else set()
    for node in _import_nodes(tree):
        if lazy is not None and (id(node) in in_functions) != lazy:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names] + [source]
        for target in targets:
            if target in modules:
                found.add(target)
            elif target.rpartition(".")[0] in modules and target not in modules:
                continue   # a name imported from a module: the module itself is in targets too
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_graph_reader_sees_imports():
    graph = import_graph()
    assert "kvpass.policies.base" in graph["kvpass.policies"]          # absolute, at the top
    assert "kvpass.kernels.write_kv" in graph["kvpass.kernels"]
    assert "kvpass.rewrites.attention_sites" in graph["kvpass.policies.base"]   # under ``if TYPE_CHECKING:``
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_kvpass_modules():
    graph = import_graph()
    for importer, imported in ALLOWED_CYCLE_EDGES:
        graph.get(importer, set()).discard(imported)
    found = cycles(graph)
    assert not found, "import cycles (each line one strongly connected set of modules):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_rewrites_and_kernels_do_not_import_the_runtime():
    graph = import_graph()
    bad = sorted((a, b) for a, deps in graph.items() if _within(a, LAYERS_BELOW_RUNTIME)
                 for b in deps if _within(b, RUNTIME) and (a, b) not in ALLOWED_RUNTIME_IMPORTS)
    assert not bad, "graph passes / ops importing the runtime: " + ", ".join(f"{a} -> {b}" for a, b in bad)


def test_allowed_cycle_edges_are_function_level_and_still_there():
    modules = all_modules()
    for importer, imported in ALLOWED_CYCLE_EDGES:
        assert importer in modules, f"{importer} is gone: remove it from ALLOWED_CYCLE_EDGES"
        lazy = imports_of(importer, modules[importer], modules, lazy=True)
        eager = imports_of(importer, modules[importer], modules, lazy=False)
        assert imported not in eager, f"{importer} imports {imported} at module level: an import loop"
        assert imported in lazy, f"{importer} no longer imports {imported}: remove it from ALLOWED_CYCLE_EDGES"


def test_allowed_runtime_imports_are_still_needed():
    graph = import_graph()
    stale = [pair for pair in ALLOWED_RUNTIME_IMPORTS if pair[1] not in graph.get(pair[0], set())]
    assert not stale, f"remove from ALLOWED_RUNTIME_IMPORTS (no longer imported): {stale}"


# Groups of modules each imported in one fresh process (one per group keeps the test a few seconds);
# within a group each module is imported before the next, so a module that only imports because an
# earlier one did would pass here, hence the light modules go first, in their own processes.
def _groups() -> list[list[str]]:
    names = sorted(all_modules())
    light = [n for n in names if n in ("kvpass.errors", "kvpass.budget", "kvpass.eval.scoring")]
    rest = [n for n in names if n not in light]
    return [[n] for n in light] + [rest[i::4] for i in range(4)]


@pytest.mark.parametrize("group", _groups(), ids=lambda g: g[0] if len(g) == 1 else f"{len(g)} modules")
def test_every_module_imports_in_a_fresh_process(group):
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", code, *group], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
