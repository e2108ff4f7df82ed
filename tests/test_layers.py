"""The package's import graph: no module imports, directly or through others, one that imports it.

Every ``import`` and ``from ... import`` in the package counts, at module level or inside a
function (a deferred import is still a dependency). A package's ``__init__`` re-exporting its
own modules is not an edge of the graph (``from jagg_pipeline.backbones import Backbone``
reads ``backbones.base`` through it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jagg_pipeline"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            continue
        modules[".".join(parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports (``from pkg import module`` names the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 100  # the graph was read
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
