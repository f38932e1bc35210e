"""The one-pass tree kernel (``tree_chunk_linear_attn``) against the reference operator (CUDA only).

Adversarial rounds: sequences of 1, 63, 64, 65, 129, 0 (empty) and 700 rows, requests at every chunk
boundary of the long ones (>= 6 handoffs), repeated requests, initial and final states, a
consumer round that starts 9 sequences (fan-out >= 8) from the exported states. KDA and GDN,
float32 (tight) and bfloat16, whose tolerance is fla's own split path's error on the same rows
(no hand-picked bound).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harts.ops.linear_attn import chunk_linear_attn, fla_chunk_linear_attn
from harts.ops.linear_attn.fla import fla_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_available(), reason="needs CUDA and fla-core")]

LENGTHS = [1, 63, 64, 65, 129, 0, 700]


def _inputs(kind: str, H: int = 4, K: int = 64, V: int = 64):  # noqa: ANN202
    torch.manual_seed(0)
    T, dev = sum(LENGTHS), "cuda"
    q = torch.randn(T, H, K, device=dev, dtype=torch.float64)
    k = F.normalize(torch.randn(T, H, K, device=dev, dtype=torch.float64), dim=-1)
    v = torch.randn(T, H, V, device=dev, dtype=torch.float64)
    g = -F.softplus(torch.randn(*(T, H, K) if kind == "kda" else (T, H), device=dev, dtype=torch.float64)) * 0.2
    beta = torch.rand(T, H, device=dev, dtype=torch.float64).clamp(0.05, 0.95)
    h0 = torch.randn(len(LENGTHS), H, K, V, device=dev, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device=dev)
    long = len(LENGTHS) - 1
    req = [[long, c] for c in range(64, 700, 64)] + [
        [4, 64],
        [4, 128],
        [4, 129],
        [3, 64],
        [0, 0],
        [2, 64],
        [long, 64],
        [5, 0],
    ]
    return [q, k, v, g, beta], h0, cu, torch.tensor(req, device=dev)


def _run(op, x, h0, cu, req):  # noqa: ANN001, ANN202
    o, final, states = op(*x, cu_seqlens=cu, initial_state=h0, chunk_size=64, state_requests=req)
    n2 = 9
    rows = torch.arange(130, device="cuda").repeat(n2)
    cu2 = torch.arange(n2 + 1, device="cuda") * 130
    o2, final2, _ = op(*(t[rows] for t in x), cu_seqlens=cu2, initial_state=states[:n2], chunk_size=64)
    return [o, final, states, o2, final2]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()


def _errors(op, kind: str, dtype: torch.dtype, weights=None, K: int = 64, H: int = 4):  # noqa: ANN001, ANN202
    from harts.ops.linear_attn.tree_kernel import tree_chunk_linear_attn  # noqa: F401  (import check)

    x64, h0, cu, req = _inputs(kind, H=H, K=K, V=K)
    leaves64 = [t.clone().requires_grad_() for t in [*x64, h0]]
    leaves = [t.to(dtype).clone().requires_grad_() for t in x64] + [h0.float().clone().requires_grad_()]
    ref = _run(chunk_linear_attn, leaves64[:5], leaves64[5], cu, req)
    out = _run(op, leaves[:5], leaves[5], cu, req)
    w = weights or [torch.randn_like(r) for r in ref]
    g_ref = torch.autograd.grad(sum((r * wi).sum() for r, wi in zip(ref, w)), leaves64)
    g_out = torch.autograd.grad(sum((o.double() * wi).sum() for o, wi in zip(out, w)), leaves)
    names = ["o", "final", "states", "o2", "final2", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    return dict(zip(names, [_rel(a, b) for a, b in zip(out + list(g_out), ref + list(g_ref))])), w


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_tree_kernel_float32_matches_reference(kind: str) -> None:
    from harts.ops.linear_attn.tree_kernel import tree_chunk_linear_attn

    errs, _ = _errors(tree_chunk_linear_attn, kind, torch.float32)
    for name, e in errs.items():
        assert e < 5e-3, f"{kind} {name}: {e:.2e}"


def test_tree_kernel_float32_head_dim_128() -> None:
    """float32 at ling3_tiny's head dim: the backward scan's launch must fit shared memory
    (two pipelining stages did not: 245,760 of 232,448 bytes on an H200)."""
    from harts.ops.linear_attn.tree_kernel import tree_chunk_linear_attn

    errs, _ = _errors(tree_chunk_linear_attn, "kda", torch.float32, K=128)
    for name, e in errs.items():
        assert e < 5e-3, f"{name}: {e:.2e}"


def test_tree_kernel_gdn_at_qwen_heads_without_fallback() -> None:
    """GDN at Qwen3.5 / Qwen3-Next's linear-attention shape (16 key heads repeated to 32 value
    heads of 128, as the layer hands them over) through the tree kernel on the GPU, forward and
    backward with exported states and a replayed consumer round, against the float64 reference;
    no warning (a fallback to the reference op would warn)."""
    import warnings

    from harts.ops.linear_attn.tree_kernel import tree_chunk_linear_attn

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        errs, _ = _errors(tree_chunk_linear_attn, "gdn", torch.float32, K=128, H=32)
    for name, e in errs.items():
        assert e < 5e-3, f"{name}: {e:.2e}"


@pytest.fixture
def gdn_native_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """GDN on fla-core's GDN kernels (``HARTS_GDN_NATIVE=1``), its check run afresh."""
    from harts.ops.linear_attn.tree_kernel import _gdn_checked

    monkeypatch.setenv("HARTS_GDN_NATIVE", "1")
    _gdn_checked.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gdn_runs_on_fla_gdn_kernels(dtype: torch.dtype, gdn_native_on: None) -> None:
    """At Qwen's linear-attention shape (32 heads of 128) GDN takes fla-core's own GDN kernels:
    their first-call check against the KDA kernels passes, without a warning (on Hopper with
    Triton < 3.7.1 this is the check that fla #640's miscompile would fail)."""
    import warnings

    from harts.ops.linear_attn.tree_kernel import gdn_native

    q = torch.zeros(1, 32, 128, device="cuda", dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gdn_native(q, q)


def test_gdn_kernels_match_the_reference(gdn_native_on: None) -> None:
    """float32 GDN on fla's GDN kernels against the float64 reference, every output and
    gradient, at Qwen's head dim; no warning (the check passed, the GDN kernels ran)."""
    import warnings

    from harts.ops.linear_attn.tree_kernel import tree_chunk_linear_attn

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        errs, _ = _errors(tree_chunk_linear_attn, "gdn", torch.float32, K=128)
    for name, e in errs.items():
        assert e < 5e-3, f"{name}: {e:.2e}"


def test_gdn_kernels_bf16_within_the_kda_kernels_error(monkeypatch: pytest.MonkeyPatch, gdn_native_on: None) -> None:
    """bf16 GDN on fla's GDN kernels: every output and gradient within 1.5x the error of the KDA
    kernels with the decay broadcast (the default) plus the float32 error, on the same rows and
    weights, at Qwen's head dim."""
    import warnings

    from harts.ops.linear_attn.tree_kernel import gdn_kernels, tree_chunk_linear_attn

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed check warns: the GDN kernels must have run
        f32, _ = _errors(tree_chunk_linear_attn, "gdn", torch.float32, K=128)
        native, w = _errors(tree_chunk_linear_attn, "gdn", torch.bfloat16, K=128)
    assert gdn_kernels() == "gdn"
    monkeypatch.setenv("HARTS_GDN_NATIVE", "0")
    kda, _ = _errors(tree_chunk_linear_attn, "gdn", torch.bfloat16, weights=w, K=128)
    for name in native:
        assert native[name] <= 1.5 * kda[name] + f32[name], f"{name}: GDN {native[name]:.2e}, KDA {kda[name]:.2e}"


def test_tree_kernel_bf16_within_fla_split_error() -> None:
    """bf16: every output and gradient within 1.5x the fla split path's error (+ the float32
    kernel's own error), on the same rows and weights."""
    from harts.ops.linear_attn.tree_kernel import tree_chunk_linear_attn

    f32, _ = _errors(tree_chunk_linear_attn, "kda", torch.float32)
    split, w = _errors(fla_chunk_linear_attn, "kda", torch.bfloat16)
    tree, _ = _errors(tree_chunk_linear_attn, "kda", torch.bfloat16, weights=w)
    for name in tree:
        assert tree[name] <= 1.5 * split[name] + f32[name], f"{name}: tree {tree[name]:.2e}, split {split[name]:.2e}"


def test_requested_state_gradient_alone_reaches_every_input() -> None:
    """Only the exported states get a gradient: an injection bug cannot hide behind outputs."""
    from harts.ops.linear_attn.tree_kernel import tree_chunk_linear_attn

    x64, h0, cu, req = _inputs("kda")
    leaves64 = [t.clone().requires_grad_() for t in [*x64, h0]]
    leaves = [t.float().clone().requires_grad_() for t in [*x64, h0]]
    _, _, s_ref = chunk_linear_attn(
        *leaves64[:5], cu_seqlens=cu, initial_state=leaves64[5], chunk_size=64, state_requests=req
    )
    _, _, s_out = tree_chunk_linear_attn(
        *leaves[:5], cu_seqlens=cu, initial_state=leaves[5], chunk_size=64, state_requests=req
    )
    w = torch.randn_like(s_ref)
    # q never reaches a state: the reference graph does not use it, and ours must give it zeros
    g_ref = torch.autograd.grad((s_ref * w).sum(), leaves64, allow_unused=True, materialize_grads=True)
    g_out = torch.autograd.grad((s_out.double() * w).sum(), leaves, allow_unused=True, materialize_grads=True)
    assert not g_out[0].any(), "q got a gradient from the states alone"
    for name, a, b in zip(["k", "v", "g", "beta", "h0"], g_out[1:], g_ref[1:]):
        assert b.abs().max() > 0, name
        assert _rel(a, b) < 5e-3, name


def test_replay_rows_give_trajectory_outputs_bit_for_bit() -> None:
    """float32: a branch restarted from the exported state at its chunk anchor, replaying the rows
    between anchor and fork, reproduces the trajectory-wise outputs after the fork exactly."""
    from harts.ops.linear_attn.tree_kernel import tree_chunk_linear_attn

    x64, _, _, _ = _inputs("kda")
    x = [t.float() for t in x64]
    L, anchor, fork = 700, 320, 347
    cu = torch.tensor([0, L], device="cuda")
    traj, _, (s_anchor,) = tree_chunk_linear_attn(
        *(t[:L] for t in x), cu_seqlens=cu, chunk_size=64, state_requests=torch.tensor([[0, anchor]], device="cuda")
    )
    rows = torch.arange(anchor, L, device="cuda")
    branch, _, _ = tree_chunk_linear_attn(
        *(t[rows] for t in x),
        cu_seqlens=torch.tensor([0, L - anchor], device="cuda"),
        initial_state=s_anchor[None],
        chunk_size=64,
    )
    assert torch.equal(branch[fork - anchor :], traj[fork:L])


# ------------------------------------------------------------------ linked rounds

#: three rounds as a layout hands them over (state ids): round 0 exports at chunk boundaries,
#: finals (a 64-row and a 129-row sequence, an empty one) and a 0-position request; round 1
#: starts 9 sequences from them (a fan-out of 4 on one state) and exports again; round 2 starts
#: from round 1's states, from a round-0 state and from zero
LINKED = [
    (
        [1, 63, 64, 65, 129, 0, 700],
        [-1] * 7,
        [(6, 64), (6, 320), (6, 640), (4, 64), (4, 129), (3, 64), (0, 0), (2, 64), (5, 0)],
        [0, 1, 2, 3, 4, 5, 6, 7, 8],
    ),
    (
        [130, 64, 1, 200, 65, 128, 0, 77, 300],
        [0, 0, 0, 0, 1, 4, 7, 8, 2],
        [(0, 128), (3, 192), (8, 300), (5, 64)],
        [10, 11, 12, 13],
    ),
    ([90, 64, 150, 33], [10, 11, 12, -1], [], []),
]


def _linked_inputs(dtype: torch.dtype, kind: str = "kda", K: int = 64):  # noqa: ANN202
    torch.manual_seed(3)
    T, H, dev = sum(sum(r[0]) for r in LINKED), 4, "cuda"
    x = [
        torch.randn(T, H, K, device=dev, dtype=torch.float64),
        F.normalize(torch.randn(T, H, K, device=dev, dtype=torch.float64), dim=-1),
        torch.randn(T, H, K, device=dev, dtype=torch.float64),
        -F.softplus(torch.randn(*(T, H, K) if kind == "kda" else (T, H), device=dev, dtype=torch.float64)) * 0.2,
        torch.rand(T, H, device=dev, dtype=torch.float64).clamp(0.05, 0.95),
    ]
    return [t.to(dtype).clone().requires_grad_() for t in x]


def _per_round(x, op=chunk_linear_attn):  # noqa: ANN001, ANN202
    """The rounds one ``op`` call each, states handed over as the per-round compact executor does."""
    states: dict[int, torch.Tensor] = {}
    outs, at = [], 0
    for lengths, init, req, ids in LINKED:
        t = sum(lengths)
        part = [a[at : at + t] for a in x]
        at += t
        zero = x[0].new_zeros(x[0].shape[1], x[0].shape[2], x[2].shape[2])
        h0 = torch.stack([states[s] if s >= 0 else zero for s in init])
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        o, _, got = op(
            *part,
            cu_seqlens=cu,
            initial_state=h0,
            chunk_size=64,
            state_requests=torch.tensor(req, dtype=torch.int64).reshape(-1, 2),
        )
        states.update({s: got[j] for j, s in enumerate(ids)})
        outs.append(o)
    return torch.cat(outs)


def _linked_plan():  # noqa: ANN202
    import numpy as np

    from harts.ops.linear_attn.tree_kernel import plan_linked_rounds

    rounds = [
        (np.concatenate([[0], np.cumsum(lengths)]), np.asarray(init), np.asarray(req).reshape(-1, 2), np.asarray(ids))
        for lengths, init, req, ids in LINKED
    ]
    plan = plan_linked_rounds(rounds, 64)
    assert plan is not None
    return plan


@pytest.mark.parametrize("kind", ["kda", "gdn", "gdn_native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_linked_rounds_equal_the_rounds_one_call_each(
    dtype: torch.dtype, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All rounds in one op (``linked_tree_linear_attn``) against the float64 reference run
    round by round with the states handed over: outputs and every input's gradient; bf16 within
    1.5x the per-round tree kernel's own bf16 error plus its float32 error."""
    import warnings

    from harts.ops.linear_attn.tree_kernel import (
        _gdn_checked,
        gdn_kernels,
        linked_tree_linear_attn,
        tree_chunk_linear_attn,
    )

    native, K = kind == "gdn_native", 64
    if native:  # GDN on fla's GDN kernels (``HARTS_GDN_NATIVE=1``), at Qwen's head dim, checked afresh
        monkeypatch.setenv("HARTS_GDN_NATIVE", "1")
        _gdn_checked.clear()
        kind, K = "gdn", 128
        # a failed check warns and runs the KDA kernels: that must not pass for this test
        warnings.simplefilter("error")
    plan = _linked_plan()
    ref_x = _linked_inputs(torch.float64, kind, K)
    ref = _per_round(ref_x)
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), ref_x)

    def errors(run, dt: torch.dtype) -> list[float]:  # noqa: ANN001
        x = _linked_inputs(dt, kind, K)
        o = run(x)
        grads = torch.autograd.grad((o.double() * w).sum(), x)
        return [_rel(a, b) for a, b in zip([o, *grads], [ref, *g_ref])]

    linked = errors(lambda x: linked_tree_linear_attn(*x, plan=plan), dtype)
    assert not native or gdn_kernels() == "gdn"
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    if dtype == torch.float32:
        for name, e in zip(names, linked):
            assert e < 5e-3, f"{name}: {e:.2e}"
        return
    # the float32 term is the per-round kernel's (a broken linked op must not widen its own bound)
    f32 = errors(lambda x: _per_round(x, tree_chunk_linear_attn), torch.float32)
    per_round = errors(lambda x: _per_round(x, tree_chunk_linear_attn), dtype)
    for name, a, b, c in zip(names, linked, per_round, f32):
        assert a <= 1.5 * b + c, f"{name}: linked {a:.2e}, per round {b:.2e}"
