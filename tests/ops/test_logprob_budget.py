"""The LM head within its memory budget: chunks of R rows cut by the budget, the kept softmax of
the first chunks that fit, against the full-softmax reference (float64, values and both
gradients) on adversarial row/target maps, and the head's peak CPU bytes under the budget for
rows x V far beyond it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import harts.ops.logprob.mapped as mapped
from harts.ops.logprob import mapped_logprobs, naive_mapped_logprobs
from harts.rl.verify import _peak_cpu_bytes

F64 = torch.float64
#: float64 tolerance, relative to the largest entry of the reference
TOL = 1e-12
#: vocabulary: a prime, so no chunk or budget divides it
V = 97
#: unique rows per chunk the test budget gives in float64
R = 8
BUDGET = R * V * 8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def _row_map(unique: int, seed: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(P, rows [n], targets [n]): ``unique`` compact rows read out of P > unique hidden rows (some
    never read), each by 1-3 positions; forks (a row read with different targets, a target
    repeated) at the first row, at the last row of the first chunk and the first of the next."""
    rng = np.random.default_rng(seed)
    P = unique + 5
    used = np.sort(rng.choice(P, unique, replace=False))
    mult = rng.integers(1, 4, unique)
    for u in {0, R - 1, R} & set(range(unique)):
        mult[u] = 4
    rows = np.repeat(used, mult)
    targets = rng.integers(0, V, rows.size)
    first = np.concatenate([[0], np.cumsum(mult)[:-1]])
    for u in {0, R - 1, R} & set(range(unique)):
        at = first[u]
        targets[at : at + 4] = [3, 96, 3, 50]  # two alike, two others, the vocabulary's last id
    order = rng.permutation(rows.size)  # positions in no particular order
    return P, torch.as_tensor(rows[order]), torch.as_tensor(targets[order])


def _run(fn, hidden, weight, up):  # noqa: ANN001, ANN202
    out = fn(hidden, weight)
    return (out, *torch.autograd.grad((out * up).sum(), (hidden, weight)))


@pytest.mark.parametrize("unique", [1, R - 1, R, R + 1, 2 * R, 3 * R + 1], ids=lambda u: f"U{u}")
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_budgeted_head_equals_the_full_softmax(unique: int, fused: bool) -> None:
    """Chunks of R rows from the budget (boundaries at R - 1, R, R + 1, a single row), every
    number of kept chunks from none to all: log-probs, d(hidden) and d(weight) equal the
    reference's to float64 rounding."""
    P, rows, targets = _row_map(unique, seed=unique)
    gen = torch.Generator().manual_seed(unique)
    hidden = torch.randn(P, 6, dtype=F64, generator=gen, requires_grad=True)
    weight = torch.randn(V, 6, dtype=F64, generator=gen, requires_grad=True)
    up = torch.randn(rows.numel(), dtype=F64, generator=gen)
    ref = _run(lambda h, w: naive_mapped_logprobs(h, w, rows, targets), hidden, weight, up)
    index = mapped.logprob_index(rows.numpy(), targets.numpy(), P, V).with_row_chunk(R)
    assert mapped.chunk_rows(V, 8, BUDGET) == R
    chunks = len(index.bounds) - 1
    assert chunks == -(-unique // R)
    for keep in sorted({0, 1, chunks - 1, chunks}):
        plan = mapped._IndexPlan(index, hidden.device)
        got = _run(lambda h, w: mapped._MappedLogprobs.apply(h, w, targets, plan, fused, keep), hidden, weight, up)
        for name, a, b in zip(("logprobs", "d_hidden", "d_weight"), got, ref):
            assert _rel(a, b) <= TOL, (name, keep, _rel(a, b))
    # the public function with that budget, the softmax kept or recomputed
    for keep_probs in (False, True):
        got = _run(
            lambda h, w: mapped_logprobs(h, w, rows, targets, budget=BUDGET, fused=fused, keep_probs=keep_probs),
            hidden,
            weight,
            up,
        )
        for name, a, b in zip(("logprobs", "d_hidden", "d_weight"), got, ref):
            assert _rel(a, b) <= TOL, (name, keep_probs, _rel(a, b))


def test_chunk_rows_and_kept_chunks_follow_the_budget() -> None:
    assert mapped.chunk_rows(V, 8, BUDGET) == R
    assert mapped.chunk_rows(V, 8, BUDGET - 1) == R - 1
    assert mapped.chunk_rows(V, 4, BUDGET) == 2 * R
    assert mapped.chunk_rows(V, 8, 1) == 1  # at least one row
    assert mapped.chunk_rows(V, 4, 10**12, row_chunk=64) == 64  # never above row_chunk
    bounds = [0, 8, 16, 24, 27]  # rows kept at 2 bytes an entry within the budget: (8 * 16) / 2 / 8
    assert mapped.kept_chunks(bounds, V, 2, 16 * V * 2) == 2
    assert mapped.kept_chunks(bounds, V, 2, 16 * V * 2 - 1) == 1
    assert mapped.kept_chunks(bounds, V, 2, 27 * V * 2) == 4  # everything fits: the whole softmax
    assert mapped.kept_chunks(bounds, V, 2, 7 * V * 2) == 0
    assert mapped.kept_chunks([0], V, 2, 10**9) == 0  # no rows
    assert mapped.head_budget("cpu") == mapped.CPU_CHUNK_BYTES
    assert mapped.head_budget("cuda", 80 * 2**30) == 5 * 2**30 and mapped.head_budget("cuda") is None
    with pytest.raises(ValueError, match="budget must be a positive"):
        hidden, weight = torch.zeros(2, 3), torch.zeros(V, 3)
        mapped_logprobs(hidden, weight, torch.tensor([0]), torch.tensor([1]), budget=0)


def test_peak_bytes_stay_within_the_budget_far_below_rows_by_vocab() -> None:
    """3,000 rows x V = 20,011 of float32 logits would take 240 MB, 120 budgets of 2 MB: the head's
    forward + backward peaks below two budgets (a chunk's logits and logsumexp's exp of it in the
    eager forward) and the O(P x D + V x D + n) rest: its inputs' gradients, d(hidden), the index
    plan. The full-softmax reference at a tenth of the positions trips the same bound."""
    torch.manual_seed(0)
    vocab, P, n, D, budget = 20_011, 3_000, 4_000, 4, 2 * 2**20
    hidden = torch.randn(P, D, requires_grad=True)
    weight = torch.randn(vocab, D, requires_grad=True)
    rows, targets = torch.randint(0, P, (n,)), torch.randint(0, vocab, (n,))
    rows[:P] = torch.arange(P)  # every row read: U = P
    rest = 4 * (P + vocab) * D * 4 + 64 * n
    assert P * vocab * 4 >= 100 * budget and 2 * budget + rest < P * vocab * 4 / 40

    peak = _peak_cpu_bytes(lambda: mapped_logprobs(hidden, weight, rows, targets, budget=budget).sum().backward())
    assert budget <= peak <= 2 * budget + rest, peak
    few = slice(0, n // 10)
    naive = _peak_cpu_bytes(lambda: naive_mapped_logprobs(hidden, weight, rows[few], targets[few]).sum().backward())
    assert naive > 2 * budget + rest, naive
