"""The plain rule (Mamba-2's SSD) on Triton: fla-core's simple_gla kernels around harts' scans
(``tree_kernel._PLAIN``) and fla's own recurrent simple_gla, against the float64 reference, run
anywhere: on CUDA compiled, on a CPU machine through Triton's interpreter.

* ``fused_recurrent_simple_gla`` (fla's definition of the recurrence) equals harts' naive plain
  rule: the scale, the decay's sign and units, the initial and final states are the same contract.
* The tree kernel's plain path: one packed round with initial states and requested states
  (exports at chunk boundaries, finals, 0), and two linked rounds (the second starting from the
  first's exported and final states), forward and every gradient (q, k, v, g, initial states).
* The backward's tail on chunk subsets equals the whole call's on each subset's rows (the linked
  op's overlapped first round), and ``plain_on_tree``'s check problem agrees between the tree
  kernel and the reference operator, and fails a gradient off by half.
* The "fla" split path on fla's ``chunk_simple_gla`` (scalar decay) and ``chunk_gla``
  (per-channel): cuts at requested chunk boundaries, a mid-chunk probe, every gradient. fla's
  state kernels call ``.to`` on a ``range`` loop index, which Triton's interpreter hands over as
  a Python int; ``_interpreted_loop_indices`` gives those loops interpreter scalars instead (on
  CUDA nothing is patched).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops._triton import check_here_or_interpreted
from tests.ops.test_tree_kernel_interpreted import (
    _device,
    _interpreter_single_config,
    _rel,
    linked_rounds,
    tails_on_chunk_subsets,
)

pytest.importorskip("fla", reason="needs fla-core (pip install harts[gpu])")

#: a one-row, a chunk-minus-one, an exact-chunk, a chunk-plus-one and a two-chunk sequence
LENGTHS = [1, 63, 64, 65, 130]
REQUESTS = [(4, 64), (4, 128), (4, 130), (2, 64), (3, 64), (0, 0), (1, 63), (4, 64)]
#: float32 kernels against float64: a few float32 roundings over sums of ~100 terms
TOL = 1e-4


def _inputs(T: int, H: int = 2, K: int = 16, V: int = 16, seed: int = 0) -> list[torch.Tensor]:
    from tests.ops.test_linear_attn_plain import plain_inputs

    return plain_inputs(T, H, K, V, per_channel=False, seed=seed)


def _interpreted_loop_indices() -> None:
    """Under Triton's interpreter, ``range`` inside fla's state kernels (``fla.ops.common.chunk_h``)
    yields interpreter int32 scalars, as a compiled kernel's loop index is, instead of Python
    ints (which have no ``.to``)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import fla.ops.common.chunk_h as chunk_h
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def scalar_range(*bounds):  # noqa: ANN002, ANN202
        for i in range(*(int(b) for b in bounds)):
            yield tl.core.tensor(TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)

    chunk_h.range = scalar_range


