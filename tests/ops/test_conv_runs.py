"""The short conv as runs with initial states (fla-core's kernel on CUDA) equals the gather conv."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.ops.conv import (
    causal_conv1d_varlen,
    conv_runs_from_ancestors,
    conv_runs_from_offsets,
    runs_causal_conv1d,
    tree_causal_conv1d,
)
from tests.ops._trees import ancestors, random_forest

F64 = torch.float64


def _unshuffled_forest(num_rows: int, seed: int) -> torch.Tensor:
    """Parents in packing order (long runs of consecutive rows, forks to earlier rows)."""
    gen = np.random.default_rng(seed)
    parent = np.full(num_rows, -1, dtype=np.int64)
    for i in range(2, num_rows):
        parent[i] = gen.integers(0, i) if gen.random() < 0.15 else i - 1
    return torch.from_numpy(parent)


def _layout_ancestors(k: int) -> torch.Tensor:
    """``Layout.ancestors`` of an adversarial step (forks at and around chunk boundaries, replay)."""
    from harts.models.config import HybridConfig
    from harts.models.hybrid_lm import HybridLM
    from tests.models._trees import mixed_batch

    model = HybridLM(HybridConfig.tiny(dtype="float64"))
    inputs = model.prepare_compact(mixed_batch(model.config.chunk_size, seed=4))
    return torch.from_numpy(inputs.layout.ancestors(k))


CASES = {
    "shuffled": lambda k: ancestors(random_forest(97, num_roots=3, seed=1), k),
    "packed": lambda k: ancestors(_unshuffled_forest(120, seed=2), k),
    "layout": _layout_ancestors,
}


def _grads(y: torch.Tensor, inputs: tuple[torch.Tensor, ...], up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((y * up).sum(), inputs)


@pytest.mark.parametrize("act", [None, "silu"], ids=["linear", "silu"])
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_runs_equal_the_gather_conv(case: str, W: int, act: str | None) -> None:
    """Values and the gradients of x, weight and bias (float64): the runs' states carry every
    ancestor a run's first rows read, and a forked row gets every reader's gradient."""
    anc = CASES[case](W - 1)
    P, D = anc.shape[0], 6
    runs = conv_runs_from_ancestors(anc.numpy())
    assert runs.num_runs < P or case == "shuffled"  # real runs exist where rows are packed
    g = torch.Generator().manual_seed(W)
    x = torch.randn(P, D, dtype=F64, generator=g, requires_grad=True)
    w = torch.randn(D, W, dtype=F64, generator=g, requires_grad=True)
    b = torch.randn(D, dtype=F64, generator=g, requires_grad=True)
    ref = tree_causal_conv1d(x, w, anc, b, activation=act)
    got = runs_causal_conv1d(x, w, runs, b, act, impl="reference")
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn(P, D, dtype=F64, generator=g)
    for a, r in zip(_grads(got, (x, w, b), up), _grads(ref, (x, w, b), up)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("act", [None, "silu"], ids=["linear", "silu"])
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_head_fixup_equals_the_gather_conv(case: str, W: int, act: str | None) -> None:
    """The CUDA path's algorithm (a no-state conv over the runs, each stated run's head redone
    over its ancestors' mini-sequence; backward with the heads' gradients zeroed in the main
    pass and restored) with a torch no-state conv: values and every gradient (float64), and the
    upstream gradient handed back unchanged."""
    from harts.ops.conv.runs import _HeadFixup, _TorchNoState

    anc = CASES[case](W - 1)
    P, D = anc.shape[0], 5
    runs = conv_runs_from_ancestors(anc.numpy())
    dev = runs.on(torch.device("cpu"))
    assert dev.heads is not None and dev.heads.rows.numel() > 0
    g = torch.Generator().manual_seed(10 + W)
    x = torch.randn(P, D, dtype=F64, generator=g, requires_grad=True)
    w = torch.randn(D, W, dtype=F64, generator=g, requires_grad=True)
    b = torch.randn(D, dtype=F64, generator=g, requires_grad=True)
    ref = tree_causal_conv1d(x, w, anc, b, activation=act)
    got = _HeadFixup.apply(x, w, b, dev, act, _TorchNoState)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn(P, D, dtype=F64, generator=g)
    kept = up.clone()
    for a, r in zip(torch.autograd.grad(got, (x, w, b), up), _grads(ref, (x, w, b), up)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    assert torch.equal(up, kept)


def test_head_fixup_rows_of_runs() -> None:
    """Heads are each stated run's first W-1 rows (fewer in a shorter run); a mini-sequence holds
    the ancestors that exist, oldest first, then the head; a root's run has none."""
    from harts.ops.conv.runs import head_fixup_rows

    cu = np.array([0, 4, 5, 9])
    state_rows = np.array([[-1, -1, -1], [-1, 1, 2], [0, 1, 4]])
    heads, positions, mini, bounds = head_fixup_rows(cu, state_rows)
    assert heads.tolist() == [4, 5, 6, 7]
    assert mini.tolist() == [1, 2, 4, 0, 1, 4, 5, 6, 7] and bounds.tolist() == [0, 3, 9]
    assert positions.tolist() == [2, 6, 7, 8] and mini[positions].tolist() == heads.tolist()


