"""``weighted_swiglu_backward``: the one-pass kernel (the SwiGLU again and both input gradients)
against float64 truth and the autograd reference, for row counts off the block, widths that are
not powers of two or span several column blocks, and float32 / bfloat16 weights; off the
kernel, autograd's gradients exactly; a failing kernel warns once. On CUDA as a compiled Triton
kernel; on a CPU machine with Triton through Triton's interpreter, in a fresh process."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from harts.ops import moe_swiglu
from harts.ops.moe_swiglu import (
    kernel_applies,
    weighted_swiglu,
    weighted_swiglu_backward,
    weighted_swiglu_backward_reference,
)
from tests.ops._triton import check_here_or_interpreted

CASES = [(37, 16), (5, 24), (130, 48), (3, 1100), (0, 16)]  # (P pairs, I)


def _inputs(p: int, i: int, dtype: torch.dtype, w_dtype: torch.dtype, dev: str, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(p, 2 * i, generator=g) * 3).to(dev, dtype)
    w = torch.rand(p, generator=g).to(dev, w_dtype)
    d_act = torch.randn(p, i, generator=g).to(dev, dtype)
    return gate_up, w, d_act


def _truth(gate_up: torch.Tensor, w: torch.Tensor, d_act: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return weighted_swiglu_backward_reference(*(x.cpu().double() for x in (gate_up, w, d_act)))


def _within(got: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, name: str) -> None:
    """The kernel's output no farther from float64 truth than the autograd reference's, plus a
    rounding step of the largest entry (both round once to the output dtype, in other orders)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype and got.is_contiguous(), name
    if not truth.numel():
        return
    e_got, e_ref = (float((x.cpu().double() - truth).abs().max()) for x in (got, ref))
    step = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[got.dtype]
    bound = e_ref + step * float(truth.abs().max())
    assert e_got <= bound, f"{name} {got.dtype}: kernel {e_got:.3g} from float64, reference {e_ref:.3g}"


def check_kernel() -> None:
    warnings.filterwarnings("error", message=".*weighted-SwiGLU backward kernel is off")  # a fallback: fail
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype, w_dtype in itertools.product((torch.float32, torch.bfloat16), (torch.float32, torch.bfloat16)):
        for p, i in CASES:
            gate_up, w, d_act = _inputs(p, i, dtype, w_dtype, dev)
            assert kernel_applies(gate_up, w, d_act)
            truth = _truth(gate_up, w, d_act)
            ref = weighted_swiglu_backward_reference(gate_up, w, d_act)
            got = moe_swiglu._kernel(gate_up, w, d_act)
            for name, a, b, t in zip(("act", "d_gate_up", "d_w"), got, ref, truth, strict=True):
                _within(a, b, t, name)
            # the forward's activation as it ran, up to a rounding step (sigmoid in another form)
            fwd = weighted_swiglu(gate_up, w)
            torch.testing.assert_close(got[0], fwd, **({} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}))
            # the public entry: its first-call check passes (no warning) and it returns the kernel's
            # (a call without pairs checks nothing: the next one does)
            moe_swiglu._checked.clear()
            for _ in range(2):
                out = weighted_swiglu_backward(gate_up, w, d_act)
                for a, b in zip(out, got, strict=True):
                    assert torch.equal(a, b)
            assert list(moe_swiglu._checked.values()) == ([True] if p else [])


def test_kernel_within_float64_truth() -> None:
    check_here_or_interpreted(check_kernel, "from tests.ops.test_moe_swiglu import check_kernel; check_kernel()")


def test_off_the_kernel_autograd_gradients_exactly() -> None:
    """On CPU without the interpreter, and in float64: the reference, which is autograd through
    ``weighted_swiglu`` (gradcheck in float64)."""
    gate_up, w, d_act = _inputs(9, 6, torch.float64, torch.float64, "cpu")
    assert not kernel_applies(gate_up, w, d_act)
    act, d_gu, d_w = weighted_swiglu_backward(gate_up, w, d_act)
    gu, wr = gate_up.clone().requires_grad_(), w.clone().requires_grad_()
    out = weighted_swiglu(gu, wr)
    want = torch.autograd.grad(out, (gu, wr), d_act)
    assert torch.equal(act, out.detach()) and torch.equal(d_gu, want[0]) and torch.equal(d_w, want[1])
    assert torch.autograd.gradcheck(weighted_swiglu, (gu, wr))
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(act, torch.nn.functional.silu(gate) * up * w[:, None], rtol=0, atol=0)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"got \[4, 7\], \[4\], \[4, 3\]"):
        weighted_swiglu_backward(torch.randn(4, 7), torch.randn(4), torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"got \[4, 8\], \[5\], \[4, 4\]"):
        weighted_swiglu_backward(torch.randn(4, 8), torch.randn(5), torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"got \[4, 8\], \[4\], \[4, 8\]"):
        weighted_swiglu_backward(torch.randn(4, 8), torch.randn(4), torch.randn(4, 8))


def test_a_failing_kernel_warns_once_and_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken(*a):  # noqa: ANN002, ANN202
        calls.append(1)
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(moe_swiglu, "kernel_applies", lambda *a: True)
    monkeypatch.setattr(moe_swiglu, "_kernel", broken)
    monkeypatch.setattr(moe_swiglu, "_checked", {})
    gate_up, w, d_act = _inputs(6, 4, torch.float32, torch.float32, "cpu")
    want = weighted_swiglu_backward_reference(gate_up, w, d_act)
    with pytest.warns(UserWarning, match="weighted-SwiGLU backward kernel is off.*RuntimeError: no GPU here"):
        got = weighted_swiglu_backward(gate_up, w, d_act)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = weighted_swiglu_backward(gate_up, w, d_act)
    assert calls == [1]
    for a, b, c in zip(got, again, want, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_a_differing_kernel_is_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call checks the kernel on its first CHECK_ROWS pairs; a kernel off by 1 % in
    d_gate_up there is switched off, and the whole call gets the reference."""
    gate_up, w, d_act = _inputs(6, 4, torch.float32, torch.float32, "cpu")
    want = weighted_swiglu_backward_reference(gate_up, w, d_act)
    seen = []

    def wrong(gu, wp, da):  # noqa: ANN001, ANN202
        seen.append(gu.shape[0])
        act, d_gu, d_w = weighted_swiglu_backward_reference(gu, wp, da)
        return act, d_gu * 1.01, d_w

    monkeypatch.setattr(moe_swiglu, "CHECK_ROWS", 4)
    monkeypatch.setattr(moe_swiglu, "kernel_applies", lambda *a: True)
    monkeypatch.setattr(moe_swiglu, "_kernel", wrong)
    monkeypatch.setattr(moe_swiglu, "_checked", {})
    with pytest.warns(UserWarning, match="differed from the autograd reference"):
        got = weighted_swiglu_backward(gate_up, w, d_act)
    assert seen == [4]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda_at_ling3_tiny_width() -> None:
    """ling3_tiny's experts (I = 512), 8 pairs of 4,099 rows, bf16 with float32 combine weights."""
    gate_up, w, d_act = _inputs(8 * 4099, 512, torch.bfloat16, torch.float32, "cuda")
    truth = _truth(gate_up, w, d_act)
    ref = weighted_swiglu_backward_reference(gate_up, w, d_act)
    got = moe_swiglu._kernel(gate_up, w, d_act)
    for name, a, b, t in zip(("act", "d_gate_up", "d_w"), got, ref, truth, strict=True):
        _within(a, b, t, name)
