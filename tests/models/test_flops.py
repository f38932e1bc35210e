"""The FLOP model counts what its docstring says."""

from __future__ import annotations

import pytest
import torch

import harts
from harts.models.flops import FlopModel


def test_matmul_and_head_flops_by_hand() -> None:
    cfg = harts.HybridConfig.tiny(layer_pattern="M", vocab_size=100, num_experts=0, first_k_dense_replace=0)
    model = harts.HybridLM(cfg)
    linear = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear))
    fm = FlopModel.from_model(model)
    assert fm.per_row_matmul == 2 * linear
    assert fm.per_logit_row == 2 * 100 * cfg.hidden_size
    assert fm.per_pair == 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    assert fm.per_row_linear_attn == 0
    assert fm.training_flops(3, 2, 5) == 3 * fm.forward_flops(3, 2, 5)


def test_moe_counts_top_k_of_e_experts() -> None:
    dense = harts.HybridLM(
        harts.HybridConfig.tiny(layer_pattern="K", num_experts=4, num_experts_per_tok=2, first_k_dense_replace=1)
    )
    moe = harts.HybridLM(
        harts.HybridConfig.tiny(layer_pattern="K", num_experts=4, num_experts_per_tok=2, first_k_dense_replace=0)
    )
    ex = moe.layers[0].mlp.experts
    per_expert = (ex.gate_up_proj.numel() + ex.down_proj.numel()) / 4
    shared = sum(m.weight.numel() for m in moe.layers[0].mlp.shared_experts.modules() if isinstance(m, torch.nn.Linear))
    mixer = sum(m.weight.numel() for m in moe.layers[0].linear_attn.modules() if isinstance(m, torch.nn.Linear))
    router = moe.layers[0].mlp.gate.weight.numel()
    assert FlopModel.from_model(moe).per_row_matmul == 2 * (mixer + shared + router + 2 * per_expert)
    assert FlopModel.from_model(dense).per_row_linear_attn > 0


def _linear_shapes(module: torch.nn.Module) -> list[tuple[int, int]]:
    return [tuple(m.weight.shape) for m in module.modules() if isinstance(m, torch.nn.Linear)]


def test_lora_counts_forward_and_input_gradient_of_the_frozen_base_and_adapters_in_full() -> None:
    """A MoE KDA layer with rank-4 adapters on every projection, the routed experts and the head,
    counted by hand from the plain model's shapes: each frozen matmul 2 m n k forward + 2 m n k
    input gradient, each adapter 3 x 2 m r (n + k), the linear-attention core 3 x forward."""
    from harts.trainer.lora import LoraConfig, apply_lora

    cfg = harts.HybridConfig.tiny(
        layer_pattern="K", num_experts=4, num_experts_per_tok=2, first_k_dense_replace=0, vocab_size=100
    )
    model = harts.HybridLM(cfg)
    r, top_k, e = 4, 2, 4
    linears = _linear_shapes(model.layers)  # mixer and shared experts: (out, in)
    _, i2, d = model.layers[0].mlp.experts.gate_up_proj.shape  # [E, 2I, D]
    i = model.layers[0].mlp.experts.down_proj.shape[-1]  # [E, D, I]
    v = cfg.vocab_size
    base = sum(o * n for o, n in linears) + e * d + top_k * (i2 * d + d * i)  # linears, router, top-k experts
    adapters = r * (sum(o + n for o, n in linears) + top_k * ((i2 + d) + (d + i)))  # no router adapter
    b, k, vd, h = cfg.chunk_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    core = h * (6 * b * k + 4 * b * vd + 2 / 3 * b * b + 6 * k * vd)
    rows, logit_rows, pairs = 10, 7, 0
    expected = rows * (2 * 2 * base + 3 * 2 * adapters + 3 * core) + logit_rows * (2 * 2 * v * d + 3 * 2 * r * (v + d))

    plain = FlopModel.from_model(model)
    assert plain.formula.startswith("MFU = training FLOPs") and not plain.frozen_base
    apply_lora(model, LoraConfig(rank=r))
    fm = FlopModel.from_model(model)
    assert fm.training_flops(rows, logit_rows, pairs) == pytest.approx(expected, rel=1e-12)
    assert fm.per_row_matmul == plain.per_row_matmul  # the base's shapes, read without adapting a weight
    assert fm.frozen_base and "no weight gradient" in fm.formula
    # what the plain model counts for the same rows: every weight gradient too, no adapters
    assert plain.training_flops(rows, logit_rows, pairs) == pytest.approx(
        rows * (3 * 2 * base + 3 * core) + logit_rows * 3 * 2 * v * d, rel=1e-12
    )


def test_lora_on_attention_only_leaves_the_mlp_and_tied_head_frozen_without_adapters() -> None:
    """Adapters on the MLA mixer only: the dense MLP and the tied head are frozen matmuls (2 x
    forward, no adapter), attention pairs 3 x forward."""
    from harts.trainer.lora import LoraConfig, apply_lora

    cfg = harts.HybridConfig.tiny(
        layer_pattern="M", vocab_size=100, num_experts=0, first_k_dense_replace=0, tie_word_embeddings=True
    )
    model = harts.HybridLM(cfg)
    mixer, mlp = _linear_shapes(model.layers[0].self_attn), _linear_shapes(model.layers[0].mlp)
    d, v, r = cfg.hidden_size, cfg.vocab_size, 2
    per_pair = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    base = sum(o * n for o, n in mixer + mlp)
    adapters = r * sum(o + n for o, n in mixer)
    rows, logit_rows, pairs = 9, 5, 40
    expected = rows * (4 * base + 6 * adapters) + logit_rows * 4 * v * d + pairs * 3 * per_pair
    apply_lora(model, LoraConfig(rank=r, train_mlp=False, train_unembed=False))
    assert FlopModel.from_model(model).training_flops(rows, logit_rows, pairs) == pytest.approx(expected, rel=1e-12)
    # the tied head with its own adapter: the embedding stays frozen, the adapter counts in full
    tied = harts.HybridLM(cfg)
    apply_lora(tied, LoraConfig(rank=r, train_attn=False, train_mlp=False, train_unembed=True))
    fm = FlopModel.from_model(tied)
    assert fm.per_logit_row_frozen == 2 * v * d and fm.per_logit_row_adapter == 2 * r * (v + d)
    assert fm.per_row_frozen == fm.per_row_matmul and fm.per_row_adapter == 0
