"""The package's import graph: no circles, and data flows one way.

Every import in harts counts, including those inside functions (a lazy import is still a
dependency) and those made through ``importlib.import_module`` / ``__import__``: a literal
name is one edge, an f-string an edge to every module under its literal prefix, and a name
computed at run time an edge to every harts module named by a string in that file (the lazy
public API's table). Layers, lowest first: errors / outputs -> tree / envs -> plan -> ops -> models ->
rl / rollout / parallel / integrations -> trainer -> experiments / serve -> commands -> cli. A module may
import its own layer or lower ones; ``import harts`` (the lazy public API) is allowed from
commands and cli. Nothing in the package imports what lives beside it in the repository
(``benchmarks``, ``tests``, ``scripts``, ``examples``): ``pip install harts`` ships none of it.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import harts

#: edges still pointing up (none: add one only with the reason it cannot be fixed yet)
KNOWN_UP: set[tuple[str, str]] = set()

RANK = {"errors": 0, "outputs": 0, "tree": 1, "envs": 1, "plan": 2, "ops": 3, "models": 4, "rl": 5, "rollout": 5,
        "parallel": 5, "integrations": 5, "trainer": 6, "experiments": 7, "serve": 7, "commands": 8,
        "cli": 9}  # fmt: skip

#: the runtime: what training, serving and their inputs run on; none of it imports the measurement room
RUNTIME = {"tree", "plan", "ops", "models", "rl", "rollout", "parallel", "integrations", "trainer", "serve"}

#: top-level names of the repository's other folders, which the package must not import
OUTSIDE = {"benchmarks", "tests", "scripts", "examples"}


def _modules() -> dict[str, pathlib.Path]:
    root = pathlib.Path(harts.__file__).parent
    mods = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    return mods


def _imported_names(tree: ast.AST) -> set[str]:
    """Every module name an ``import`` statement or an import call of ``tree`` can load."""
    names: set[str] = set()
    dynamic = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                names.add(f"{arg.values[0].value}*")  # every module under the literal prefix
            else:
                dynamic = True
    if dynamic:  # a name computed at run time: any harts module this file names in a string
        names.update(
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        )  # fmt: skip
    return names


def _is_import_call(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, f in mods.items():
        for target in _imported_names(ast.parse(f.read_text())):
            if target.endswith("*"):
                edges[name].update(m for m in mods if m.startswith(target[:-1]) and m != name)
            elif target in mods and target != name:
                edges[name].add(target)
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
                assert a in ("commands", "cli", "harts"), (v, w)
            elif a != "harts" and RANK[b] > RANK[a] and (v, w) not in KNOWN_UP:
                up.append((v, w))
    assert not up, up


def test_the_runtime_never_imports_the_experiments() -> None:
    """Benches time the runtime from outside (``harts.experiments``): no runtime module imports
    one, not even beside it (``serve`` shares its rank), so measurement never ships in a step."""
    into = [(v, w) for v, ws in _graph().items() for w in ws if _layer(v) in RUNTIME and _layer(w) == "experiments"]
    assert not into, into
    assert "experiments" in {_layer(m) for m in _modules()}


def test_the_package_imports_nothing_beside_it() -> None:
    outside = []
    for name, f in _modules().items():
        for target in _imported_names(ast.parse(f.read_text())):
            if target.split(".")[0].rstrip("*") in OUTSIDE:
                outside.append((name, target))
    assert not outside, outside


def test_import_calls_are_edges() -> None:
    """The graph sees ``importlib`` imports: the CLI's command modules (an f-string) and the lazy
    public API's table (a name computed at run time)."""
    edges = _graph()
    assert "harts.commands.bench" in edges["harts.cli"]
    assert {"harts.trainer.engine", "harts.tree.workloads"} <= edges["harts"]
