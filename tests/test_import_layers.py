"""The package's import graph: no circles, and data flows one way.

Every ``import`` in harts counts, including those inside functions (a lazy import is still a
dependency). Layers, lowest first: errors -> tree / envs -> plan -> ops -> models -> rl /
rollout / parallel / integrations -> trainer / bench -> serve -> commands -> cli. A module may import its own layer
or lower ones;
``import harts`` (the lazy public API) is allowed from bench and commands.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import harts

#: edges still pointing up (none: add one only with the reason it cannot be fixed yet)
KNOWN_UP: set[tuple[str, str]] = set()

RANK = {"errors": 0, "tree": 1, "envs": 1, "plan": 2, "ops": 3, "models": 4, "rl": 5, "rollout": 5,
        "parallel": 5, "integrations": 5, "trainer": 6, "bench": 6, "serve": 7, "commands": 8, "cli": 9}  # fmt: skip


def _graph() -> dict[str, set[str]]:
    root = pathlib.Path(harts.__file__).parent
    mods = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    edges: dict[str, set[str]] = defaultdict(set)
    for name, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "harts"


def test_no_import_cycles() -> None:
    edges = _graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(v: str, path: list[str]) -> None:
        state[v] = 1
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                cycles.append(path[path.index(w) :] + [w])
            elif w not in state:
                visit(w, [*path, w])
        state[v] = 2

    for v in sorted(edges):
        if v not in state:
            visit(v, [v])
    assert not cycles, cycles


def test_layers_point_one_way() -> None:
    up = []
    for v, ws in _graph().items():
        for w in ws:
            a, b = _layer(v), _layer(w)
            if b == "harts":
                assert a in ("bench", "commands", "cli", "harts"), (v, w)
            elif a != "harts" and RANK[b] > RANK[a] and (v, w) not in KNOWN_UP:
                up.append((v, w))
    assert not up, up
