"""MoE on compact rows with multiplicity weights equals MoE on the expanded rows."""

from __future__ import annotations

import pytest
import torch

from harts.models import HybridConfig
from harts.models.layers.moe import MoE


@pytest.mark.parametrize("score,groups", [("sigmoid", 2), ("softmax", 1)])
def test_weighted_moe_equals_expanded(score: str, groups: int) -> None:
    torch.manual_seed(0)
    cfg = HybridConfig.tiny(
        dtype="float64",
        num_experts=8,
        num_experts_per_tok=3,
        router_score=score,
        n_group=groups,
        topk_group=1 if groups > 1 else 1,
        initializer_range=0.3,
    )
    moe = MoE(cfg).double()
    moe.gate.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(7, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    q = torch.tensor([1, 3, 1, 5, 2, 1, 4])
    y, z, aux, counts = moe(x, q.double())
    xe = x.repeat_interleave(q, dim=0)
    ye, ze, auxe, countse = moe(xe, torch.ones(int(q.sum()), dtype=torch.float64))
    torch.testing.assert_close(y.repeat_interleave(q, dim=0), ye, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, ze, rtol=1e-12, atol=0)
    torch.testing.assert_close(aux, auxe, rtol=1e-12, atol=0)
    assert torch.equal(counts, countse) and counts.sum() == q.sum() * 3
    # gradients of the router losses agree too (weights = multiplicities)
    gz = torch.autograd.grad(z + aux, moe.gate.weight, retain_graph=True)[0]
    gze = torch.autograd.grad(ze + auxe, moe.gate.weight)[0]
    torch.testing.assert_close(gz, gze, rtol=1e-10, atol=1e-14)


def test_group_routing_stays_in_top_groups() -> None:
    torch.manual_seed(1)
    cfg = HybridConfig.tiny(dtype="float64", num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1)
    moe = MoE(cfg).double()
    _, _, idx, w = moe.gate(torch.randn(50, cfg.hidden_size, dtype=torch.float64))
    assert (idx // 2).eq((idx // 2)[:, :1]).all()  # both experts from the one chosen group
    torch.testing.assert_close(w.sum(-1), torch.full((50,), cfg.routed_scaling_factor, dtype=torch.float64))


def _expert_grads(moe: MoE, x: torch.Tensor, w: torch.Tensor, impl: str) -> list[torch.Tensor]:
    moe.experts.impl = impl
    y, z, aux, counts = moe(x, w)
    loss = (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).view_as(y)).sum() + z + aux
    params = [x, moe.experts.gate_up_proj, moe.experts.down_proj, moe.gate.weight]
    return [y.detach(), counts, *torch.autograd.grad(loss, params)]


@pytest.mark.parametrize("rows,experts,topk", [(50, 8, 3), (3, 16, 2), (1, 4, 4), (0, 8, 2)])
def test_grouped_experts_equal_loop(rows: int, experts: int, topk: int) -> None:
    """The grouped-GEMM path equals the per-expert reference, output and every gradient,
    including experts that get no row (3 rows x 2 of 16 experts) and an empty input."""
    torch.manual_seed(2)
    cfg = HybridConfig.tiny(dtype="float32", num_experts=experts, num_experts_per_tok=topk, initializer_range=0.3)
    moe = MoE(cfg)
    x = torch.randn(rows, cfg.hidden_size, requires_grad=True)
    w = torch.arange(1, rows + 1, dtype=torch.float32)
    ref = _expert_grads(moe, x, w, "loop") if rows else None
    got = _expert_grads(moe, x, w, "grouped") if rows else None
    if rows == 0:
        moe.experts.impl = "grouped"
        y = moe.experts(x, torch.zeros(0, topk, dtype=torch.long), torch.zeros(0, topk))
        assert y.shape == (0, cfg.hidden_size)
        return
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_grouped_experts_bf16_close_and_deterministic() -> None:
    torch.manual_seed(3)
    cfg = HybridConfig.tiny(dtype="float32", num_experts=8, num_experts_per_tok=2, initializer_range=0.3)
    moe = MoE(cfg)
    x32 = torch.randn(64, cfg.hidden_size)
    idx = torch.randint(0, 8, (64, 2))
    w = torch.rand(64, 2)
    moe.experts.impl = "loop"
    ref = moe.experts(x32, idx, w)
    moe = moe.to(torch.bfloat16)
    moe.experts.impl = "grouped"
    a = moe.experts(x32.bfloat16(), idx, w)
    b = moe.experts(x32.bfloat16(), idx, w)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


def test_experts_auto_impl_and_bad_impl() -> None:
    cfg = HybridConfig.tiny(dtype="float64", num_experts=4, num_experts_per_tok=2)
    moe = MoE(cfg).double()
    x = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 1], [0, 3]])
    w = torch.rand(5, 2, dtype=torch.float64)
    y = moe.experts(x, idx, w)  # float64: auto takes the reference loop
    moe.experts.impl = "loop"
    assert torch.equal(y, moe.experts(x, idx, w))
    with pytest.raises(ValueError, match="impl"):
        moe.experts.impl = "fast"


