"""The daemon's layers (scheduler_daemon/__init__.py): no import cycle among its modules,
only ``llama/`` imports llama_cpp, and ``core/`` imports neither Redis nor ``service/``.

Read from each file's syntax tree (every import, at the top, in a function or under
``TYPE_CHECKING``), so nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "scheduler_daemon"
ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> set[str]:
    """Every module a file imports, absolute (``from . import x`` names ``pkg.x``)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # ``from pkg import mod`` imports a module when mod is one
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """The package's modules, each with the package's modules it imports."""
    files = {module_name(p, root): p for p in (root / PACKAGE).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        graph[name] = {m for m in imports_of(path, root) if m in files and m != name}
    return graph


def external_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module's imports' top-level packages."""
    files = {module_name(p, root): p for p in (root / PACKAGE).rglob("*.py")}
    return {name: {m.split(".")[0] for m in imports_of(path, root)}
            for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color[nxt] == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if color[nxt] == WHITE and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE and (cycle := visit(node)):
            return cycle
    return None


def layer_violations(root: Path = ROOT) -> list[str]:
    """Each broken rule as ``module: what it imports``."""
    bad = []
    for name, deps in sorted(import_graph(root).items()):
        if name.startswith(f"{PACKAGE}.core") and (
                broken := sorted(d for d in deps if d.startswith(f"{PACKAGE}.service"))):
            bad.append(f"{name}: {', '.join(broken)}")
    for name, tops in sorted(external_imports(root).items()):
        if "llama_cpp" in tops and not name.startswith(f"{PACKAGE}.llama"):
            bad.append(f"{name}: llama_cpp")
        if "redis" in tops and name.startswith(f"{PACKAGE}.core"):
            bad.append(f"{name}: redis")
    return bad


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert f"{PACKAGE}.core.inference" in graph
    assert f"{PACKAGE}.core.scheduler" in graph[f"{PACKAGE}.core.inference"]
    assert f"{PACKAGE}.core.inference" in graph[f"{PACKAGE}.service.daemon"]
    # a function-level import counts: the core builds the real engine from settings
    assert f"{PACKAGE}.llama.engine" in graph[f"{PACKAGE}.core.inference"]


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_layers_hold():
    assert layer_violations() == []


def test_only_the_llama_layer_imports_llama_cpp():
    importers = {name for name, tops in external_imports().items() if "llama_cpp" in tops}
    assert importers == {f"{PACKAGE}.llama.{name}"
                         for name in ("batch", "embedder", "engine", "logs", "sampler")}
