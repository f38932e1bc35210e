"""Rollouts from the policy: the sampler's log-probs are the training forward's (float64, 1e-9),
forks share caches, trees branch at turn boundaries and sampling is deterministic in its seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.envs import ToolLookup
from harts.models.config import HybridConfig
from harts.models.hybrid_lm import HybridLM
from harts.rl.grpo import per_logprob
from harts.rollout.collect import RolloutConfig, collect
from harts.rollout.decode import extend, new_branch
from harts.rollout.sampler import SamplingConfig, generate, sample_tokens
from harts.tree.batch import RolloutBatch


def _model(dtype: str = "float64", vocab: int = 16, seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(HybridConfig.tiny(vocab_size=vocab, dtype=dtype))


def _gap(model: HybridLM, batch: RolloutBatch, mode: str) -> float:
    """Largest |training log-prob - sampler log-prob| over action tokens."""
    with torch.no_grad():
        lp = model(batch, mode=mode).logprobs.double().numpy()
    act = per_logprob(batch, batch.action_mask)
    return float(np.abs(lp[act] - per_logprob(batch, batch.old_logprobs)[act]).max())


def sampled_tree(model: HybridLM, stop_tokens: tuple[int, ...] = ()) -> RolloutBatch:
    """A hand-grown tree: a prompt of 11 tokens, 3 sampled turns, an observation each, 2 sampled
    turns per observation (``stop_tokens`` ending those); paths that cross several
    linear-attention chunks at chunk 8, forks inside a chunk, old log-probs the sampler's."""
    gen = torch.Generator().manual_seed(3)
    prompt = list(range(1, 12))
    (root,) = extend(model, [new_branch(model)], [prompt])
    kids, first = generate(model, root.fork(3), SamplingConfig(max_tokens=6), gen)
    obs = [[20, 21, 22, 23, 24], [25], [26, 27, 28]]
    grand = []
    for b, o in zip(kids, obs):
        grand += extend(model, [b], [o])[0].fork(2)
    grand, second = generate(model, grand, SamplingConfig(max_tokens=9, stop_tokens=stop_tokens), gen)
    # one value per predicted token: the root's lists are one shorter than its tokens
    nodes = [{"id": "p", "parent": None, "tokens": prompt, "action_mask": [False] * (len(prompt) - 1)}]
    nodes[0]["logprobs"] = [0.0] * (len(prompt) - 1)
    for i, (turn, o) in enumerate(zip(first, obs)):
        nodes.append({"id": f"a{i}", "parent": "p", "tokens": turn.tokens, "logprobs": turn.logprobs})
        nodes.append({"id": f"o{i}", "parent": f"a{i}", "tokens": o, "action_mask": [False] * len(o)})
        for j in range(2):
            t = second[2 * i + j]
            nodes.append({"id": f"b{i}{j}", "parent": f"o{i}", "tokens": t.tokens, "logprobs": t.logprobs})
    for n in nodes:
        n.setdefault("action_mask", [True] * len(n["tokens"]))
        n.setdefault("logprobs", [0.0] * len(n["tokens"]))
    return RolloutBatch.from_tree(nodes)


@pytest.mark.parametrize("mode", ["compact", "trajectory"])
def test_sampled_tree_logprobs_equal_training_forward_float64(mode: str) -> None:
    """``sampled_tree``: every sampled token's log-prob equals the training forward's to 1e-9."""
    model = _model(vocab=32)
    batch = sampled_tree(model, stop_tokens=(5,))
    assert batch.num_trajectories == 6 and batch.lengths.max() > 3 * model.config.chunk_size
    assert _gap(model, batch, mode) < 1e-9


def test_collected_trees_match_training_forward_float64() -> None:
    model = _model()
    ro = collect(model, ToolLookup, RolloutConfig(tasks=6), np.random.default_rng(1), torch.Generator().manual_seed(1))
    assert _gap(model, ro.batch, "compact") < 1e-9


