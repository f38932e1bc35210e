"""Every registered mixer letter has a complete spec, and the floors that apply plans read it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import harts
from harts.errors import UserError
from harts.models.layers.registry import MIXERS, NO_MIXER, mixer_spec
from harts.models.layers.spec import MixerSpec
from harts.models.memory import parameter_count

#: spec fields that may be None, and what None means there
_OPTIONAL = {"tp_plan", "cp_divisors"}


def _config(letter: str) -> harts.HybridConfig:
    return harts.HybridConfig.tiny(layer_pattern=letter + "A", num_experts=0, first_k_dense_replace=0)


@pytest.mark.parametrize("letter", list(MIXERS))
def test_every_registered_letter_has_a_complete_spec(letter: str) -> None:
    spec = MIXERS[letter]
    assert isinstance(spec, MixerSpec) and spec.letter == letter
    for f in dataclasses.fields(MixerSpec):
        value = getattr(spec, f.name)
        assert value is not None or f.name in _OPTIONAL, f"{letter}: {f.name} missing"
    assert spec.family in ("linear", "full") and spec.description
    assert spec.core_region == ("linear_attention" if spec.family == "linear" else "attention")
    cfg = _config(letter)
    model = harts.HybridLM(cfg.replace(layer_pattern=letter), seed=0)
    layer = model.layers[0]
    mixer = getattr(layer, spec.attribute)
    assert isinstance(mixer, spec.module) and layer.mixer is mixer
    # the spec's own counts against the built layer
    assert spec.parameters(cfg) == sum(p.numel() for p in mixer.parameters())
    for dev in ("cpu", "cuda"):
        outside, core = spec.row_elements(cfg, dev)
        assert outside > 0 and core > 0
        assert (spec.view_row_elements(cfg, dev) > 0) == (spec.family == "full")
    pair, row = spec.core_flops(cfg)
    assert (pair > 0, row > 0) == (spec.family == "full", spec.family == "linear")
    assert (spec.attention_dims(cfg) is not None) == (spec.family == "full")
    if spec.family == "full":
        assert cfg.attention_head_dims[letter] == spec.attention_dims(cfg)
    targets = spec.lora_targets(mixer)
    assert targets and all(isinstance(m, torch.nn.Linear) for _, m in targets)
    if spec.cp_divisors is not None:
        assert all(rule in ("divides", "divides_or_multiple") for _, _, rule in spec.cp_divisors(cfg, 1))
    if spec.tp_plan is not None:
        names = dict(mixer.named_modules())
        plan, _ = spec.tp_plan(mixer, 1)
        assert all(n in names for n in plan) and spec.tp_divisors(cfg)


def test_no_mixer_letter_and_unknown_letters() -> None:
    from harts.models.config import LAYER_LETTERS

    assert LAYER_LETTERS == "".join(MIXERS) + NO_MIXER
    assert mixer_spec(NO_MIXER) is None and NO_MIXER not in MIXERS
    with pytest.raises(UserError, match=r"letters must be from KGMAS-, got \['X'\]"):
        harts.HybridConfig.tiny(layer_pattern="KX")


def test_decoder_layers_are_blocks_either_may_be_absent() -> None:
    """A mixer-only layer has no FFN and no post-mixer norm, an FFN-only layer no mixer and no
    input norm; the model's parameters are what the config counts."""
    cfg = harts.HybridConfig.tiny(
        layer_pattern="S-A-", ffn_pattern="-D-E", hidden_act="silu", num_experts=4, first_k_dense_replace=0
    )
    model = harts.HybridLM(cfg, seed=0)
    mamba, mlp, attn, moe = model.layers
    assert mamba.mlp is None and not hasattr(mamba, "post_attention_layernorm") and mamba.mixer is mamba.mamba
    assert mlp.mixer is None and not hasattr(mlp, "input_layernorm") and isinstance(mlp.mlp, harts.models.layers.MLP)
    assert attn.mlp is None and attn.mixer is attn.self_attn
    assert moe.is_moe and moe.mixer is None and isinstance(moe.mlp, harts.models.layers.MoE)
    assert parameter_count(cfg) == model.num_parameters()
    with pytest.raises(UserError, match=r"decoder layers \[1\] have neither a mixer nor an FFN"):
        cfg.replace(ffn_pattern="--DE")
    with pytest.raises(UserError, match=r"ffn_pattern 'DD': one letter of DE- per layer"):
        cfg.replace(ffn_pattern="DD")


def test_relu2_mlp_has_no_gate_and_is_counted() -> None:
    cfg = harts.HybridConfig.tiny(layer_pattern="-", ffn_pattern="D", hidden_act="relu2", num_experts=0)
    model = harts.HybridLM(cfg.replace(dtype="float64"), seed=0)
    mlp = model.layers[0].mlp
    assert not hasattr(mlp, "gate_proj") and parameter_count(cfg) == model.num_parameters()
    x = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    want = mlp.down_proj.weight @ torch.relu(mlp.up_proj.weight @ x.T).pow(2)
    torch.testing.assert_close(mlp(x), want.T, rtol=1e-12, atol=1e-12)


def test_parallel_checks_name_a_mixer_without_a_plan_and_split_mamba2_rows() -> None:
    from harts.parallel.context_parallel import check_context_parallel
    from harts.parallel.tensor_parallel import check_tensor_parallel

    cfg = harts.HybridConfig.tiny(layer_pattern="SA", num_experts=0, first_k_dense_replace=0)
    with pytest.raises(UserError, match=r"--tp 2: tensor parallelism does not split Mamba-2 SSD layers \(S\)"):
        check_tensor_parallel(cfg, 2)
    check_context_parallel(cfg, 2)  # rows, not weights: the conv's channels and the SSD's heads split
    mamba = harts.HybridConfig.tiny(layer_pattern="S", num_experts=0, first_k_dense_replace=0)
    with pytest.raises(UserError, match=r"--cp 8 does not divide the model's 4 Mamba-2 heads"):
        check_context_parallel(mamba, 8)
    odd = mamba.replace(mamba_head_dim=5, mamba_n_groups=1, ssm_state_size=1)  # 4 x 5 + 2 x 1 channels
    with pytest.raises(UserError, match=r"--cp 4 does not divide the model's 22 Mamba-2 conv channels"):
        check_context_parallel(odd, 4)
