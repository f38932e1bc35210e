"""Nemotron-H (Nemotron 3 Nano's layout, and the dense variant) and Granite 4.0-H
(``granitemoehybrid``) both ways against transformers.

transformers' CPU paths compute the Mamba-2 scan, its gated norm and the routers in float32
whatever the weights' dtype, so, as in ``test_hf_logits``, the comparisons are float32 at
<= 1e-4 relative to the logit scale; the round trips are byte-exact.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402

from harts.cli import main  # noqa: E402
from harts.integrations.hf import (  # noqa: E402
    UnsupportedConfigError,
    adapter_for,
    from_hf,
    from_pretrained,
    inspect_checkpoint,
    save_hf_checkpoint,
    to_hf_state_dict,
)
from tests.integrations._hf import (  # noqa: E402
    batch_of,
    hf_logits,
    hf_logprobs,
    make_hf_model,
    max_rel_logit_diff,
    trajectories,
)
from tests.integrations.test_hf_logits import _tree_trajectories  # noqa: E402

B = 8
TOL = 1e-4
#: (model type, extra config): Nano's MoE layout (grouped routing, scaled top-k), its ungrouped
#: unnormalized router, a dense Nemotron-H (MLP layers); Granite 4.0-H with MoE and NoPE, and
#: dense (the shared MLP alone) with RoPE and a tied head
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "nemotron-moe": ("nemotron_h", {}),
    "nemotron-moe-ungrouped": (
        "nemotron_h",
        dict(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0),
    ),
    "nemotron-dense": ("nemotron_h", dict(hybrid_override_pattern="M-M*-M-")),
    "granite-moe-nope": ("granitemoehybrid", {}),
    "granite-dense-rope-tied": (
        "granitemoehybrid",
        dict(
            num_local_experts=0,
            position_embedding_type="rope",
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            tie_word_embeddings=True,
        ),
    ),
}


def _model(variant: str, seed: int) -> Any:  # noqa: ANN401 - a transformers model
    model_type, kw = VARIANTS[variant]
    return make_hf_model(model_type, seed=seed, **kw)


def test_nemotron_layers_follow_the_block_kinds() -> None:
    for variant in ("nemotron-moe", "nemotron-dense"):
        hf = _model(variant, seed=1)
        cfg = from_hf(hf, chunk_size=B).config
        pattern = hf.config.hybrid_override_pattern
        assert cfg.layer_pattern == "".join({"M": "S", "*": "A"}.get(k, "-") for k in pattern)
        assert cfg.ffn_pattern == "".join({"-": "D", "E": "E"}.get(k, "-") for k in pattern)
        assert cfg.hidden_act == "relu2" and not cfg.attn_qk_norm and cfg.partial_rotary_factor == 0.0


def test_granite_layers_and_scalings() -> None:
    cfg = from_hf(_model("granite-moe-nope", seed=1), chunk_size=B).config
    assert cfg.layer_pattern == "SSAS" and cfg.ffn_pattern == "" and cfg.moe_layer_ids == [0, 1, 2, 3]
    scalings = (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling, cfg.attn_scale)
    assert scalings == (3.0, 0.5, 2.5, 0.3)
    assert cfg.partial_rotary_factor == 0.0 and not cfg.attn_qk_norm and not cfg.attn_output_gate


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trajectory_logits_match_transformers(variant: str) -> None:
    hf = _model(variant, seed=3)
    model = from_hf(hf, chunk_size=B)
    trajs = trajectories([1, 5, B - 1, B, B + 1, 3 * B + 3], seed=1)
    assert max_rel_logit_diff(hf, model, trajs) <= TOL


@pytest.mark.parametrize("variant", ["nemotron-moe", "nemotron-dense", "granite-moe-nope", "granite-dense-rope-tied"])
def test_compact_logprobs_match_transformers(variant: str) -> None:
    hf = _model(variant, seed=5)
    model = from_hf(hf, chunk_size=B)
    trajs = _tree_trajectories(seed=7)
    batch = batch_of(trajs)
    with torch.no_grad():
        ours = model(batch, mode="compact").logprobs.double()
        traj = model(batch, mode="trajectory").logprobs.double()
    ref = hf_logprobs(hf, trajs)
    scale = max(1.0, float(ref.abs().max()))
    assert float((ours - ref).abs().max()) <= TOL * scale
    assert float((ours - traj).abs().max()) <= TOL * scale


@pytest.mark.parametrize("variant", ["nemotron-moe", "nemotron-dense", "granite-moe-nope", "granite-dense-rope-tied"])
def test_round_trip_state_dict_is_byte_exact(variant: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = _model(variant, seed=11)
    sd = to_hf_state_dict(from_hf(hf, chunk_size=B))
    ref = hf.state_dict()
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    fresh = AutoModelForCausalLM.from_config(hf.config).eval()
    fresh.load_state_dict(sd, strict=True)
    t = trajectories([13], seed=2)[0]
    assert torch.equal(hf_logits(fresh, t), hf_logits(hf, t))


@pytest.mark.parametrize("variant,pattern", [("nemotron-moe", "S-SA-S-"), ("granite-moe-nope", "SSAS")])
def test_hub_layout_loads_and_saves_back(variant: str, pattern: str, tmp_path) -> None:
    """transformers' save_pretrained writes the Hub layout (Nemotron-H: ``backbone.`` and
    per-expert tensors; Granite: ``input_linear`` / ``output_linear`` experts, ``router.layer``):
    harts reads it, ``harts convert`` reports every tensor mapped, and harts' own checkpoint
    loads in transformers with the same tensors."""
    from transformers import AutoModelForCausalLM

    hf = _model(variant, seed=13)
    hub = tmp_path / "hub"
    hf.save_pretrained(hub, max_shard_size="40KB")
    model = from_pretrained(str(hub), chunk_size=B)
    direct = from_hf(hf, chunk_size=B)
    a, b = model.state_dict(), direct.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    report = inspect_checkpoint(str(hub))
    assert report.all_mapped and report.model_type == VARIANTS[variant][0] and report.layer_pattern == pattern
    assert report.num_parameters == sum(p.numel() for p in model.parameters())
    assert main(["convert", str(hub)]) == 0
    out = tmp_path / "out"
    save_hf_checkpoint(model, str(out))
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = hf.state_dict()
    assert all(torch.equal(back.state_dict()[k], ref[k]) for k in ref)


@pytest.mark.parametrize(
    "variant,changes,named",
    [
        (
            "nemotron-moe",
            dict(mlp_hidden_act="silu", time_step_limit=(0.0, 1.0), moe_latent_size=8),
            ["mlp_hidden_act='silu'", "time_step_limit", "moe_latent_size=8"],
        ),
        (
            "granite-moe-nope",
            dict(hidden_act="gelu", time_step_limit=(0.0, 1.0), attention_bias=True),
            ["hidden_act='gelu'", "time_step_limit", "attention_bias=True"],
        ),
    ],
)
def test_unsupported_options_are_all_named(variant: str, changes: dict[str, Any], named: list[str]) -> None:
    cfg = _model(variant, seed=0).config
    for name, value in changes.items():
        setattr(cfg, name, value)
    with pytest.raises(UnsupportedConfigError) as err:
        adapter_for(VARIANTS[variant][0]).config_from_hf(cfg)
    assert all(n in str(err.value) for n in named)
