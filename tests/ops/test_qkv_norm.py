"""``split_l2norm_qkv``: the one-kernel split + q / k l2 norms equals the torch reference forward and
backward (every gradient, also when only some outputs are used), on KDA-like (as many v heads as
q / k heads) and GDN-like shapes (more v heads, another head dim), with row counts off the block;
it falls back where the kernel does not apply, and a failing kernel warns once. On CUDA as a
compiled Triton kernel; on a CPU machine with Triton through Triton's interpreter, in a fresh
process (Triton reads ``TRITON_INTERPRET`` when first imported)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from harts.ops.qkv_norm import ACTIVATIONS, kernel_applies, split_l2norm_qkv, split_l2norm_qkv_reference
from tests.ops._triton import check_here_or_interpreted

CASES = [  # (T, HK, K, HV, V)
    (37, 2, 16, 2, 16),  # KDA-like, rows not a multiple of the block
    (70, 2, 32, 4, 16),  # GDN-like: more v heads, another head dim
    (1, 1, 16, 1, 32),
    (0, 2, 16, 2, 16),
]


def _grads(fn, mixed: torch.Tensor, w: tuple[torch.Tensor, ...], used: tuple[bool, bool, bool]):  # noqa: ANN202
    x = mixed.detach().clone().requires_grad_(True)
    outs = fn(x)
    loss = sum((o.float() * wi).sum() for o, wi, u in zip(outs, w, used, strict=True) if u)
    loss.backward()
    return outs, x.grad


def _assert_grad_close(g_ker: torch.Tensor, g_ref: torch.Tensor, tol: float, truth: torch.Tensor | None = None) -> None:
    """The kernel's input gradient against the reference's: within ``tol`` in float32. In
    bfloat16, where the two round partial sums at other points (a replayed row's slots are
    added in float32 by the kernel, in bfloat16 by autograd's accumulation) and so differ by an
    ulp of a large entry at a few elements, both are held to the float32 ``truth`` instead: the
    kernel's largest error at most twice the reference's (an ulp of the largest entry either way)."""
    if truth is None or g_ker.dtype != torch.bfloat16:
        torch.testing.assert_close(g_ker, g_ref, rtol=tol, atol=tol)
        return
    e_ker, e_ref = (float((g.float() - truth).abs().max()) for g in (g_ker, g_ref))
    bound = 2 * e_ref + 2.0**-8 * float(truth.abs().max())
    assert e_ker <= bound, f"bfloat16 gradient: kernel {e_ker:.3g} from float32, reference {e_ref:.3g}"


def check_kernel() -> None:
    import warnings

    from harts.ops.qkv_norm import _forward

    warnings.filterwarnings("error", message=".*split-l2norm kernel is off")  # a fallback: fail
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    for (dtype, tol), act in itertools.product(((torch.float32, 2e-6), (torch.bfloat16, 1e-2)), ACTIVATIONS):
        for t, hk, dk, hv, dv in CASES:
            c = 2 * hk * dk + hv * dv
            mixed = (torch.randn(t, c, generator=g) * 3).to(dev, dtype)
            if t:
                mixed[0, :dk] = 0  # a zero q head: eps keeps it finite
            assert kernel_applies(mixed, hk, dk, hv, dv), (t, hk, dk, hv, dv)
            want = split_l2norm_qkv_reference(mixed, hk, dk, hv, dv, activation=act)
            got = _forward(mixed, hk, dk, hv, dv, 1e-6, activation=act)
            for a, b in zip(got, want, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)
            if act is None:
                assert torch.equal(got[2], want[2])
            w = tuple(torch.randn(o.shape, generator=g).to(dev) for o in want)
            for used in ((True, True, True), (True, False, True), (False, True, False)):
                a = (hk, dk, hv, dv)
                o_ref, g_ref = _grads(
                    lambda x, a=a, act=act: split_l2norm_qkv_reference(x, *a, activation=act), mixed, w, used
                )
                o_ker, g_ker = _grads(lambda x, a=a, act=act: split_l2norm_qkv(x, *a, activation=act), mixed, w, used)
                assert g_ker is not None and g_ref is not None
                torch.testing.assert_close(g_ker, g_ref, rtol=tol, atol=tol)
                if not used[2]:  # the unused v part gets a zero gradient
                    assert torch.count_nonzero(g_ker[:, 2 * hk * dk :]) == 0
    # the first call of a shape inside activation checkpointing: its check saves nothing, so the
    # recomputation saves what the forward saved
    from torch.utils.checkpoint import checkpoint

    import harts.ops.qkv_norm as qn

    qn._checked.clear()
    mixed = torch.randn(33, 2 * 2 * 16 + 2 * 16, generator=g).to(dev).requires_grad_(True)
    out = checkpoint(lambda x: sum(o.sum() for o in split_l2norm_qkv(x, 2, 16, 2, 16)), mixed, use_reentrant=False)
    out.backward()
    assert mixed.grad is not None and qn._checked
    # float64 and head dims that are not powers of two: the reference
    m64 = torch.randn(5, 2 * 2 * 16 + 2 * 16, dtype=torch.float64, device=dev)
    assert not kernel_applies(m64, 2, 16, 2, 16)
    assert not kernel_applies(torch.randn(5, 2 * 2 * 24 + 2 * 24, device=dev), 2, 24, 2, 24)


def test_kernel_equals_the_reference() -> None:
    check_here_or_interpreted(check_kernel, "from tests.ops.test_qkv_norm import check_kernel; check_kernel()")


def check_gathered_kernel() -> None:
    """With a row gather (compact execution's linear-attention rows): outputs equal the reference
    split followed by ``gather_rows``, and the gradient of every source row sums its slots'
    (rows read twice, rows read by no slot, slots out of row order), also with outputs unused."""
    import warnings

    import numpy as np

    from harts.ops.row_gather import row_gather_plan

    warnings.filterwarnings("error", message=".*split-l2norm kernel is off")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(1)
    for (dtype, tol), act in itertools.product(((torch.float32, 2e-6), (torch.bfloat16, 1e-2)), ACTIVATIONS):
        for t, hk, dk, hv, dv in CASES[:3]:
            rng = np.random.default_rng(t)
            # every row but the last once, a few rows again (replay), out of order
            index = np.concatenate([np.arange(max(t - 1, 1)), rng.integers(0, max(t - 1, 1), size=min(t, 7))])
            rng.shuffle(index)
            rows = row_gather_plan(index, t, dev)
            mixed = (torch.randn(t, 2 * hk * dk + hv * dv, generator=g) * 3).to(dev, dtype)
            want = split_l2norm_qkv_reference(mixed, hk, dk, hv, dv, rows=rows, activation=act)
            got = split_l2norm_qkv(mixed, hk, dk, hv, dv, rows=rows, activation=act)
            for a, b in zip(got, want, strict=True):
                assert a.shape == b.shape == (index.size, *b.shape[1:]) and a.is_contiguous()
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)
            w = tuple(torch.randn(o.shape, generator=g).to(dev) for o in want)
            for used in ((True, True, True), (False, True, True), (True, False, False)):
                a = (hk, dk, hv, dv)
                _, g_ref = _grads(
                    lambda x, a=a, act=act: split_l2norm_qkv_reference(x, *a, rows=rows, activation=act), mixed, w, used
                )
                _, g_ker = _grads(
                    lambda x, a=a, act=act: split_l2norm_qkv(x, *a, rows=rows, activation=act), mixed, w, used
                )
                assert g_ker is not None and g_ref is not None
                torch.testing.assert_close(g_ker, g_ref, rtol=tol, atol=tol)
                if t > 1:
                    assert torch.count_nonzero(g_ker[t - 1]) == 0  # read by no slot


def test_gathered_kernel_equals_the_reference_then_gather() -> None:
    check_here_or_interpreted(
        check_gathered_kernel, "from tests.ops.test_qkv_norm import check_gathered_kernel; check_gathered_kernel()"
    )


def test_rows_of_another_size_are_named() -> None:
    import numpy as np

    from harts.ops.row_gather import row_gather_plan

    rows = row_gather_plan(np.arange(4), 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="rows gather from 4 rows; mixed has 9"):
        split_l2norm_qkv(torch.randn(9, 56), 3, 8, 2, 4, rows=rows)


def test_reference_on_cpu_and_float64_gradients() -> None:
    """Off CUDA (without the interpreter) the reference runs: v a view, q / k unit rows."""
    mixed = torch.randn(9, 2 * 3 * 8 + 2 * 4, dtype=torch.float64, requires_grad=True)
    q, k, v = split_l2norm_qkv(mixed, 3, 8, 2, 4)
    assert q.shape == (9, 3, 8) and k.shape == (9, 3, 8) and v.shape == (9, 2, 4)
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(9, 3, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    assert torch.equal(v.reshape(9, 8), mixed[:, 48:])
    assert torch.autograd.gradcheck(lambda x: split_l2norm_qkv(x, 3, 8, 2, 4), (mixed,))


def test_silu_then_split_in_float64() -> None:
    """With ``activation="silu"``: the split of the SiLU, bit for bit (float64, the reference), and
    its gradient (gradcheck), gathered too."""
    import numpy as np

    from harts.ops.row_gather import row_gather_plan

    mixed = torch.randn(9, 2 * 3 * 8 + 2 * 4, dtype=torch.float64, requires_grad=True)
    got = split_l2norm_qkv(mixed, 3, 8, 2, 4, activation="silu")
    want = split_l2norm_qkv(torch.nn.functional.silu(mixed), 3, 8, 2, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.autograd.gradcheck(lambda x: split_l2norm_qkv(x, 3, 8, 2, 4, activation="silu"), (mixed,))
    rows = row_gather_plan(np.array([3, 0, 3, 8]), 9, torch.device("cpu"))
    assert torch.autograd.gradcheck(lambda x: split_l2norm_qkv(x, 3, 8, 2, 4, rows=rows, activation="silu"), (mixed,))


def test_extra_slot_gradient_with_silu_equals_autograd() -> None:
    """The replayed slots' gradient, taken in torch (``_l2norm_split_grad``), through the SiLU:
    equal to autograd of the reference (float64) up to its float32."""
    from harts.ops.qkv_norm import _l2norm_split_grad

    g = torch.Generator().manual_seed(3)
    hk, dk, hv, dv = 2, 8, 3, 4
    x = torch.randn(5, 2 * hk * dk + hv * dv, dtype=torch.float64, generator=g, requires_grad=True)
    dy = (
        torch.randn(5, hk, dk, dtype=torch.float64, generator=g),
        torch.randn(5, hk, dk, dtype=torch.float64, generator=g),
        torch.randn(5, hv, dv, dtype=torch.float64, generator=g),
    )
    for act in ACTIVATIONS:
        outs = split_l2norm_qkv_reference(x, hk, dk, hv, dv, activation=act)
        (want,) = torch.autograd.grad(sum((o * d).sum() for o, d in zip(outs, dy, strict=True)), x)
        got = _l2norm_split_grad(x.detach(), *dy, hk, dk, 1e-6, act)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # it takes dy in float32


def test_bad_activation_is_named() -> None:
    with pytest.raises(ValueError, match="activation must be None or 'silu', got 'gelu'"):
        split_l2norm_qkv(torch.randn(9, 56), 3, 8, 2, 4, activation="gelu")


def test_bad_width_names_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"mixed must be \[T, 2\*3\*8 \+ 2\*4\] = \[T, 56\], got \[9, 55\]"):
        split_l2norm_qkv(torch.randn(9, 55), 3, 8, 2, 4)


def test_a_failing_kernel_warns_once_and_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import harts.ops.qkv_norm as qn

    def broken(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("no such op")

    monkeypatch.setattr(qn, "kernel_applies", lambda *a: True)
    monkeypatch.setattr(qn, "_forward", broken)
    monkeypatch.setattr(qn, "_checked", {})
    mixed = torch.randn(6, 2 * 2 * 8 + 2 * 8)
    want = split_l2norm_qkv_reference(mixed, 2, 8, 2, 8)
    with pytest.warns(UserWarning, match=r"split-l2norm kernel is off for .*it failed \(RuntimeError: no such op\)"):
        got = qn.split_l2norm_qkv(mixed, 2, 8, 2, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    got = qn.split_l2norm_qkv(mixed, 2, 8, 2, 8)  # no second warning, no launch
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    monkeypatch.setattr(qn, "_forward", lambda m, *a: tuple(o * 2 for o in want))  # other values
    monkeypatch.setattr(qn, "_checked", {})
    with pytest.warns(UserWarning, match="differed from the torch reference"):
        qn.split_l2norm_qkv(mixed, 2, 8, 2, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", ACTIVATIONS, ids=str)
def test_kernel_on_cuda_at_ling3_tiny_heads(act: str | None) -> None:
    """KDA's heads in ling3_tiny (16 heads of 128), rows off the block: forward and every gradient,
    from the kernel (a fallback to the reference warns, and fails here)."""
    import warnings

    warnings.filterwarnings("error", message=".*split-l2norm kernel is off")
    g = torch.Generator().manual_seed(1)
    t, h, d = 4097, 16, 128
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
        mixed = torch.randn(t, 3 * h * d, generator=g).to("cuda", dtype)
        w = tuple(torch.randn(t, h, d, generator=g).cuda() for _ in range(3))
        used = (True, True, True)
        o_ref, g_ref = _grads(lambda x: split_l2norm_qkv_reference(x, h, d, h, d, activation=act), mixed, w, used)
        o_ker, g_ker = _grads(lambda x: split_l2norm_qkv(x, h, d, h, d, activation=act), mixed, w, used)
        _, truth = _grads(lambda x: split_l2norm_qkv_reference(x, h, d, h, d, activation=act), mixed.float(), w, used)
        for a, b in zip(o_ker, o_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        _assert_grad_close(g_ker, g_ref, tol, truth)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", ACTIVATIONS, ids=str)
def test_gathered_kernel_on_cuda(act: str | None) -> None:
    """The row-gathering variant compiled on CUDA: the small cases of the interpreted test, and
    ling3_tiny's heads over a compact-like gather (every row once in order, 300 replayed again
    further on, the last 5 rows unread), forward and every gradient."""
    import numpy as np

    from harts.ops.row_gather import row_gather_plan

    if act is None:
        check_gathered_kernel()  # (both activations)
    g = torch.Generator().manual_seed(2)
    t, h, d = 4097, 16, 128
    rng = np.random.default_rng(0)
    index = np.concatenate([np.arange(2000), rng.integers(0, t - 5, size=300), np.arange(2000, t - 5)])
    rows = row_gather_plan(index, t, torch.device("cuda"))
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
        mixed = torch.randn(t, 3 * h * d, generator=g).to("cuda", dtype)
        w = tuple(torch.randn(index.size, h, d, generator=g).cuda() for _ in range(3))
        used = (True, True, True)
        o_ref, g_ref = _grads(
            lambda x: split_l2norm_qkv_reference(x, h, d, h, d, rows=rows, activation=act), mixed, w, used
        )
        o_ker, g_ker = _grads(lambda x: split_l2norm_qkv(x, h, d, h, d, rows=rows, activation=act), mixed, w, used)
        _, truth = _grads(
            lambda x: split_l2norm_qkv_reference(x, h, d, h, d, rows=rows, activation=act), mixed.float(), w, used
        )
        for a, b in zip(o_ker, o_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        _assert_grad_close(g_ker, g_ref, tol, truth)
        assert g_ker is not None and torch.count_nonzero(g_ker[t - 5 :]) == 0


def test_bench_says_where_the_kernel_does_not_apply(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.ops.qkv_norm import main

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernel applies here")
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--rows", "8"])
    assert e.value.code == 2
    assert "the kernel does not apply here (cpu, bfloat16, head dim 128)" in capsys.readouterr().err


def test_bench_conv_comparison_wiring(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The bench's conv + split comparison (fla-core's conv on CUDA) with the conv's torch
    reference in its place: both arrangements agree and each pass gets a time."""
    import functools

    import benchmarks.ops.qkv_norm as bench
    from harts.ops.conv import runs_causal_conv1d

    monkeypatch.setattr(bench, "runs_causal_conv1d", functools.partial(runs_causal_conv1d, impl="reference"))
    h, d, t = 2, 16, 40
    g = torch.Generator().manual_seed(4)
    pre = torch.randn(t, 3 * h * d, generator=g)
    grads = tuple(torch.randn(t, h, d, generator=g) for _ in range(3))
    out = bench._time_conv_silu(pre, grads, h, d, sequences=3, repeat=1, tol=1e-5)
    assert set(out) == {"forward", "forward_backward"}
    assert all(set(row) == {"silu in conv", "silu in split"} and min(row.values()) >= 0 for row in out.values())
    assert "silu in split" in capsys.readouterr().out
