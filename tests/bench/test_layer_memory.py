"""``benchmarks/modules/layer_memory.py``: every layer kind of a preset, FFN-less and mixer-less
ones included, is measured as a one-layer model; and Mamba-2's CPU count never falls below what
the eager reference keeps (``estimate_memory``'s pre-flight check must not pass a step that does
not fit)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.modules.layer_memory import _kinds, measure_layer, one_layer
from harts.models.config import HybridConfig


def test_a_preset_with_an_ffn_pattern_splits_into_one_layer_kinds() -> None:
    full = HybridConfig.preset("nemotron_3_nano_30b_a3b")
    kinds = _kinds(full)
    assert [(letter, ffn) for letter, ffn, _ in kinds] == [("S", "-"), ("-", "E"), ("A", "-")]
    for letter, ffn, index in kinds:
        one = one_layer(full, letter, ffn)  # a valid one-layer config (validated on construction)
        assert one.num_hidden_layers == 1 and one.layer_pattern == full.layer_pattern[index] == letter
        assert one.is_moe_layer(0) == full.is_moe_layer(index) and one.has_ffn(0) == full.has_ffn(index)


def test_a_preset_without_an_ffn_pattern_keeps_dense_and_moe_apart() -> None:
    full = HybridConfig.preset("qwen3_5_35b_a3b")
    assert {(letter, ffn) for letter, ffn, _ in _kinds(full)} == {("G", "E"), ("A", "E")}
    assert one_layer(full, "G", "E").ffn_pattern == ""


# Wide enough that the per-row terms dominate; the chunk and state sizes of the real models'
# ratio (state 128 at chunk 64 there, 64 at 64 and 16 at 16 here).
SHAPES = {
    "wide": dict(mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=64, mamba_n_groups=2, chunk_size=64),
    "narrow": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, mamba_n_groups=1, chunk_size=16),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_mamba2_cpu_count_covers_what_the_reference_keeps(shape: str, dtype: str) -> None:
    """The count is written for bfloat16, where every float32 copy is a storage of its own; in
    float32 those copies are the tensors themselves (``.to`` is a no-op), so it may overcount
    there by the gated norm's float32 input and gate (2 of the ~10 head-dim-wide terms)."""
    config = HybridConfig.tiny(layer_pattern="S", ffn_pattern="-", vocab_size=256, hidden_size=64, dtype=dtype,
                               **SHAPES[shape])  # fmt: skip
    r = measure_layer(config, 256, torch.device("cpu"), 0)
    assert 1.0 <= r["ratio"] <= (1.05 if dtype == "bfloat16" else 1.2), r
