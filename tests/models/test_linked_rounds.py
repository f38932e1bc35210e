"""The "tree_linked" linear-attention backend in the model: a compact microbatch's rounds linked
into one op per layer give the per-round tree kernel's log-probs and gradients (CUDA only; the
op itself: ``tests/ops/test_tree_kernel.py``, the host plan: ``tests/ops/test_linked_plan.py``)."""

from __future__ import annotations

import pytest
import torch

from harts.models.execution.config import ExecutionConfig
from harts.rl.grpo import grpo_loss


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linked_rounds_match_the_per_round_tree_kernel_in_the_model() -> None:
    pytest.importorskip("fla")
    from harts.models import HybridConfig, HybridLM
    from harts.tree.workloads import generate

    torch.manual_seed(0)
    cfg = HybridConfig.ling3_tiny(
        layer_pattern="KKM", vocab_size=512, num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1
    )
    model = HybridLM(cfg).to("cuda", torch.float32)
    batch = generate("small", step=0)
    runs = {}
    for backend in ("tree", "tree_linked"):
        execution = ExecutionConfig(mode="compact", attention="mask", linear_attention_backend=backend)
        inputs = model.prepare_compact(batch, execution)
        assert len(inputs.layout.rounds) > 1
        model.zero_grad(set_to_none=True)
        out = model(inputs, execution)
        grpo_loss(out.logprobs, batch).loss.backward()
        runs[backend] = (
            out.logprobs.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
    (lp, g), (lp_linked, g_linked) = runs["tree"], runs["tree_linked"]
    torch.testing.assert_close(lp_linked, lp, rtol=1e-4, atol=1e-4)
    assert set(g_linked) == set(g)
    for n in g:
        scale = float(g[n].abs().max()) or 1.0
        assert float((g_linked[n] - g[n]).abs().max()) <= 1e-3 * scale, n
