"""``benchmarks.ops.block_mask``: exact and conservative block counts of a step's microbatches."""

from __future__ import annotations

import json

import numpy as np

from benchmarks.ops.block_mask import main, step_masks, visible_pairs


def test_block_mask_bench_counts(tmp_path, capsys):
    out = tmp_path / "bm.json"
    assert (
        main(["--workload", "tiny", "--capacity", "1500", "--chunk-size", "16", "--repeat", "1", "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    sides = report["sides"]
    assert set(sides) == {"baseline", "harts"}
    masks = list(step_masks("tiny", 0, 1500, 16))
    for side, row in sides.items():
        assert row["microbatches"] == sum(s == side for s, _, _ in masks)
        # bounds are conservative: never fewer kept blocks; full blocks are found the same way
        assert row["bounds_full"] == row["exact_full"]
        assert row["bounds_partial"] >= row["exact_partial"] > 0
        assert row["host_ms_median"] > 0
        assert row["visible_pairs"] == sum(visible_pairs(pre, end) for s, pre, end in masks if s == side)
        assert 0 < row["block_efficiency"] <= 1
    # document-causal rows: the bounds are exact
    assert sides["baseline"]["bounds_partial"] == sides["baseline"]["exact_partial"]
    assert "harts" in capsys.readouterr().out


def test_visible_pairs_count_ancestors_and_self() -> None:
    # a root (pre 0, subtree [0, 4)) with children 1 and 2 (leaf) and 3 under 2; a padding row
    pre = np.array([0, 1, 2, 3, -1])
    end = np.array([4, 2, 4, 4, -1])
    # rows see 1, 2, 2, 3 rows (themselves and their ancestors); padding counts nothing
    assert visible_pairs(pre, end) == 1 + 2 + 2 + 3
    chain = np.arange(5)
    assert visible_pairs(chain, np.full(5, 5)) == 15  # causal: n (n + 1) / 2
    assert visible_pairs(np.array([-1, -1]), np.array([-1, -1])) == 0


def test_block_mask_bench_counts_one_replica(tmp_path, capsys):
    """--dp/--replica count one replica's microbatches only; a replica outside [0, dp) is named."""
    import pytest

    argv = ["--workload", "tiny", "--capacity", "600", "--chunk-size", "16", "--repeat", "1"]
    whole = {s: sum(len(pre) for t, pre, _ in step_masks("tiny", 0, 600, 16) if t == s) for s in ("baseline", "harts")}
    rows = {s: 0 for s in whole}
    for r in range(2):
        out = tmp_path / f"r{r}.json"
        assert main([*argv, "--dp", "2", "--replica", str(r), "--json", str(out)]) == 0
        masks = list(step_masks("tiny", 0, 600, 16, dp=2, replica=r))
        for side in rows:
            rows[side] += sum(len(pre) for t, pre, _ in masks if t == side)
            assert json.loads(out.read_text())["sides"][side]["microbatches"] == sum(t == side for t, _, _ in masks)
    assert rows["baseline"] == whole["baseline"]  # the replicas split the raw tokens
    with pytest.raises(SystemExit):
        main([*argv, "--dp", "2", "--replica", "2"])
    assert "--replica must lie in [0, --dp=2)" in capsys.readouterr().err
