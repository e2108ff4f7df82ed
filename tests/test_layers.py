"""The package's layers: every import runs down (or across one floor), never up, and no cycle.

The folders of ``jagg_pipeline`` are the layers, listed bottom-up in :data:`FLOORS`; a module
may import modules of its own folder, of another folder on its floor, and of lower floors.
Every ``import`` and ``from ... import`` counts, at module level or inside a function (a
deferred import is still a dependency), and a package's ``__init__`` is a module of its folder.

``python tests/test_layers.py`` prints the structure: rooms (modules) per floor and the arrows
(imports) between floors.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jagg_pipeline"

# Bottom-up. The package root holds only the version (floor 0) and ``python -m`` (the top).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("support",),  # error types, start-up, timers
    ("core",),  # the gradient core: SDE steps, GRPO, JAGG (pure tensor functions)
    ("config",),  # the typed config, its loading and schema, model sources
    ("backbones", "rewards"),  # the plug-in families (the toy scene is the toy reward's truth)
    ("io",),  # artifacts between stages: files, manifests, shards, tables, prompts, figures
    ("stages",),  # rollout, score, train, evaluate; the policy, FSDP, checkpoints
    ("workflow", "toyworld"),  # the workflow's experiments; the toy world's build
    ("reports", "bench"),  # summary, comparison, tracking; benchmarks and gradcheck
    ("cli",),  # the commands
)
ROOT_FLOORS = {"jagg_pipeline": 0, "jagg_pipeline.__main__": len(FLOORS) - 1}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package's ``__init__`` by its own)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports (``from pkg import module`` names the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # ``from pkg import module`` depends on the module; other names on ``pkg`` itself.
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in known
                else node.module
                for alias in node.names
            ]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def room(module: str) -> str:
    """The folder a module lives in (``jagg_pipeline.core.jagg`` -> ``core``)."""
    return module if module in ROOT_FLOORS else module.split(".")[1]


def floor(module: str) -> int:
    """The floor of a module's folder; KeyError for a folder no floor lists."""
    if module in ROOT_FLOORS:
        return ROOT_FLOORS[module]
    return next(i for i, rooms in enumerate(FLOORS) if room(module) in rooms)


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``edges``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = 2
        path.pop()
        return None

    for module in sorted(edges):
        if module not in state and (found := visit(module)):
            return found
    return None


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import from a floor into a higher one, as ``a -> b``."""
    return sorted(
        f"{a} -> {b}" for a, targets in edges.items() for b in targets if floor(b) > floor(a)
    )


def test_every_folder_has_a_floor():
    unplaced = sorted(
        {room(m) for m in modules() if m not in ROOT_FLOORS}
        - {r for rooms in FLOORS for r in rooms}
    )
    assert not unplaced, f"folders without a floor in FLOORS: {unplaced}"


def test_imports_run_down_the_floors():
    edges = graph()
    assert sum(map(len, edges.values())) > 150  # the graph was read
    assert not upward(edges), "imports into a higher floor:\n" + "\n".join(upward(edges))


def test_the_package_has_no_import_cycle():
    found = cycle(graph())
    assert found is None, " -> ".join(found)


def test_the_toy_world_sits_on_the_plug_ins_not_under_them():
    # Above both families, so test_imports_run_down_the_floors forbids them importing it.
    toyworld = FLOORS.index(("workflow", "toyworld"))
    assert toyworld > FLOORS.index(("backbones", "rewards"))
    edges = graph()
    used = {room(b) for a, targets in edges.items() if room(a) == "toyworld" for b in targets}
    assert {"backbones", "rewards"} <= used


def test_the_checks_find_what_they_look_for():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
    assert upward({"jagg_pipeline.core.jagg": {"jagg_pipeline.cli.train"}}) == [
        "jagg_pipeline.core.jagg -> jagg_pipeline.cli.train"
    ]
    assert floor("jagg_pipeline.backbones") == floor("jagg_pipeline.rewards.toy_scene") == 3


def structure() -> str:
    """The drawing in words: rooms per floor, arrows down, across and up, cycles."""
    edges = graph()
    lines = []
    for i in reversed(range(len(FLOORS))):
        rooms = Counter(room(m) for m in edges if m not in ROOT_FLOORS and floor(m) == i)
        lines.append(f"floor {i}: " + ", ".join(f"{r} ({rooms[r]})" for r in FLOORS[i]))
    arrows = [(a, b) for a, targets in edges.items() for b in targets]
    down = sum(floor(b) < floor(a) for a, b in arrows)
    across = sum(floor(b) == floor(a) and room(a) != room(b) for a, b in arrows)
    inside = sum(room(a) == room(b) for a, b in arrows)
    lines.append(
        f"{len(edges)} modules on {len(FLOORS)} floors, {len(arrows)} arrows: {down} down, "
        f"{across} across a floor, {inside} inside a folder, {len(upward(edges))} up; "
        f"cycles: {'none' if cycle(edges) is None else ' -> '.join(cycle(edges))}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(structure())
