"""Presets of real models: every field as harts.integrations.hf converts the published config.json,
every shape as transformers builds it (one layer, on the meta device: nothing is allocated), and
``layers=N`` cutting the real layer pattern."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harts import HybridConfig
from harts.errors import UserError
from harts.models.config import PRESET_NAMES
from tests.models._published import PUBLISHED, cut, text_config

#: fields of the routed experts' shape, which say nothing once a cut leaves no MoE layer
_ROUTED_SHAPE = ("num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group")


def _converted(published: dict[str, Any]) -> HybridConfig:
    """``published`` through its harts adapter, as ``harts.integrations.hf.pretrained_config``
    converts it (dtype as the checkpoint stores it: bfloat16)."""
    from harts.integrations.hf.api import ADAPTERS, hf_config_from_dict

    for config in (published, text_config(published)):
        adapter = ADAPTERS.get(config.get("model_type", ""))
        if adapter is not None:
            return adapter.config_from_hf(hf_config_from_dict(config), dtype="bfloat16")
    pytest.skip(f"harts.integrations.hf has no adapter for {published['model_type']} yet")


def _fields(config: HybridConfig) -> dict[str, Any]:
    fields = config.to_dict()
    if not config.num_experts:
        for name in _ROUTED_SHAPE:
            fields.pop(name)
    return fields


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_is_its_published_config(name: str) -> None:
    assert HybridConfig.preset(name) == _converted(PUBLISHED[name])


@pytest.mark.parametrize("layers", [1, 2, 4, 5])
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_cut_preset_is_its_cut_published_config(name: str, layers: int) -> None:
    want = _converted(cut(PUBLISHED[name], layers))
    got = HybridConfig.preset(name, layers=layers)
    assert _fields(got) == _fields(want)
    assert got.moe_layer_ids == want.moe_layer_ids


def _transformers_parameters(published: dict[str, Any]) -> int:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = text_config(published)
    hf_config = CONFIG_MAPPING[config["model_type"]].from_dict(dict(config))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("full_attention", [False, True], ids=["linear", "full"])
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_one_layer_has_the_shapes_transformers_builds(name: str, full_attention: bool) -> None:
    """One decoder layer of each kind at the model's real width (embeddings, its mixer, its FFN,
    the head) holds as many parameters as transformers' model of the published config."""
    from harts.models.hybrid_lm import HybridLM

    overrides = {}
    if full_attention:
        overrides["layer_pattern"] = "M" if name.startswith("kimi") else "A"
    config = HybridConfig.preset(name, layers=1, **overrides)
    with torch.device("meta"):
        model = HybridLM(config)
    assert all(p.is_meta for p in model.parameters())
    want = _transformers_parameters(cut(PUBLISHED[name], 1, full_attention_first=full_attention))
    assert model.num_parameters() == want


def test_layer_patterns_and_moe_layers() -> None:
    assert HybridConfig.preset("qwen3_next_80b_a3b").layer_pattern == "GGGA" * 12
    assert HybridConfig.preset("qwen3_5_35b_a3b").moe_layer_ids == list(range(40))
    assert HybridConfig.preset("qwen3_5_27b").moe_layer_ids == []
    kimi = HybridConfig.preset("kimi_linear_48b_a3b")
    assert [i for i, t in enumerate(kimi.layer_pattern) if t == "M"] == [3, 7, 11, 15, 19, 23, 26]
    assert kimi.moe_layer_ids == list(range(1, 27))
    four = HybridConfig.preset("kimi_linear_48b_a3b", layers=4)
    assert (four.layer_pattern, four.moe_layer_ids, four.first_k_dense_replace) == ("KKKM", [1, 2, 3], 1)
    one = HybridConfig.preset("kimi_linear_48b_a3b", layers=1)
    assert (one.layer_pattern, one.num_experts, one.moe_layer_ids) == ("K", 0, [])
    assert HybridConfig.preset("tiny", layers=2).layer_pattern == "KG"
    # layers cuts the pattern as overridden; the other overrides stay
    cfg = HybridConfig.preset("ling3-tiny", layers=3, layer_pattern="KGMA", vocab_size=100)
    assert (cfg.layer_pattern, cfg.vocab_size, cfg.hidden_size) == ("KGM", 100, 1536)
    assert HybridConfig.preset("Qwen3.5-9B") == HybridConfig.preset("qwen3_5_9b")


def test_every_name_is_a_preset() -> None:
    names = ("qwen3_5_9b", "qwen3_5_27b", "qwen3_5_35b_a3b", "qwen3_next_80b_a3b", "kimi_linear_48b_a3b")
    names += ("nemotron_3_nano_30b_a3b", "granite_4_0_h_small")
    assert set(PRESET_NAMES) == {"tiny", "ling3_tiny", *names}
    for name in PRESET_NAMES:
        depth = HybridConfig.preset(name).num_hidden_layers
        assert HybridConfig.preset(name, layers=depth) == HybridConfig.preset(name)


def test_bad_name_or_layers_is_a_user_error() -> None:
    with pytest.raises(UserError, match="unknown model preset 'qwen9'; known: tiny, ling3_tiny, qwen3_5_9b"):
        HybridConfig.preset("qwen9")
    for layers in (0, 33, -1, True, 2.0, "2"):
        with pytest.raises(UserError, match=r"layers .*: qwen3_5_9b has 32 decoder layers; use 1 \.\. 32"):
            HybridConfig.preset("qwen3_5_9b", layers=layers)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="--layers 5: tiny has 4 decoder layers"):
        HybridConfig.tiny().first_layers(5, name="tiny", option="--layers")