def test_gap_detects_other_weights() -> None:
    """The consistency check can fail: a perturbed model no longer reproduces the sampler."""
    model = _model()
    ro = collect(model, ToolLookup, RolloutConfig(tasks=2), np.random.default_rng(1), torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.lm_head.weight.add_(1e-3 * torch.randn_like(model.lm_head.weight))
    assert _gap(model, ro.batch, "compact") > 1e-6


def test_fork_shares_caches_and_children_diverge() -> None:
    model = _model()
    (root,) = extend(model, [new_branch(model)], [[1, 2, 3]])
    a, b = root.fork(2)
    assert all(x.state_HKV is y.state_HKV and x.k_LGD is y.k_LGD for x, y in zip(a.layers, root.layers))
    a2, b2 = extend(model, [a, b], [[4], [5, 6]])
    assert (a2.length, b2.length) == (4, 5)
    assert a2.layers[0].state_HKV is not root.layers[0].state_HKV
    # the parent is untouched: extending it again gives the same logits as the first child
    (a3,) = extend(model, [root], [[4]])
    torch.testing.assert_close(a3.logits, a2.logits, rtol=0, atol=1e-12)


def test_top_p_keeps_the_nucleus_and_renormalizes() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)).repeat(400, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, lp = sample_tokens(logits, SamplingConfig(top_p=0.7), gen)
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.log(torch.tensor([0.5, 0.3]) / 0.8).double()
    torch.testing.assert_close(lp, expected[tokens])
    tokens, lp = sample_tokens(logits, SamplingConfig(temperature=2.0), gen)
    want = torch.log_softmax(logits[0] / 2.0, -1)
    torch.testing.assert_close(lp, want[tokens])


def test_generate_stops_at_stop_tokens_and_max_tokens() -> None:
    model = _model(vocab=8)
    (root,) = extend(model, [new_branch(model)], [[1, 2]])
    _, turns = generate(model, root.fork(16), SamplingConfig(max_tokens=5, stop_tokens=(3,)), torch.Generator())
    for t in turns:
        assert len(t.tokens) == 5 or t.tokens[-1] == 3
        assert 3 not in t.tokens[:-1]
    assert any(len(t.tokens) < 5 for t in turns)


def test_collect_branches_at_turn_boundaries_and_is_deterministic() -> None:
    model = _model()
    cfg = RolloutConfig(tasks=5, group_size=3, fork_width=2, max_leaves=6)
    runs = [collect(model, ToolLookup, cfg, np.random.default_rng(7), torch.Generator().manual_seed(7)) for _ in "ab"]
    a, b = (r.batch for r in runs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.old_logprobs, b.old_logprobs)
    tree = a.tree
    assert tree is not None and tree.num_nodes < sum(len(p) for p in map(tree.path, tree.leaves))
    for task in range(cfg.tasks):
        leaves = a.group_ids == task
        assert 3 <= leaves.sum() <= 6
        # every trajectory of a task starts with the task's prompt (one shared root node)
        assert len({tree.path(int(v))[0] for v in tree.leaves[leaves]}) == 1
        adv = a.advantages[a.offsets[:-1][leaves]]
        assert abs(adv.mean()) < 1e-9
    assert runs[0].retries > 0  # an untrained policy makes tool errors, and retries after them
    np.testing.assert_array_equal(a.rewards, runs[0].rewards)  # the batch carries each path's reward


@pytest.mark.parametrize("mode", ["compact", "trajectory"])
def test_bf16_sampler_error_is_no_worse_than_the_trainers(mode: str) -> None:
    """In bfloat16 sampler and trainer differ by rounding only: measured against the same
    weights in float64, the sampler's log-prob error is at most twice the training forward's."""
    model = _model("bfloat16", vocab=32)
    gen = torch.Generator().manual_seed(0)
    (root,) = extend(model, [new_branch(model)], [list(range(1, 20))])
    kids, turns = generate(model, root.fork(6), SamplingConfig(max_tokens=12), gen)
    batch = RolloutBatch.from_trajectories(
        [list(range(1, 20)) + t.tokens for t in turns],
        action_mask=[[False] * 19 + [True] * len(t.tokens) for t in turns],
        old_logprobs=[[0.0] * 19 + t.logprobs for t in turns],
    )
    act = per_logprob(batch, batch.action_mask)
    with torch.no_grad():
        train = model(batch, mode=mode).logprobs.double().numpy()[act]
        exact = model.to(torch.float64)(batch, mode=mode).logprobs.numpy()[act]
    sampler = per_logprob(batch, batch.old_logprobs)[act]
    err_sampler, err_train = np.abs(sampler - exact).mean(), np.abs(train - exact).mean()
    assert 0 < err_sampler <= 2 * err_train
