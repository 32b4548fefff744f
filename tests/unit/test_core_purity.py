"""kvpool_master/core is pure: it imports no I/O framework and no clock, even transitively."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
from pathlib import Path

FORBIDDEN = {"grpc", "google", "asyncio", "prometheus_client", "time", "uvloop", "threading"}
CORE = Path(__file__).resolve().parents[2] / "kvpool_master" / "core"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _project_file(module: str) -> Path | None:
    if not module.startswith(("kvpool_master", "kvpool_client", "kvpool_wire")):
        return None
    spec = importlib.util.find_spec(module.rsplit(".", 1)[0]) if "." in module else None
    with contextlib.suppress(ModuleNotFoundError, ValueError):
        spec = importlib.util.find_spec(module) or spec
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def test_core_imports_no_io_framework_or_clock() -> None:
    todo = sorted(CORE.glob("*.py"))
    assert len(todo) >= 9, "the core modules were not found"
    seen: set[Path] = set()
    offenders: list[str] = []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in _imports(path):
            if module.split(".")[0] in FORBIDDEN:
                offenders.append(f"{path.name} imports {module}")
            target = _project_file(module)
            if target is not None and target not in seen:
                todo.append(target)
    assert not offenders, offenders
    # The walk followed the core's project imports (types, status) as well.
    assert any(p.name == "types.py" for p in seen)


def test_the_walk_catches_a_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "bad.py"
    sample.write_text("import os\nfrom time import monotonic\nimport grpc.aio\n")
    assert {"time", "grpc.aio"} <= _imports(sample)