def check_fla_split_plain(per_channel: bool) -> None:
    """``fla_split_linear_attn`` (``fla_chunk_linear_attn`` past its CUDA guard) on the plain rule
    against the float64 reference: one packed round, initial states, aligned, final, 0 and
    mid-chunk requests (the last one a probe call), every gradient."""
    _interpreter_single_config()
    _interpreted_loop_indices()
    from harts.ops.linear_attn.chunk import chunk_linear_attn
    from harts.ops.linear_attn.fla import fla_split_linear_attn
    from harts.ops.linear_attn.utils import check_linear_attn_inputs
    from tests.ops.test_linear_attn_plain import plain_inputs

    dev, H, K, V = _device(), 2, 16, 16
    x64 = plain_inputs(sum(LENGTHS), H, K, V, per_channel, seed=9)
    h064 = torch.randn(len(LENGTHS), H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    cu = torch.tensor([0, *np.cumsum(LENGTHS)])
    req = torch.tensor([*REQUESTS, (4, 70)])
    ref = [t.clone().requires_grad_() for t in (*x64, h064)]
    want = chunk_linear_attn(
        *ref[:4], None, cu_seqlens=cu, initial_state=ref[4], chunk_size=64, state_requests=req, rule="plain"
    )
    leaves = [t.float().to(dev).requires_grad_() for t in (*x64, h064)]
    spec = check_linear_attn_inputs(*leaves[:4], None, cu, leaves[4], req, None, "plain")
    got = fla_split_linear_attn(*leaves[:4], None, spec, leaves[4], 64)
    w = [torch.randn(r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(11)) for r in want]
    g_ref = torch.autograd.grad(sum((r * wi).sum() for r, wi in zip(want, w)), ref)
    g_out = torch.autograd.grad(sum((a.double() * wi.to(dev)).sum() for a, wi in zip(got, w)), leaves)
    names = ["o", "final", "states", "dq", "dk", "dv", "dg", "dh0"]
    for name, a, b in zip(names, [*got, *g_out], [*want, *g_ref], strict=True):
        assert b.abs().max() > 0, name
        assert _rel(a, b) < TOL, f"{name}: relative error {_rel(a, b):.2e}"


def check_fused_recurrent_matches_naive() -> None:
    _interpreter_single_config()
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    from harts.ops.linear_attn.naive import naive_recurrent_linear_attn

    dev, lengths = _device(), [1, 20, 37]
    x64 = _inputs(sum(lengths), seed=1)
    h064 = torch.randn(len(lengths), 2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, *np.cumsum(lengths)])
    ref = [t.clone().requires_grad_() for t in (*x64, h064)]
    o_r, f_r, _ = naive_recurrent_linear_attn(
        *ref[:4], None, cu_seqlens=cu, initial_state=ref[4], rule="plain", scale=0.5
    )
    leaves = [t.float().to(dev).requires_grad_() for t in (*x64, h064)]
    o, final = fused_recurrent_simple_gla(
        *(t[None] for t in leaves[:4]),
        scale=0.5,
        initial_state=leaves[4],
        output_final_state=True,
        cu_seqlens=cu.to(dev),
    )
    w = torch.randn(o_r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g_ref = torch.autograd.grad((o_r * w).sum() + f_r.sum(), ref)
    g_out = torch.autograd.grad((o[0].double() * w.to(dev)).sum() + final.double().sum(), leaves)
    names = ["o", "final", "dq", "dk", "dv", "dg", "dh0"]
    for name, a, b in zip(names, [o[0], final, *g_out], [o_r, f_r, *g_ref], strict=True):
        assert b.abs().max() > 0, name
        assert _rel(a, b) < TOL, f"{name}: relative error {_rel(a, b):.2e}"


def check_tree_op_plain() -> None:
    """One packed round with initial states and requested states, on ``_PLAIN``."""
    _interpreter_single_config()
    from harts.ops.linear_attn.chunk import chunk_linear_attn
    from harts.ops.linear_attn.tree_kernel import _PLAIN, _device_meta, _TreeKDA

    dev = _device()
    x64 = _inputs(sum(LENGTHS))
    h064 = torch.randn(len(LENGTHS), 2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *np.cumsum(LENGTHS)])
    ref_leaves = [t.clone().requires_grad_() for t in (*x64, h064)]
    o_r, f_r, s_r = chunk_linear_attn(
        *ref_leaves[:4],
        None,
        cu_seqlens=cu,
        initial_state=ref_leaves[4],
        chunk_size=64,
        state_requests=torch.tensor(REQUESTS),
        rule="plain",
    )
    leaves = [t.float().to(dev).requires_grad_() for t in (*x64, h064)]
    starts = np.concatenate([[0], np.cumsum(LENGTHS)[:-1]]).tolist()
    meta = _device_meta(starts, LENGTHS, REQUESTS, 64, dev)
    q, k, v, g, h0 = leaves
    o, final, exported = _TreeKDA.apply(
        *(t[None].contiguous() for t in (q, k, v, g)), None, h0, meta, 16**-0.5, 64, _PLAIN
    )
    states = torch.cat([exported, final, h0])[meta.source]
    w = [torch.randn(r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) for r in (o_r, f_r, s_r)]
    g_ref = torch.autograd.grad(sum((r * wi).sum() for r, wi in zip((o_r, f_r, s_r), w)), ref_leaves)
    got = (o[0], final, states)
    g_out = torch.autograd.grad(sum((a.double() * wi.to(dev)).sum() for a, wi in zip(got, w)), leaves)
    names = ["o", "final", "states", "dq", "dk", "dv", "dg", "dh0"]
    for name, a, b in zip(names, [*got, *g_out], [o_r, f_r, s_r, *g_ref], strict=True):
        assert b.abs().max() > 0, name
        assert _rel(a, b) < TOL, f"{name}: relative error {_rel(a, b):.2e}"


def check_linked_plain() -> None:
    """``linked_rounds`` on ``_PLAIN``."""
    import harts.ops.linear_attn.tree_kernel as tk

    o, g_out, o_r, g_ref = linked_rounds(tk._PLAIN, _inputs(330, seed=3), rule="plain")
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg"], [o, *g_out], [o_r, *g_ref], strict=True):
        assert b.abs().max() > 0, name
        assert _rel(a, b) < TOL, f"{name}: relative error {_rel(a, b):.2e}"


def check_plain_tail_on_chunk_subsets() -> None:
    """The plain backward's tail on two chunk ranges gives, on each range's rows, exactly the
    whole call's gradients (h and dh sliced, fla's kernels addressing them by program id)."""
    _interpreter_single_config()
    import harts.ops.linear_attn.tree_kernel as tk

    dev, lengths, B, scale = _device(), [130, 64, 70], 64, 16**-0.5
    q, k, v, g = (t.float().to(dev)[None].contiguous() for t in _inputs(sum(lengths), seed=5))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    meta = tk._device_meta(starts, lengths, [], B, dev)
    _, w, u, _, _, _ = tk._PLAIN.fwd_intra(q, k, v, g, None, scale, meta.cu_seqlens, meta.chunk_indices, B)
    assert w is None and u is v
    first, rest, whole, t0 = tails_on_chunk_subsets(tk._PLAIN, q, k, v, g, None, lengths, B, scale)
    assert whole[4] is None and first[4] is None  # no beta, no dbeta
    for name, a, b, c in zip(["dq", "dk", "dv", "dg"], first[:4], rest[:4], whole[:4], strict=True):
        assert torch.equal(a[:, :t0], c[:, :t0]), name
        assert torch.equal(b[:, t0:], c[:, t0:]), name