@pytest.mark.gpu
def test_grouped_experts_cuda_no_host_sync() -> None:
    """bf16 on CUDA: forward and backward never synchronize with the host, and match the loop."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(4)
    cfg = HybridConfig.tiny(
        dtype="float32",
        hidden_size=256,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        initializer_range=0.05,
    )
    moe = MoE(cfg).cuda().to(torch.bfloat16)
    x = torch.randn(4096, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wt = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    moe.experts.impl = "loop"
    ref = _expert_grads(moe, x, wt, "loop")
    moe.experts.impl = "grouped"
    _expert_grads(moe, x, wt, "grouped")  # warm-up (lazy init may sync once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        idx = moe.gate(x)[2]
        y = moe.experts(x, idx, moe.gate(x)[3])
        y.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = _expert_grads(moe, x, wt, "grouped")
    for a, b in zip(ref, got):
        scale = a.float().abs().max().item() + 1e-6
        assert (a.float() - b.float()).abs().max().item() <= 0.03 * scale


def test_half_router_logits_match_the_upcast_linear() -> None:
    """The half-precision router GEMM's autograd (the Function itself, on CPU) gives the upcast
    F.linear's logits and gradients: the same products, float32 gradients rounded once (bit for
    bit); its split backward (``router_grad_split``) within one bfloat16 rounding of them."""
    _check_half_router(torch.device("cpu"), exact_logits=True)


@pytest.mark.gpu
def test_half_router_logits_match_the_upcast_linear_on_cuda() -> None:
    """On CUDA: one bf16 tensor-core GEMM with float32 output; logits agree with the float32
    GEMM up to summation order, gradients (the same float32 GEMMs) bit for bit, and the split
    tensor-core backward within one bfloat16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_half_router(torch.device("cuda"), exact_logits=False)


