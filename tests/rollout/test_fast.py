"""The batched decoder (``harts.rollout.fast``) against the reference decoder in float64: the same
seeds sample the same tokens with the same log-probs (to 1e-10; both are sums of the same float64
terms in another order) across forks, observations, requests joining mid-decode and stop
sequences, on every mixer kind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.models.config import HybridConfig
from harts.models.hybrid_lm import HybridLM
from harts.ops.linear_attn import naive_recurrent_linear_attn
from harts.rollout.context import recurrent_step
from harts.rollout.decode import extend, new_branch
from harts.rollout.fast import DecodeBatch, FastDecoder, FastDecoding
from harts.rollout.sampler import SamplingConfig, generate

TOL = 1e-10

CONFIGS = {
    "tiny-KGMA-moe": {},
    "KDA-MLA": {"layer_pattern": "KMKM", "num_experts": 0},
    "GDN-gatedGQA": {"layer_pattern": "GGAG", "num_experts": 0, "attn_output_gate": True},
}


def _model(name: str, vocab: int = 32) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(HybridConfig.tiny(vocab_size=vocab, dtype="float64", **CONFIGS[name]))


def _same(ref_turns, fast_turns) -> None:  # type: ignore[no-untyped-def]
    assert [t.tokens for t in ref_turns] == [t.tokens for t in fast_turns]
    assert [t.stopped for t in ref_turns] == [t.stopped for t in fast_turns]
    ref = np.concatenate([t.logprobs for t in ref_turns])
    fast = np.concatenate([t.logprobs for t in fast_turns])
    np.testing.assert_allclose(fast, ref, rtol=0, atol=TOL)


def _fast_turn(dec: FastDecoder, ids: list[int], cfg: SamplingConfig, seed: int, detok=None):  # type: ignore[no-untyped-def]
    d = FastDecoding(dec, ids, cfg, detok)
    gen = torch.Generator().manual_seed(seed)
    while not d.done:
        d.step(gen)
    return d.turns


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-steps"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_turn_tree_equals_reference(name: str, static: bool) -> None:
    """Prompt over several chunks, 3 forks, observations of different lengths, 2 forks each,
    a second turn with top-k / top-p and a stop token: tokens and log-probs as the reference's,
    eager or through the bucketed static steps that CUDA graphs capture (6 rows padded to 8)."""
    model = _model(name)
    prompt = list(range(1, 20))
    obs = [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [25], [26, 27, 28]]
    first = SamplingConfig(max_tokens=6)
    second = SamplingConfig(max_tokens=9, stop_tokens=(5,), top_k=12, top_p=0.9, temperature=0.8)

    (root,) = extend(model, [new_branch(model)], [prompt])
    kids, ref1 = generate(model, root.fork(3), first, torch.Generator().manual_seed(3))
    grand = []
    for b, o in zip(kids, obs):
        grand += extend(model, [b], [o])[0].fork(2)
    _, ref2 = generate(model, grand, second, torch.Generator().manual_seed(4))

    dec = FastDecoder(model)
    dec.static_steps = static
    (seq,) = dec.open()
    dec.extend([seq], [prompt])
    torch.testing.assert_close(dec.logits[seq], root.logits, rtol=0, atol=TOL)
    kids_f = dec.fork(seq, 3)
    _same(ref1, _fast_turn(dec, kids_f, first, 3))
    dec.extend(kids_f, obs)  # all three observations in one chunked call
    grand_f = [n for k in kids_f for n in dec.fork(k, 2)]
    _same(ref2, _fast_turn(dec, grand_f, second, 4))
    assert (dec._static is not None) == static


def test_requests_join_mid_decode_and_stop_strings() -> None:
    """Two requests in one ``DecodeBatch``: the second prefills and joins after the first has
    decoded 3 steps; greedy and sampled, one with a stop string, each equal to its own
    reference run."""
    model = _model("tiny-KGMA-moe")

    def detok(ids):  # type: ignore[no-untyped-def]
        return "".join(chr(97 + t % 26) for t in ids)

    cfg_a = SamplingConfig(max_tokens=10, stop_strings=("e",), topk_logprobs=3)
    cfg_b = SamplingConfig(max_tokens=7, temperature=0.0)
    pa, pb = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5]

    (ra,) = extend(model, [new_branch(model)], [pa])
    _, ref_a = generate(model, ra.fork(4), cfg_a, torch.Generator().manual_seed(7), detok)
    (rb,) = extend(model, [new_branch(model)], [pb])
    _, ref_b = generate(model, rb.fork(2), cfg_b, torch.Generator().manual_seed(8))

    dec = FastDecoder(model)
    batch = DecodeBatch(dec)
    (sa,) = dec.open()
    dec.extend([sa], [pa])
    da = FastDecoding(dec, dec.fork(sa, 4), cfg_a, detok)
    batch.add(da, torch.Generator().manual_seed(7))
    finished = []
    for _ in range(3):
        finished += batch.step()
    (sb,) = dec.open()
    dec.extend([sb], [pb])
    db = FastDecoding(dec, dec.fork(sb, 2), cfg_b)
    batch.add(db, torch.Generator().manual_seed(8))
    while batch.jobs:
        finished += batch.step()
    assert set(map(id, finished)) == {id(da), id(db)}
    assert any(t.stopped for t in ref_a) and any(not t.stopped for t in ref_a)
    _same(ref_a, da.turns)
    _same(ref_b, db.turns)
    ref_top = np.concatenate([np.ravel(t.topk_logprobs) for t in ref_a])
    np.testing.assert_allclose(np.concatenate([np.ravel(t.topk_logprobs) for t in da.turns]), ref_top, atol=TOL)
    assert [t.topk_ids for t in ref_a] == [t.topk_ids for t in da.turns]


def test_closed_forks_free_only_their_own_slots() -> None:
    """Forks hold their parent's key/value slots by reference: closing the parent frees
    nothing the children still read; closing everything frees every slot."""
    model = _model("GDN-gatedGQA")
    dec = FastDecoder(model)
    (root,) = dec.open()
    dec.extend([root], [[1, 2, 3, 4, 5]])
    kids = dec.fork(root, 3)
    assert (dec.cache.refs > 0).sum() == 5 and (dec.cache.refs == 4).sum() == 5
    dec.close([root])
    dec.extend(kids, [[6], [7, 8], [9]])
    assert (dec.cache.refs > 0).sum() == 5 + 4
    dec.close(kids)
    assert not dec.cache.refs.any()


@pytest.mark.parametrize("rule", ["delta", "plain"])
@pytest.mark.parametrize("scalar", [False, True], ids=["per-channel", "scalar"])
def test_recurrent_step_is_the_recurrence(rule: str, scalar: bool) -> None:
    """The decode step's torch recurrence is the reference recurrence's token (both rules)."""
    gen = torch.Generator().manual_seed(0)
    B, H, K, V = 3, 2, 4, 5
    q, k = (torch.randn(B, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, H, *(() if scalar else (K,)), generator=gen, dtype=torch.float64)
    beta = torch.rand(B, H, generator=gen, dtype=torch.float64) if rule == "delta" else None
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    o, S = recurrent_step(q, k, v, g, beta, S0, 0.5)
    o_ref, S_ref, _ = naive_recurrent_linear_attn(
        q, k, v, g, beta, cu_seqlens=torch.arange(B + 1), initial_state=S0, scale=0.5, rule=rule
    )
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-12)


def test_collect_builds_the_same_trees_with_either_decoder() -> None:
    """``collect`` through the batched decoder (forced on the CPU) grows the reference's trees:
    the same tokens, forks and old log-probs (to 1e-10)."""
    from harts.envs import ToolLookup
    from harts.rollout.collect import RolloutConfig, collect

    model = _model("tiny-KGMA-moe", vocab=64)
    cfg = RolloutConfig(tasks=3, group_size=2, fork_width=2, max_leaves=4, max_turns=3)
    runs = [
        collect(model, ToolLookup, cfg, np.random.default_rng(1), torch.Generator().manual_seed(1), fast=fast)
        for fast in (False, True)
    ]
    ref, fast = (r.batch for r in runs)
    assert ref.num_trajectories == fast.num_trajectories > cfg.tasks
    np.testing.assert_array_equal(ref.tokens, fast.tokens)
    np.testing.assert_array_equal(ref.offsets, fast.offsets)
    np.testing.assert_allclose(fast.old_logprobs, ref.old_logprobs, rtol=0, atol=TOL)
    np.testing.assert_array_equal(runs[0].rewards, runs[1].rewards)


def test_prefill_past_the_token_budget_runs_in_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts past ``PREFILL_TOKENS`` in one call run in groups of sequences, with the same
    logits and hidden states as one forward of the reference."""
    import harts.rollout.fast as fast

    model = _model("KDA-MLA")
    prompts = [list(range(1, 12)), [5, 6], list(range(3, 20)), [7]]
    ref, ref_h = _ref_hidden(model, prompts)
    monkeypatch.setattr(fast, "PREFILL_TOKENS", 13)
    dec = FastDecoder(model)
    ids = dec.open(len(prompts))
    hidden = dec.extend(ids, prompts, hidden=True)
    assert hidden is not None and [h.shape[0] for h in hidden] == [len(p) for p in prompts]
    for n, branch, h, h_ref in zip(ids, ref, hidden, ref_h):
        torch.testing.assert_close(dec.logits[n], branch.logits, rtol=0, atol=TOL)
        torch.testing.assert_close(h, h_ref, rtol=0, atol=TOL)


