"""The packages' layout: no two of our modules import each other, directly or through others, even
inside functions (a cycle there is the same tangle, only deferred to the first call)."""

import ast
from pathlib import Path

from helpers import REPO

PACKAGES = ("starpo_jax", "envs_jax")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the modules of ours it imports anywhere in its file}."""
    files = [p for package in PACKAGES for p in (REPO / package).rglob("*.py")]
    ours = {module_name(p) for p in files}
    graph = {}
    for path in files:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from package import module` names a module; `from module import name` the module
                names = {f"{node.module}.{a.name}" for a in node.names} & ours
                imported |= names or ({node.module} & ours)
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names} & ours
        graph[module_name(path)] = imported - {module_name(path)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_ours_imports_itself_through_others():
    graph = import_graph()
    assert "starpo_jax.models.loading" in graph and "starpo_jax.models.bundled" in graph["starpo_jax.models.loading"]
    assert cycles(graph) == []
