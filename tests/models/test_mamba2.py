"""The Mamba-2 (SSD) mixer: equal to transformers' own NemotronH layer, and compact == trajectory-wise.

transformers' torch path (``NemotronHMamba2Mixer`` on the CPU) runs its scan and its gated norm in
float32 whatever the parameters' dtype (``.float()`` inside ``mamba2_chunk_scan``,
``NemotronHRMSNormGated``), so its float64 layer is not a float64 reference. The tolerance is
derived the flash-attention way: harts' float64 layer is the reference, and transformers'
float64 layer must be within twice the error of transformers' layer run entirely in float32.
A wrong formula (norm before gate, a missing D skip, ungrouped norm) is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from harts.models import HybridConfig, HybridLM
from harts.models.execution.trajectory import TrajectoryContext
from harts.models.layers.mamba2 import Mamba2Mixer
from harts.tree.batch import RolloutBatch
from tests.models._trees import batch_of, mixed_batch, tree_cases
from tests.models.test_compact_vs_trajectory import check_agreement

pytest.importorskip("transformers")

B = 8
#: a Nemotron-H-shaped tiny model: Mamba-2-only, MLP-only, attention-only and MoE-only layers
NEMOTRON_PATTERN = dict(layer_pattern="S-S-A-S", ffn_pattern="-E-D-D-")


def _hf_mixer(seed: int = 0):  # noqa: ANN202 - a transformers module
    import transformers
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    hc = transformers.NemotronHConfig(
        vocab_size=64,
        hidden_size=32,
        hybrid_override_pattern="M",
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=B,
        layer_norm_epsilon=1e-5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
    )
    torch.manual_seed(seed)
    ref = NemotronHMamba2Mixer(hc, layer_idx=0).double().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # nothing at its initial value (all-ones norm, D, dt_bias)
        for name, t in ref.named_parameters():
            if name == "A_log":
                t.copy_(torch.empty(t.shape).uniform_(0.0, 1.5, generator=g))
            elif t.ndim <= 1:
                t.add_(0.3 * torch.randn(t.shape, generator=g, dtype=t.dtype))
            else:
                t.copy_(0.3 * torch.randn(t.shape, generator=g, dtype=t.dtype))
    return ref


def _harts_mixer(ref: torch.nn.Module) -> Mamba2Mixer:
    cfg = HybridConfig.tiny(
        layer_pattern="S",
        dtype="float64",
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        mamba_n_groups=2,
        linear_conv_kernel_dim=4,
        chunk_size=B,
        rms_norm_eps=1e-5,
        num_experts=0,
    )
    ours = Mamba2Mixer(cfg).double()
    ours.load_state_dict(ref.state_dict(), strict=True)  # transformers' names, unchanged
    return ours


def _run(module: torch.nn.Module, x: torch.Tensor, ctx: TrajectoryContext | None) -> tuple[torch.Tensor, dict]:
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad()
    y = module(x, ctx) if ctx is not None else module(x[None])[0]
    w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    (y * w).sum().backward()
    grads = {n: p.grad.double().clone() for n, p in module.named_parameters()}
    grads["x"] = x.grad.double().clone()
    return y.double().detach(), grads


def test_mixer_equals_transformers_nemotron_h_forward_and_backward() -> None:
    ref = _hf_mixer()
    ours = _harts_mixer(ref)
    t = 3 * B + 5  # several chunks and a partial one
    x = torch.randn(t, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    batch = RolloutBatch.from_trajectories([[0] * t], advantages=[0.0])
    y, g = _run(ours, x, TrajectoryContext(batch, B, torch.device("cpu")))
    y_hf, g_hf = _run(ref, x, None)
    y_32, g_32 = _run(ref.float(), x.float(), None)

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    assert err(y_hf, y) <= 2 * err(y_32, y), (err(y_hf, y), err(y_32, y))
    assert set(g) == set(g_hf)
    for name in g:
        assert err(g_hf[name], g[name]) <= 2 * err(g_32[name], g[name]), name


def test_mixer_is_one_trajectory_at_a_time() -> None:
    """Packed trajectories do not see each other: the conv and the scan restart at each."""
    ours = _harts_mixer(_hf_mixer())
    lengths = [B + 3, 2 * B, 5]
    x = torch.randn(sum(lengths), 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    packed = RolloutBatch.from_trajectories([[0] * n for n in lengths], advantages=[0.0] * 3)
    with torch.no_grad():
        y = ours(x, TrajectoryContext(packed, B, torch.device("cpu")))
        start = 0
        for n in lengths:
            alone = RolloutBatch.from_trajectories([[0] * n], advantages=[0.0])
            y_alone = ours(x[start : start + n], TrajectoryContext(alone, B, torch.device("cpu")))
            torch.testing.assert_close(y[start : start + n], y_alone, rtol=1e-12, atol=1e-12)
            start += n


def _nemotron_model(**overrides) -> HybridLM:  # noqa: ANN003
    torch.manual_seed(0)
    fields = dict(
        dtype="float64",
        chunk_size=B,
        num_experts=4,
        attn_qk_norm=False,
        partial_rotary_factor=0.0,
        attn_output_gate=False,
        **NEMOTRON_PATTERN,
    )
    model = HybridLM(HybridConfig.tiny(**{**fields, **overrides}))
    with torch.no_grad():  # decays in the trained range, non-trivial skips and routing biases
        for layer in model.layers:
            if layer.letter == "S":
                layer.mamba.A_log.uniform_(0.0, 1.5)
                layer.mamba.D.normal_()
                layer.mamba.conv1d.bias.normal_(std=0.3)
            if layer.is_moe:
                layer.mlp.gate.e_score_correction_bias.normal_(std=0.05)
    return model


def test_nemotron_shaped_model_compact_equals_trajectory_mixed() -> None:
    check_agreement(_nemotron_model(), mixed_batch(B))


@pytest.mark.parametrize("case", list(tree_cases(B)))
def test_nemotron_shaped_model_compact_equals_trajectory_on_trees(case: str) -> None:
    check_agreement(_nemotron_model(), batch_of(tree_cases(B)[case], seed=3))


def test_nemotron_shaped_model_with_recompute() -> None:
    check_agreement(_nemotron_model(hidden_act="silu"), mixed_batch(B, seed=1), recompute=True)
