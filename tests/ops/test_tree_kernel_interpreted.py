"""The tree kernel's GDN kernel set (fla-core's own GDN kernels around harts' scans,
``tree_kernel._GDN``) against the float64 reference operator, run anywhere: on CUDA compiled, on a
CPU machine through Triton's interpreter (fla-core's kernels and harts' scans alike).

What this pins down is the composition: which fla kernel gets which tensor, the decay's log2
units, the scans' scalar decay, harts' own launch of fla's dqkwg kernel, the reverse cumsum of
the decay gradient, the linked rounds' split backward. Forward outputs, final and exported
states and every input's gradient (q, k, v, g, beta, initial states), float32 against float64.
The check that ``gdn_native`` runs once per shape is exercised the same way, with a negative
control. (On the GPU, ``tests/ops/test_tree_kernel.py`` times nothing either: it checks bf16 and
Qwen's head shapes there.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.ops._triton import check_here_or_interpreted

pytest.importorskip("fla", reason="needs fla-core (pip install harts[gpu])")

#: sequences with a one-row, a chunk-minus-one, an exact-chunk, a chunk-plus-one and a two-chunk
#: length; requests at chunk boundaries (exports), full lengths (finals) and 0 (initial)
LENGTHS = [1, 63, 64, 65, 130]
REQUESTS = [(4, 64), (4, 128), (4, 130), (2, 64), (3, 64), (0, 0), (1, 63)]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _interpreter_single_config() -> None:
    """Triton's interpreter cannot benchmark, so fla's autotuned kernels run their first config
    there (any config computes the same function)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from tests.ops.test_tree_scan import _scan_module

    _scan_module()  # the interpreter's index patch
    import triton.runtime.autotuner as autotuner

    if getattr(autotuner.Autotuner, "_harts_first_config", False):
        return
    run = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    autotuner.Autotuner.run = first_config
    autotuner.Autotuner._harts_first_config = True


def _inputs(T: int, H: int = 2, K: int = 16, V: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(T, H, K, generator=g, dtype=torch.float64),
        F.normalize(torch.randn(T, H, K, generator=g, dtype=torch.float64), dim=-1),
        torch.randn(T, H, V, generator=g, dtype=torch.float64),
        -F.softplus(torch.randn(T, H, generator=g, dtype=torch.float64)) * 0.3,
        torch.rand(T, H, generator=g, dtype=torch.float64).clamp(0.05, 0.95),
    ]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-9)).item()