def check_plain_check() -> None:
    """``plain_on_tree``'s check problem: the tree kernel and the reference operator agree within
    its tolerance, and a result with a gradient off by half does not."""
    _interpreter_single_config()
    from harts.ops.linear_attn.tree_kernel import _PLAIN, _check_close, _check_problem

    dev = _device()
    small = dict(lengths=(130, 64, 1, 200), requests=((0, 64), (0, 128), (0, 130), (1, 64), (2, 0), (3, 192)))
    tree = _check_problem(_PLAIN, dev, torch.float32, 2, 16, 16, **small, rule="plain")
    ref = _check_problem(None, dev, torch.float32, 2, 16, 16, **small, rule="plain")
    assert len(tree) == len(ref) == 8
    assert _check_close(tree, ref, torch.float32)
    bad = [t.clone() for t in tree]
    bad[4] = bad[4] * 1.5  # dk
    assert not _check_close(bad, ref, torch.float32)


CHECKS = (
    check_fused_recurrent_matches_naive,
    check_tree_op_plain,
    check_linked_plain,
    check_plain_tail_on_chunk_subsets,
    check_plain_check,
    lambda: check_fla_split_plain(per_channel=False),
    lambda: check_fla_split_plain(per_channel=True),
)


def run_checks() -> None:
    """Every check above, in one process (one interpreter start-up on a CPU machine: the checks
    themselves take seconds there)."""
    for check in CHECKS:
        check()


def test_plain_kernels() -> None:
    check_here_or_interpreted(
        run_checks, "from tests.ops.test_linear_attn_plain_kernels import run_checks; run_checks()"
    )


def test_plain_on_tree_takes_scalar_decay_only() -> None:
    """A per-channel decay (GLA) never runs the tree kernel's plain path (fla's chunk_gla through
    the split path serves it); on CPU tensors a scalar one needs no check."""
    from harts.ops.linear_attn.tree_kernel import plain_on_tree

    q, v = torch.zeros(4, 2, 16), torch.zeros(4, 2, 8)
    assert plain_on_tree(q, v, torch.zeros(4, 2))
    assert not plain_on_tree(q, v, torch.zeros(4, 2, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_channel", [False, True], ids=["simple_gla", "gla"])
def test_fla_split_plain_matches_reference(per_channel: bool) -> None:
    """fla's chunk_simple_gla / chunk_gla behind the split path: a round exporting states
    (aligned, mid-chunk, final, 0) and a second round consuming them, every gradient."""
    from harts.ops.linear_attn import chunk_linear_attn, fla_chunk_linear_attn
    from harts.ops.linear_attn.fla import fla_available
    from tests.ops.test_linear_attn_plain import plain_inputs

    if not fla_available():
        pytest.skip("needs fla-core on CUDA")
    T, H, K, V = 900, 4, 64, 64
    x64 = [t.cuda() for t in plain_inputs(T, H, K, V, per_channel)]
    cu = torch.tensor([0, 400, 401, 650, 900])
    h0 = torch.randn(4, H, K, V, dtype=torch.float64, device="cuda")
    req = torch.tensor([[0, 128], [0, 256], [0, 200], [2, 64], [3, 250], [1, 1], [0, 0]])

    def run(op, x, h):  # noqa: ANN001, ANN202
        o, final, states = op(*x, None, cu_seqlens=cu, initial_state=h, state_requests=req, rule="plain")
        rows = torch.arange(100, device="cuda").repeat(states.shape[0])
        cu2 = torch.arange(states.shape[0] + 1) * 100
        o2, final2, _ = op(*(t[rows] for t in x), None, cu_seqlens=cu2, initial_state=states, rule="plain")
        return [o, final, states, o2, final2]

    ref_leaves = [t.clone().requires_grad_() for t in (*x64, h0)]
    leaves = [t.float().requires_grad_() for t in (*x64, h0)]
    ref = run(chunk_linear_attn, ref_leaves[:4], ref_leaves[4])
    out = run(fla_chunk_linear_attn, leaves[:4], leaves[4])
    for name, a, b in zip(["o", "final", "states", "o2", "final2"], out, ref, strict=True):
        assert _rel(a, b) < 5e-3, name
    w = [torch.randn_like(r) for r in ref]
    g_ref = torch.autograd.grad(sum((r * wi).sum() for r, wi in zip(ref, w)), ref_leaves)
    g_out = torch.autograd.grad(sum((o.double() * wi).sum() for o, wi in zip(out, w)), leaves)
    for name, a, b in zip(["q", "k", "v", "g", "h0"], g_out, g_ref, strict=True):
        assert _rel(a, b) < 2e-2, name
