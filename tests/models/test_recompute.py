"""Selective recomputation (``ExecutionConfig.recompute_skip``, ``harts.models.recompute``):
the skipped cores run once, everything else is recomputed, and gradients are bit-identical to
full recomputation (float64, CPU)."""

from __future__ import annotations

import pytest
import torch

from harts import ExecutionConfig
from harts.models.execution.compact import CompactContext
from harts.models.execution.trajectory import TrajectoryContext
from harts.models.layers.moe import MoE
from harts.rl.grpo import grpo_loss
from harts.rl.verify import run_step
from tests.models._trees import mixed_batch
from tests.models.test_compact_vs_trajectory import B, check_agreement, make_model

SKIPS = [
    ("attention",),
    ("linear_attention",),
    ("moe",),
    ("attention", "linear_attention"),
    ("attention", "linear_attention", "moe"),
]


def _ids(skip: tuple[str, ...]) -> str:
    return "+".join(skip)


@pytest.mark.parametrize("skip", SKIPS, ids=_ids)
@pytest.mark.parametrize("mode", ["trajectory", "compact"])
def test_skipped_cores_give_the_gradients_of_full_recomputation(mode: str, skip: tuple[str, ...]) -> None:
    model = make_model("KGMA", moe=True)
    inputs = model.prepare_compact(mixed_batch(B, seed=4))
    full = run_step(model, inputs, mode=mode, recompute=True, kl_coef=0.1)
    got = run_step(model, inputs, mode=mode, recompute=True, recompute_skip=skip, kl_coef=0.1)
    assert torch.equal(full.logprobs, got.logprobs)
    assert set(full.grads) == set(got.grads) == {n for n, _ in model.named_parameters()}
    for name, g in full.grads.items():
        assert torch.equal(g, got.grads[name]), name


def test_compact_with_skipped_cores_equals_trajectory_wise() -> None:
    check_agreement(
        make_model("GKAM", moe=True),
        mixed_batch(B, seed=1),
        recompute=True,
        recompute_skip=("attention", "linear_attention"),
    )


