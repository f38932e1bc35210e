"""KDA's log-decay by fla-core's fused gate (the fast path "fla_gate", on by default on CUDA):
where it applies, how the layer hands it its arguments (a stand-in for fla-core on the CPU:
log-probs and every gradient equal ``kda_log_decay``'s, softplus and safe gate), and on CUDA
fla-core's kernel against ``kda_log_decay`` forward and backward."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

import harts.models.layers.kda as kda
from harts.models.execution.backends import default_fast_paths
from harts.models.layers.kda import KimiDeltaAttention, fla_gate_applies, kda_log_decay
from harts.rl.verify import run_step
from tests.models._trees import mixed_batch
from tests.models.test_compact_vs_trajectory import B, make_model


def test_fla_gate_applies_only_on_cuda_in_half_or_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    import harts.ops.linear_attn.fla as fla_mod

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # only the device type is read
    monkeypatch.delenv("HARTS_KDA_FLA_GATE", raising=False)
    assert "fla_gate" not in default_fast_paths(cpu)
    assert not fla_gate_applies(torch.zeros(3, 4), True)  # CPU
    monkeypatch.setattr(fla_mod, "fla_available", lambda: True)
    assert "fla_gate" in default_fast_paths(cuda)  # None: the environment decides, on by default
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert fla_gate_applies(torch.zeros(3, 4, dtype=torch.bfloat16), True)
    assert fla_gate_applies(torch.zeros(3, 4, dtype=torch.float32), True)
    assert not fla_gate_applies(torch.zeros(3, 4, dtype=torch.float64), True)
    assert not fla_gate_applies(torch.zeros(3, 4, dtype=torch.bfloat16), False)
    for off in ("0", "false", "Off"):
        monkeypatch.setenv("HARTS_KDA_FLA_GATE", off)
        assert "fla_gate" not in default_fast_paths(cuda)
    monkeypatch.setattr(fla_mod, "fla_available", lambda: False)
    monkeypatch.delenv("HARTS_KDA_FLA_GATE")
    assert "fla_gate" not in default_fast_paths(cuda)
    assert not fla_gate_applies(torch.zeros(3, 4, dtype=torch.bfloat16), True)


def _stand_in_gate(calls: list) -> types.ModuleType:
    """``fla.ops.kda.gate`` with ``fused_kda_gate`` as its docstring states it, in torch."""

    def fused_kda_gate(g, A_log, dt_bias, lower_bound=None, output_dtype=torch.float32):  # noqa: ANN001, ANN202, N803
        calls.append((tuple(g.shape), tuple(A_log.shape), tuple(dt_bias.shape), lower_bound, output_dtype))
        x = g + dt_bias.view(g.shape[-2:])
        if lower_bound is not None:
            return (lower_bound * torch.sigmoid(A_log.exp()[:, None] * x)).to(output_dtype)
        return (-A_log.exp()[:, None] * F.softplus(x)).to(output_dtype)

    mod = types.ModuleType("fla.ops.kda.gate")
    mod.fused_kda_gate = fused_kda_gate  # type: ignore[attr-defined]
    return mod


@pytest.mark.parametrize("safe", [False, True], ids=["softplus", "safe_gate"])
@pytest.mark.parametrize("mode", ["trajectory", "compact"])
def test_layer_hands_the_fused_gate_its_arguments(monkeypatch: pytest.MonkeyPatch, mode: str, safe: bool) -> None:
    model = make_model("KM", moe=False, kda_safe_gate=safe)
    batch = mixed_batch(B)
    want = run_step(model, batch, mode=mode, kl_coef=0.1)  # the CPU: kda_log_decay
    calls: list = []
    for name in ("fla", "fla.ops", "fla.ops.kda"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name, types.ModuleType(name)))
    monkeypatch.setitem(sys.modules, "fla.ops.kda.gate", _stand_in_gate(calls))
    monkeypatch.setattr(kda, "fla_gate_applies", lambda f, enabled: True)
    got = run_step(model, batch, mode=mode, kl_coef=0.1)
    layer = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    h, k = layer.num_heads, layer.head_k_dim
    assert calls and all(c[1:] == ((h,), (h * k,), -5.0 if safe else None, torch.float64) for c in calls)
    assert all(c[0][1:] == (h, k) for c in calls)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-12, atol=1e-12)
    assert set(got.grads) == set(want.grads)
    for name, g in want.grads.items():
        torch.testing.assert_close(got.grads[name], g, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "safe_gate"])
def test_fla_fused_gate_equals_kda_log_decay_on_cuda(lower_bound: float | None) -> None:
    """fla-core's gate kernel against ``kda_log_decay`` run eagerly in float64 (ling3_tiny's 16
    heads of 128, rows off any block): g and the gradients of f, dt_bias and A_log, in float32
    and bfloat16 (rounded once to the input dtype, so within its rounding of float64)."""
    pytest.importorskip("fla")
    from fla.ops.kda.gate import fused_kda_gate

    g = torch.Generator().manual_seed(0)
    t, h, k = 4099, 16, 128
    f64 = (torch.randn(t, h, k, generator=g, dtype=torch.float64) * 3).cuda()
    dt64 = torch.randn(h * k, generator=g, dtype=torch.float64).cuda()
    a64 = torch.randn(h, generator=g, dtype=torch.float64).cuda()
    up64 = torch.randn(t, h, k, generator=g, dtype=torch.float64).cuda()

    def run(fn, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        # fresh leaves each run: .to(float64) would hand back f64 itself, and a later run's
        # .to(dtype) would then be a non-leaf whose .grad stays None
        f, dt, a = (x.detach().clone().to(dtype).requires_grad_(True) for x in (f64, dt64, a64))
        out = fn(f, dt, a)
        (out.double() * up64).sum().backward()
        return out.double(), f.grad.double(), dt.grad.double(), a.grad.double()

    def truth(f, dt, a):  # noqa: ANN001, ANN202
        return kda_log_decay.eager(f, dt.view(h, k), a, lower_bound)

    want = run(truth, torch.float64)
    for dtype, rel in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        got = run(lambda f, dt, a: fused_kda_gate(f, a, dt, lower_bound, output_dtype=f.dtype), dtype)
        for name, x, y in zip(("g", "d f", "d dt_bias", "d A_log"), got, want, strict=True):
            err, scale = float((x - y).abs().max()), float(y.abs().max())
            assert err <= rel * scale, f"{dtype} {name}: {err:.3g} of {scale:.3g}"