def _check_half_router(device: torch.device, exact_logits: bool) -> None:
    from harts.models.layers.moe import _HalfRouterLogits

    torch.manual_seed(0)
    x = torch.randn(512, 256).bfloat16().to(device).requires_grad_()
    w = (torch.randn(32, 256) * 0.1).bfloat16().to(device).requires_grad_()
    # gradients over six orders of magnitude: the split must keep float32's range and precision
    g = torch.randn(512, 32, device=device) * torch.logspace(-6, 0, 32, device=device)
    ref = torch.nn.functional.linear(x.float(), w.float())
    dx_ref, dw_ref = torch.autograd.grad((ref * g).sum(), (x, w))
    exact64 = [g.double() @ w.double(), g.double().t() @ x.double()]
    # sums of |terms|: float32 accumulation (either path) errs relative to these, not the result
    mags = [g.double().abs() @ w.double().abs(), g.double().abs().t() @ x.double().abs()]
    for split in (False, True):
        out = _HalfRouterLogits.apply(x, w, split)
        assert out.dtype == torch.float32
        tol = 0.0 if exact_logits else 1e-5
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        dx, dw = torch.autograd.grad((out * g).sum(), (x, w))
        assert dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
        if not split:
            torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
            torch.testing.assert_close(dw, dw_ref, rtol=0, atol=0)
            continue
        for got, want, truth, mag in zip((dx, dw), (dx_ref, dw_ref), exact64, mags):
            # within one bfloat16 rounding of the float64 product plus float32 accumulation,
            # the bound the float32 GEMMs' result meets too
            err = (got.double() - truth).abs()
            assert bool((err <= 2**-8 * truth.abs() + 2**-16 * mag).all())
            assert float((got == want).float().mean()) > 0.98  # nearly always the same rounding


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_fast_paths_equal_the_reference(recompute: bool) -> None:
    """Every MoE fast path (``FAST_PATHS``: the forward's dispatch reused by the recomputation,
    the combine weights permuted by gathers both ways; the split router backward runs on CUDA
    only) gives the reference code's output and gradients bit for bit, grouped experts in
    float32, with and without checkpoint's recomputation (through the MoE bench's harness); a
    recomputation finds the forward's dispatch in the slot and sorts nothing."""
    from benchmarks.modules.moe import run_moe
    from harts.models.layers.moe import FAST_PATHS, Experts

    torch.manual_seed(0)
    cfg = HybridConfig.tiny(
        dtype="float32", num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, initializer_range=0.3
    )
    moe = MoE(cfg)
    assert moe.fast == frozenset(FAST_PATHS) and moe.experts.uses_grouped(torch.zeros(1))
    x = torch.randn(301, cfg.hidden_size)
    gy = torch.randn(301, cfg.hidden_size)
    w = torch.rand(301) + 0.5
    sorts = []
    real = Experts.dispatch

    def counting(self, topk_idx):  # noqa: ANN001, ANN202
        sorts.append(1)
        return real(self, topk_idx)

    outs = {}
    for fast in (frozenset(), frozenset(FAST_PATHS)):
        moe.fast = fast
        sorts.clear()
        Experts.dispatch = counting  # type: ignore[method-assign]
        try:
            outs[fast] = run_moe(moe, x, w, gy, recompute=recompute)
        finally:
            Experts.dispatch = real  # type: ignore[method-assign]
        # with reuse the recomputation does not sort again; without it, it does
        assert len(sorts) == (2 if recompute and not fast else 1)
    ref, got = outs.values()
    assert len(ref) == len(got) == 2 + len(list(moe.parameters()))
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_moe_bench_runs_on_cpu(tmp_path) -> None:  # noqa: ANN001
    """``python -m benchmarks.modules.moe`` on a small preset: every variant and mode, equal
    results, its JSON; bad arguments are argparse errors."""
    import json

    from benchmarks.modules.moe import kernel_family, main

    out = tmp_path / "moe.json"
    assert main(["--device", "cpu", "--model", "tiny", "--rows", "64", "--dtype", "float32", "--repeat", "1",
                 "--json", str(out)]) == 0  # fmt: skip
    rec = json.loads(out.read_text())
    assert set(rec["modes"]) == {"plain", "recompute", "kept"} and rec["model_tflop"] > 0
    for rows in rec["modes"].values():
        assert {"reference", "fast"} <= set(rows)
        for r in rows.values():
            assert r["max_rel_diff_vs_first"] == r["max_rel_diff_vs_first_mode"] == 0.0 and r["ms"] > 0
    assert kernel_family("void at::native::(anonymous namespace)::indexSelectLargeIndex") == "gather / scatter"
    assert kernel_family("triton_poi_fused_mul_silu_0") == "compiled element-wise"
    for bad in (["--variants", "nope"], ["--modes", "both"], ["--rows", "0"]):
        with pytest.raises(SystemExit):
            main(["--device", "cpu", "--model", "tiny", *bad])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lean_routed_experts_equal_the_autograd_path(dtype: torch.dtype) -> None:
    """``Experts.forward(..., lean=True)`` keeps only its inputs and recomputes the gather, the
    gate/up GEMM and the SwiGLU in its backward: output and every gradient (rows, combine
    weights, both weight tensors) bit for bit the autograd path's, with rows of multiplicity 0
    and experts that get no row."""
    from harts.models.layers.moe import Experts

    torch.manual_seed(1)
    cfg = HybridConfig.tiny(dtype="float32", num_experts=8, num_experts_per_tok=3, initializer_range=0.3)
    experts = Experts(cfg).to(dtype)
    t, k = 203, 3
    x = torch.randn(t, cfg.hidden_size, dtype=dtype)
    # experts 6 and 7 never chosen; ties between rows
    idx = torch.stack([torch.randperm(6)[:k] for _ in range(t)])
    w = torch.rand(t, k, dtype=dtype)
    gy = torch.randn(t, cfg.hidden_size, dtype=dtype)
    outs = []
    # the autograd path, lean, and lean keeping its gate/up output (ExecutionConfig.moe_keep_gate_up)
    for lean, keep in ((False, False), (True, False), (True, True)):
        experts.zero_grad(set_to_none=True)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = experts(xx, idx, ww, lean=lean, keep_gate_up=keep)
        (y.float() * gy.float()).sum().backward()
        outs.append([y.detach(), xx.grad, ww.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    for name, a, b, c in zip(["y", "d_x", "d_w", "d_gate_up", "d_down"], *outs):
        assert a is not None and b is not None and torch.equal(a, b), name
        assert c is not None and torch.equal(a, c), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_grouped_linear_weight_gradient_comes_in_the_weight_layout(dtype: torch.dtype) -> None:
    """``_GroupedLinear`` (the grouped experts' GEMMs): y = x @ w[e]^T per expert group, with
    gradients equal to autograd's through ``_grouped_mm(x, w.transpose(1, 2))``, the weight
    gradient made contiguous in w's own [E, N, K] layout (autograd's is a transposed view, which
    AccumulateGrad copies); an empty group and a frozen weight included."""
    from harts.models.layers.moe import _GroupedLinear

    torch.manual_seed(0)
    e, n, kd = 4, 8, 16  # _grouped_mm takes strides of multiples of 16 bytes
    sizes = [7, 0, 3, 11]  # expert 1 gets no row
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = torch.randn(sum(sizes), kd, dtype=dtype)
    w = torch.randn(e, n, kd, dtype=dtype)
    g = torch.randn(sum(sizes), n, dtype=dtype)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y1 = _GroupedLinear.apply(x1, w1, offs)
    y1.backward(g)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y2 = torch._grouped_mm(x2, w2.transpose(1, 2), offs=offs)
    d_x2, d_wt = torch.autograd.grad(y2, (x2, w2), g)
    assert torch.equal(y1, y2) and torch.equal(x1.grad, d_x2)
    torch.testing.assert_close(w1.grad, d_wt, rtol=0, atol=0)
    assert w1.grad.is_contiguous()
    ref = torch.stack([g[a:b].float().T @ x[a:b].float() for a, b in zip([0, *offs[:-1].tolist()], offs.tolist())])
    torch.testing.assert_close(w1.grad.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    x3 = x.clone().requires_grad_()
    _GroupedLinear.apply(x3, w, offs).backward(g)  # frozen weight: only the row gradient
    assert torch.equal(x3.grad, d_x2)


def test_lean_routed_experts_keep_no_pair_sized_activation() -> None:
    """What the lean path keeps for its backward: no [T K, .] floating tensor (the gathered rows,
    the gate/up output and the activation are what the autograd path keeps); only the rows, the
    combine weights, the weights and the dispatch's integer indices."""
    from harts.models.layers.moe import Experts

    torch.manual_seed(0)
    cfg = HybridConfig.tiny(dtype="float32", num_experts=8, num_experts_per_tok=4, initializer_range=0.3)
    experts = Experts(cfg)
    t, k = 64, 4
    x = torch.randn(t, cfg.hidden_size, requires_grad=True)
    idx = torch.stack([torch.randperm(8)[:k] for _ in range(t)])
    w = torch.rand(t, k, requires_grad=True)
    params = {p.data_ptr() for p in experts.parameters()}
    for lean, keep in ((False, False), (True, False), (True, True)):
        kept: list[torch.Tensor] = []

        def pack(saved: torch.Tensor) -> torch.Tensor:
            if saved.data_ptr() not in params:
                kept.append(saved)
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
            experts(x, idx, w, lean=lean, keep_gate_up=keep)
        pair_floats = [s for s in kept if s.is_floating_point() and s.dim() >= 1 and s.shape[0] == t * k]
        if lean and keep:  # the gate/up output [T K, 2I] only
            assert [tuple(s.shape) for s in pair_floats] == [(t * k, 2 * cfg.moe_intermediate_size)]
        elif lean:
            assert pair_floats == [], [tuple(s.shape) for s in pair_floats]
        else:
            assert pair_floats, "the autograd path keeps pair-sized activations"
