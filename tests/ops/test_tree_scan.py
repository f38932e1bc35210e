"""harts' state scans with boundary-state export and gradient injection (``tree_scan``), and the
request planning of the one-pass tree kernel (``tree_kernel.plan_state_io``).

The scans are checked against a float64 torch recurrence with autograd: on CUDA as compiled
Triton kernels, on a CPU machine with Triton installed through Triton's interpreter.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from harts.ops.linear_attn.tree_kernel import plan_state_io
from tests.ops._triton import check_here_or_interpreted

# ---------------------------------------------------------------- request planning (numpy)


def test_plan_maps_requests_to_chunks():
    io = plan_state_io([130, 64, 0, 5], [(0, 64), (0, 128), (0, 130), (1, 64), (0, 64), (2, 0), (3, 0)], 64)
    assert io.num_chunks == 3 + 1 + 0 + 1
    assert io.chunk_offsets.tolist() == [0, 3, 4, 4, 5]
    assert io.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [3, 0]]
    # (0, 64) and (0, 128): starts of chunks 1 and 2 of sequence 0; a repeated request shares its slot
    assert io.num_exported == 2
    assert io.export_index.tolist() == [-1, 0, 1, -1, -1]
    assert io.inject_index.tolist() == [0, 1, -1, -1, -1]  # the end of the chunk before each export
    e, n = io.num_exported, 4
    # final states of sequences 0 and 1 (count == length; also the empty sequence 2's), the initial state of 3
    assert io.source.tolist() == [0, 1, e + 0, e + 1, 0, e + 2, e + n + 3]


def test_plan_rejects_unaligned_requests():
    with pytest.raises(ValueError, match="not a multiple of the chunk size 64"):
        plan_state_io([200], [(0, 100)], 64)


# ---------------------------------------------------------------- the scans


def _scan_module():
    """tree_scan as compiled kernels (CUDA) or interpreted (``TRITON_INTERPRET=1`` set before
    triton was first imported: see ``test_scans_export_and_inject_like_the_recurrence``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        import triton.runtime.interpreter as interp

        if hasattr(interp, "_patch_lang_tensor") and not getattr(interp, "_harts_index_patch", False):
            # numpy >= 2.4 refuses int() of a 1-element array, which Triton 3.6's interpreter does
            # for a loop bound loaded from memory; convert through a flat element instead
            original = interp._patch_lang_tensor

            def patched(tensor, scope):  # noqa: ANN001, ANN202
                original(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

            interp._patch_lang_tensor = patched
            interp._harts_index_patch = True
    from harts.ops.linear_attn import tree_scan

    return tree_scan


def _reference(kg, w, u, gk, qg, S0, lengths, B, scale):  # noqa: ANN001, ANN202
    """The recurrence of the module docstring, float64, differentiable."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    T, H, V = u.shape[1], u.shape[2], u.shape[3]
    start_states, end_states, finals = [], [], []
    v_new = torch.zeros(T, H, V, dtype=u.dtype)
    out = torch.zeros(T, H, V, dtype=u.dtype)
    for i, n in enumerate(lengths):
        S = S0[i]
        for c in range((n + B - 1) // B):
            a, b = int(starts[i]) + c * B, int(starts[i]) + min((c + 1) * B, n)
            rows = torch.arange(a, b)
            start_states.append(S)
            vn = u[0, a:b] - torch.einsum("thk,hkv->thv", w[0, a:b], S)
            v_new = v_new.index_copy(0, rows, vn)
            out = out.index_copy(0, rows, scale * torch.einsum("thk,hkv->thv", qg[0, a:b], S))
            S = S * torch.exp2(gk[0, b - 1])[..., None] + torch.einsum("thk,thv->hkv", kg[0, a:b], vn)
            end_states.append(S)
        finals.append(S)
    return start_states, end_states, torch.stack(finals), v_new, out


@pytest.mark.parametrize("scalar", [False, True], ids=["per-channel", "scalar"])
@pytest.mark.parametrize("lengths", [[1, 15, 16, 17, 40, 0, 33], [64, 1]], ids=["ragged", "aligned"])
def test_scans_export_and_inject_like_the_recurrence(lengths, scalar):
    """On CUDA in this process; on CPU in a fresh interpreter with TRITON_INTERPRET=1 (Triton reads
    it when first imported, and other tests of this process may have imported it already).
    ``scalar``: GDN's decay, one per row and head, with the raw keys and queries."""
    check_here_or_interpreted(
        lambda: check_scans(lengths, scalar),
        f"from tests.ops.test_tree_scan import check_scans; check_scans({lengths!r}, {scalar!r})",
    )


def check_scans(lengths: list[int], scalar: bool = False) -> None:
    """The scans against the float64 recurrence: states, exports, and every gradient. With
    ``scalar`` the kernels get the raw keys / queries and a [1, T, H] decay, the recurrence the
    decayed ones (``kg = k exp2(g_last - g)``, ``qg = q exp2(g)``) and the decay per channel."""
    scan = _scan_module()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B, H, K, V, scale = 16, 2, 16, 48, 0.25
    torch.manual_seed(0)
    T, N = sum(lengths), len(lengths)
    dt = torch.float64
    kg, w, qg = (torch.randn(1, T, H, K, dtype=dt) * 0.3 for _ in range(3))
    u = torch.randn(1, T, H, V, dtype=dt, requires_grad=True)
    gk = -torch.rand(1, T, H, K, dtype=dt) * 0.5
    k_in, q_in, g_in = kg, qg, gk
    if scalar:  # the kernels' inputs raw, the recurrence's decayed by the same [1, T, H] decay
        g_in = -torch.rand(1, T, H, dtype=dt) * 0.5
        last = torch.tensor(
            [s + min((r // B + 1) * B, n) - 1 for s, n in zip(np.cumsum([0, *lengths]), lengths) for r in range(n)],
            dtype=torch.long,
        )
        kg = k_in * torch.exp2(g_in[:, last] - g_in)[..., None]
        qg = q_in * torch.exp2(g_in)[..., None]
        gk = g_in[..., None].expand(1, T, H, K)
    S0 = torch.randn(N, H, K, V, dtype=dt, requires_grad=True)
    chunks = [(n + B - 1) // B for n in lengths]
    offs = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    nt = int(offs[-1])
    exports = [(i, c) for i in range(N) for c in range(1, chunks[i])]  # every interior chunk start
    export_index = torch.full((nt,), -1, dtype=torch.int32)
    inject_index = torch.full((nt,), -1, dtype=torch.int32)
    for s, (i, c) in enumerate(exports):
        export_index[offs[i] + c] = s
        inject_index[offs[i] + c - 1] = s
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=dev)
    co = torch.tensor(offs, device=dev)

    def f32(x):  # noqa: ANN001, ANN202
        return x.detach().float().contiguous().to(dev)

    starts, ends, finals, v_new, out = _reference(kg, w, u, gk, qg, S0, lengths, B, scale)
    h, vn, fin, exported = scan.tree_scan_fwd(
        f32(k_in),
        f32(w),
        f32(u),
        f32(g_in),
        cu_seqlens=cu,
        chunk_offsets=co,
        num_chunks=nt,
        chunk_size=B,
        initial_state=f32(S0),
        export_index=export_index.to(dev),
        num_exported=len(exports),
    )

    def close(a, b, what):  # noqa: ANN001, ANN202
        err = ((a.double().cpu() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-6)).item()
        assert err < 1e-5, f"{what}: relative error {err:.2e}"

    close(h[0], torch.stack(starts), "chunk-start states")
    close(vn[0], v_new, "v_new")
    close(fin, finals, "final states")
    if exports:
        close(exported, torch.stack([starts[offs[i] + c] for i, c in exports]), "exported states")

    # backward: output, v_new and final-state gradients plus one injected gradient per export
    do, dv = torch.randn(1, T, H, V, dtype=dt), torch.randn(1, T, H, V, dtype=dt)
    dht = torch.randn(N, H, K, V, dtype=dt)
    G = torch.randn(len(exports), H, K, V, dtype=dt)
    for name, use_out in (("all gradients", True), ("injected only", False)):
        loss = sum((G[s] * starts[offs[i] + c]).sum() for s, (i, c) in enumerate(exports))
        if use_out:
            loss = loss + (do[0] * out).sum() + (dv[0] * v_new).sum() + (dht * finals).sum()
        ref = torch.autograd.grad(loss, [S0, u, *ends], retain_graph=True, allow_unused=True)
        zeros = torch.zeros(1, T, H, V)
        dh, dh0, dv2 = scan.tree_scan_bwd(
            f32(q_in),
            f32(k_in),
            f32(w),
            f32(g_in),
            f32(do) if use_out else zeros.to(dev),
            f32(dv) if use_out else zeros.to(dev),
            scale=scale,
            cu_seqlens=cu,
            chunk_offsets=co,
            num_chunks=nt,
            chunk_size=B,
            dht=f32(dht) if use_out else None,
            inject=f32(G),
            inject_index=inject_index.to(dev),
        )
        close(dh0, ref[0], f"{name}: initial-state gradient")
        close(dv2[0], ref[1][0], f"{name}: v_new gradient")
        ends_grad = torch.stack([g if g is not None else torch.zeros(H, K, V, dtype=dt) for g in ref[2:]])
        close(dh[0], ends_grad, f"{name}: end-of-chunk state gradients")
        if not use_out and exports:
            assert dh0.abs().max() > 0  # the injection alone reaches the initial state
