"""docs/ENVIRONMENT.md lists every ``HARTS_*`` variable the package names, and each is read in
one place: its name is a string of its own (``os.environ.get("HARTS_X")``, ``env_switch(...)``,
a constant) exactly once in ``harts/``, at the reader the page names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bHARTS_[A-Z0-9_]+\b")


def documented() -> dict[str, str]:
    """{variable: its "Read by" cell} from the page's first table."""
    rows = {}
    for line in (ROOT / "docs" / "ENVIRONMENT.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and NAME.fullmatch(cells[0].strip("`")):
            rows[cells[0].strip("`")] = cells[4]
    return rows


def sources() -> list[Path]:
    return sorted((ROOT / "harts").rglob("*.py"))


def test_every_variable_the_package_names_is_documented() -> None:
    named = {m for path in sources() for m in NAME.findall(path.read_text())}
    assert named, "no HARTS_* name found: the scan looks in the wrong place"
    assert named == set(documented()), named ^ set(documented())


def test_each_variable_is_read_in_one_place_the_page_names() -> None:
    places: dict[str, list[Path]] = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                places.setdefault(node.value, []).append(path)
    table = documented()
    assert set(places) == set(table)
    for name, paths in places.items():
        assert len(paths) == 1, f"{name} is named in {[str(p.relative_to(ROOT)) for p in paths]}"
        rel = paths[0].relative_to(ROOT).as_posix()
        assert rel in table[name], f"{name}: read in {rel}, the page says {table[name]}"
