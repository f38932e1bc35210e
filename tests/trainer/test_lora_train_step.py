"""``harts train --lora``'s step: ``train_step`` over a model ``apply_lora`` adapted, AdamW on the
adapters alone and no expert-bias update, as ``harts.trainer.run`` sets it up. In float64 the
compact step equals the trajectory-wise one on the adversarial trees (forks at chunk B - 1, B,
B + 1, nested forks, one-token segments, duplicates: ``tests.models._trees``) with adapters on
every projection, the routed experts' included: the loss, the MoE objective, every adapter's
gradient and every adapter after the update; and the base (weights and buffers) does not move.

The adapters' B is random (a fresh adapter's is zero, which zeroes A's gradient), so that every
adapter gets a gradient. Tolerance: float64 rounding summed over a step's tokens and layers is
around 1e-13 relative here; a wrong gradient is off by percents."""

from __future__ import annotations

import pytest
import torch

from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import HybridLM
from harts.trainer.lora import LoraConfig, apply_lora
from harts.trainer.step import StepLog, TrainConfig, train_step
from tests.models._trees import mixed_batch
from tests.trainer.test_lora import make_model, randomize_b

B = 8
TOL = 1e-10


def _step(mode: str, lora: LoraConfig) -> tuple[StepLog, dict[str, torch.Tensor], HybridLM, dict[str, torch.Tensor]]:
    """One step; its log, the adapters' gradients before clipping, the model after, its base before."""
    model = make_model()
    params = apply_lora(model, lora)
    randomize_b(model)
    before = {**model.state_dict(), **dict(model.named_buffers())}
    before = {k: v.clone() for k, v in before.items() if ".lora_" not in k}
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    # several microbatches; the MoE statistics of the whole step, so the objective is the same
    cfg = TrainConfig(capacity=128, execution=ExecutionConfig(mode=mode), moe_statistics="step", expert_bias_rate=0.0)
    grads: dict[str, torch.Tensor] = {}

    def on_update() -> None:
        grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    log = train_step(model, optimizer, mixed_batch(B), cfg, on_update=on_update)
    assert log.microbatches > 1
    return log, grads, model, before


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), floor)


@pytest.mark.parametrize(
    "lora",
    [LoraConfig(rank=4, alpha=8.0), LoraConfig(rank=3, alpha=5.0, train_attn=False, train_unembed=False)],
    ids=["every-target", "mlp-only"],
)
def test_compact_lora_step_equals_trajectory(lora: LoraConfig) -> None:
    (log, grads, model, before), (ref_log, ref_grads, ref_model, _) = (
        _step(m, lora) for m in ("compact", "trajectory")
    )
    for key in ("loss", "moe_objective", "grad_norm"):
        assert abs(getattr(log, key) - getattr(ref_log, key)) <= TOL * abs(getattr(ref_log, key)), key
    assert grads.keys() == ref_grads.keys() and all(".lora_" in n for n in grads)
    assert any(".experts.parametrizations." in n for n in grads), "adapters on the routed experts"
    assert all(float(g.abs().max()) > 0 for g in ref_grads.values()), "every adapter gets a gradient"
    # each gradient against its own scale, floored at 1e-3 of the largest (as harts.rl.verify)
    floor = 1e-3 * max(float(g.abs().max()) for g in ref_grads.values())
    worst = {n: _rel(grads[n], ref_grads[n], floor) for n in ref_grads}
    assert max(worst.values()) <= TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    after, ref_after = dict(model.named_parameters()), dict(ref_model.named_parameters())
    for n in ref_grads:
        assert _rel(after[n].detach(), ref_after[n].detach(), 1e-300) <= TOL, n
    now = {**model.state_dict(), **dict(model.named_buffers())}
    assert all(torch.equal(now[k], v) for k, v in before.items()), "the base moved"
