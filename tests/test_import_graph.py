"""The package's import graph: no cycles, and every import points down the layers.

Every `import` and `from ... import` statement counts, at module level or inside a function (or under
`if TYPE_CHECKING:`), since a lazy import is still a dependency. Layers, lowest first:

    0  top-level modules (config, request, sampling_params, ...)
    1  core, distributed, structured_output, kernels
    2  attention
    3  models
    4  worker
    5  executor
    6  engine
    7  entrypoints
    8  bench, tools

A module may import its own package and the layers below it, never a layer above nor another package of
its own layer: the packages that share a layer are independent of one another (the top-level modules
count as one package). bench/ and tools/ sit on top; only entrypoints/cli.py (which registers their
subcommands) imports them from below. stepahead/__init__.py, the public API that re-exports from the
layers, is left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "stepahead"

LOWEST = 0
TOP_LEVEL_MODULES = "top-level modules"  # the package the top-level modules count as
LAYERS: dict[str, int] = {
    # Top-level modules: plain data and helpers that everything may use.
    **{name: LOWEST for name in ("config", "request", "sampling_params", "outputs", "validation", "utils",
                                 "errors", "tracing", "mkl_env", "grammar_bounds")},
    # Packages that import only top-level modules.
    "core": 1,
    "distributed": 1,
    "structured_output": 1,
    "kernels": 1,
    # The forward pass, bottom up: attention over the paged cache, the models, the worker that runs them.
    "attention": 2,
    "models": 3,
    "worker": 4,
    "executor": 5,
    "engine": 6,
    "entrypoints": 7,
    "bench": 8,
    "tools": 8,
}
TOP = LAYERS["bench"]
# Registers the bench and tools subcommands of the `stepahead` command.
MAY_IMPORT_TOP = {"stepahead.entrypoints.cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The stepahead module an imported name lives in (a submodule if there is one), or None."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported stepahead module, line) for every import statement of the module, anywhere in it."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: strip the module itself (unless a package), then level - 1 more
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "stepahead" or target.startswith("stepahead."):
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != "stepahead" and (resolved, node.lineno) not in found:
                    found.append((resolved, node.lineno))
    return found


def package_of(module: str) -> str:
    """The top-level package (or TOP_LEVEL_MODULES) a module belongs to, for the layer rules."""
    area = module.split(".")[1]
    return TOP_LEVEL_MODULES if LAYERS.get(area) == LOWEST else area


def layer_of(module: str) -> int:
    area = module.split(".")[1]
    if area not in LAYERS:
        raise AssertionError(f"{module}: stepahead/{area} has no layer; add it to LAYERS in {Path(__file__).name}")
    return LAYERS[area]


def import_graph() -> dict[str, list[tuple[str, int]]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items() if name != "stepahead"}


def layer_violations(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    out = []
    for source, targets in sorted(graph.items()):
        for target, line in targets:
            if package_of(source) == package_of(target):
                continue
            lower, higher = layer_of(source), layer_of(target)
            if higher < lower or (higher == TOP and source in MAY_IMPORT_TOP):
                continue
            why = "another package of its layer" if higher == lower else f"layer {higher}"
            out.append(f"{source} (line {line}) imports {target}: layer {lower} imports {why}")
    return out


def import_cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (or a module importing itself)."""
    edges = {m: sorted({t for t, _ in targets if t in graph}) for m, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph is small, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges[node]:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    modules = {"stepahead": tmp_path, "stepahead.engine": tmp_path, "stepahead.engine.messages": tmp_path,
               "stepahead.engine.llm": tmp_path, "stepahead.bench.trace": tmp_path}
    source = tmp_path / "llm.py"
    source.write_text(
        "from . import messages\n"
        "from stepahead.engine import messages as m2\n"
        "def f():\n"
        "    import stepahead.bench.trace\n"
        "    from stepahead import engine\n"
    )
    found = imports_of("stepahead.engine.llm", source, modules)
    assert found == [("stepahead.engine.messages", 1), ("stepahead.engine.messages", 2),
                     ("stepahead.bench.trace", 4), ("stepahead.engine", 5)]
    graph = {"stepahead.a": [("stepahead.b", 1)], "stepahead.b": [("stepahead.a", 3)], "stepahead.c": []}
    assert import_cycles(graph) == [["stepahead.a", "stepahead.b"]]


def test_imports_up_or_across_a_layer_are_violations():
    graph = {"stepahead.models.llama": [("stepahead.models.rope", 1), ("stepahead.attention.rows", 2),
                                        ("stepahead.config", 3), ("stepahead.worker.staging", 4)],
             "stepahead.kernels.cpu_ops": [("stepahead.core.stop", 5)],
             "stepahead.config": [("stepahead.request", 6)],
             "stepahead.entrypoints.cli": [("stepahead.bench.cli", 7)]}
    assert layer_violations(graph) == [
        "stepahead.kernels.cpu_ops (line 5) imports stepahead.core.stop: layer 1 imports another package of its layer",
        "stepahead.models.llama (line 4) imports stepahead.worker.staging: layer 3 imports layer 4",
    ]


def test_every_area_has_a_layer():
    for name in all_modules():
        if name != "stepahead":
            layer_of(name)


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_upward_imports():
    violations = layer_violations(import_graph())
    if violations:
        pytest.fail("imports against the layer order:\n" + "\n".join(violations))
