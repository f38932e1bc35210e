"""``launch_rank``: the one reader of torchrun's ``RANK`` before a process group exists."""

from __future__ import annotations

import pytest

from harts.parallel.mesh import launch_rank


def test_launch_rank_reads_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert launch_rank() == 0
    monkeypatch.setenv("RANK", "3")
    assert launch_rank() == 3
    monkeypatch.setenv("RANK", "")
    assert launch_rank() == 0
