"""The package layout holds: kvpool_master imports kvpool_wire and itself, never kvpool_client;
kvpool_wire imports neither; kvpool_client has no import cycle; the client core is pure."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvpool_master", "kvpool_client", "kvpool_wire")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file, lazily too)."""
    modules = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")
               if "_pb" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            for candidate in candidates:
                if candidate in modules and candidate != name:
                    targets.add(candidate)
                    break
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_master_imports_only_the_wire_package() -> None:
    graph = _graph()
    offenders = [f"{m} -> {t}" for m, targets in graph.items() if m.startswith("kvpool_master")
                 for t in targets if t.startswith("kvpool_client")]
    assert not offenders, offenders
    wire = [f"{m} -> {t}" for m, targets in graph.items() if m.startswith("kvpool_wire")
            for t in targets if not t.startswith("kvpool_wire")]
    assert not wire, wire


def test_the_client_has_no_import_cycle() -> None:
    graph = {m: {t for t in targets if t.startswith("kvpool_client")}
             for m, targets in _graph().items() if m.startswith("kvpool_client")}
    # A package's __init__ importing its own modules is not a cycle of the code's layers.
    for module, targets in graph.items():
        targets.discard(module.rsplit(".", 1)[0])
    assert not _cycles(graph), _cycles(graph)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_client_core_is_pure() -> None:
    """kvpool_client/core imports no I/O framework, thread, socket or clock, even through the
    project modules it uses."""
    forbidden = {"asyncio", "grpc", "socket", "threading", "time", "uvloop", "select",
                 "concurrent"}
    graph = _graph()
    core = [m for m in graph if m.startswith("kvpool_client.core")]
    assert len(core) >= 4
    seen: set[str] = set()
    todo = list(core)
    offenders: list[str] = []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = ROOT / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / module.replace(".", "/") / "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            offenders += [f"{module} imports {n}" for n in names if n.split(".")[0] in forbidden]
        todo.extend(graph[module])
    assert not offenders, offenders
