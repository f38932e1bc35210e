"""``harts fidelity``: the per-token metrics (Eqs. 25-27) against a dense computation, gradient
cosines, microbatch choice, and the command on CPU (float64: every path equals Baseline A to
rounding at every depth; float32: the JSON fields and the PNG)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harts.cli import main
from harts.rl.fidelity import PathRun, gradient_cosines, token_errors
from harts.rl.fidelity_ablation import PATHS, _Sums, choose_microbatches
from harts.rl.verify import StepResult


def _path(h: torch.Tensor, rows: np.ndarray) -> PathRun:
    step = StepResult(torch.zeros(0), 0.0, None, None, None, {}, 0.0, 0)
    return PathRun(hidden_TD=h, rows=torch.as_tensor(rows), step=step)


@pytest.mark.parametrize("chunk", [1, 3, 1000], ids=lambda c: f"chunk{c}")
def test_token_errors_match_dense(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    v, d, n = 50, 8, 11
    w = torch.randn(v, d, generator=g, dtype=torch.float64)
    h_a = torch.randn(n + 3, d, generator=g, dtype=torch.float64)
    h_x = torch.randn(n + 5, d, generator=g, dtype=torch.float64)
    rows_a = np.arange(n) + 2  # rows are a gather, not the first n rows
    rows_x = np.arange(n)[::-1].copy()
    targets = torch.randint(0, v, (n,), generator=g).numpy()
    got = token_errors(_path(h_a, rows_a), _path(h_x, rows_x), w, targets, chunk_rows=chunk)

    z_a, z_x = h_a[rows_a] @ w.T, h_x[rows_x] @ w.T
    p_a, p_x = torch.softmax(z_a, -1), torch.softmax(z_x, -1)
    kl_ax = (p_a * (p_a.log() - p_x.log())).sum(-1)
    kl_xa = (p_x * (p_x.log() - p_a.log())).sum(-1)
    t = torch.as_tensor(targets)
    dnll = (p_x.log()[torch.arange(n), t] - p_a.log()[torch.arange(n), t]).abs()
    cos = torch.nn.functional.cosine_similarity(z_a, z_x, dim=-1)
    np.testing.assert_allclose(got["sym_kl"], (0.5 * (kl_ax + kl_xa)).numpy(), rtol=1e-10)
    np.testing.assert_allclose(got["abs_dnll"], dnll.numpy(), rtol=1e-10)
    np.testing.assert_allclose(got["cos"], cos.numpy(), rtol=1e-12)
    assert np.all(got["sym_kl"] > 0)

    same = token_errors(_path(h_a, rows_a), _path(h_a, rows_a), w, targets, chunk_rows=chunk)
    assert np.all(same["sym_kl"] == 0) and np.all(same["abs_dnll"] == 0)
    np.testing.assert_allclose(same["cos"], 1.0, atol=1e-15)


def test_gradient_cosines() -> None:
    a = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([1.0, 0.0]), "z": torch.zeros(3), "u": torch.zeros(2)}
    b = {"x": torch.tensor([2.0, 4.0]), "y": torch.tensor([-1.0, 0.0]), "z": torch.zeros(3), "u": torch.ones(2)}
    got = gradient_cosines(a, b)
    assert got == pytest.approx({"x": 1.0, "y": -1.0, "z": 1.0, "u": 0.0})
    with pytest.raises(ValueError, match="different parameters"):
        gradient_cosines(a, {"x": b["x"]})


def test_choose_microbatches_covers_every_bucket_first() -> None:
    depths = [np.array([0, 0, 1]), np.array([0, 1, 2]), np.array([0, 7, 8]), np.array([0, 3])]
    # bucket 6+ -> mb 2; 3 -> mb 3; 2 -> mb 1; 1 and 0 already covered; then mb 0
    assert choose_microbatches(depths, None, 6) == [2, 3, 1, 0]
    assert choose_microbatches(depths, 2, 6) == [2, 3]
    # with buckets 0, 1, 2+: mb 2 holds most 2+ tokens, then bucket 1 (a tie: the first wins)
    assert choose_microbatches(depths, None, 2) == [2, 0, 1, 3]


def test_depth_sums_means_and_ratios() -> None:
    sums = _Sums(3)
    bucket = np.array([0, 0, 2, 2, 2])
    sums.add_tokens(bucket)
    zero = np.zeros(5)
    errs = {"baseline_b": np.array([1.0, 3.0, 0.0, 0.0, 0.0]), "replay": np.array([2.0, 2.0, 1.0, 2.0, 3.0])}
    for p, v in errs.items():
        sums.add(p, bucket, {"sym_kl": v, "abs_dnll": 2 * v, "cos": zero})
    rec = sums.record(["0", "1", "2+"])
    assert rec["tokens"] == [2, 0, 3]
    assert rec["mean"]["replay"]["abs_dnll"] == [4.0, 0.0, 4.0]
    assert rec["mean"]["baseline_b"]["sym_kl"] == [2.0, 0.0, 0.0]
    assert rec["ratio_to_baseline_b"]["replay"]["sym_kl"] == [1.0, None, None]


def _run(tmp_path, *extra: str) -> dict:  # noqa: ANN001
    out = tmp_path / "fid.json"
    argv = ["fidelity", "--workload", "tiny", "--model", "tiny", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_fidelity_float64_every_path_is_baseline_to_rounding(tmp_path, capsys) -> None:  # noqa: ANN001
    rec = _run(tmp_path, "--dtype", "float64", "--recompute", "both")
    assert "Table 5" in capsys.readouterr().out
    assert set(rec["settings"]) == {"recompute=False", "recompute=True"}
    mb = rec["microbatches"][0]
    assert mb["replay_rows"] > 0 and mb["calls_no_replay"] >= mb["calls"]
    tokens = np.asarray(rec["settings"]["recompute=False"]["handoff_depth"]["tokens"])
    assert tokens.sum() == sum(m["S"] - m["trajectories"] for m in rec["microbatches"])
    assert np.flatnonzero(tokens).max() >= 5  # the tiny workload reaches depth 5
    for setting in rec["settings"].values():
        for axis in ("handoff_depth", "imported_states"):
            mean = setting[axis]["mean"]
            # on CPU a rerun is bit-identical
            assert max(mean["baseline_b"]["sym_kl"]) == 0 and max(mean["baseline_b"]["abs_dnll"]) == 0
            # no noise to measure against: no ratio
            assert setting[axis]["ratio_to_baseline_b"]["replay"]["abs_dnll"] == [None] * 7
            for p in ("replay", "no_replay"):
                assert max(mean[p]["abs_dnll"]) <= 1e-10, (axis, p)
                assert max(mean[p]["sym_kl"]) <= 1e-20, (axis, p)
        for p in PATHS[1:]:
            assert setting["mean_cos"][p] == pytest.approx(1.0, abs=1e-12)
            assert max(setting["loss"]["abs_diff"][p]) <= 1e-12
            assert setting["gradient_cos"][p]["min"] >= 1 - 1e-10
            assert setting["gradient_cos"][p]["groups"]  # per parameter group
            assert setting["max_rel_diff"][p]["gradients"] <= 1e-8


def test_fidelity_float32_json_and_plot(tmp_path) -> None:  # noqa: ANN001
    png = tmp_path / "fig4.png"
    rec = _run(
        tmp_path, "--dtype", "float32", "--recompute", "on", "--plot", str(png), "--logit-chunk", "97",
        "--reference-dtype", "float64",
    )  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (setting,) = rec["settings"].values()
    d = setting["handoff_depth"]
    assert d["buckets"] == ["0", "1", "2", "3", "4", "5", "6+"]
    assert set(d["mean"]) == set(PATHS[1:]) and set(d["ratio_to_baseline_b"]) == {"replay", "no_replay"}
    for p in PATHS[1:]:
        assert set(d["mean"][p]) == {"sym_kl", "abs_dnll", "cos"}
        assert len(d["mean"][p]["sym_kl"]) == 7
        assert setting["mean_cos"][p] > 0.9999
    # no-replay executes differently (its own rounding) where replay stays on the baseline's grid
    assert sum(d["mean"]["no_replay"]["abs_dnll"][1:]) > 0

    # against the float64 copy every float32 path has rounding error, Baseline A's own included,
    # and Replay's stays of the same size as A's at every depth
    hi = setting["vs_reference"]["handoff_depth"]
    assert set(hi["mean"]) == set(PATHS) and hi["tokens"] == d["tokens"]
    for i, n in enumerate(hi["tokens"]):
        if n and i > 0:
            assert hi["mean"]["baseline_a"]["abs_dnll"][i] > 0
            assert 0.5 < hi["ratio_to_baseline_a"]["replay"]["abs_dnll"][i] < 2.0
    assert setting["vs_reference"]["mean_cos"]["replay"] > 0.9999


def test_fidelity_batch_file(tmp_path) -> None:  # noqa: ANN001
    from harts.tree.workloads import generate

    path = tmp_path / "batch.jsonl"
    generate("tiny", step=1).save(str(path))
    out = tmp_path / "f.json"
    argv = ["fidelity", "--workload", str(path), "--model", "tiny", "--recompute", "off", "--capacity", "300"]
    assert main([*argv, "--microbatches", "2", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert len(rec["microbatches"]) == len(rec["microbatch_ids"]) == 2
    assert max(rec["settings"]["recompute=False"]["handoff_depth"]["mean"]["replay"]["abs_dnll"]) <= 1e-10


def test_fidelity_user_errors(tmp_path, capsys) -> None:  # noqa: ANN001
    assert main(["fidelity", "--workload", "tiny", "--model", "tiny", "--capacity", "8"]) == 2
    assert "--capacity" in capsys.readouterr().err
    png = tmp_path / "x.png"
    png.write_bytes(b"")
    assert main(["fidelity", "--workload", "tiny", "--model", "tiny", "--plot", str(png)]) == 2
    assert "--overwrite" in capsys.readouterr().err
