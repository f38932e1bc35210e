"""The sampler's options against their definitions: greedy is the argmax, top-k never leaves the k
largest and renormalizes over them, stop strings end a turn at the token that completes them (across
token boundaries), and top-k log-probs are the k largest of log_softmax of the training forward
(float64: the two paths differ only in summation order, ~1e-12)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.models.config import HybridConfig
from harts.models.hybrid_lm import HybridLM
from harts.rollout.decode import extend, extend_hidden, new_branch
from harts.rollout.sampler import SamplingConfig, generate, sample_tokens, topk_logprobs
from harts.tree.batch import RolloutBatch

VOCAB = 24
#: float64 forward vs float64 decoding of the same weights: a few ulps of O(1) log-probs per layer
TOL = 1e-9


def _model(seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(HybridConfig.tiny(vocab_size=VOCAB, dtype="float64"))


def _trainer_logprobs(model: HybridLM, prefix: list[int]) -> torch.Tensor:
    """[V] log p(v | prefix) from the training forward: one trajectory ``prefix + [v]`` per token
    v (the prefix computed once), each trajectory's last log-prob."""
    batch = RolloutBatch.from_trajectories([prefix + [v] for v in range(VOCAB)])
    with torch.no_grad():
        lp = model(batch, mode="compact").logprobs.double()
    return lp.reshape(VOCAB, len(prefix))[:, -1]


def test_greedy_is_the_argmax_with_the_models_logprob_and_draws_nothing() -> None:
    model = _model()
    prompt = [3, 1, 4, 1, 5]
    (root,) = extend(model, [new_branch(model)], [prompt])
    gen = torch.Generator().manual_seed(7)
    state = gen.get_state()
    _, (turn,) = generate(model, [root], SamplingConfig(temperature=0.0, max_tokens=6), gen)
    assert torch.equal(gen.get_state(), state)
    for t, (tok, lp) in enumerate(zip(turn.tokens, turn.logprobs)):
        ref = _trainer_logprobs(model, prompt + turn.tokens[:t])
        assert tok == int(ref.argmax())
        assert abs(lp - float(ref[tok])) < TOL
    # top-k and top-p cannot move the argmax
    _, (again,) = generate(model, [root], SamplingConfig(temperature=0.0, top_k=2, top_p=0.3, max_tokens=6), gen)
    assert again.tokens == turn.tokens


def test_greedy_takes_the_first_of_equal_maxima() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]], dtype=torch.float64)
    tokens, lp = sample_tokens(logits, SamplingConfig(temperature=0.0), torch.Generator())
    assert tokens.tolist() == [1]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[:, 1], rtol=1e-15, atol=0)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_samples_only_the_k_largest_renormalized(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(64, VOCAB, dtype=torch.float64, generator=gen)
    temperature = 1.7
    draws = [sample_tokens(logits, SamplingConfig(top_k=k, temperature=temperature), gen) for _ in range(40)]
    top = logits.topk(k, dim=-1).indices
    for tokens, lp in draws:
        assert (tokens[:, None] == top).any(-1).all()
        restricted = torch.full_like(logits, -torch.inf).scatter(1, top, logits.gather(1, top) / temperature)
        want = torch.log_softmax(restricted, -1).gather(1, tokens[:, None])[:, 0]
        torch.testing.assert_close(lp, want, rtol=1e-12, atol=1e-12)
    # every one of the k is reachable: a flat distribution spreads over all of them
    flat = torch.zeros(2000, VOCAB, dtype=torch.float64)
    flat[:, :k] += 1.0
    tokens, _ = sample_tokens(flat, SamplingConfig(top_k=k), gen)
    assert set(tokens.tolist()) == set(range(k))


def test_top_k_then_top_p() -> None:
    """top-k cuts first, top-p then keeps the nucleus of the renormalized k."""
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    tokens, lp = sample_tokens(probs.log().repeat(500, 1), SamplingConfig(top_k=3, top_p=0.7), gen)
    # over the top 3 (0.4, 0.3, 0.2) / 0.9, the mass before token 1 is 0.44 < 0.7, before token 2 0.78
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(lp, (torch.tensor([0.4, 0.3]) / 0.7).log().double()[tokens])


def test_topk_logprobs_of_sampled_positions_and_of_a_prompt_equal_the_training_forward() -> None:
    model = _model(1)
    prompt = [2, 7, 1, 8, 2, 8]
    k = 5
    (root,), (hidden_TD,) = extend_hidden(model, [new_branch(model)], [prompt])
    for i in range(1, len(prompt)):
        ids, lps = topk_logprobs(torch.nn.functional.linear(hidden_TD[i - 1 : i], model.lm_head_weight), k)
        want = _trainer_logprobs(model, prompt[:i]).topk(k)
        assert ids[0].tolist() == want.indices.tolist()
        assert float((lps[0] - want.values).abs().max()) < TOL
    cfg = SamplingConfig(max_tokens=5, topk_logprobs=k, temperature=1.3)
    _, turns = generate(model, root.fork(2), cfg, torch.Generator().manual_seed(2))
    for turn in turns:
        assert len(turn.topk_ids) == len(turn.tokens) and all(len(r) == k for r in turn.topk_ids)
        for t in range(len(turn.tokens)):
            want = _trainer_logprobs(model, prompt + turn.tokens[:t]).topk(k)
            assert turn.topk_ids[t] == want.indices.tolist()
            assert float(np.abs(np.array(turn.topk_logprobs[t]) - want.values.numpy()).max()) < TOL


def test_stop_strings_end_the_turn_at_the_token_that_completes_them() -> None:
    """One character per token (token t is chr(97 + t)), so a two-character stop string spans
    two tokens; the greedy turn without stop strings says where it first completes."""
    model = _model(2)
    (root,) = extend(model, [new_branch(model)], [[0]])

    def text(ids):  # the detokenizer
        return "".join(chr(97 + t) for t in ids)

    _, (free,) = generate(model, [root], SamplingConfig(temperature=0.0, max_tokens=12), torch.Generator())
    full = text(free.tokens)
    stop = full[2:4]  # two characters, so two tokens
    end = full.index(stop) + len(stop)
    cfg = SamplingConfig(temperature=0.0, max_tokens=12, stop_strings=("zz", stop))
    _, (turn,) = generate(model, [root], cfg, torch.Generator(), detokenize=text)
    assert turn.tokens == free.tokens[:end] and turn.stopped
    assert turn.logprobs == free.logprobs[:end]
    with pytest.raises(ValueError, match="detokenizer"):
        generate(model, [root], cfg, torch.Generator())
    # a stop string that never appears: the turn runs to max_tokens, not stopped
    _, (long,) = generate(
        model,
        [root],
        SamplingConfig(temperature=0.0, max_tokens=12, stop_strings=("zz",)),
        torch.Generator(),
        detokenize=text,
    )
    assert long.tokens == free.tokens and not long.stopped
