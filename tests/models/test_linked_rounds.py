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

    def run(m: HybridLM, backend: str, attention: str = "mask") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        execution = ExecutionConfig(mode="compact", attention=attention, linear_attention_backend=backend)
        inputs = m.prepare_compact(batch, execution)
        assert len(inputs.layout.rounds) > 1
        m.zero_grad(set_to_none=True)
        out = m(inputs, execution)
        grpo_loss(out.logprobs, batch).loss.backward()
        grads = {n: p.grad.detach().double().cpu() for n, p in m.named_parameters() if p.grad is not None}
        return out.logprobs.detach().double().cpu(), grads

    lp, g = run(model, "tree")
    lp_linked, g_linked = run(model, "tree_linked")
    # the truth: the same weights in float64 (torch's chunked recurrence, dense attention per
    # branch; on the GPU: the CPU needs more than 24 GB for it)
    model64 = HybridLM(cfg)
    model64.load_state_dict(model.state_dict())
    lp64, g64 = run(model64.to("cuda", torch.float64), "reference", "gather")
    torch.testing.assert_close(lp_linked, lp, rtol=1e-4, atol=1e-4)

    def as_close_to_float64(name: str, per_round: torch.Tensor, linked: torch.Tensor, truth: torch.Tensor) -> None:
        # fla-core's float32 kernels use TF32 dots on Hopper, and the MoE router's top-k can turn
        # their noise into a different expert at a row (the likely cause): on an H200 the linked op's
        # log-probs were up to 0.51 from float64 here while within 1e-4 of the per-round
        # kernel's. Float32 sums in another order: the linked op may differ from the per-round
        # one, but must stay as close to float64 as it (gradients with much cancellation, such
        # as A_log's, differ between the two by more than 1e-3 of their largest entry)
        scale = float(truth.abs().max()) or 1.0
        e_tree, e_linked = (float((x - truth).abs().max()) for x in (per_round, linked))
        assert e_linked <= 2 * e_tree + 1e-5 * scale, f"{name}: linked {e_linked:.2e}, per round {e_tree:.2e}"

    as_close_to_float64("log-probs", lp, lp_linked, lp64)
    assert set(g_linked) == set(g) == set(g64)
    for n in g:
        as_close_to_float64(n, g[n], g_linked[n], g64[n])
