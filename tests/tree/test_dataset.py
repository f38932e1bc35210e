"""``--data PATH...``: files, directories and glob patterns as an ordered list of batch files,
repeated over epochs; every bad path is a UserError naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from harts.errors import UserError
from harts.tree.dataset import batch_files, epoch_order


def _touch(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return str(path)


def test_files_directories_and_patterns_in_order(tmp_path: Path) -> None:
    b = _touch(tmp_path / "d" / "b.jsonl")
    a = _touch(tmp_path / "d" / "a.parquet")
    c = _touch(tmp_path / "d" / "sub" / "c.jsonl")
    _touch(tmp_path / "d" / "notes.txt")
    _touch(tmp_path / "d" / ".hidden.jsonl")
    x = _touch(tmp_path / "x.jsonl")
    assert batch_files([str(tmp_path / "d")]) == [a, b, c]
    assert batch_files([x, str(tmp_path / "d" / "*.jsonl"), x]) == [x, b, x]
    assert batch_files([str(tmp_path / "**" / "*.jsonl")]) == [b, c, x]


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("missing.jsonl", "no such file or directory"),
        ("empty", "a directory without batch files"),
        ("notes.txt", "not a batch file"),
        ("*.parquet", "the pattern matches no batch file"),
    ],
)
def test_bad_paths_are_named(tmp_path: Path, name: str, match: str) -> None:
    (tmp_path / "empty").mkdir()
    _touch(tmp_path / "notes.txt")
    with pytest.raises(UserError, match=match) as err:
        batch_files([str(tmp_path / name)])
    assert name in str(err.value)


def test_epoch_order() -> None:
    assert epoch_order(3, 2) == [0, 1, 2, 0, 1, 2]
    assert epoch_order(3, 2, 4) == [0, 1, 2, 0]
    with pytest.raises(UserError, match="--steps 7: the data gives 6 steps"):
        epoch_order(3, 2, 7)
