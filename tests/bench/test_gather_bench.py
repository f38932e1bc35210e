"""``benchmarks.ops.gather``: every gather variant returns x[index], for both index patterns."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.ops.gather import GATHERS, gather_indices, main


@pytest.mark.parametrize("pattern", ["moe", "rounds"])
def test_index_patterns_and_variants_agree(pattern: str) -> None:
    gen = torch.Generator().manual_seed(0)
    index = gather_indices(pattern, 40, 3, 6, 0.25, gen)
    if pattern == "moe":  # every row topk times, grouped by expert
        assert index.numel() == 120 and torch.bincount(index, minlength=40).eq(3).all()
    else:  # a permutation, mostly in place
        assert sorted(index.tolist()) == list(range(40)) and (index == torch.arange(40)).sum() >= 30
    x = torch.randn(40, 5, generator=gen)
    for fn in GATHERS.values():
        assert torch.equal(fn(x, index), x[index])


def test_main_writes_both_patterns(tmp_path, capsys) -> None:
    out = tmp_path / "g.json"
    assert main(["--rows", "256", "--dim", "16", "--repeat", "1", "--dtype", "float32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["patterns"]) == {"moe", "rounds"}
    for p in report["patterns"].values():
        assert set(p["variants"]) == set(GATHERS) and all(v["ms"] >= 0 for v in p["variants"].values())
    assert "index_select" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--shuffled", "2"])
    assert "--shuffled must lie in [0, 1]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="pattern must be"):
        gather_indices("zigzag", 4, 1, 2, 0.0, torch.Generator())
