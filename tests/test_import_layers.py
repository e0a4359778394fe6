"""The toolkit's imports point down its layers (toolkit/layers.py), with no circle, in-function imports included.

The in-function imports that remain are there for start-up time or for a heavy optional library, never to hide a
circle (this test reads them like any other import):
- the command line (cli.py, compare/cli.py, launch/) imports a command's modules when that command runs: `toolkit
  --help`, `toolkit validate` and the launcher's own process start without torch's or transformers' import (~3 s);
- train/checks.py, train/notes.py, train/runinfo.py and plan/predict.py import model building, data and the planner
  inside the checks that need them, which `toolkit validate` and the launcher run before any rank starts;
- checkpoint/loading.py, model/tp_plan.py and memory/ import transformers-backed builders and peft (LoRA) only where
  a run builds a model or traces one; strategies/base.py imports the activation tracer (transformers' logging);
- DeepSpeed itself is imported only inside strategies/zero/ functions that set a zero run up.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from toolkit.layers import LAYERS

PACKAGE = Path(__file__).resolve().parent.parent / "toolkit"
MAX_MODULES_PER_FOLDER = 12


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imported(module: str, node: ast.Import | ast.ImportFrom, *, is_package: bool) -> list[str]:
    """The toolkit modules one import statement reads (`from toolkit.x import y`: toolkit.x.y where that is a
    module, else toolkit.x)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")[: None if is_package else -1]
            base = base[: len(base) - node.level + 1]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in MODULES else origin for alias in node.names]
    out = []
    for target in targets:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target.startswith("toolkit") and target != module:
            out.append(target)
    return out


def _import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):  # in-function imports too
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(_imported(module, node, is_package=path.name == "__init__.py"))
    return graph


def _layer_of(module: str) -> int:
    head = module.removeprefix("toolkit").lstrip(".").split(".")[0]
    for index, (_, members) in enumerate(LAYERS):
        if head in members:
            return index
    raise AssertionError(f"{module} is in no layer of toolkit/layers.py: add its package to the table")


def test_every_import_points_down_the_layers():
    graph = _import_graph()
    upward = [f"{a} ({LAYERS[_layer_of(a)][0]}) imports {b} ({LAYERS[_layer_of(b)][0]})"
              for a in sorted(graph) for b in sorted(graph[a]) if _layer_of(b) < _layer_of(a)]
    assert upward == []


def test_no_import_circle():
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    assert circles == []


def test_the_graph_sees_in_function_imports():
    # the walk is what the two tests above stand on: loading imports checkpoint.state inside a function only
    assert "toolkit.checkpoint.state" in _import_graph()["toolkit.checkpoint.loading"]


def test_no_folder_holds_more_than_a_dozen_modules():
    folders: dict[Path, int] = defaultdict(int)
    for path in MODULES.values():
        folders[path.parent] += 1
    crowded = {str(folder.relative_to(PACKAGE.parent)): n for folder, n in folders.items()
               if n > MAX_MODULES_PER_FOLDER}
    assert crowded == {}