def check_tree_op_gdn() -> None:
    """One packed round with initial states and requested states, on ``_GDN``."""
    _interpreter_single_config()
    from harts.ops.linear_attn.chunk import chunk_linear_attn
    from harts.ops.linear_attn.tree_kernel import _GDN, _device_meta, _TreeKDA

    dev = _device()
    x64 = _inputs(sum(LENGTHS))
    h064 = torch.randn(len(LENGTHS), 2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *np.cumsum(LENGTHS)])
    ref_leaves = [t.clone().requires_grad_() for t in (*x64, h064)]
    o_r, f_r, s_r = chunk_linear_attn(
        *ref_leaves[:5],
        cu_seqlens=cu,
        initial_state=ref_leaves[5],
        chunk_size=64,
        state_requests=torch.tensor(REQUESTS),
    )
    leaves = [t.float().to(dev).requires_grad_() for t in (*x64, h064)]
    starts = np.concatenate([[0], np.cumsum(LENGTHS)[:-1]]).tolist()
    meta = _device_meta(starts, LENGTHS, REQUESTS, 64, dev)
    q, k, v, g, beta, h0 = leaves
    o, final, exported = _TreeKDA.apply(
        *(t[None].contiguous() for t in (q, k, v, g, beta)), h0, meta, 16**-0.5, 64, _GDN
    )
    states = torch.cat([exported, final, h0])[meta.source]
    w = [torch.randn(r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) for r in (o_r, f_r, s_r)]
    g_ref = torch.autograd.grad(sum((r * wi).sum() for r, wi in zip((o_r, f_r, s_r), w)), ref_leaves)
    got = (o[0], final, states)
    g_out = torch.autograd.grad(sum((a.double() * wi.to(dev)).sum() for a, wi in zip(got, w)), leaves)
    names = ["o", "final", "states", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, a, b in zip(names, [*got, *g_out], [o_r, f_r, s_r, *g_ref], strict=True):
        assert b.abs().max() > 0, name
        assert _rel(a, b) < 1e-4, f"{name}: relative error {_rel(a, b):.2e}"


def linked_rounds(kernels, x64: list[torch.Tensor], rule: str = "delta"):  # noqa: ANN001, ANN201
    """Two linked rounds (the second starts from the first's exported and final states) as one
    op on ``kernels`` and the reference run round by round with the states handed over, over
    the float64 inputs ``x64`` (q, k, v, g and, for the delta rule, beta; 330 rows, 2 heads of
    16): (the op's output, its input gradients, the reference's output, its gradients)."""
    _interpreter_single_config()
    import harts.ops.linear_attn.tree_kernel as tk
    from harts.ops.linear_attn.chunk import chunk_linear_attn

    no_beta = [None] if rule == "plain" else []
    rounds = [([130, 64], [-1, -1], [(0, 64), (0, 128), (1, 64)], [0, 1, 2]), ([70, 65, 1], [0, 1, 2], [], [])]
    dev = _device()
    ref = [t.clone().requires_grad_() for t in x64]
    outs, states, at = [], {}, 0
    for lengths, init, req, ids in rounds:
        n = sum(lengths)
        part = [t[at : at + n] for t in ref]
        at += n
        h0 = torch.stack([states[s] if s >= 0 else torch.zeros(2, 16, 16, dtype=torch.float64) for s in init])
        o, _, got = chunk_linear_attn(
            *part,
            *no_beta,
            cu_seqlens=torch.tensor([0, *np.cumsum(lengths)]),
            initial_state=h0,
            chunk_size=64,
            state_requests=torch.tensor(req, dtype=torch.int64).reshape(-1, 2),
            rule=rule,
        )
        states.update({s: got[j] for j, s in enumerate(ids)})
        outs.append(o)
    o_r = torch.cat(outs)
    plan = tk.plan_linked_rounds(
        [
            (np.concatenate([[0], np.cumsum(a)]), np.asarray(b), np.asarray(c).reshape(-1, 2), np.asarray(d))
            for a, b, c, d in rounds
        ],
        64,
    )
    assert plan is not None
    meta = tk._linked_device(plan, dev)
    leaves = [t.float().to(dev).requires_grad_() for t in x64]
    o = tk._LinkedKDA.apply(*(t[None].contiguous() for t in leaves), *no_beta, meta, 16**-0.5, 64, kernels)[0]
    w = torch.randn(o_r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    g_ref = torch.autograd.grad((o_r * w).sum(), ref)
    g_out = torch.autograd.grad((o.double() * w.to(dev)).sum(), leaves)
    return o, g_out, o_r, g_ref


def check_linked_gdn() -> None:
    """``linked_rounds`` on ``_GDN``."""
    import harts.ops.linear_attn.tree_kernel as tk

    o, g_out, o_r, g_ref = linked_rounds(tk._GDN, _inputs(330, seed=3))
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], [o, *g_out], [o_r, *g_ref], strict=True):
        assert _rel(a, b) < 1e-4, f"{name}: relative error {_rel(a, b):.2e}"


