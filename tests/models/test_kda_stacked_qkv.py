"""KDA's stacked projections (the fast paths "stacked_qkv" for q / k / v and "stacked_gates" for
the low-rank gates' first factors and beta's, both on by default on CUDA):
one GEMM over the stacked weights gives the separate GEMMs' outputs and every gradient, to float64
rounding, in both execution modes; the CPU default stays the separate GEMMs."""

from __future__ import annotations

import pytest
import torch

from harts.models.hybrid_lm import HybridLM
from harts.models.layers.kda import KimiDeltaAttention
from harts.rl.verify import run_step
from tests.models._trees import mixed_batch
from tests.models.test_compact_vs_trajectory import B, make_model


def with_path(model: HybridLM, path: str, on: bool) -> tuple[str, ...]:
    """``ExecutionConfig.fast_paths``: the model's default ones on this device, ``path`` turned on or off."""
    default = model.backends().fast_paths
    return tuple(sorted(default | {path} if on else default - {path}))


@pytest.mark.parametrize("flag", ["stacked_qkv", "stacked_gates"])
@pytest.mark.parametrize("mode", ["trajectory", "compact"])
def test_stacked_projection_equals_separate_gemms(mode: str, flag: str) -> None:
    model = make_model("KM", moe=False)
    assert next(m for m in model.modules() if isinstance(m, KimiDeltaAttention)).low_rank_gates
    batch = mixed_batch(B)
    runs = {}
    for stacked in (False, True):
        runs[stacked] = run_step(model, batch, mode=mode, kl_coef=0.1, fast_paths=with_path(model, flag, stacked))
    a, b = runs[False], runs[True]
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=1e-12, atol=1e-12)
    assert set(a.grads) == set(b.grads)
    for name, g in a.grads.items():
        torch.testing.assert_close(b.grads[name], g, rtol=1e-10, atol=1e-12, msg=name)
    # the weights get their own gradients, not a stacked copy's
    for name in ("q_proj.weight", "v_proj.weight", "f_a_proj.weight", "g_a_proj.weight", "b_proj.weight"):
        assert any(n.endswith(name) for n in b.grads), name


def test_cpu_default_is_the_three_gemms() -> None:
    model = make_model("K", moe=False)
    assert not {"stacked_qkv", "stacked_gates"} & model.backends().fast_paths  # CUDA only
    layer = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    calls = []
    handle = layer.q_proj.register_forward_hook(lambda *a: calls.append(1))
    run_step(model, mixed_batch(B), mode="compact")
    handle.remove()
    assert calls  # the q projection ran as its own module on CPU


def test_full_rank_gates_ignore_the_gate_stacking() -> None:
    """Full-rank gates (Ling 3.0 / BailingHybrid) have nothing small to stack: the flag changes
    nothing there."""
    import dataclasses

    model = make_model("K", moe=False)
    cfg = dataclasses.replace(model.config, kda_low_rank_gates=False)
    torch.manual_seed(0)
    from harts.models import HybridLM

    full = HybridLM(cfg).double()
    batch = mixed_batch(B)
    runs = {}
    for stacked in (False, True):
        runs[stacked] = run_step(full, batch, mode="compact", fast_paths=with_path(full, "stacked_gates", stacked))
    assert torch.equal(runs[True].logprobs.nan_to_num(), runs[False].logprobs.nan_to_num())
