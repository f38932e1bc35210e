"""KDA's stacked q / k / v projection (``KimiDeltaAttention.stacked_qkv``, on by default on CUDA):
one GEMM over the stacked weights gives the three GEMMs' outputs and every gradient, to float64
rounding, in both execution modes; the CPU default stays the three GEMMs."""

from __future__ import annotations

import pytest
import torch

from harts.models.layers.kda import KimiDeltaAttention
from harts.rl.verify import run_step
from tests.models._trees import mixed_batch
from tests.models.test_compact_vs_trajectory import B, make_model


@pytest.mark.parametrize("mode", ["trajectory", "compact"])
def test_stacked_projection_equals_three_gemms(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    model = make_model("KM", moe=False)
    batch = mixed_batch(B)
    runs = {}
    for stacked in (False, True):
        monkeypatch.setattr(KimiDeltaAttention, "stacked_qkv", stacked)
        runs[stacked] = run_step(model, batch, mode=mode, kl_coef=0.1)
    a, b = runs[False], runs[True]
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=1e-12, atol=1e-12)
    assert set(a.grads) == set(b.grads)
    for name, g in a.grads.items():
        torch.testing.assert_close(b.grads[name], g, rtol=1e-10, atol=1e-12, msg=name)
    # the q / k / v weights get their own gradients, not a stacked copy's
    assert any(n.endswith("q_proj.weight") for n in a.grads) and any(n.endswith("v_proj.weight") for n in b.grads)


def test_cpu_default_is_the_three_gemms() -> None:
    assert KimiDeltaAttention.stacked_qkv is None  # None: CUDA only
    model = make_model("K", moe=False)
    layer = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    calls = []
    handle = layer.q_proj.register_forward_hook(lambda *a: calls.append(1))
    run_step(model, mixed_batch(B), mode="compact")
    handle.remove()
    assert calls  # the q projection ran as its own module on CPU
