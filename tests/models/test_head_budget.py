"""``ExecutionConfig.lm_head_budget`` in the model: a budget of a few rows per logits chunk, its
softmax kept or recomputed, gives the plain full-softmax head's step (float64: log-probs, loss,
every gradient), compact and trajectory-wise alike, with tied or untied embeddings and with a
LoRA adapter on the head."""

from __future__ import annotations

import pytest
import torch

from harts.rl.verify import compare_runs, run_step
from harts.trainer.lora import LoraConfig, apply_lora
from tests.models._trees import batch_of, tree_cases
from tests.models.test_compact_vs_trajectory import TOL, B, make_model

#: the tiny model's vocabulary; the budget holds 3 rows of its float64 logits
V = 64
BUDGET = 3 * V * 8


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-head"])
def test_budgeted_head_gives_the_plain_heads_step(tied: bool, lora: bool) -> None:
    model = make_model("KA", moe=False, vocab_size=V, tie_word_embeddings=tied)
    if lora:
        apply_lora(model, LoraConfig(rank=2, train_attn=False, train_mlp=False, train_unembed=True))
        with torch.no_grad():  # B starts at zero: make the adapter change the head
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(std=0.1)
    batch = batch_of(tree_cases(B)["several_forks_in_one_chunk"], seed=2)
    # several chunks of 3 rows on either side
    assert model.prepare_compact(batch).layout.num_rows > 3 * 3
    ref = run_step(model, batch, mode="trajectory", fused_logprobs=False, kl_coef=0.1)
    assert ref.grads
    for mode in ("trajectory", "compact"):
        for keep in (False, True, None):
            got = run_step(
                model,
                batch,
                mode=mode,
                fused_logprobs=True,
                lm_head_budget=BUDGET,
                keep_lm_head_probs=keep,
                kl_coef=0.1,
            )
            diff = compare_runs(ref, got)
            assert max(diff.values()) <= TOL, (mode, keep, diff)
