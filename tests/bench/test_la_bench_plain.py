"""``benchmarks.ops.la --rule plain``: Mamba-2's SSD on the rounds of real plans. On the CPU the
run goes end to end on the reference op at tiny shapes; ``--model`` takes a preset's Mamba-2
shapes; the "plain" baseline (fla's ``chunk_simple_gla``) computes the reference's function
(through Triton's interpreter on a CPU machine); the table's tree / plain row and the JSON's
ratios are the sums over the rounds."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from benchmarks.ops import la
from harts.errors import UserError
from tests.ops._triton import check_here_or_interpreted

TINY = ["--workload", "tiny", "--device", "cpu", "--rule", "plain", "--chunk-size", "8", "--dtype", "float32"]
TINY += ["--heads", "2", "--key-dim", "8", "--dim", "16", "--repeat", "1"]


def test_plain_rule_cpu_smoke(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "la plain.json"
    assert la.main([*TINY, "--backends", "reference", "--json", str(out)]) == 0
    assert "H 2, K 8, V 16, plain (Mamba-2 SSD), float32 on cpu" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["shapes"] == {"heads": 2, "key_dim": 8, "value_dim": 16, "rule": "plain"}
    assert data["rounds"] and all(r["forward_backward_ms"]["reference"] > 0 for r in data["rounds"])


def test_model_takes_the_presets_mamba2_shapes() -> None:
    # Nemotron 3 Nano: 64 SSD heads of 64 channels, state size 128
    assert la.mamba2_shapes("nemotron_3_nano_30b_a3b") == (64, 128, 64)
    assert la.mamba2_shapes("granite_4_0_h_small") == (128, 128, 64)
    with pytest.raises(UserError, match="qwen3_5_9b has no Mamba-2 layers"):
        la.mamba2_shapes("qwen3_5_9b")
    with pytest.raises(SystemExit):  # argparse: --model needs --rule plain
        la.main(["--model", "nemotron_3_nano_30b_a3b", "--device", "cpu", "--backends", "reference"])


def test_tree_over_plain_is_the_ratio_of_the_sums(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The report's arithmetic, with the reference op standing in for both CUDA backends (the
    timings differ run to run; the summary must be their sums' ratio whatever they are)."""
    from harts.ops.linear_attn.chunk import chunk_linear_attn

    monkeypatch.setattr(la, "_op", lambda backend, device: chunk_linear_attn)
    out = tmp_path / "la.json"
    assert la.main([*TINY, "--backends", "tree,plain", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    for key, field in (("tree_over_plain_fwd", "forward_ms"), ("tree_over_plain_fwd_bwd", "forward_backward_ms")):
        tree, plain = (sum(r[field][b] for r in data["rounds"]) for b in ("tree", "plain"))
        assert data["summary"][key] == pytest.approx(tree / plain, rel=1e-12)
        assert f"{key}: {tree / plain:.3f}" in printed
    assert "\ntree / plain " in printed and f"within {la.TREE_OVER_PLAIN_TARGET}x" in printed


def check_plain_baseline_is_the_ssd() -> None:
    """la's "plain" backend (fla's chunk_simple_gla) on a round of the bench's own SSD inputs
    equals the float64 reference operator: outputs, final states and every gradient."""
    from harts.ops.linear_attn.chunk import chunk_linear_attn
    from tests.ops.test_linear_attn_plain_kernels import _interpreted_loop_indices
    from tests.ops.test_tree_kernel_interpreted import _device, _interpreter_single_config, _rel

    _interpreter_single_config()
    _interpreted_loop_indices()
    dev = _device()
    shape = la.RoundShape(microbatch=0, round=0, cu_seqlens=[0, 70, 134], has_initial=[False, True], requests=[])
    xs, beta, h0 = la._inputs(shape, 2, 16, 8, "plain", True, torch.float32, dev, seed=0)
    assert beta is None and h0 is not None
    cu = torch.tensor(shape.cu_seqlens)
    leaves = [t.detach().clone().requires_grad_() for t in (*xs, h0)]
    ref = [t.detach().double().cpu().requires_grad_() for t in leaves]
    kw = dict(cu_seqlens=cu, chunk_size=64, rule="plain", scale=1.0)
    got = la._op("plain", dev)(*leaves[:4], None, initial_state=leaves[4], **kw)[:2]
    want = chunk_linear_attn(*ref[:4], None, initial_state=ref[4], **kw)[:2]
    w = [torch.randn(r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) for r in want]
    g_out = torch.autograd.grad(sum((a.double() * wi.to(dev)).sum() for a, wi in zip(got, w)), leaves)
    g_ref = torch.autograd.grad(sum((r * wi).sum() for r, wi in zip(want, w)), ref)
    for name, a, b in zip(["o", "final", "dq", "dk", "dv", "dg", "dh0"], [*got, *g_out], [*want, *g_ref], strict=True):
        assert b.abs().max() > 0, name
        # float32 kernels against float64: a few roundings over sums of ~100 terms
        assert _rel(a, b) < 1e-4, f"{name}: relative error {_rel(a, b):.2e}"


def test_plain_baseline_is_the_ssd() -> None:
    pytest.importorskip("fla", reason="needs fla-core (pip install harts[gpu])")
    check_here_or_interpreted(
        check_plain_baseline_is_the_ssd,
        "from tests.bench.test_la_bench_plain import check_plain_baseline_is_the_ssd as c; c()",
    )
