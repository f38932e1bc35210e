"""The attention benchmark's inputs: variant parsing, and the masks it times are the model's."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.ops.attention import KV_BLOCK_KEY, _visible_pairs, masks_of_step, parse_variant


def test_parse_variant_layers_options_left_to_right() -> None:
    harts_opts = {"fwd_BLOCK_M": 128, "bwd_num_stages": 3}
    assert parse_variant("torch") == {}
    assert parse_variant("harts", harts_opts) == harts_opts
    got = parse_variant("harts+bwd=32,128,128,32,2,8+safe", harts_opts)
    assert got == {
        "fwd_BLOCK_M": 128,
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 2,
        "bwd_num_warps": 8,
        "ROWS_GUARANTEED_SAFE": True,
    }
    assert parse_variant("torch+tma+prescale+nodq") == {"USE_TMA": True, "PRESCALE_QK": True, "WRITE_DQ": False}
    assert parse_variant("flash") == {"BACKEND": "FLASH"}
    assert parse_variant("flash+kv=96") == {"BACKEND": "FLASH", KV_BLOCK_KEY: 96}
    assert parse_variant("fwd=64,32,1,4") == {
        "fwd_BLOCK_M": 64,
        "fwd_BLOCK_N": 32,
        "fwd_num_stages": 1,
        "fwd_num_warps": 4,
    }
    for bad, match in [
        ("bwd=1,2", "must be harts, torch"),
        ("fwd=a,b,c,d", "needs integers"),
        ("fast", "must be"),
        ("kv=100", "multiple of 16"),
        ("kv=96,2", "one multiple"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_variant(bad)


def test_masks_are_the_largest_microbatches_with_their_pairs() -> None:
    """The baseline's mask is document-causal over its largest raw microbatch; harts' is the tree
    mask of its largest compact microbatch; the pairs counted are the visible ones."""
    from harts.plan.baselines.trajectory_plan import plan_trajectory_step
    from harts.tree.workloads import generate

    masks = masks_of_step("tiny", 0, 256, 8)
    base, tree = masks["baseline"], masks["harts"]
    lengths = np.asarray(generate("tiny", step=0).lengths)
    raw = plan_trajectory_step(lengths, dp=1, capacity=256)
    assert len(base["pre"]) == max(int(lengths[mb].sum()) for mb in raw.microbatches)
    for m in (base, tree):
        pre, end = m["pre"], m["end"]
        visible = (pre[None, :] <= pre[:, None]) & (pre[:, None] < end[None, :]) & (pre[None, :] >= 0)
        np.fill_diagonal(visible, True)  # a padding row sees itself
        assert _visible_pairs(m) == int(visible.sum())
    assert np.array_equal(base["pre"], np.arange(len(base["pre"])))
