"""``grouped_topk``: the one-kernel group-limited top-k expert choice equals the torch reference
(DeepSeek-V3 routing) on every shape it takes, picks the lowest index among ties, and falls back
to the reference where it does not apply. On CUDA as a compiled Triton kernel; on a CPU machine
with Triton through Triton's interpreter, in a fresh process (Triton reads ``TRITON_INTERPRET``
when first imported)."""

from __future__ import annotations

import os

import pytest
import torch

from harts.ops.router_topk import grouped_topk, grouped_topk_reference, kernel_applies
from tests.ops._triton import check_here_or_interpreted

CASES = [  # (T, E, n_group, topk_group, k)
    (37, 128, 8, 4, 8),  # Ling / DeepSeek-V3 shape, rows not a multiple of the block
    (64, 16, 4, 2, 3),
    (5, 8, 1, 1, 2),  # no grouping
    (1, 32, 4, 4, 16),  # every group kept, k = half the experts
    (0, 128, 8, 4, 8),
]


def check_kernel() -> None:
    import warnings

    from harts.ops.router_topk import _launch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    for t, e, n_group, topk_group, k in CASES:
        scores = torch.rand(t, e, generator=g).to(dev)
        bias = (torch.randn(e, generator=g) * 0.05).to(dev)
        assert kernel_applies(scores, n_group, topk_group, k), (t, e, n_group, topk_group, k)
        want = grouped_topk_reference(scores, bias, n_group, topk_group, k)
        got = _launch(scores, bias, n_group, topk_group, k)
        assert got.dtype == torch.int64 and got.shape == (t, k)
        assert torch.equal(got, want), (t, e, n_group, topk_group, k)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the first call's check passes: no warning
            assert torch.equal(grouped_topk(scores, bias, n_group, topk_group, k), want)
            assert torch.equal(grouped_topk(scores, bias, n_group, topk_group, k), want)
    # ties: the lowest index wins, groups and experts alike
    flat = torch.full((3, 16), 0.5, device=dev)
    assert _launch(flat, torch.zeros(16, device=dev), 4, 2, 5).tolist() == [[0, 1, 2, 3, 4]] * 3
    # equal top-2 values in a group count twice in its score (as topk(2) takes them)
    s = torch.zeros(1, 8, device=dev)
    s[0, 0] = s[0, 1] = 0.4  # group 0: 0.8
    s[0, 4] = 0.7  # group 1: 0.7
    assert _launch(s, torch.zeros(8, device=dev), 2, 1, 2).tolist() == [[0, 1]]


def test_kernel_equals_the_reference() -> None:
    check_here_or_interpreted(check_kernel, "from tests.ops.test_router_topk import check_kernel; check_kernel()")


def test_falls_back_where_the_kernel_does_not_apply() -> None:
    scores = torch.rand(9, 12, dtype=torch.float64)
    bias = torch.zeros(12, dtype=torch.float64)
    # float64, or 12 experts (not a power of two), or on a CPU without the interpreter
    assert not kernel_applies(scores, 3, 2, 4)
    assert not kernel_applies(scores.float(), 3, 2, 4)
    assert not kernel_applies(torch.rand(4, 16, dtype=torch.float64), 4, 2, 2)
    assert not kernel_applies(torch.rand(4, 16), 16, 2, 2)  # groups of one expert
    assert not kernel_applies(torch.rand(4, 16), 4, 2, 9)  # more experts than the kept groups hold
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        assert not kernel_applies(torch.rand(4, 16), 4, 2, 2)
    assert torch.equal(grouped_topk(scores, bias, 3, 2, 4), grouped_topk_reference(scores, bias, 3, 2, 4))


def test_a_failing_kernel_warns_once_and_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import harts.ops.router_topk as rt

    def broken(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("no such op")

    monkeypatch.setattr(rt, "kernel_applies", lambda *a: True)
    monkeypatch.setattr(rt, "_launch", broken)
    monkeypatch.setattr(rt, "_checked", {})
    scores, bias = torch.rand(6, 16), torch.zeros(16)
    want = grouped_topk_reference(scores, bias, 4, 2, 3)
    with pytest.warns(UserWarning, match=r"kernel is off for .*it failed \(RuntimeError: no such op\)"):
        assert torch.equal(rt.grouped_topk(scores, bias, 4, 2, 3), want)
    assert torch.equal(rt.grouped_topk(scores, bias, 4, 2, 3), want)  # no second warning, no launch

    monkeypatch.setattr(rt, "_launch", lambda s, b, g, kg, k: want.flip(1))  # other values, best last
    monkeypatch.setattr(rt, "_checked", {})
    with pytest.warns(UserWarning, match="differed from the torch reference"):
        assert torch.equal(rt.grouped_topk(scores, bias, 4, 2, 3), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_equals_the_reference_on_cuda() -> None:
    pytest.importorskip("triton")
    check_kernel()
    # a paper-sized microbatch: 65,536 rows of Ling's 128 experts in 8 groups
    g = torch.Generator(device="cuda").manual_seed(1)
    scores = torch.rand(65_536, 128, device="cuda", generator=g)
    bias = torch.randn(128, device="cuda", generator=g) * 0.05
    got, want = grouped_topk(scores, bias, 8, 4, 8), grouped_topk_reference(scores, bias, 8, 4, 8)
    # the values chosen, best first (8.4 M random floats may hold a tie, ordered either way)
    choice = scores + bias
    assert torch.equal(choice.gather(1, got), choice.gather(1, want))
    assert (got != want).any(dim=1).float().mean() < 1e-3


def test_the_check_accepts_another_order_of_ties() -> None:
    from harts.ops.router_topk import _same_choice

    scores = torch.tensor([[0.5, 0.5, 0.1, 0.9]])
    bias = torch.zeros(4)
    assert _same_choice(scores, bias, torch.tensor([[3, 0, 1]]), torch.tensor([[3, 1, 0]]))
    assert not _same_choice(scores, bias, torch.tensor([[3, 0, 2]]), torch.tensor([[3, 1, 0]]))
    assert not _same_choice(scores, bias, torch.tensor([[3, 0]]), torch.tensor([[3, 1, 0]]))
