"""``harts.models.memory``: the parameter count equals the built model's, the terms follow the
capacity, recomputation, sharding and the LM head, and the estimate lies within 25 % of the
measured peak resident memory of real CPU steps (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from harts.models import HybridConfig, HybridLM
from harts.models.config import PRESET_NAMES
from harts.models.execution.config import ExecutionConfig
from harts.models.memory import TERMS, estimate_memory, gathered_view_rows, parameter_count
from harts.ops.logprob.mapped import CPU_CHUNK_BYTES

PROBE = Path(__file__).with_name("_memory_probe.py")

VARIANTS = {
    "dense-gates": dict(kda_low_rank_gates=False),
    "no-q-lora-tied": dict(q_lora_rank=None, mla_head_gate=True, tie_word_embeddings=True),
    "shared-gate": dict(
        shared_expert_gate=True, shared_expert_intermediate_size=24, num_shared_experts=2, attn_output_gate=False
    ),
}


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_parameter_count_equals_the_models_for_every_preset(name: str) -> None:
    config = HybridConfig.preset(name)
    with torch.device("meta"):
        model = HybridLM(config, seed=0)
    assert parameter_count(config) == model.num_parameters()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_parameter_count_equals_the_models_for_variants(name: str) -> None:
    config = HybridConfig.tiny(**VARIANTS[name])
    assert parameter_count(config) == HybridLM(config, seed=0).num_parameters()


def test_terms_follow_capacity_recompute_shards_and_head() -> None:
    config = HybridConfig.tiny(vocab_size=157_184)
    base = estimate_memory(config, capacity=8192)
    assert set(base.terms) == set(TERMS) and base.total > 0
    double = estimate_memory(config, capacity=16384)
    assert double.terms["activations"] == 2 * base.terms["activations"]
    assert double.terms["parameters"] == base.terms["parameters"]
    recompute = estimate_memory(config, ExecutionConfig(recompute=True), capacity=8192)
    assert recompute.terms["activations"] < base.terms["activations"] / 5
    sharded = estimate_memory(config, capacity=8192, shards=4)
    assert sharded.terms["parameters"] == -(-base.parameters // 4) * 4
    assert sharded.terms["optimizer"] < base.terms["optimizer"] / 3
    # the CPU head holds a bounded chunk; the plain head grows with the positions
    fused = estimate_memory(config, ExecutionConfig(fused_logprobs=True), capacity=65536)
    assert fused.terms["lm_head"] <= 2 * CPU_CHUNK_BYTES
    plain = estimate_memory(config, ExecutionConfig(mode="trajectory"), capacity=65536)
    assert plain.terms["lm_head"] == 3 * 65536 * 157_184 * 4
    no_opt = estimate_memory(config, capacity=8192, optimizer=False)
    assert no_opt.terms["optimizer"] == 0 and no_opt.total < base.total


def test_largest_term_and_summary_name_the_biggest_first() -> None:
    est = estimate_memory(HybridConfig.preset("ling3_tiny"), capacity=65536, dtype="float32")
    name, size = est.largest
    assert size == max(est.terms.values())
    assert est.summary().startswith(name)
    assert est.summary(skip=1, top=2).count(",") == 1


def test_cuda_counts_no_runtime_and_keeps_the_head_softmax_within_its_budget() -> None:
    """On CUDA in half precision the head keeps the softmax of the first chunks that fit in its
    budget (a sixteenth of the device), whole where all fit; never more than the budget unless
    ``keep_lm_head_probs=True``; its chunks follow the budget too."""
    config = HybridConfig.preset("ling3_tiny")  # V = 157,184, bf16
    v, total = config.vocab_size, 150 * 2**30
    chunk = 4096 * v * 2  # a 4,096-row chunk's bf16 softmax

    def head(capacity: int = 65536, device_total: int | None = total, **fields: Any) -> int:
        est = estimate_memory(
            config, ExecutionConfig(**fields), capacity=capacity, device_type="cuda", device_total_bytes=device_total
        )
        assert est.terms["runtime"] == 0 and est.terms["allocator"] == 0
        return est.terms["lm_head"]

    recomputed = head(keep_lm_head_probs=False)
    budget = total // 16
    assert head() - recomputed == budget // chunk * chunk <= budget  # the first chunks that fit
    assert head(keep_lm_head_probs=True) - recomputed == 65536 * v * 2  # every row, when asked
    # a microbatch whose whole softmax fits keeps it whole
    assert head(capacity=5000) - head(capacity=5000, keep_lm_head_probs=False) == 5000 * v * 2
    # unknown device memory: nothing kept by default, unless a budget is given
    assert head(device_total=None) == recomputed
    assert head(device_total=None, lm_head_budget=budget) == head()
    # a budget below one 4,096-row chunk of float32 logits cuts the chunk rows
    small = head(lm_head_budget=2**30, keep_lm_head_probs=False)
    rows = 2**30 // (v * 4)
    assert small == recomputed - (4096 - rows) * v * 6


_BIG = dict(
    vocab_size=2000,
    hidden_size=128,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    chunk_size=64,
    num_attention_heads=4,
    head_dim=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    intermediate_size=256,
    moe_intermediate_size=64,
)

CASES = {
    "tiny-8-layers-T32768": {"rows": 32768, "config": {"vocab_size": 2000, "layer_pattern": "KGMAKGMA"}},
    "wide-T8192": {"rows": 8192, "config": _BIG},
    "wide-recompute-T8192": {"rows": 8192, "recompute": True, "config": _BIG},
    "wide-bf16-T8192": {"rows": 8192, "config": {**_BIG, "dtype": "bfloat16"}},
    "vocab-300k-adamw-T1024": {"rows": 1024, "optimizer": True, "config": {"vocab_size": 300_000}},
    "plain-head-V30000-T4096": {"rows": 4096, "fused": False, "config": {"vocab_size": 30_000}},
    "compact-T16384": {"rows": 16384, "mode": "compact", "trajectories": 8, "config": {"vocab_size": 2000}},
    # 32 paths share half the rows and three of four layers attend: the gathered ancestor views
    # (16.5 x the compact rows) are a fifth of the peak
    "compact-views-KMAM-T16384": {
        "rows": 16384,
        "mode": "compact",
        "trajectories": 32,
        "config": {"vocab_size": 2000, "layer_pattern": "KMAM"},
    },
}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("case", sorted(CASES))
def test_estimate_within_25_percent_of_the_measured_cpu_peak(case: str) -> None:
    out = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(CASES[case])], capture_output=True, text=True, check=True, timeout=600
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    ratio = result["estimate"] / result["measured"]
    assert 0.75 <= ratio <= 1.25, (case, ratio, result)


def test_gathered_views_are_counted_where_they_are_made() -> None:
    """Compact attention through ancestor views ("gather", and "auto" on the CPU) keeps each
    branch's K/V over its ancestors: a term linear in the view rows beyond the compact rows and
    in the attention layers; none in trajectory mode, with the tree mask, or without sharing."""
    config = HybridConfig.tiny(vocab_size=512, layer_pattern="KMAM")
    compact = ExecutionConfig(mode="compact")

    def views(cfg: ExecutionConfig = compact, view_rows: int | None = 8192 * 5, device: str = "cpu", **kw: Any) -> int:
        return estimate_memory(
            kw.pop("config", config), cfg, capacity=8192, view_rows=view_rows, device_type=device
        ).terms["views"]

    base = views()
    assert base > 0
    assert views(view_rows=8192 * 9) == 2 * base  # (9 - 1) / (5 - 1): the rows beyond the own ones
    one, two = (views(config=HybridConfig.tiny(vocab_size=512, layer_pattern=p)) for p in ("KMKK", "KMKM"))
    assert 0 < one < base and two == 2 * one  # per attention layer
    assert views(replace(compact, attention="gather"), device="cuda") > 0
    for cfg, view_rows, device in (
        (ExecutionConfig(mode="trajectory"), 8192 * 5, "cpu"),
        (replace(compact, attention="mask"), 8192 * 5, "cpu"),
        (compact, 8192 * 5, "cuda"),  # auto is the tree mask on CUDA for MLA's unequal head dims
        (compact, None, "cpu"),
        (compact, 8192, "cpu"),
    ):
        assert views(cfg, view_rows, device) == 0, (cfg, view_rows, device)
    # kept for the backward unless the layer is recomputed; its backward counts them either way
    with_views = estimate_memory(config, compact, capacity=8192, view_rows=8192 * 5)
    without = estimate_memory(config, compact, capacity=8192)
    assert with_views.total - without.total >= base
    recomputed = estimate_memory(config, replace(compact, recompute=True), capacity=8192, view_rows=8192 * 5)
    assert recomputed.terms["views"] == 0 and recomputed.terms["backward"] > 0
    assert gathered_view_rows(8192, 4.5) == 36864 and gathered_view_rows(8192, 0.5) == 8192
    # GQA at one head dim in half precision: auto gathers on CUDA (FlashAttention-2 varlen views)
    qwen = HybridConfig.preset("qwen3_next_80b_a3b", layers=4)
    half = dict(capacity=8192, view_rows=8192 * 5, device_type="cuda")
    assert estimate_memory(replace(qwen, dtype="bfloat16"), compact, **half).terms["views"] > 0
    assert estimate_memory(replace(qwen, dtype="float32"), compact, **half).terms["views"] == 0


def test_estimate_takes_the_execution_of_a_run() -> None:
    config = HybridConfig.tiny(vocab_size=512)
    cfg = ExecutionConfig(recompute=True, recompute_layers=2)
    some = estimate_memory(config, cfg, capacity=4096)
    every = estimate_memory(config, replace(cfg, recompute_layers=None), capacity=4096)
    none = estimate_memory(config, capacity=4096)
    assert every.terms["activations"] < some.terms["activations"] < none.terms["activations"]