def tails_on_chunk_subsets(kernels, q, k, v, g, beta, lengths: list[int], B: int, scale: float):  # noqa: ANN001, ANN201
    """The backward's tail of ``kernels`` (a tree-kernel set: ``_GDN``, ``_PLAIN``) on the first
    sequence's chunks, on the rest, and on all of them, over one packed problem of ``lengths``;
    with the first sequence's row count: (first, rest, whole, t0)."""
    import harts.ops.linear_attn.tree_kernel as tk
    from harts.ops.linear_attn.tree_scan import tree_scan_bwd

    dev = q.device
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(6)).to(dev)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    meta = tk._device_meta(starts, lengths, [], B, dev)
    cu, ci, co, nt = meta.cu_seqlens, meta.chunk_indices, meta.chunk_offsets, meta.io.num_chunks
    gc, w, u, _, _, A = kernels.fwd_intra(q, k, v, g, beta, scale, cu, ci, B)
    w, qg, kg, h, v_new, dAqk, dv = kernels.bwd_head(q, k, v, gc, beta, None, A, None, do, scale, cu, ci, co, nt, B)
    dh, _, dv2 = tree_scan_bwd(
        qg,
        kg,
        w,
        gc,
        do,
        dv,
        scale=scale,
        cu_seqlens=cu,
        chunk_offsets=co,
        num_chunks=nt,
        chunk_size=B,
        dht=None,
        inject=None,
        inject_index=None,
        want_initial_state_grad=False,
    )

    def tail(lo: int, hi: int) -> list[torch.Tensor]:
        return kernels.bwd_tail(
            q, k, v, v_new, w, gc, beta, A, h[:, lo:hi], do, dh[:, lo:hi], dv2, dAqk, scale, cu, ci[lo:hi], co, B
        )

    m = int(meta.io.chunk_offsets[1])  # the first sequence's chunks
    return tail(0, m), tail(m, nt), tail(0, nt), lengths[0]


def check_gdn_tail_on_chunk_subsets() -> None:
    """The GDN backward's tail run on two chunk ranges (as the linked op's first round runs
    beside the later rounds on the GPU: h and dh sliced, fla's kernels addressing them by
    program id) gives, on each range's rows, exactly the whole call's gradients."""
    _interpreter_single_config()
    import harts.ops.linear_attn.tree_kernel as tk

    dev, lengths, B, scale = _device(), [130, 64, 70], 64, 16**-0.5
    q, k, v, g, beta = (t.float().to(dev)[None].contiguous() for t in _inputs(sum(lengths), seed=5))
    first, rest, whole, t0 = tails_on_chunk_subsets(tk._GDN, q, k, v, g, beta, lengths, B, scale)
    for name, a, b, c in zip(["dq", "dk", "dv", "dg", "dbeta"], first, rest, whole, strict=True):
        assert torch.equal(a[:, :t0], c[:, :t0]), name
        assert torch.equal(b[:, t0:], c[:, t0:]), name


def check_gdn_check() -> None:
    """``gdn_native``'s check problem: the GDN and KDA kernel sets agree within its tolerance,
    and a result off by fla #640's order (a gradient scaled by 1.5) does not, nor one beside a
    reference holding a NaN."""
    _interpreter_single_config()
    from harts.ops.linear_attn.tree_kernel import _GDN, _KDA, _check_close, _check_problem

    dev = _device()
    small = dict(lengths=(130, 64, 1, 200), requests=((0, 64), (0, 128), (0, 130), (1, 64), (2, 0), (3, 192)))
    gdn = _check_problem(_GDN, dev, torch.float32, 2, 16, 16, **small)
    kda = _check_problem(_KDA, dev, torch.float32, 2, 16, 16, **small)
    assert _check_close(gdn, kda, torch.float32)
    bad = [t.clone() for t in gdn]
    bad[4] = bad[4] * 1.5  # dk
    assert not _check_close(bad, kda, torch.float32)
    # a NaN on the reference's side fails it too (max(NaN, ...) would compare as no difference)
    nan_ref = [t.clone() for t in kda]
    nan_ref[0].view(-1)[0] = float("nan")
    assert not _check_close(gdn, nan_ref, torch.float32)


@pytest.mark.parametrize(
    "check", ["check_tree_op_gdn", "check_linked_gdn", "check_gdn_tail_on_chunk_subsets", "check_gdn_check"]
)
def test_gdn_kernel_set(check: str) -> None:
    check_here_or_interpreted(
        globals()[check], f"from tests.ops.test_tree_kernel_interpreted import {check}; {check}()"
    )
