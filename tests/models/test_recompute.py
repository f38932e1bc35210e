"""Selective recomputation (``ExecutionConfig.recompute_skip``, ``harts.models.recompute``):
the skipped cores run once, everything else is recomputed, and gradients are bit-identical to
full recomputation (float64, CPU)."""

from __future__ import annotations

import pytest
import torch

from harts import ExecutionConfig
from harts.models.execution.compact import CompactContext
from harts.models.execution.trajectory import TrajectoryContext
from harts.rl.grpo import grpo_loss
from harts.rl.verify import run_step
from tests.models._trees import mixed_batch
from tests.models.test_compact_vs_trajectory import B, check_agreement, make_model

SKIPS = [("attention",), ("linear_attention",), ("attention", "linear_attention")]


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
    out = model(inputs, ExecutionConfig(mode=mode, recompute=True, recompute_skip=skip))
    forward = dict(calls)
    assert forward == {"attention": 2, "linear_attention": 2}  # KGMA: K, G linear; M, A full
    grpo_loss(out.logprobs, batch).loss.backward()
    for core in calls:
        # checkpoint reruns every layer in the backward, except the skipped cores
        assert calls[core] == forward[core] * (1 if core in skip else 2), (core, calls)
    (ctx,) = seen
    assert ctx.kept_cores == {}, "every stored core output is taken by the recomputation"


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
        (dict(recompute=True, recompute_skip=("moe",)), "unknown core 'moe'"),
        (dict(recompute=True, recompute_skip="attention"), "tuple of core names"),
        (dict(recompute=True, recompute_skip=("attention", "attention")), "names a core twice"),
        (dict(recompute=False, recompute_skip=("attention",)), "needs recompute=True"),
    ],
)
def test_bad_recompute_skip_is_named(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExecutionConfig(**fields)
