"""``benchmarks.ops.kernel_sweep``: the host shapes it reads from a step, and the scan sweep itself
(on CUDA here, on CPU through Triton's interpreter): every configuration checked against the
default one's outputs and timed, a failing one recorded with its error."""

from __future__ import annotations

import numpy as np
import torch

from tests.ops._triton import check_here_or_interpreted


def test_microbatch_shapes_are_the_first_microbatch_of_each_side() -> None:
    from benchmarks.ops.kernel_sweep import microbatch_shapes

    shapes = microbatch_shapes("tiny", 0, 1, 0, 4096)
    rounds = shapes["rounds"]
    assert rounds and all(len(r["lengths"]) == len(r["has_init"]) for r in rounds)
    assert not any(rounds[0]["has_init"]) and any(any(r["has_init"]) for r in rounds[1:])
    # the conv runs cover the physical rows; the rounds read them and a few replayed ones again
    cu = np.asarray(shapes["conv_cu"])
    assert cu[0] == 0 and (np.diff(cu) > 0).all() and 0 < cu[-1] <= sum(sum(r["lengths"]) for r in rounds)
    assert shapes["conv_state_rows"].shape == (cu.size - 1, 3)
    assert 0 < sum(shapes["baseline_lengths"]) <= 4096


def test_scan_sweep_checks_and_times_every_configuration() -> None:
    check_here_or_interpreted(
        _check_scan_sweep, "from tests.bench.test_kernel_sweep import _check_scan_sweep; _check_scan_sweep()"
    )


def _check_scan_sweep() -> None:
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests.ops.test_tree_scan import _scan_module

        _scan_module()  # the interpreter's numpy patch
    from benchmarks.ops import kernel_sweep as ks
    from harts.ops.linear_attn.tree_scan import ScanConfig

    ks.H = 2
    shapes = {
        "rounds": [
            {"lengths": [130], "requests": [(0, 64), (0, 128)], "has_init": [False]},
            {"lengths": [70, 10], "requests": [], "has_init": [True, True]},
        ],
        "baseline_lengths": [100, 90],
    }
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = ks.sweep_scans(shapes, device, 1, [ScanConfig(16, 2, 1), ScanConfig(64, 4), ScanConfig(24, 4)])
    assert [r["block_v"] for r in rows] == [16, 64, 24]
    for r in rows[:2]:
        assert all(r[f"{s}_{p}_ms"] > 0 for s in ("harts", "baseline") for p in ("fwd", "bwd")), r
    assert "power-of-two block_v" in rows[2]["error"]
