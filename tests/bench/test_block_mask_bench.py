"""block_mask_bench: exact and conservative block counts of a step's microbatches."""

from __future__ import annotations

import json

from harts.bench.block_mask_bench import main, step_masks


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
    # document-causal rows: the bounds are exact
    assert sides["baseline"]["bounds_partial"] == sides["baseline"]["exact_partial"]
    assert "harts" in capsys.readouterr().out
