"""chunk_linear_attn against the token-by-token recurrence: outputs, final and requested states,
and every gradient (inputs, initial states, requested states consumed by a later call)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harts.ops.linear_attn import chunk_linear_attn, naive_recurrent_linear_attn

F64 = torch.float64


def make_inputs(T: int, H: int, K: int, V: int, kind: str, dtype=F64, decay: float = 0.3) -> list[torch.Tensor]:
    q = torch.randn(T, H, K, dtype=dtype)
    k = F.normalize(torch.randn(T, H, K, dtype=dtype), dim=-1)
    v = torch.randn(T, H, V, dtype=dtype)
    g_shape = (T, H, K) if kind == "kda" else (T, H)
    g = -decay * F.softplus(torch.randn(g_shape, dtype=dtype))
    beta = torch.rand(T, H, dtype=dtype).clamp(0.05, 0.95)
    return [q, k, v, g, beta]


def split_lengths(T: int) -> torch.Tensor:
    """Three odd-length sequences packed into T rows (the first is the longest)."""
    a = T // 2 + 1
    b = (T - a) // 3
    return torch.tensor([0, a, a + b, T])


def run_twice(op, inputs, h0, cu, requests, chunk_size):
    """One call exporting states, then a second call started from them (a later round)."""
    o, final, req = op(*inputs, cu_seqlens=cu, initial_state=h0, chunk_size=chunk_size, state_requests=requests)
    # Round 2: every requested state starts a sequence over the first 9 rows.
    R = req.shape[0]
    rows = torch.arange(9).repeat(R)
    cu2 = torch.arange(R + 1) * 9
    o2, final2, _ = op(*(x[rows] for x in inputs), cu_seqlens=cu2, initial_state=req, chunk_size=chunk_size)
    return o, final, req, o2, final2


def weighted_loss(outs, weights):
    return sum((o * w).sum() for o, w in zip(outs, weights))


@pytest.mark.parametrize("kind", ["kda", "gdn"])
@pytest.mark.parametrize(
    "T,H,K,V,B",
    [
        pytest.param(*case, id="T{}-H{}-K{}-V{}-B{}".format(*case))
        for case in [(63, 2, 16, 8, 16), (65, 2, 16, 8, 16), (130, 2, 16, 8, 16), (130, 1, 8, 16, 64), (65, 3, 8, 4, 8)]
    ],
)
def test_chunk_matches_naive_values_and_all_gradients(T, H, K, V, B, kind):
    inputs = make_inputs(T, H, K, V, kind)
    cu = split_lengths(T)
    N = cu.numel() - 1
    L0 = int(cu[1])
    h0 = torch.randn(N, H, K, V, dtype=F64)
    # aligned boundaries, a final state, count 0, mid-chunk counts (no_replay), duplicates
    requests = torch.tensor(
        [[0, B], [0, L0], [1, 0], [2, 1], [0, min(B + 3, L0 - 2)], [0, B], [2, int(cu[3] - cu[2])], [0, L0 - 1]]
    )
    leaves = [x.clone().requires_grad_() for x in [*inputs, h0]]
    ref = run_twice(naive_recurrent_linear_attn, leaves[:5], leaves[5], cu, requests, B)
    out = run_twice(chunk_linear_attn, leaves[:5], leaves[5], cu, requests, B)
    for name, a, b in zip(["o", "final", "requested", "o2", "final2"], out, ref):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    weights = [torch.randn_like(x) for x in ref]
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    g_ref = torch.autograd.grad(weighted_loss(ref, weights), leaves)
    g_out = torch.autograd.grad(weighted_loss(out, weights), leaves)
    for name, a, b in zip(names, g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"d{name}")


@pytest.mark.parametrize("B", [8, 32], ids=lambda b: f"B{b}")
def test_strong_decay_is_finite_in_float32(B):
    """Decays of ~-6 per token over a chunk underflow exp(G); factorised forms would overflow."""
    T, H, K, V = 130, 2, 32, 8
    inputs = make_inputs(T, H, K, V, "kda", dtype=torch.float32, decay=6.0)
    leaves = [x.clone().requires_grad_() for x in inputs]
    cu = torch.tensor([0, T])
    o, final, _ = chunk_linear_attn(*leaves, cu_seqlens=cu, chunk_size=B)
    ref, ref_final, _ = naive_recurrent_linear_attn(*(x.double() for x in inputs), cu_seqlens=cu)
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.double(), ref_final, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(o.sum() + final.sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)


def test_sequences_do_not_see_each_other():
    """float32: a sequence's results are bitwise the same alone or packed beside others."""
    T, H, K, V, B = 200, 2, 16, 16, 16
    inputs = make_inputs(T, H, K, V, "kda", dtype=torch.float32)
    cu = torch.tensor([0, 37, 101, 150, 200])
    h0 = torch.randn(4, H, K, V)
    requests = torch.tensor([[1, 32], [1, 48], [3, 16], [2, 49]])
    o, final, req = chunk_linear_attn(*inputs, cu_seqlens=cu, initial_state=h0, chunk_size=B, state_requests=requests)
    for i in range(4):
        lo, hi = int(cu[i]), int(cu[i + 1])
        mine = requests[:, 0] == i
        local = torch.stack([torch.zeros_like(requests[mine, 1]), requests[mine, 1]], dim=1)
        o_i, f_i, r_i = chunk_linear_attn(
            *(x[lo:hi] for x in inputs),
            cu_seqlens=torch.tensor([0, hi - lo]),
            initial_state=h0[i : i + 1],
            chunk_size=B,
            state_requests=local,
        )
        assert torch.equal(o_i, o[lo:hi]), i
        assert torch.equal(f_i[0], final[i]), i
        assert torch.equal(r_i, req[mine]), i


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_replay_from_boundary_state_reproduces_the_trajectory(dtype, kind):
    """A branch that starts at the exported state at 2B reproduces the trajectory's tail exactly;
    one that starts at the mid-chunk state at p (the no_replay ablation) equals it only in exact math."""
    T, H, K, V, B = 150, 2, 16, 16, 32
    p = 2 * B + 11
    inputs = make_inputs(T, H, K, V, kind, dtype=dtype)
    cu = torch.tensor([0, T])
    o, _, states = chunk_linear_attn(
        *inputs, cu_seqlens=cu, chunk_size=B, state_requests=torch.tensor([[0, 2 * B], [0, p]])
    )
    # replay: rows [2B, T) from the boundary state (the first p - 2B of them are replay rows)
    o_replay, _, _ = chunk_linear_attn(
        *(x[2 * B :] for x in inputs), cu_seqlens=torch.tensor([0, T - 2 * B]), initial_state=states[:1], chunk_size=B
    )
    # no_replay: rows [p, T) from the state at p, which shifts this branch's chunk grid
    o_direct, _, _ = chunk_linear_attn(
        *(x[p:] for x in inputs), cu_seqlens=torch.tensor([0, T - p]), initial_state=states[1:], chunk_size=B
    )
    replay_err = (o_replay[p - 2 * B :] - o[p:]).abs().max().item()
    direct_err = (o_direct - o[p:]).abs().max().item()
    if dtype == torch.float64:
        assert replay_err <= 1e-12 and direct_err <= 1e-12
    else:
        assert replay_err == 0.0
        assert direct_err > 1e-7  # a different floating-point path: measurable