def test_offsets_runs_equal_the_varlen_conv_with_empty_trajectories() -> None:
    offsets = np.array([0, 5, 5, 12, 13, 13, 30])
    runs = conv_runs_from_offsets(offsets)
    assert runs.state_rows is None and runs.cu_seqlens.tolist() == [0, 5, 12, 13, 30]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 4, dtype=F64, generator=g, requires_grad=True)
    w = torch.randn(4, 4, dtype=F64, generator=g, requires_grad=True)
    ref = causal_conv1d_varlen(x, w, torch.as_tensor(offsets))
    got = runs_causal_conv1d(x, w, runs, None, "silu", impl="reference")
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_bad_runs_and_ancestors_are_named() -> None:
    anc = np.array([[-1, -1], [0, -1], [1, 0], [2, 5]])  # row 3's second ancestor is not row 2's first
    with pytest.raises(ValueError, match="row 3's ancestors"):
        conv_runs_from_ancestors(anc)
    runs = conv_runs_from_ancestors(anc[:3])
    assert runs.cu_seqlens.tolist() == [0, 3] and runs.state_rows.tolist() == [[-1, -1]]
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    with pytest.raises(ValueError, match="runs cover 3 rows; x has 4"):
        runs_causal_conv1d(x, w, runs)
    with pytest.raises(ValueError, match="kernel width 4 needs 3"):
        runs_causal_conv1d(x[:3], torch.randn(3, 4), runs)
    with pytest.raises(ValueError, match="impl"):
        runs_causal_conv1d(x[:3], w, runs, impl="cuda")
    with pytest.raises(ValueError, match="offsets must rise"):
        conv_runs_from_offsets(np.array([0, 4, 2]))
    empty = conv_runs_from_ancestors(np.zeros((0, 2), dtype=np.int64))
    assert runs_causal_conv1d(torch.zeros(0, 3), w, empty).shape == (0, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fla_runs_equal_the_reference_on_cuda(dtype: torch.dtype) -> None:
    """fla-core's kernel with initial states against the float64 gather conv: output and
    gradients within the dtype's rounding (fla accumulates in float32 and rounds once)."""
    pytest.importorskip("fla")
    anc = _layout_ancestors(3)
    P, D, W = anc.shape[0], 96, 4
    runs = conv_runs_from_ancestors(anc.numpy())
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(P, D, dtype=F64, generator=g)
    w64 = torch.randn(D, W, dtype=F64, generator=g) * 0.5
    up = torch.randn(P, D, dtype=F64, generator=g)
    x, w = (t.to("cuda", dtype).requires_grad_() for t in (x64, w64))
    got = runs_causal_conv1d(x, w, runs, None, "silu", impl="fla")
    gx, gw = _grads(got, (x, w), up.to("cuda", dtype))
    xr, wr = (t.detach().double().requires_grad_() for t in (x, w))  # the same rounded inputs
    ref = tree_causal_conv1d(xr, wr, anc.cuda(), None, activation="silu")
    rx, rw = _grads(ref, (xr, wr), up.to("cuda", dtype).double())
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    for a, r in [(got, ref), (gx, rx), (gw, rw)]:
        err = ((a.double() - r).abs().max() / r.abs().max()).item()
        assert err < tol, err


@pytest.mark.parametrize("case", ["mixed", "forks_near_chunk_boundaries"])
def test_executors_route_the_conv_through_runs(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both executors with the runs conv (the path CUDA + fla-core takes; here its torch
    reference): compact equals trajectory-wise, and both equal the gather conv's run (float64)."""
    import dataclasses
    import functools

    import harts.ops.conv as conv_mod
    from harts.models.config import HybridConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.rl.verify import compare_runs, run_step
    from tests.models._trees import batch_of, mixed_batch, tree_cases

    torch.manual_seed(0)
    model = HybridLM(HybridConfig.tiny(dtype="float64", layer_pattern="KGMA", chunk_size=8, num_experts=4))
    batch = mixed_batch(8) if case == "mixed" else batch_of(tree_cases(8)[case], seed=3)
    inputs = model.prepare_compact(batch)
    gather = run_step(model, inputs, mode="trajectory", kl_coef=0.1)

    calls: list[int] = []
    reference = functools.partial(conv_mod.runs_causal_conv1d, impl="reference")

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return reference(*args, **kwargs)

    monkeypatch.setattr(conv_mod, "runs_causal_conv1d", counted)
    # the kernel record with fla-core's conv, as CUDA + fla-core resolves it
    record = dataclasses.replace(model.backends(), conv="fla")
    monkeypatch.setattr(HybridLM, "backends", lambda self, config=None: record)
    runs_traj = run_step(model, inputs, mode="trajectory", kl_coef=0.1)
    runs_compact = run_step(model, inputs, mode="compact", kl_coef=0.1)
    assert calls, "the runs conv was not used"
    for got in (runs_traj, runs_compact):
        assert max(compare_runs(gather, got).values()) <= 1e-9


def test_runs_carry_fla_s_chunk_index_of_their_lengths() -> None:
    """The chunk index passed to fla (so fla need not upload one synchronously) is that of the runs."""
    from harts.ops.conv.runs import FLA_CONV_CHUNK

    runs = conv_runs_from_offsets(np.array([0, 5, 5, 200, 264]))
    dev = runs.on(torch.device("cpu"))
    cu, cu_host, chunks = dev.cu_seqlens, dev.cu_seqlens_host, dev.chunk_indices
    assert cu_host.tolist() == cu.tolist() == [0, 5, 200, 264] and dev.state_rows is None and dev.heads is None
    lengths = np.diff(cu_host.numpy())
    expected = [(r, c) for r, m in enumerate(lengths) for c in range(-(-int(m) // FLA_CONV_CHUNK))]
    assert [tuple(x) for x in chunks.tolist()] == expected


def test_fla_path_hands_the_gradient_back_as_a_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs without states call fla-core's autograd conv on ``x[None]``: its [1, P, D] output
    comes back as a view whose backward is a view too (an indexing ``y[0]`` zero-filled and
    copied a [1, P, D] gradient every layer). fla-core is replaced by the reference here."""
    import sys
    import types

    def fake_causal_conv1d(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices):  # noqa: ANN001, ANN202, ARG001
        y = causal_conv1d_varlen(x[0], weight, cu_seqlens_cpu, bias=bias, activation=activation)
        return y[None], None

    mod = types.ModuleType("fla.modules.causal_conv1d")
    mod.causal_conv1d = fake_causal_conv1d  # type: ignore[attr-defined]
    for name in ("fla", "fla.modules"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name, types.ModuleType(name)))
    monkeypatch.setitem(sys.modules, "fla.modules.causal_conv1d", mod)
    offsets = np.array([0, 5, 12, 30])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 4, dtype=F64, generator=g, requires_grad=True)
    w = torch.randn(4, 4, dtype=F64, generator=g, requires_grad=True)
    y = runs_causal_conv1d(x, w, conv_runs_from_offsets(offsets), None, "silu", impl="fla")
    assert y.shape == (30, 4) and "Select" not in y.grad_fn.name()
    ref = causal_conv1d_varlen(x, w, torch.as_tensor(offsets), activation="silu")
    up = torch.randn(30, 4, dtype=F64, generator=g)
    for a, b in zip(_grads(y, (x, w), up), _grads(ref, (x, w), up), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
