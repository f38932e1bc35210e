"""Compact execution equals trajectory-wise execution (issue 5's correctness list), float64 CPU.

Same weights, same batch: log-probs, the GRPO loss (with KL), MoE router losses and counts,
and every parameter gradient agree to 1e-9 relative error.
"""

from __future__ import annotations

import pytest
import torch

from harts import ExecutionConfig
from harts.models import HybridConfig, HybridLM
from harts.rl.verify import compare_runs, run_step
from tests.models._trees import batch_of, mixed_batch, tree_cases

TOL = 1e-9
B = 8


def make_model(pattern: str, moe: bool, dtype: str = "float64", **overrides) -> HybridLM:
    torch.manual_seed(0)
    fields = dict(dtype=dtype, layer_pattern=pattern, chunk_size=B, num_experts=4 if moe else 0)
    cfg = HybridConfig.tiny(**{**fields, **overrides})
    model = HybridLM(cfg)
    # non-trivial routing biases so expert choice differs from score order
    for layer in model.layers:
        if layer.is_moe:
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.05)
    return model


def check_agreement(model: HybridLM, batch, **compact_kw) -> dict[str, float]:
    inputs = model.prepare_compact(batch)
    ref = run_step(model, inputs, mode="trajectory", kl_coef=0.1)
    got = run_step(model, inputs, mode="compact", kl_coef=0.1, **compact_kw)
    diff = compare_runs(ref, got)
    assert set(ref.grads) == {n for n, _ in model.named_parameters()}, "every parameter must get a gradient"
    assert max(diff.values()) <= TOL, diff
    if ref.expert_counts is not None:
        assert torch.equal(ref.expert_counts, got.expert_counts)
        assert ref.expert_counts.sum(1).eq(batch.num_tokens * model.config.num_experts_per_tok).all()
    return diff


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("pattern", ["K", "G", "M", "A", "KGMA"])
def test_patterns_agree(pattern: str, moe: bool) -> None:
    check_agreement(make_model(pattern, moe), mixed_batch(B))


@pytest.mark.parametrize("case", list(tree_cases(B)))
def test_tree_cases_agree(case: str) -> None:
    batch = batch_of(tree_cases(B)[case], seed=3)
    check_agreement(make_model("KGMA", moe=True), batch)


@pytest.mark.parametrize(
    "recompute,attention",
    [(True, "gather"), (False, "mask"), (True, "mask")],
    ids=["recompute", "mask", "recompute-mask"],
)
def test_recompute_and_attention_agree(recompute: bool, attention: str) -> None:
    check_agreement(make_model("GKAM", moe=True), mixed_batch(B, seed=1), recompute=recompute, attention=attention)


def test_trajectory_mask_attention_equals_per_trajectory_calls() -> None:
    """The baseline's one-call document-causal mask ("mask") equals one call per trajectory."""
    model = make_model("MA", moe=True)
    batch = mixed_batch(B, seed=2)
    inputs = model.prepare_compact(batch)
    ref = run_step(model, inputs, mode="trajectory", kl_coef=0.1)
    got = run_step(model, inputs, mode="trajectory", kl_coef=0.1, attention="mask")
    diff = compare_runs(ref, got)
    assert max(diff.values()) <= TOL, diff
    with pytest.raises(ValueError, match="attention must be"):
        model(batch, mode="trajectory", attention="dense")
    # "auto" is the per-call path on CPU (mask on CUDA): bit-identical to "gather" here
    for mode in ("trajectory", "compact"):
        auto = model(inputs, mode=mode, attention="auto").logprobs
        assert torch.equal(auto, model(inputs, mode=mode, attention="gather").logprobs)


def test_chunk_16_and_qwen_style_moe_agree() -> None:
    torch.manual_seed(0)
    cfg = HybridConfig.tiny(
        dtype="float64",
        layer_pattern="GAKM",
        chunk_size=16,
        router_score="softmax",
        shared_expert_gate=True,
        norm_unit_offset=True,
        router_bias=False,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        q_lora_rank=None,
        rope_interleave=True,
        linear_num_key_heads=2,
    )
    check_agreement(HybridLM(cfg), mixed_batch(16, seed=2))


def test_ling3_style_layer_options_agree() -> None:
    torch.manual_seed(0)
    cfg = HybridConfig.tiny(
        dtype="float64",
        layer_pattern="KKM",
        kda_low_rank_gates=False,
        kda_safe_gate=True,
        mla_head_gate=True,
        mla_norm_eps=1e-5,
        n_group=2,
        topk_group=2,
    )
    check_agreement(HybridLM(cfg), mixed_batch(B, seed=4))
    cfg = cfg.replace(mla_rope=False, kda_safe_gate=False, layer_pattern="MK")
    check_agreement(HybridLM(cfg), mixed_batch(16, seed=2))


def test_recompute_reexecutes_the_plan() -> None:
    model = make_model("KM", moe=True)
    batch = mixed_batch(B)
    calls = {"n": 0}
    model.layers[0].linear_attn.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    run_step(model, batch, mode="compact", recompute=False)
    assert calls["n"] == 1
    run_step(model, batch, mode="compact", recompute=True)
    assert calls["n"] == 3  # forward + the re-execution in backward


def _no_replay_batch():
    # forks strictly inside chunks, several handoffs
    cases = tree_cases(B, seed=5)
    return batch_of(cases["several_forks_in_one_chunk"] + cases["chain_of_handoffs"] + cases["fan_out_9"], seed=5)