def _ref_hidden(model: HybridLM, prompts: list[list[int]]):  # type: ignore[no-untyped-def]
    from harts.rollout.decode import extend_hidden

    return extend_hidden(model, [new_branch(model)] * len(prompts), prompts)


def test_caches_grow_past_their_first_capacity() -> None:
    """A cache allocated for 1 sequence, 4 slots and 2 positions grows (sequences, slots,
    positions, every layer's tensors) and decodes as the reference does."""
    from harts.rollout.cache import SlotCache

    model = _model("GDN-gatedGQA")
    prompt, cfg = list(range(1, 10)), SamplingConfig(max_tokens=5)
    (root,) = extend(model, [new_branch(model)], [prompt])
    _, ref = generate(model, root.fork(3), cfg, torch.Generator().manual_seed(2))
    dec = FastDecoder(model)
    dec.cache = SlotCache(dec.device, seqs=1, slots=4, positions=2)
    (seq,) = dec.open()
    dec.extend([seq], [prompt])
    _same(ref, _fast_turn(dec, dec.fork(seq, 3), cfg, 2))
    assert dec.cache.table_NL.shape[0] >= 4 and dec.cache.num_slots >= 9 + 3 * 4


def _teacher_forced(make, prompt: list[int], steps: list[list[int]], fast: bool, graphs: bool = False):  # type: ignore[no-untyped-def]
    """Logits [steps + 1, forks, V] after the prompt and after each forced step of 3 forks."""
    model = make()
    if not fast:
        (root,) = extend(model, [new_branch(model)], [prompt])
        branches, out = root.fork(3), []
        for toks in steps:
            out.append(torch.stack([b.logits for b in branches]))
            branches = extend(model, branches, [[t] for t in toks])
        out.append(torch.stack([b.logits for b in branches]))
        return torch.stack(out).double().cpu()
    dec = FastDecoder(model, cuda_graphs=graphs)
    (seq,) = dec.open()
    dec.extend([seq], [prompt])
    ids, out = dec.fork(seq, 3), []
    for toks in steps:
        out.append(torch.stack([dec.logits[n] for n in ids]))
        dec.extend(ids, [[t] for t in toks])
    out.append(torch.stack([dec.logits[n] for n in ids]))
    return torch.stack(out).double().cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("name", ["KDA-MLA", "GDN-gatedGQA"])
def test_cuda_decoder_within_float32_error_of_the_reference(name: str, graphs: bool) -> None:
    """On CUDA (fla-core's chunked prefill and fused recurrent steps, CUDA graphs), the batched
    decoder's float32 logits are as close to the float64 reference as the float32 reference is
    (within twice its error), across a prompt of two chunks and forced steps of three forks."""
    dims = {"chunk_size": 64, "linear_key_head_dim": 32, "linear_value_head_dim": 32, "head_dim": 32}

    def make(dtype: str, device: str):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        cfg = HybridConfig.tiny(vocab_size=32, dtype="float64", **CONFIGS[name], **dims)
        return HybridLM(cfg).to(device=device, dtype=getattr(torch, dtype))

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 32, (97,), generator=gen).tolist()
    steps = torch.randint(0, 32, (6, 3), generator=gen).tolist()
    truth = _teacher_forced(lambda: make("float64", "cpu"), prompt, steps, fast=False)
    low = _teacher_forced(lambda: make("float32", "cpu"), prompt, steps, fast=False)
    fast = _teacher_forced(lambda: make("float32", "cuda"), prompt, steps, fast=True, graphs=graphs)
    assert (fast - truth).abs().max() <= 2 * (low - truth).abs().max()
