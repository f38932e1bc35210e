"""The FLOP model counts what its docstring says."""

from __future__ import annotations

import torch

import harts
from harts.models.flops import FlopModel
from harts.trainer.step_bench import microbatch_counts


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


def test_pairs_of_a_tree_and_of_its_trajectories() -> None:
    batch = harts.RolloutBatch.from_trajectories([[1, 5, 9, 2], [1, 5, 9, 7, 7], [1, 4]], advantages=[1.0, -1.0, 0.5])
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=16))
    rows, logit_rows, pairs = microbatch_counts(batch, batch, "trajectory")
    assert (rows, logit_rows, pairs) == (11, 8, 10 + 15 + 3)
    inputs = model.prepare_compact(batch)
    rows, logit_rows, pairs = microbatch_counts(batch, inputs, "compact")
    # trie: 1 -> 5 -> 9 -> {2, 7 -> 7}, 1 -> 4: positions 0,1,2,3,3,4,1
    assert rows == 7 and pairs == 1 + 2 + 3 + 4 + 4 + 5 + 2
    # logits come from rows that have a child: 1 (predicts 5 and 4), 5, 9 (predicts 2 and 7), first 7
    assert logit_rows == 4
