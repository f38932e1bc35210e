"""CPU memory linear in the work: bottom-right causal attention (``attend_causal``) without an
[L, M] mask or score matrix, and the LM head's CPU chunks recut to ``CPU_CHUNK_BYTES``; values
and every gradient against the dense references."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import harts.ops.logprob.mapped as mapped
from harts.ops.attention import ancestor_view_attention, varlen_causal_attention
from harts.ops.attention.core import attend_causal
from harts.ops.logprob import mapped_logprobs, naive_mapped_logprobs

F64 = torch.float64


class _Shapes(TorchDispatchMode):
    """Every tensor shape an operator returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _reference(q, k, v, scale):  # noqa: ANN001, ANN202
    """Dense bottom-right causal softmax attention (the visibility matrix made explicitly)."""
    L, M, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    visible = torch.ones(L, M, dtype=torch.bool).tril(M - L)
    return torch.einsum("hij,jhe->ihe", s.masked_fill(~visible, float("-inf")).softmax(-1), vv)


@pytest.mark.parametrize(
    "L,M,H,G,D,E",
    [
        pytest.param(63, 63, 4, 2, 8, 8, id="L63-M63-H4-G2"),
        pytest.param(65, 200, 4, 4, 8, 8, id="L65-M200-H4"),
        pytest.param(17, 500, 2, 1, 12, 6, id="L17-M500-D12-E6"),
        pytest.param(30, 64, 3, 3, 6, 10, id="L30-M64-D6-E10"),
        pytest.param(1, 1, 2, 2, 8, 8, id="L1-M1"),
    ],
)
def test_attend_causal_matches_the_dense_reference(L, M, H, G, D, E) -> None:  # noqa: ANN001
    torch.manual_seed(L + M)
    x = [torch.randn(n, h, d, dtype=F64, requires_grad=True) for n, h, d in ((L, H, D), (M, G, D), (M, G, E))]
    w = torch.randn(L, H, E, dtype=F64)
    out, ref = attend_causal(*x, 0.3), _reference(*x, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(torch.autograd.grad((out * w).sum(), x), torch.autograd.grad((ref * w).sum(), x)):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-11)


def test_attend_causal_in_bfloat16_is_as_close_as_the_dense_bfloat16_reference() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(40, 4, 16), torch.randn(300, 2, 16), torch.randn(300, 2, 16)
    exact = _reference(q.double(), k.double(), v.double(), 0.25)
    low = [t.bfloat16() for t in (q, k, v)]
    err = (attend_causal(*low, 0.25).double() - exact).abs().max()
    err_ref = (_reference(*low, 0.25).double() - exact).abs().max()
    assert err <= 2 * err_ref + 1e-3


def test_no_square_tensor_on_the_cpu() -> None:
    """A long ancestor view and long sequences: no tensor has two dims of the rows' size."""
    P, H, D, E = 640, 2, 12, 8
    q = torch.randn(P, H, D, requires_grad=True)
    k, v = torch.randn(P, H, D, requires_grad=True), torch.randn(P, H, E, requires_grad=True)
    trunk = torch.arange(512)
    q_rows = torch.arange(P)
    kv_rows = torch.cat([trunk, trunk, torch.arange(512, P)])
    rec = _Shapes()
    with rec:
        o = ancestor_view_attention(
            q,
            k,
            v,
            q_rows=q_rows,
            cu_q=torch.tensor([0, 512, P]),
            kv_rows=kv_rows,
            cu_kv=torch.tensor([0, 512, 512 + P]),
            scale=0.3,
        )
        o2 = varlen_causal_attention(q, k, v, cu_seqlens=torch.tensor([0, 300, P]), scale=0.3)
        (o.sum() + o2.sum()).backward()
    square = [s for s in rec.shapes if sum(d >= 128 for d in s) >= 2]
    assert not square, square[:5]


@pytest.mark.parametrize("chunk_bytes", [8 * 4 * 11, 1])
def test_cpu_head_recut_chunks_match_the_reference(monkeypatch: pytest.MonkeyPatch, chunk_bytes: int) -> None:
    """CPU chunks of 8 rows (and of 1) instead of ``row_chunk``'s 64: same values, every gradient."""
    monkeypatch.setattr(mapped, "CPU_CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    P, D, V, n = 50, 6, 11, 90
    hidden = torch.randn(P, D, dtype=F64, requires_grad=True)
    weight = torch.randn(V, D, dtype=F64, requires_grad=True)
    rows, targets = torch.randint(0, P, (n,)), torch.randint(0, V, (n,))
    w = torch.randn(n, dtype=F64)
    got = mapped_logprobs(hidden, weight, rows, targets, row_chunk=64)
    want = naive_mapped_logprobs(hidden, weight, rows, targets)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad((got * w).sum(), (hidden, weight))
    g_ref = torch.autograd.grad((want * w).sum(), (hidden, weight))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_cpu_head_holds_at_most_one_recut_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapped, "CPU_CHUNK_BYTES", 16 * 97 * 4)
    assert mapped.chunk_rows(97, 4, mapped.head_budget("cpu")) == 16
    hidden = torch.randn(300, 8, requires_grad=True)
    weight = torch.randn(97, 8, requires_grad=True)
    rows, targets = torch.arange(300), torch.randint(0, 97, (300,))
    rec = _Shapes()
    with rec:
        mapped_logprobs(hidden, weight, rows, targets).sum().backward()
    assert max(s[0] for s in rec.shapes if len(s) == 2 and s[1] == 97) == 16


def test_cpu_row_chunk_bounds_and_index_recut() -> None:
    budget = mapped.head_budget("cpu")
    assert budget == mapped.CPU_CHUNK_BYTES
    assert mapped.chunk_rows(157_184, 4, budget) == mapped.CPU_CHUNK_BYTES // (157_184 * 4)
    assert mapped.chunk_rows(64, 4, budget) == mapped.ROW_CHUNK  # never above row_chunk
    assert mapped.chunk_rows(10**12, 4, budget) == 1
    import numpy as np

    rows, targets = np.array([3, 1, 3, 0, 2, 2, 4]), np.array([1, 0, 2, 1, 1, 1, 0])
    index = mapped.logprob_index(rows, targets, 5, 3, row_chunk=4)
    recut, direct = index.with_row_chunk(2), mapped.logprob_index(rows, targets, 5, 3, row_chunk=2)
    assert (recut.bounds, recut.pos_bounds, recut.pair_bounds) == (
        direct.bounds,
        direct.pos_bounds,
        direct.pair_bounds,
    )
    assert index.with_row_chunk(4) is index
    with pytest.raises(ValueError, match="row_chunk must be positive"):
        index.with_row_chunk(0)
