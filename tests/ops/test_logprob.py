"""mapped_logprobs against log_softmax over gathered rows: values, gradients, and a memory bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import harts.ops.logprob.mapped as mapped
from harts.ops.logprob import mapped_logprobs, naive_mapped_logprobs
from harts.ops.logprob.mapped import _stable_argsort, logprob_index

F64 = torch.float64


class LargestTensor(TorchDispatchMode):
    """Records the largest numel among all tensors produced by dispatched ops."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.shape = t.numel(), tuple(t.shape)
        return out


def make_case(P: int, D: int, V: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(P, D, dtype=F64, generator=gen, requires_grad=True)
    weight = torch.randn(V, D, dtype=F64, generator=gen, requires_grad=True)
    rows = torch.randint(0, P, (n,), generator=gen)
    targets = torch.randint(0, V, (n,), generator=gen)
    return hidden, weight, rows, targets


@pytest.mark.parametrize(
    "P,D,V,n,chunk",
    [
        pytest.param(*c, id="P{}-D{}-V{}-n{}-C{}".format(*c))
        for c in [(63, 8, 97, 130, 16), (65, 16, 33, 65, 2048), (7, 4, 11, 63, 3)]
    ],
)
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "kept-probs"])
def test_values_and_gradients_match_log_softmax(P, D, V, n, chunk, fused, keep):
    """Every backward path (recomputed logits, eager or fused: the target entries set to their
    totals afterwards; or the forward's kept softmax) is exact in float64, including a fork row
    with a repeated target."""
    hidden, weight, rows, targets = make_case(P, D, V, n)
    # a fork: one row read by several positions with different targets (and one repeated target)
    rows[:4] = 5
    targets[:4] = torch.tensor([1, 2, 3, 1])
    out = mapped_logprobs(hidden, weight, rows, targets, row_chunk=chunk, fused=fused, keep_probs=keep)
    ref = naive_mapped_logprobs(hidden, weight, rows, targets)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn(n, dtype=F64)
    g_out = torch.autograd.grad((out * up).sum(), (hidden, weight))
    g_ref = torch.autograd.grad((ref * up).sum(), (hidden, weight))
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_gradcheck_and_second_consumers():
    hidden, weight, rows, targets = make_case(6, 3, 7, 15, seed=1)
    assert torch.autograd.gradcheck(lambda h, w: mapped_logprobs(h, w, rows, targets, row_chunk=4), (hidden, weight))
    assert torch.autograd.gradcheck(
        lambda h, w: mapped_logprobs(h, w, rows, targets, row_chunk=4, keep_probs=True), (hidden, weight)
    )
    # only hidden needs a gradient (a frozen head): the weight gradient is skipped
    (g,) = torch.autograd.grad(mapped_logprobs(hidden, weight.detach(), rows, targets).sum(), (hidden,))
    (g_ref,) = torch.autograd.grad(naive_mapped_logprobs(hidden, weight.detach(), rows, targets).sum(), (hidden,))
    torch.testing.assert_close(g, g_ref)


def test_never_allocates_positions_by_vocab():
    """Forward + backward stay within row_chunk x V; the n x V reference trips the same check."""
    P, D, V, n, chunk = 40, 8, 101, 300, 16
    hidden, weight, rows, targets = make_case(P, D, V, n)
    limit = chunk * V
    with LargestTensor() as mode:
        out = mapped_logprobs(hidden, weight, rows, targets, row_chunk=chunk)
        out.sum().backward()
    assert mode.largest <= limit, f"allocated {mode.shape}"
    with LargestTensor() as mode:
        naive_mapped_logprobs(hidden, weight, rows, targets).sum().backward()
    assert mode.largest >= n * V  # the check can fail


