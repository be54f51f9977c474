"""stepahead/core imports nothing above it and its modules import each other without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import stepahead.core

CORE_DIR = Path(stepahead.core.__file__).parent
# What the core may use besides its own modules: plain data and helpers, no engine, worker or torch.
ALLOWED_OUTSIDE = {
    "stepahead.request", "stepahead.sampling_params", "stepahead.config", "stepahead.validation",
    "stepahead.utils", "stepahead.outputs", "stepahead.errors", "stepahead.tracing",
}


def _stepahead_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "stepahead" or n.startswith("stepahead.")}


def _core_graph() -> dict[str, set[str]]:
    return {f"stepahead.core.{p.stem}": _stepahead_imports(p) for p in CORE_DIR.glob("*.py")}


def test_core_imports_only_allowed_modules():
    outside = {(mod, dep) for mod, deps in _core_graph().items() for dep in deps
               if not dep.startswith("stepahead.core.") and dep not in ALLOWED_OUTSIDE}
    assert not outside


def test_core_modules_form_no_import_cycle():
    graph = {mod: {d for d in deps if d.startswith("stepahead.core.")} for mod, deps in _core_graph().items()}
    done: set[str] = set()

    def visit(mod: str, path: tuple[str, ...]) -> None:
        assert mod not in path, f"import cycle: {' -> '.join((*path, mod))}"
        if mod in done:
            return
        for dep in graph.get(mod, ()):
            visit(dep, (*path, mod))
        done.add(mod)

    for mod in graph:
        visit(mod, ())