def test_state_request_at_every_position_matches_naive():
    T, H, K, V, B = 40, 1, 8, 8, 8
    inputs = make_inputs(T, H, K, V, "kda")
    cu = torch.tensor([0, 19, 40])
    requests = torch.tensor([[s, c] for s, n in ((0, 19), (1, 21)) for c in range(n + 1)])
    _, _, req = chunk_linear_attn(*inputs, cu_seqlens=cu, chunk_size=B, state_requests=requests)
    _, _, ref = naive_recurrent_linear_attn(*inputs, cu_seqlens=cu, state_requests=requests)
    torch.testing.assert_close(req, ref, rtol=1e-11, atol=1e-12)


def test_empty_sequence_keeps_its_initial_state():
    T, H, K, V = 20, 1, 4, 4
    inputs = make_inputs(T, H, K, V, "gdn")
    cu = torch.tensor([0, 0, 20, 20])
    h0 = torch.randn(3, H, K, V, dtype=F64)
    o, final, req = chunk_linear_attn(
        *inputs, cu_seqlens=cu, initial_state=h0, chunk_size=8, state_requests=torch.tensor([[0, 0], [2, 0]])
    )
    ref = naive_recurrent_linear_attn(*inputs, cu_seqlens=cu, initial_state=h0)
    torch.testing.assert_close(o, ref[0])
    assert torch.equal(final[0], h0[0]) and torch.equal(final[2], h0[2])
    assert torch.equal(req[0], h0[0]) and torch.equal(req[1], h0[2])


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(cu_seqlens=torch.tensor([0, 10])), "end at T"),
        (dict(cu_seqlens=torch.tensor([0, 12, 8, 16])), "non-decreasing"),
        (dict(state_requests=torch.tensor([[0, 9]])), r"state_requests\[0\].*8 positions"),
        (dict(state_requests=torch.tensor([[3, 1]])), "sequence 3"),
        (dict(initial_state=torch.zeros(3, 2, 4, 4, dtype=F64)), "initial_state"),
        (dict(chunk_size=0), "chunk_size"),
    ],
    ids=["cu-end", "cu-order", "req-count", "req-seq", "h0-shape", "chunk"],
)
def test_bad_inputs_raise(bad, match):
    inputs = make_inputs(16, 2, 4, 4, "kda")
    kwargs = dict(cu_seqlens=torch.tensor([0, 8, 16]))
    kwargs.update(bad)
    with pytest.raises(ValueError, match=match):
        chunk_linear_attn(*inputs, **kwargs)


