"""The project's import graph: no cycles anywhere, and layers that import only downward.

Every `.py` file of the project's packages is parsed (nothing is imported), and every import statement counts,
wherever it stands: inside functions, under `if TYPE_CHECKING:`, in a `try`. A cycle hidden behind a lazy import
is still a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "conveyor_kernels", "jobs", "api", "conveyor", "bench", "migrations", "tests")
# layer -> the layers it must not import: conveyor/ (CLI) → api/ → jobs/ → engine/ → conveyor_kernels/
FORBIDDEN = {
    "conveyor_kernels": ("engine", "jobs", "api", "conveyor"),
    "engine": ("jobs", "api", "conveyor"),
    "jobs": ("api", "conveyor"),
    "api": ("conveyor",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if ".venv" not in path.parts
    }


def imported_names(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of everything the file imports; `from a import b` yields a.b (a module or not)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        yield from _names(node, module, path.name == "__init__.py")


def eagerly_imported_names(path: Path, module: str) -> Iterator[str]:
    """What importing the file imports at once: module-level imports (in `if` and `try` blocks too), not those in
    functions or under `if TYPE_CHECKING:`."""

    def walk(statements: list[ast.stmt]) -> Iterator[str]:
        for node in statements:
            yield from (name for name, _ in _names(node, module, path.name == "__init__.py"))
            if isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    yield from walk(node.body)
                yield from walk(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(handler.body for handler in node.handlers), node.orelse, node.finalbody):
                    yield from walk(block)

    yield from walk(ast.parse(path.read_text(), str(path)).body)


def _names(node: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, node.lineno
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            anchor = module.split(".")
            anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        yield base, node.lineno
        for alias in node.names:
            yield f"{base}.{alias.name}", node.lineno


@functools.cache
def import_graph() -> dict[str, dict[str, int]]:
    """module -> {project module it imports (the named module and the packages above it): line}."""
    modules = project_modules()
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        for imported, line in imported_names(path, name):
            parts = imported.split(".")
            for end in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                target = ".".join(parts[:end])
                if target in modules and target != name and not name.startswith(target + "."):
                    graph[name].setdefault(target, line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components with more than one module (iterative: the graph is deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_graph_finds_the_cycles_it_is_shown() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_the_graph_sees_lazy_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "jobs.run.pipeline" in graph["jobs.tasks"]  # a module-level import
    assert "engine.engine_loop" in graph["jobs.run.kinds"]  # under TYPE_CHECKING
    assert "conveyor.run_file" in graph["conveyor.cli"]  # inside a function


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = [
        ", ".join(f"{module} imports {sorted(set(graph[module]) & set(cycle))}" for module in cycle)
        for cycle in strongly_connected(graph)
    ]
    assert not cycles, "modules importing each other, directly or around a loop:\n" + "\n".join(cycles)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downward(layer: str) -> None:
    graph = import_graph()
    upward = [
        f"{module} imports {target} (line {line})"
        for module, targets in graph.items()
        if module.split(".")[0] == layer
        for target, line in targets.items()
        if target.split(".")[0] in FORBIDDEN[layer]
    ]
    assert not upward, "\n".join(upward)


def test_the_api_does_not_load_torch() -> None:
    """The API resolves no model: torch would cost each of its workers seconds of start-up and hundreds of MB. What
    importing `api.app` imports at once, followed through the project's modules, never reaches torch."""
    modules = project_modules()
    seen, todo, loads = {"api.app"}, ["api.app"], []
    while todo:
        module = todo.pop()
        for name in eagerly_imported_names(modules[module], module):
            if name.split(".")[0] in ("torch", "triton", "transformers", "sentence_transformers"):
                loads.append(f"{module} imports {name}")
            parts = name.split(".")
            for end in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                target = ".".join(parts[:end])
                if target in modules and target not in seen:
                    seen.add(target)
                    todo.append(target)
    assert not loads, loads


def test_no_package_shares_its_import_name_with_an_installed_distribution() -> None:
    """Each top-level package is the only module of its name here: another distribution's package of the same name
    would be shadowed by ours, or ours by it, depending on the working directory (transformers 5.25 requires Hugging
    Face's `kernels`, the name this project's kernel package had)."""
    owners = importlib.metadata.packages_distributions()
    shared = {package: owners[package] for package in PACKAGES if set(owners.get(package, ())) - {"conveyor"}}
    assert not shared, shared