def test_no_replay_is_exact_in_float64() -> None:
    model = make_model("KKKG", moe=False)
    inputs = model.prepare_compact(_no_replay_batch())
    assert sum(int((~r.is_output).sum()) for r in inputs.layout.rounds) > 0
    ref = model(inputs, mode="trajectory").logprobs.detach()
    nr_config = ExecutionConfig(no_replay=True)
    nr = model(model.prepare_compact(_no_replay_batch(), nr_config), nr_config)
    assert nr.info["replay_rows"] == 0 and nr.info["no_replay"]
    assert (nr.logprobs.detach() - ref).abs().max() <= TOL * ref.abs().max()
    # the model executes the plan it is given: inputs prepared for replay are not re-planned
    with pytest.raises(ValueError, match="no_replay"):
        model(inputs, nr_config)


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_replay_reproduces_float32_path_and_no_replay_does_not(per_channel: bool) -> None:
    """The linear-attention core on identical float32 inputs: replay (compact) reproduces the
    trajectory-wise result, starting side branches at the fork (no_replay) measurably does not."""
    import numpy as np

    from harts.models.execution.compact import CompactContext
    from harts.models.execution.trajectory import TrajectoryContext
    from harts.models.layers.norms import l2norm

    batch = _no_replay_batch()
    model = make_model("K", moe=False)
    replay_in = model.prepare_compact(batch)
    no_replay_in = model.prepare_compact(batch, ExecutionConfig(no_replay=True))
    gen = torch.Generator().manual_seed(0)
    c, h, k, v = replay_in.cb.num_compact_tokens, 2, 16, 16
    q_c = l2norm(torch.randn(c, h, k, generator=gen))
    k_c = l2norm(torch.randn(c, h, k, generator=gen))
    v_c = torch.randn(c, h, v, generator=gen)
    g_c = -torch.rand(c, h, k, generator=gen) * 0.2 if per_channel else -torch.rand(c, h, generator=gen) * 0.2
    beta_c = torch.rand(c, h, generator=gen)
    m = torch.as_tensor(replay_in.cb.semantic_to_compact)

    traj = TrajectoryContext(batch, B, torch.device("cpu"))
    ref = traj.linear_attention(q_c[m], k_c[m], v_c[m], g_c[m], beta_c[m])

    def run(inputs):
        lay = inputs.layout
        ctx = CompactContext(lay, device=torch.device("cpu"))
        to_c = torch.as_tensor(np.maximum(lay.phys_to_compact, 0))
        o = ctx.linear_attention(q_c[to_c], k_c[to_c], v_c[to_c], g_c[to_c], beta_c[to_c])
        return o[torch.as_tensor(lay.semantic_to_phys)]

    err_replay = (run(replay_in) - ref).abs().max().item()
    err_no_replay = (run(no_replay_in) - ref).abs().max().item()
    print(f"float32 max |diff| vs trajectory-wise: replay {err_replay:.3e}, no_replay {err_no_replay:.3e}")
    assert err_no_replay > 0.0
    assert err_no_replay > 10 * err_replay, (err_replay, err_no_replay)


def test_attention_auto_avoids_flex_below_its_head_dim() -> None:
    """FlexAttention lowers on CUDA only for head dims >= 16: "auto" takes the mask path there
    only for models that have them (the tiny preset's MLA has 12 / 8 and had ended ``harts
    compare --device cuda`` in an Inductor traceback), and an explicit "mask" names the dims."""
    from harts.models.execution.config import FLEX_MIN_HEAD_DIM

    tiny, ling = HybridConfig.tiny(), HybridConfig.ling3_tiny()
    assert tiny.min_attention_head_dim == 8 < FLEX_MIN_HEAD_DIM <= ling.min_attention_head_dim
    assert HybridConfig.tiny(layer_pattern="KG").min_attention_head_dim is None
    auto, mask = ExecutionConfig(attention="auto"), ExecutionConfig(attention="mask")
    assert auto.resolved_attention("cuda", tiny.min_attention_head_dim) == "gather"
    assert auto.resolved_attention("cuda", ling.min_attention_head_dim) == "mask"
    assert auto.resolved_attention("cuda", None) == "mask"
    assert auto.resolved_attention("cpu", ling.min_attention_head_dim) == "gather"
    assert mask.resolved_attention("cpu", 8) == "mask"  # the CPU path has no such limit
    with pytest.raises(ValueError, match="head dims >= 16; this model's smallest is 8"):
        mask.resolved_attention("cuda", 8)


def test_rounds_in_physical_order_concatenate_to_the_scattered_output() -> None:
    """The planner's rounds cover the physical rows in order, so the linear-attention output is
    their outputs concatenated; the general scatter (index_copy) gives the same values and
    gradients (float64, a replay tree)."""
    import numpy as np

    from harts.models.execution.compact import CompactContext
    from harts.models.layers.norms import l2norm

    batch = _no_replay_batch()
    lay = make_model("K", moe=False).prepare_compact(batch).layout
    p, h, k = int(lay.num_rows), 2, 16
    gen = torch.Generator().manual_seed(0)
    xs = [l2norm(torch.randn(p, h, k, generator=gen, dtype=torch.float64)) for _ in range(2)]
    xs += [
        torch.randn(p, h, k, generator=gen, dtype=torch.float64),
        -torch.rand(p, h, k, generator=gen, dtype=torch.float64) * 0.2,
    ]
    xs += [torch.rand(p, h, generator=gen, dtype=torch.float64)]
    w = torch.randn(p, h, k, generator=gen, dtype=torch.float64)
    results = []
    for in_order in (True, False):
        ctx = CompactContext(lay, device=torch.device("cpu"))
        assert ctx.outputs_in_order and any(r.num_replay for r in ctx.rounds)
        ctx.outputs_in_order = in_order
        leaves = [x.clone().requires_grad_() for x in xs]
        out = ctx.linear_attention(*leaves)
        results.append([out, *torch.autograd.grad((out * w).sum(), leaves)])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert np.asarray(lay.rounds[0].out_rows)[0] == 0
