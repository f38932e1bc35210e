"""No function in the package is longer than 120 lines (the style asks for about 100): a long
function is split where its phases are, so that each reads top to bottom on one screen."""

from __future__ import annotations

import ast
import pathlib

import harts

LIMIT = 120


def test_no_function_exceeds_the_limit() -> None:
    root = pathlib.Path(harts.__file__).parent
    long = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > LIMIT:
                    long.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
