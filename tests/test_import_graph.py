"""The package's imports form no cycle, and point one way: rooms below never import rooms above."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_lc"

LAYERS = {
    "megatron_lc.errors": 0, "megatron_lc.flags": 0, "megatron_lc.plan_cache": 0, "megatron_lc.command_line": 0, "megatron_lc.devices": 0, "megatron_lc.processes": 0, "megatron_lc.scheduler": 0,
    "megatron_lc.parallel_state": 1, "megatron_lc.context_layout": 1, "megatron_lc.training.schedule": 1,
    "megatron_lc.training.args": 1, "megatron_lc.training.profiling": 1,
    "megatron_lc.attention": 2, "megatron_lc.memory": 2, "megatron_lc.data": 2,
    "megatron_lc.models": 3,
    "megatron_lc.config": 4, "megatron_lc.arguments": 4,
    "megatron_lc.training": 5, "megatron_lc.planning": 5,
    "megatron_lc.evaluate": 6, "megatron_lc.train": 6, "megatron_lc.testing": 6, "megatron_lc.evaluation": 5, "megatron_lc.entry": 6, "megatron_lc": 6,
}
"""Each room's layer: a module may import its own layer's rooms and those below, never above."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every package module `name` imports, at module level or inside functions. `from P import x` counts
    P itself (its __init__ runs) and P.x when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                    cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


def _layer(module: str) -> int:
    room = max((r for r in LAYERS if module == r or module.startswith(r + ".")), key=len)
    return LAYERS[room]


def test_the_package_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_points_down_the_layers():
    upward = sorted(f"{name} imports {target}" for name, targets in _graph().items() for target in targets
                    if _layer(target) > _layer(name))
    assert upward == []


def test_models_import_nothing_from_training_or_planning():
    graph = _graph()
    assert not {t for name, targets in graph.items() if name.startswith("megatron_lc.models") for t in targets
                if t.startswith(("megatron_lc.training", "megatron_lc.planning", "megatron_lc.config"))}