def test_half_precision_computes_in_float32():
    hidden, weight, rows, targets = make_case(10, 8, 13, 20)
    out = mapped_logprobs(hidden.detach().bfloat16(), weight.detach().bfloat16(), rows, targets)
    ref = naive_mapped_logprobs(hidden.detach().bfloat16().double(), weight.detach().bfloat16().double(), rows, targets)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise():
    hidden, weight, rows, targets = make_case(5, 3, 7, 4)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 5\)"):
        mapped_logprobs(hidden, weight, rows + 5, targets)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 7\)"):
        mapped_logprobs(hidden, weight, rows, targets + 7)
    with pytest.raises(ValueError, match="equal length"):
        mapped_logprobs(hidden, weight, rows, targets[:2])
    with pytest.raises(ValueError, match="lm_head_weight"):
        mapped_logprobs(hidden, weight.T, rows, targets)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_half_gemms_on_cuda_within_plain_bf16_error():
    """CUDA bf16: the chunk GEMMs run in bf16 with float32 output, with the fused (default) and
    the eager element-wise passes. Forward and both gradients stay
    within 2x the error of what a bf16 trainer does by hand (bf16 logits, then log_softmax), both
    measured against float64 on the same bf16-rounded operands; the forward is float32-exact."""
    P, D, V, n = 700, 256, 50_000, 1_000
    hidden, weight, rows, targets = make_case(P, D, V, n)
    h16, w16 = (t.detach().bfloat16().cuda().requires_grad_() for t in (hidden, weight))
    h64, w64 = (t.detach().bfloat16().double().cuda().requires_grad_() for t in (hidden, weight))
    g = torch.randn(n, dtype=F64).cuda()
    rows_c, targets_c = rows.cuda(), targets.cuda()

    def run(h, w, fn):  # noqa: ANN001, ANN202
        out = fn(h, w)
        dh, dw = torch.autograd.grad((out.double() * g).sum(), (h, w))
        return out.double(), dh.double(), dw.double()

    ref = run(h64, w64, lambda h, w: naive_mapped_logprobs(h, w, rows_c, targets_c))
    ours = run(h16, w16, lambda h, w: mapped_logprobs(h, w, rows, targets, row_chunk=256))
    eager = run(h16, w16, lambda h, w: mapped_logprobs(h, w, rows, targets, row_chunk=256, fused=False))
    # the kept bf16 softmax instead of recomputed logits (one more rounding per d(logits) entry)
    kept = run(h16, w16, lambda h, w: mapped_logprobs(h, w, rows, targets, row_chunk=256, keep_probs=True))
    # the default under a budget of one 256-row chunk of float32 logits: the bf16 softmax of the
    # first two of the three chunks kept, the last one's logits recomputed
    budget = 256 * V * 4
    assert mapped.kept_chunks(mapped.logprob_index(rows, targets, P, V, 256).bounds, V, 2, budget) == 2
    partial = run(h16, w16, lambda h, w: mapped_logprobs(h, w, rows, targets, row_chunk=256, budget=budget))
    plain = run(
        h16.detach().clone().requires_grad_(),
        w16.detach().clone().requires_grad_(),
        lambda h, w: torch.log_softmax((h[rows_c] @ w.T).float(), -1).gather(1, targets_c[:, None])[:, 0],
    )
    err = [(a - r).abs().max().item() / r.abs().max().item() for a, r in zip(ours, ref)]
    err_eager = [(a - r).abs().max().item() / r.abs().max().item() for a, r in zip(eager, ref)]
    err_kept = [(a - r).abs().max().item() / r.abs().max().item() for a, r in zip(kept, ref)]
    err_partial = [(a - r).abs().max().item() / r.abs().max().item() for a, r in zip(partial, ref)]
    err_plain = [(a - r).abs().max().item() / r.abs().max().item() for a, r in zip(plain, ref)]
    assert err[0] < 1e-5, err
    for name, e, ee, ep in zip(["logprobs", "d_hidden", "d_weight"], err, err_eager, err_plain):
        assert e <= 2 * ep + 1e-6, f"{name}: {e:.2e} vs plain bf16 {ep:.2e}"
        # the fused passes (compiled exp, one rounding per entry) stay as close as the eager ones
        assert e <= 1.5 * ee + 1e-6, f"{name}: fused {e:.2e} vs eager {ee:.2e}"
    # kept probabilities: the same forward (the same online max and sum, compiled in another
    # kernel: float32 summation order aside); gradients within plain bf16's error (2x, as above)
    assert abs(err_kept[0] - err[0]) <= 1e-6, (err_kept, err)
    for name, ek, epart, ep in zip(["logprobs", "d_hidden", "d_weight"], err_kept, err_partial, err_plain):
        assert ek <= 2 * ep + 1e-6, f"{name}: kept probs {ek:.2e} vs plain bf16 {ep:.2e}"
        assert epart <= 2 * ep + 1e-6, f"{name}: partly kept probs {epart:.2e} vs plain bf16 {ep:.2e}"


@pytest.mark.parametrize(
    "P,V,n,forks",
    [(1, 1, 1, 0), (50, 7, 400, 3), (70_000, 70_000, 90_000, 50), (3_000, 157_184, 20_000, 200)],
)
def test_index_plan_equals_unique_and_sorts(P: int, V: int, n: int, forks: int) -> None:
    """The O(n + P) index plan gives np.unique's and a stable argsort's arrays exactly, also with
    more than 2**16 unique rows or a vocabulary above 2**16 (two radix digits)."""
    rng = np.random.default_rng(P + V + n)
    rows = rng.integers(0, P, n)
    targets = rng.integers(0, V, n)
    # repeated (row, target) pairs and forks: positions that share a row, same or other target
    dup = rng.integers(0, n, forks)
    rows[dup[: forks // 2]], targets[dup[: forks // 2]] = rows[0], targets[0]
    rows[dup[forks // 2 :]] = rows[0]
    plan = logprob_index(rows, targets, P, V, 4096)
    uniq, inv = np.unique(rows, return_inverse=True)
    pairs, pair_inv = np.unique(inv * V + targets, return_inverse=True)
    assert np.array_equal(plan.uniq, uniq) and np.array_equal(plan.inv, inv)
    assert np.array_equal(plan.order, np.argsort(inv, kind="stable"))
    assert np.array_equal(plan.pair_inv, pair_inv) and plan.num_pairs == pairs.size
    assert np.array_equal(plan.pair_row, pairs // V) and np.array_equal(plan.pair_target, pairs % V)
    for top in (2, 1 << 16, (1 << 16) + 1, 1 << 33):
        keys = rng.integers(0, top, 1000)
        assert np.array_equal(_stable_argsort(keys, top), np.argsort(keys, kind="stable"))
