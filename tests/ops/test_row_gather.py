"""One gather for every round's rows: the same values and gradients as separate gathers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harts.ops.row_gather import gather_rows, row_gather_plan

F64 = torch.float64


@given(st.integers(1, 30), st.lists(st.lists(st.integers(0, 29), max_size=12), min_size=1, max_size=5), st.data())
def test_pieces_and_gradients_equal_separate_gathers(p: int, pieces: list[list[int]], data: st.DataObject) -> None:
    pieces = [[i % p for i in piece] for piece in pieces]  # duplicates within and across pieces, unread rows
    used = data.draw(st.lists(st.booleans(), min_size=len(pieces), max_size=len(pieces)))  # unused pieces: no grad
    g = torch.Generator().manual_seed(len(pieces))
    x = torch.randn(p, 3, 2, dtype=F64, generator=g, requires_grad=True)
    weights = [torch.randn(len(piece), 3, 2, dtype=F64, generator=g) for piece in pieces]

    ref_pieces = [x[torch.tensor(piece, dtype=torch.int64)] for piece in pieces]
    (ref,) = torch.autograd.grad(sum((w * r).sum() for w, r, u in zip(weights, ref_pieces, used) if u) + 0 * x.sum(), x)
    plan = row_gather_plan(np.concatenate([np.array(pc, dtype=np.int64) for pc in pieces]), p, torch.device("cpu"))
    got_pieces = torch.split(gather_rows(x, plan), [len(pc) for pc in pieces])
    for a, b in zip(got_pieces, ref_pieces):
        assert torch.equal(a, b)
    (got,) = torch.autograd.grad(sum((w * r).sum() for w, r, u in zip(weights, got_pieces, used) if u) + 0 * x.sum(), x)
    torch.testing.assert_close(got, ref, rtol=1e-14, atol=1e-14)


def test_gradcheck_with_repeats_and_unread_rows() -> None:
    plan = row_gather_plan(np.array([3, 0, 3, 3, 1]), 5, torch.device("cpu"))  # rows 2, 4 unread
    x = torch.randn(5, 2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: gather_rows(t, plan), (x,))


def test_no_slot_and_bad_input_are_named() -> None:
    plan = row_gather_plan(np.zeros(0, dtype=np.int64), 4, torch.device("cpu"))
    x = torch.randn(4, 2, dtype=F64, requires_grad=True)
    y = gather_rows(x, plan)
    assert y.shape == (0, 2)
    (y.sum() + 0 * x.sum()).backward()
    assert torch.equal(x.grad, torch.zeros(4, 2, dtype=F64))
    with pytest.raises(ValueError, match="slot 1 reads row 4, outside"):
        row_gather_plan(np.array([0, 4]), 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="gathers from 4 rows; x has 3"):
        gather_rows(torch.zeros(3, 2), plan)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_gradients_match_separate_gathers_and_repeat_bit_for_bit(dtype: torch.dtype) -> None:
    """On CUDA the replay slots go through index_put's sorted accumulate: the same gradient as
    separate gathers (to rounding), and the same bits on every run (no atomics)."""
    g = torch.Generator().manual_seed(0)
    p, pieces = 5000, 4
    index = [torch.randint(0, p, (3000,), generator=g) for _ in range(pieces)]  # many repeats
    x = torch.randn(p, 4, 32, generator=g).to("cuda", dtype).requires_grad_()
    w = [torch.randn(3000, 4, 32, generator=g).to("cuda", dtype) for _ in range(pieces)]
    plan = row_gather_plan(torch.cat(index).numpy(), p, x.device)

    def grad_of(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        (d,) = torch.autograd.grad(sum((wi.float() * pi.float()).sum() for wi, pi in zip(w, parts)), x)
        return d

    got = [grad_of(torch.split(gather_rows(x, plan), [3000] * pieces)) for _ in range(2)]
    ref = grad_of(tuple(x[i.cuda()] for i in index))
    assert torch.equal(got[0], got[1])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[0].float(), ref.float(), rtol=tol, atol=tol)
