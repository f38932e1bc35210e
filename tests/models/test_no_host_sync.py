"""A training microbatch on CUDA never waits for the device: forward, GRPO loss and backward, in
both modes, under ``torch.cuda.set_sync_debug_mode("error")`` (issue 10: no ``.item()``,
``.tolist()``, ``unique`` or synchronous upload inside a microbatch, so the host can prepare the
next kernels while the device runs). GPU only; the CPU suite checks the same code's numerics."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["trajectory", "compact"])
@pytest.mark.parametrize("logprobs", ["all", "actions"])
def test_microbatch_never_synchronizes(mode: str, logprobs: str) -> None:
    pytest.importorskip("fla")
    from harts.models.config import HybridConfig
    from harts.models.execution.config import ExecutionConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.rl.grpo import grpo_loss, grpo_normalizer
    from harts.tree.workloads import generate

    torch.manual_seed(0)
    # ling3_tiny's layer shapes (fla's chunk 64, MLA 192 / 128) on a small vocabulary and few experts
    cfg = HybridConfig.ling3_tiny(
        layer_pattern="KM", vocab_size=512, num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1
    )
    model = HybridLM(cfg).to("cuda", torch.bfloat16)
    batch = generate("tiny", step=0)
    execution = ExecutionConfig(
        mode=mode, attention="mask", recompute=True, linear_attention_backend="auto", logprob_positions=logprobs
    )
    inputs = model.prepare_compact(batch, execution) if mode == "compact" else batch
    normalizer = grpo_normalizer(batch)

    def microbatch() -> None:
        out = model(inputs, execution)
        loss = grpo_loss(out.logprobs, batch, normalizer=normalizer).loss
        assert out.moe_losses is not None
        (loss + out.moe_objective(1e-3, 1e-3)).backward()

    microbatch()  # compiles, autotunes, allocates: may synchronize
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        microbatch()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
