"""MoE on compact rows with multiplicity weights equals MoE on the expanded rows."""

from __future__ import annotations

import pytest
import torch

from harts.models import HybridConfig
from harts.models.layers.moe import MoE


@pytest.mark.parametrize("score,groups", [("sigmoid", 2), ("softmax", 1)])
def test_weighted_moe_equals_expanded(score: str, groups: int) -> None:
    torch.manual_seed(0)
    cfg = HybridConfig.tiny(dtype="float64", num_experts=8, num_experts_per_tok=3, router_score=score,
                            n_group=groups, topk_group=1 if groups > 1 else 1, initializer_range=0.3)
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
