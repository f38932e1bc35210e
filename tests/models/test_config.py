from __future__ import annotations

import pytest

from harts import HybridConfig


def test_presets_accept_overrides() -> None:
    c = HybridConfig.tiny(layer_pattern="KGMA", chunk_size=16)
    assert c.chunk_size == 16 and c.num_hidden_layers == 4
    ling = HybridConfig.ling3_tiny()
    assert ling.layer_pattern == "KKKM" * 6 and ling.hidden_size == 1536 and ling.vocab_size == 157_184
    assert ling.num_experts == 128 and ling.num_experts_per_tok == 8 and ling.moe_intermediate_size == 512
    assert ling.intermediate_size == 4608 and ling.first_k_dense_replace == 1 and ling.chunk_size == 64
    assert ling.moe_layer_ids == list(range(1, 24))
    assert HybridConfig.from_dict(c.to_dict()) == c
    assert HybridConfig.preset("ling3-tiny", num_experts=0).moe_layer_ids == []


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(layer_pattern="KXM"), "layer_pattern"),
        (dict(chunk_size=12), "chunk_size"),
        (dict(num_attention_heads=3), "num_key_value_heads"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(router_score="relu"), "router_score"),
    ],
)
def test_bad_config_raises(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridConfig.tiny(**bad)
    with pytest.raises(ValueError, match="unknown model preset"):
        HybridConfig.preset("huge")
