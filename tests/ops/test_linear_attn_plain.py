"""The plain linear-attention rule (Mamba-2's SSD: S = exp(g) S + k v^T, no beta), float64 CPU.

``chunk_linear_attn(rule="plain")`` against the token-by-token recurrence (outputs, final and
requested states, every gradient including the initial states' and those of states consumed by
a later call), and the compact executor against the trajectory-wise one on the adversarial trees
(forks at B - 1, B, B + 1, nested forks, one-token segments, duplicates), replay and no_replay
layouts, outputs and every input gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts.ops.linear_attn import chunk_linear_attn, naive_recurrent_linear_attn
from tests.ops.test_linear_attn import run_twice, split_lengths, weighted_loss

F64 = torch.float64
#: float64 references: the chunked and token-by-token forms differ only by summation order
RTOL, ATOL = 1e-10, 1e-11


def plain_inputs(T: int, H: int, K: int, V: int, per_channel: bool, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v, g of the plain rule (unnormalised keys, as Mamba-2's B; scalar or per-channel g)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen, dtype=F64)
    k = torch.randn(T, H, K, generator=gen, dtype=F64) * 0.5
    v = torch.randn(T, H, V, generator=gen, dtype=F64)
    g = -0.3 * F.softplus(torch.randn((T, H, K) if per_channel else (T, H), generator=gen, dtype=F64))
    return [q, k, v, g]


@pytest.mark.parametrize("per_channel", [False, True], ids=["ssd", "gla"])
@pytest.mark.parametrize(
    "T,H,K,V,B",
    [
        pytest.param(*case, id="T{}-H{}-K{}-V{}-B{}".format(*case))
        for case in [(63, 2, 16, 8, 16), (65, 2, 16, 8, 16), (130, 1, 8, 16, 64), (65, 3, 8, 4, 8)]
    ],
)
def test_plain_chunk_matches_naive_values_and_all_gradients(T, H, K, V, B, per_channel):
    q, k, v, g = plain_inputs(T, H, K, V, per_channel)
    cu = split_lengths(T)
    N, L0 = cu.numel() - 1, int(cu[1])
    h0 = torch.randn(N, H, K, V, dtype=F64)
    # aligned boundaries, a final state, count 0, mid-chunk counts (no_replay), duplicates
    requests = torch.tensor(
        [[0, B], [0, L0], [1, 0], [2, 1], [0, min(B + 3, L0 - 2)], [0, B], [2, int(cu[3] - cu[2])], [0, L0 - 1]]
    )
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]

    def op(fn):  # noqa: ANN001, ANN202 - run_twice's op over (q, k, v, g), the plain rule
        return lambda q, k, v, g, **kw: fn(q, k, v, g, None, rule="plain", **kw)

    inputs = leaves[:4]
    ref = run_twice(op(naive_recurrent_linear_attn), inputs, leaves[4], cu, requests, B)
    out = run_twice(op(chunk_linear_attn), inputs, leaves[4], cu, requests, B)
    for name, a, b in zip(["o", "final", "requested", "o2", "final2"], out, ref, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=name)
    weights = [torch.randn_like(x) for x in ref]
    g_ref = torch.autograd.grad(weighted_loss(ref, weights), leaves)
    g_out = torch.autograd.grad(weighted_loss(out, weights), leaves)
    for name, a, b in zip(["q", "k", "v", "g", "initial_state"], g_out, g_ref, strict=True):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=ATOL, msg=f"d{name}")


def test_plain_rule_is_the_closed_form_recurrence():
    """The naive plain rule is S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale q_t^T S_t, written
    here as an explicit sum: o_t = scale sum_{s <= t} (q_t . k_s) exp(G_t - G_s) v_s (+ the decayed
    initial state), so the reference the other tests trust is itself pinned down."""
    T, H, K, V = 11, 2, 4, 3
    q, k, v, g = plain_inputs(T, H, K, V, per_channel=False, seed=3)
    h0 = torch.randn(1, H, K, V, dtype=F64)
    o, final, _ = naive_recurrent_linear_attn(
        q, k, v, g, None, cu_seqlens=torch.tensor([0, T]), initial_state=h0, rule="plain", scale=0.7
    )
    G = g.cumsum(0)  # [T, H]
    decay = (G[:, None] - G[None, :]).exp() * torch.ones(T, T).tril()[..., None]  # [t, s, H]
    scores = torch.einsum("thk,shk->tsh", q, k) * decay
    want = 0.7 * (torch.einsum("tsh,shv->thv", scores, v) + torch.einsum("thk,hkv->thv", q * G.exp()[..., None], h0[0]))
    torch.testing.assert_close(o, want, rtol=RTOL, atol=ATOL)
    want_final = G[-1].exp()[:, None, None] * h0[0] + torch.einsum("sh,shk,shv->hkv", (G[-1] - G).exp(), k, v)
    torch.testing.assert_close(final[0], want_final, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "rule, beta, match",
    [
        ("plain", True, "plain rule takes no beta"),
        ("delta", False, "delta rule needs beta"),
        ("mamba", False, "rule must be one of"),
    ],
    ids=["plain-with-beta", "delta-without-beta", "unknown-rule"],
)
def test_rule_and_beta_must_agree(rule, beta, match):
    q, k, v, g = plain_inputs(16, 2, 4, 4, per_channel=False)
    b = torch.rand(16, 2, dtype=F64) if beta else None
    with pytest.raises(ValueError, match=match):
        chunk_linear_attn(q, k, v, g, b, cu_seqlens=torch.tensor([0, 16]), rule=rule)


# ----------------------------------------------------------- compact == trajectory-wise, per op

B_TREE = 8


def _contexts(no_replay: bool):  # noqa: ANN202 - (batch, compact batch, layout, TrajectoryContext, CompactContext)
    from harts.models.execution.compact import CompactContext
    from harts.models.execution.trajectory import TrajectoryContext
    from harts.plan.calls import plan_calls
    from harts.plan.layout import build_layout
    from harts.tree.compact import compact
    from tests.models._trees import mixed_batch

    batch = mixed_batch(B_TREE)
    cb = compact(batch)
    layout = build_layout(cb, plan_calls(cb.segment_trees, B_TREE), no_replay=no_replay)
    cpu = torch.device("cpu")
    return batch, cb, layout, TrajectoryContext(batch, B_TREE, cpu), CompactContext(layout, device=cpu)


@pytest.mark.parametrize(
    "no_replay, per_channel, gathered",
    [(False, False, False), (True, False, False), (False, True, False), (True, True, False), (False, False, True)],
    ids=["replay-ssd", "no_replay-ssd", "replay-gla", "no_replay-gla", "replay-ssd-qkv_gathered"],
)
def test_plain_compact_equals_trajectory_wise(no_replay, per_channel, gathered):
    """Per-compact-token inputs read by both executors: the compact rounds (boundary states
    handed over, their gradients flowing back into the producing rounds, replay of less than one
    chunk) give each semantic position the trajectory-wise output, and every input the same
    gradient; also with q / k / v handed over already gathered (``la_input_rows``)."""
    from harts.ops.row_gather import gather_rows

    batch, cb, layout, traj, comp = _contexts(no_replay)
    rounds = layout.rounds
    assert len(rounds) > 1 and any(len(np.asarray(r.requests)) for r in rounds)
    if not no_replay:
        assert sum(int((~np.asarray(r.is_output)).sum()) for r in rounds) > 0  # replay rows exist
    C, H, K, V = cb.num_compact_tokens, 2, 8, 4
    leaves = [x.requires_grad_() for x in plain_inputs(C, H, K, V, per_channel, seed=7)]
    m = torch.as_tensor(cb.semantic_to_compact)
    to_c = torch.as_tensor(np.maximum(layout.phys_to_compact, 0))
    s_to_p = torch.as_tensor(layout.semantic_to_phys)

    ref = traj.linear_attention(*(x[m] for x in leaves), None, rule="plain", scale=0.5)
    q, k, v, g = (x[to_c] for x in leaves)
    if gathered:
        q, k, v = (gather_rows(x, comp.la_input_rows()) for x in (q, k, v))
    out = comp.linear_attention(q, k, v, g, None, rule="plain", scale=0.5, qkv_gathered=gathered)[s_to_p]
    assert out.shape == ref.shape == (batch.num_tokens, H, V)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    w = torch.randn(ref.shape, dtype=F64, generator=torch.Generator().manual_seed(8))
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    g_out = torch.autograd.grad((out * w).sum(), leaves)
    for name, a, b in zip(["q", "k", "v", "g"], g_out, g_ref, strict=True):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=ATOL, msg=f"d{name}")


def test_plain_compact_rejects_a_beta():
    _, cb, layout, _, comp = _contexts(False)
    P = int(layout.num_rows)
    q, k, v, g = plain_inputs(P, 1, 4, 4, per_channel=False)
    with pytest.raises(ValueError, match="plain rule takes no beta"):
        comp.linear_attention(q, k, v, g, torch.rand(P, 1, dtype=F64), rule="plain")