def test_g_shape_is_checked():
    q, k, v, g, beta = make_inputs(16, 2, 4, 4, "kda")
    with pytest.raises(ValueError, match="g must be"):
        chunk_linear_attn(q, k, v, g[..., :3], beta, cu_seqlens=torch.tensor([0, 16]))


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_tokens_without_decay_keep_exact_gradients(kind):
    """g = 0 rows make in-chunk decay differences exactly 0, the edge of the clamp in the op."""
    T, H, K, V, B = 65, 2, 8, 8, 32
    inputs = make_inputs(T, H, K, V, kind)
    inputs[3][::3] = 0.0
    inputs[3][40:50] = 0.0
    leaves = [x.clone().requires_grad_() for x in inputs]
    cu = torch.tensor([0, 65])
    out = chunk_linear_attn(*leaves, cu_seqlens=cu, chunk_size=B)[:2]
    ref = naive_recurrent_linear_attn(*leaves, cu_seqlens=cu)[:2]
    w = [torch.randn_like(r) for r in ref]
    for a, b in zip(
        torch.autograd.grad(weighted_loss(out, w), leaves), torch.autograd.grad(weighted_loss(ref, w), leaves)
    ):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_backend_dispatch_on_cpu():
    from harts.ops.linear_attn import chunk_linear_attn, linear_attn_op

    cpu = torch.device("cpu")
    assert linear_attn_op("reference", cpu) is chunk_linear_attn
    assert linear_attn_op("auto", cpu) is chunk_linear_attn
    with pytest.raises(ValueError, match="'fla' needs a CUDA device"):
        linear_attn_op("fla", cpu)
    with pytest.raises(ValueError, match="must be one of"):
        linear_attn_op("triton", cpu)


def test_backend_dispatch_follows_the_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla-core's kernels run chunk 64 (KDA also 32): "auto" on CUDA picks the reference op for
    another chunk size (the tiny preset's 8; it had picked the tree kernel, which then raised in
    the middle of ``harts compare``), and an explicit fla backend names the mismatch."""
    import harts.ops.linear_attn.dispatch as dispatch

    monkeypatch.setattr(dispatch, "fla_available", lambda: True)
    cuda = torch.device("cuda")  # only the device type is read
    assert dispatch.linear_attn_op("auto", cuda, 8) is dispatch.chunk_linear_attn
    with pytest.raises(
        ValueError, match="'tree' runs fla-core's kernels at chunk size 64; this model's chunk size is 8"
    ):
        dispatch.linear_attn_op("tree", cuda, 8)
    with pytest.raises(ValueError, match="'fla' runs fla-core's kernels at chunk size 32 or 64; .* is 16"):
        dispatch.linear_attn_op("fla", cuda, 16)
    assert dispatch.linear_attn_op("fla", cuda, 32) is dispatch.fla_chunk_linear_attn


def test_auto_resolves_to_the_tree_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The "auto" backend is the tree kernel on CUDA with fla-core at chunk 64 (the compact
    executor links a microbatch's rounds: ``ExecutionConfig.link_rounds``), the reference
    elsewhere; explicit names come back as they are, and the old name "tree_linked" as "tree"."""
    import harts.ops.linear_attn.dispatch as dispatch

    monkeypatch.setattr(dispatch, "fla_available", lambda: True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert dispatch.resolve_linear_attn_backend("auto", cuda, 64) == "tree"
    assert dispatch.resolve_linear_attn_backend("auto", cuda, 8) == "reference"
    assert dispatch.resolve_linear_attn_backend("auto", cpu, 64) == "reference"
    for name in ("tree", "fla", "reference"):
        assert dispatch.resolve_linear_attn_backend(name, cuda, 64) == name
    assert dispatch.resolve_linear_attn_backend("tree_linked", cuda, 64) == "tree"
    monkeypatch.setattr(dispatch, "fla_available", lambda: False)
    assert dispatch.resolve_linear_attn_backend("auto", cuda, 64) == "reference"
