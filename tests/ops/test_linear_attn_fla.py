"""fla-core fast path against the reference chunk operator (CUDA only; marked gpu)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from harts.ops.linear_attn import chunk_linear_attn, fla_chunk_linear_attn
from harts.ops.linear_attn.fla import fla_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_available(), reason="needs CUDA and fla-core")]


def make(T, H, K, V, kind, dtype):
    dev = "cuda"
    q = torch.randn(T, H, K, device=dev, dtype=torch.float64)
    k = F.normalize(torch.randn(T, H, K, device=dev, dtype=torch.float64), dim=-1)
    v = torch.randn(T, H, V, device=dev, dtype=torch.float64)
    g = -F.softplus(torch.randn(*(T, H, K) if kind == "kda" else (T, H), device=dev, dtype=torch.float64)) * 0.2
    beta = torch.rand(T, H, device=dev, dtype=torch.float64).clamp(0.05, 0.95)
    x64 = [q, k, v, g, beta]
    return x64, [x.to(dtype) for x in x64]


def run(op, x, h0, cu, req):
    """A round exporting states, and a second round consuming them (both differentiable)."""
    o, final, states = op(*x, cu_seqlens=cu, initial_state=h0, chunk_size=64, state_requests=req)
    rows = torch.arange(100, device="cuda").repeat(states.shape[0])
    cu2 = torch.arange(states.shape[0] + 1, device="cuda") * 100
    o2, final2, _ = op(*(t[rows] for t in x), cu_seqlens=cu2, initial_state=states, chunk_size=64)
    return [o, final, states, o2, final2]


def rel_err(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 5e-2)], ids=["f32", "bf16"])
def test_fla_kda_matches_reference_with_exported_states(dtype, tol):
    T, H, K, V = 900, 4, 64, 64
    x64, x = make(T, H, K, V, "kda", dtype)
    cu = torch.tensor([0, 400, 401, 650, 900], device="cuda")
    h0 = torch.randn(4, H, K, V, device="cuda", dtype=torch.float64)
    req = torch.tensor([[0, 128], [0, 256], [0, 200], [2, 64], [3, 250], [1, 1], [0, 0]], device="cuda")
    leaves64 = [t.clone().requires_grad_() for t in [*x64, h0]]
    leaves = [t.clone().requires_grad_() for t in [*x, h0.float()]]
    ref = run(chunk_linear_attn, leaves64[:5], leaves64[5], cu, req)
    out = run(fla_chunk_linear_attn, leaves[:5], leaves[5], cu, req)
    for name, a, b in zip(["o", "final", "states", "o2", "final2"], out, ref):
        assert rel_err(a, b) < tol, name
    w = [torch.randn_like(r) for r in ref]
    g_ref = torch.autograd.grad(sum((r * wi).sum() for r, wi in zip(ref, w)), leaves64)
    g_out = torch.autograd.grad(sum((o.double() * wi).sum() for o, wi in zip(out, w)), leaves)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], g_out, g_ref):
        assert rel_err(a, b) < 4 * tol, name


def test_fla_split_export_reproduces_the_unsplit_call():
    """Cutting sequences at requested chunk boundaries leaves outputs and final states unchanged."""
    T, H, K, V = 700, 2, 64, 64
    _, x = make(T, H, K, V, "kda", torch.float32)
    cu = torch.tensor([0, 300, 700], device="cuda")
    plain = fla_chunk_linear_attn(*x, cu_seqlens=cu)
    split = fla_chunk_linear_attn(
        *x, cu_seqlens=cu, state_requests=torch.tensor([[0, 128], [1, 64], [1, 320]], device="cuda")
    )
    assert (split[0] - plain[0]).abs().max().item() <= 1e-5
    assert (split[1] - plain[1]).abs().max().item() <= 1e-5


def test_fla_gdn_forward_and_guarded_backward():
    T, H, K, V = 500, 2, 64, 64
    x64, x = make(T, H, K, V, "gdn", torch.float32)
    cu = torch.tensor([0, 200, 500], device="cuda")
    req = torch.tensor([[0, 128], [1, 70]], device="cuda")
    ref = chunk_linear_attn(*x64, cu_seqlens=cu, state_requests=req)
    with torch.no_grad():
        out = fla_chunk_linear_attn(*x, cu_seqlens=cu, state_requests=req)
    for a, b in zip(out, ref):
        assert rel_err(a, b) < 5e-3
    leaves = [t.clone().requires_grad_() for t in x]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, final, states = fla_chunk_linear_attn(*leaves, cu_seqlens=cu, state_requests=req)
    grads = torch.autograd.grad(o.sum() + final.sum() + states.sum(), leaves)
    assert all(torch.isfinite(gr).all() for gr in grads)


def test_fla_rejects_cpu_and_odd_chunk_sizes():
    _, x = make(64, 1, 16, 16, "kda", torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        fla_chunk_linear_attn(*(t.cpu() for t in x), cu_seqlens=torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="chunk_size"):
        fla_chunk_linear_attn(*x, cu_seqlens=torch.tensor([0, 64], device="cuda"), chunk_size=16)