def _count_core_calls(monkeypatch: pytest.MonkeyPatch, contexts: list) -> dict[str, int]:
    """Counts calls of each core on the row contexts; ``contexts`` collects the contexts called."""
    calls = {"attention": 0, "linear_attention": 0}
    for cls in (TrajectoryContext, CompactContext):
        for name in calls:
            original = getattr(cls, name)

            def counted(self, *args, _original=original, _name=name, **kwargs):  # noqa: ANN001, ANN202
                calls[_name] += 1
                if not any(c is self for c in contexts):
                    contexts.append(self)
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("skip", [(), *SKIPS], ids=lambda s: _ids(s) or "none")
@pytest.mark.parametrize("mode", ["trajectory", "compact"])
def test_a_skipped_core_runs_once_and_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, mode: str, skip: tuple[str, ...]
) -> None:
    model = make_model("KGMA", moe=True)
    batch = mixed_batch(B, seed=2)
    inputs = model.prepare_compact(batch)
    seen: list = []
    calls = _count_core_calls(monkeypatch, seen)
    moe_calls = [0]
    real_moe = MoE.forward

    def counted_moe(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        moe_calls[0] += 1
        assert kwargs.get("lean") == ("moe" in skip)  # a kept block's routed experts run lean
        return real_moe(self, *args, **kwargs)

    monkeypatch.setattr(MoE, "forward", counted_moe)
    out = model(inputs, ExecutionConfig(mode=mode, recompute=True, recompute_skip=skip))
    forward = dict(calls)
    assert forward == {"attention": 2, "linear_attention": 2}  # KGMA: K, G linear; M, A full
    grpo_loss(out.logprobs, batch).loss.backward()
    for core in calls:
        # checkpoint reruns every layer in the backward, except the skipped cores
        assert calls[core] == forward[core] * (1 if core in skip else 2), (core, calls)
    n_moe = sum(layer.is_moe for layer in model.layers)
    assert n_moe >= 2 and moe_calls[0] == n_moe * (1 if "moe" in skip else 2)
    (ctx,) = seen
    assert ctx.kept_for_recompute == {}, "every stored core output is taken by the recomputation"


def test_a_second_backward_recomputes_the_skipped_core() -> None:
    """retain_graph: the stored output is taken by the first recomputation; the second one
    runs the core again and still gives the same gradients."""
    model = make_model("KGMA", moe=True)
    batch = mixed_batch(B, seed=5)
    inputs = model.prepare_compact(batch)
    grads = []
    for skip in ((), ("attention", "linear_attention")):
        model.zero_grad(set_to_none=True)
        out = model(inputs, ExecutionConfig(mode="compact", recompute=True, recompute_skip=skip))
        loss = grpo_loss(out.logprobs, batch).loss
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def test_without_grad_nothing_is_stored() -> None:
    model = make_model("KGMA", moe=True)
    inputs = model.prepare_compact(mixed_batch(B, seed=6))
    with torch.no_grad():
        ref = model(inputs, mode="compact").logprobs
        got = model(inputs, mode="compact", recompute=True, recompute_skip=("attention",)).logprobs
    assert torch.equal(ref, got)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(recompute=True, recompute_skip=("mlp",)), "unknown core 'mlp'"),
        (dict(recompute=True, recompute_skip="attention"), "tuple of core names"),
        (dict(recompute=True, recompute_skip=("attention", "attention")), "names a core twice"),
        (dict(recompute=False, recompute_skip=("attention",)), "needs recompute=True"),
    ],
)
def test_bad_recompute_skip_is_named(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExecutionConfig(**fields)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_skipped_cores_on_cuda_match_full_recomputation(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on CUDA, compact mode (FlexAttention under the tree mask, the tree kernel on fla-core):
    keeping both cores through checkpointing gives full recomputation's log-probs and gradients,
    bitwise when a rerun is bitwise, else as closely as a rerun. Trajectory mode runs the same
    ``run_core`` (the CPU tests cover both modes)."""
    pytest.importorskip("fla")
    from harts.models import HybridConfig, HybridLM

    # the layer glue runs eagerly (its compilation is tested elsewhere and took most of the
    # cold start); FlexAttention and the linear-attention kernels, the cores at stake, still compile
    monkeypatch.setenv("HARTS_COMPILE", "0")
    from harts.tree.workloads import generate

    torch.manual_seed(0)
    cfg = HybridConfig.ling3_tiny(
        layer_pattern="KM", vocab_size=512, num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1
    )
    model = HybridLM(cfg).to("cuda", torch.bfloat16)
    batch = generate("tiny", step=0)
    runs = []
    for skip in ((), ("attention", "linear_attention"), ()):
        execution = ExecutionConfig(
            mode="compact", attention="mask", recompute=True, recompute_skip=skip, linear_attention_backend="auto"
        )
        inputs = model.prepare_compact(batch, execution)
        model.zero_grad(set_to_none=True)
        out = model(inputs, execution)
        grpo_loss(out.logprobs, batch).loss.backward()
        runs.append((out.logprobs.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (ref_lp, ref_g), (lp, g), (again_lp, again_g) = runs
    deterministic = torch.equal(ref_lp, again_lp) and all(torch.equal(ref_g[n], again_g[n]) for n in ref_g)
    assert set(g) == set(ref_g) and len(g) == len(list(model.parameters()))
    if deterministic:
        assert torch.equal(lp, ref_lp)
        for n in ref_g:
            assert torch.equal(g[n], ref_g[n]), n
    else:  # a rerun itself differs: agree as closely as two reruns do
        for n in ref_g:
            rerun = float((again_g[n].float() - ref_g[n].float()).abs().max())
            assert float((g[n].float() - ref_g[n].float()).abs().max()) <= 2 * rerun + 1e-6, n


@pytest.mark.parametrize("dtype", ["float64", "float32"], ids=["loop-experts", "grouped-experts"])
def test_recomputation_reuses_the_forward_s_expert_choice(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """With recomputation each MoE layer chooses its experts once (the forward's choice is
    reused by checkpoint), and the gradients are those of a run without recomputation."""
    from harts.models.layers.moe import TopKRouter

    model = make_model("KM", moe=True, dtype=dtype)
    batch = mixed_batch(B, seed=7)
    inputs = model.prepare_compact(batch)
    plain = run_step(model, inputs, mode="compact", recompute=False, kl_coef=0.1)
    chosen = []
    original = TopKRouter.choose

    def counted(self, scores, **kw):  # noqa: ANN001, ANN003, ANN202
        chosen.append(self)
        return original(self, scores, **kw)

    monkeypatch.setattr(TopKRouter, "choose", counted)
    moe_layers = sum(layer.is_moe for layer in model.layers)
    recomputed = run_step(model, inputs, mode="compact", recompute=True, kl_coef=0.1)
    assert moe_layers >= 1 and len(chosen) == moe_layers  # not 2 x: the recomputation reuses it
    assert torch.equal(plain.logprobs, recomputed.logprobs)
    for name, g in plain.grads.items():
        assert torch.equal(g, recomputed.grads[name]), name
    assert torch.equal(plain.expert_counts, recomputed.expert_counts)


@pytest.mark.parametrize("layers", [0, 1, 3, 4])
@pytest.mark.parametrize("mode", ["trajectory", "compact"])
def test_recomputing_the_first_layers_only(monkeypatch: pytest.MonkeyPatch, mode: str, layers: int) -> None:
    """``recompute_layers=N``: the first N layers run under checkpoint (their cores run twice, or
    once when skipped) and the rest keep their activations (cores once); log-probs and every
    gradient equal full recomputation's bit for bit (float64); nothing is left in the store."""
    model = make_model("KGMA", moe=True)  # layers: K, G (linear), M, A (full)
    batch = mixed_batch(B, seed=7)
    inputs = model.prepare_compact(batch)
    full = run_step(model, inputs, mode=mode, recompute=True, kl_coef=0.1)
    skip = ("attention",)
    got = run_step(model, inputs, mode=mode, recompute=True, recompute_layers=layers, recompute_skip=skip, kl_coef=0.1)
    assert torch.equal(full.logprobs, got.logprobs)
    for name, g in full.grads.items():
        assert torch.equal(g, got.grads[name]), name
    seen: list = []
    calls = _count_core_calls(monkeypatch, seen)
    out = model(inputs, ExecutionConfig(mode=mode, recompute=True, recompute_layers=layers, recompute_skip=skip))
    assert out.info["checkpointed_layers"] == layers
    grpo_loss(out.logprobs, batch).loss.backward()
    # linear layers 0, 1 rerun when checkpointed; full-attention layers 2, 3 are skipped cores
    assert calls == {"linear_attention": 2 + min(layers, 2), "attention": 2}
    (ctx,) = seen
    assert ctx.kept_for_recompute == {}, "a layer that is not checkpointed leaves nothing to take"


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(recompute=False, recompute_layers=2), "needs recompute=True"),
        (dict(recompute=True, recompute_layers=-1), ">= 0"),
        (dict(recompute=True, recompute_layers=1.5), "integer"),
        (dict(recompute=True, recompute_layers=True), "integer"),
    ],
)
def test_bad_recompute_layers_is_named(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExecutionConfig(**fields)


def test_more_recompute_layers_than_the_model_has_is_named() -> None:
    model = make_model("KGMA", moe=True)
    inputs = model.prepare_compact(mixed_batch(B, seed=3))
    with pytest.raises(ValueError, match="recompute_layers=5, but the model has 4 decoder layers"):
        model(inputs, mode="compact", recompute=True, recompute_layers=5)


@pytest.mark.parametrize("mode", ["trajectory", "compact"])
def test_a_kept_moe_block_with_grouped_experts_gives_full_recomputation_s_gradients(mode: str) -> None:
    """float32 on CPU takes the grouped experts, so a kept MoE block runs its lean routed experts
    (``_LeanRoutedExperts``): log-probs and every gradient equal full recomputation's (the same
    kernels: bit for bit on CPU), and compact equals trajectory-wise as closely as without it."""
    model = make_model("KGMA", moe=True, dtype="float32")
    assert all(layer.mlp.experts.uses_grouped(torch.zeros(1)) for layer in model.layers if layer.is_moe)
    inputs = model.prepare_compact(mixed_batch(B, seed=8))
    full = run_step(model, inputs, mode=mode, recompute=True, kl_coef=0.1)
    got = run_step(model, inputs, mode=mode, recompute=True, recompute_skip=("moe",), kl_coef=0.1)
    assert torch.equal(full.logprobs, got.logprobs)
    assert set(full.grads) == set(got.grads) == {n for n, _ in model.named_parameters()}
    for name, g in full.grads.items():
        assert torch.equal(g, got.grads[name]), name


@pytest.mark.parametrize("mode", ["trajectory", "compact"])
@pytest.mark.parametrize("keep", [1, 3])
def test_moe_layers_keeping_their_gate_up_output(monkeypatch: pytest.MonkeyPatch, mode: str, keep: int) -> None:
    """``moe_keep_gate_up=N``: the first N MoE layers' lean experts keep their gate/up output
    (the others recompute it), with log-probs and every gradient bit for bit those without."""
    from harts.models.layers import moe as moe_module

    model = make_model("KGMA", moe=True, dtype="float32")
    n_moe = sum(layer.is_moe for layer in model.layers)
    assert n_moe >= 2
    inputs = model.prepare_compact(mixed_batch(B, seed=9))
    base = run_step(model, inputs, mode=mode, recompute=True, recompute_skip=("moe",), kl_coef=0.1)
    flags: list[bool] = []
    real = moe_module._LeanRoutedExperts.apply
    monkeypatch.setattr(
        moe_module._LeanRoutedExperts, "apply", lambda *a: flags.append(bool(a[-1])) or real(*a), raising=True
    )
    got = run_step(
        model, inputs, mode=mode, recompute=True, recompute_skip=("moe",), moe_keep_gate_up=keep, kl_coef=0.1
    )
    assert flags == [i < keep for i in range(n_moe)]
    assert torch.equal(base.logprobs, got.logprobs)
    for name, g in base.grads.items():
        assert torch.equal(g, got.grads[name]), name


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(recompute=True, moe_keep_gate_up=2), "needs recompute=True with 'moe' in recompute_skip"),
        (dict(moe_keep_gate_up=1), "needs recompute=True"),
        (dict(recompute=True, recompute_skip=("moe",), moe_keep_gate_up=-1), ">= 0"),
        (dict(recompute=True, recompute_skip=("moe",), moe_keep_gate_up=True), "integer"),
    ],
)
def test_bad_moe_keep_gate_up_is_named(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExecutionConfig(**fields)
