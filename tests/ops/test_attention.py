"""Compact full attention: ancestor views == tree mask == per-path causal attention, values and
every gradient, with GQA and MLA head shapes, against dense references."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch

from harts.ops.attention import (
    ancestor_view_attention,
    bottom_right_causal_mask,
    tree_mask_attention,
    varlen_causal_attention,
)
from harts.ops.attention.naive import (
    ancestor_view_visibility,
    causal_visibility,
    naive_masked_attention,
    tree_mask_visibility,
)
from tests.ops._trees import branches, paths, preorder, random_forest

F64 = torch.float64
HEADS = [
    pytest.param(4, 4, 8, 8, id="H4-G4-D8"),
    pytest.param(4, 2, 8, 8, id="H4-G2-D8"),
    pytest.param(2, 1, 12, 6, id="H2-G1-D12-E6"),
]


def qkv(P, H, G, D, E):
    return [
        torch.randn(P, H, D, dtype=F64, requires_grad=True),
        torch.randn(P, G, D, dtype=F64, requires_grad=True),
        torch.randn(P, G, E, dtype=F64, requires_grad=True),
    ]


def grads(out, inputs, w):
    return torch.autograd.grad((out * w).sum(), inputs)


def assert_all_close(a_list, b_list, tol=1e-11):
    for a, b in zip(a_list, b_list):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("H,G,D,E", HEADS)
@pytest.mark.parametrize("P", [63, 65, 130], ids=lambda p: f"P{p}")
def test_tree_attention_equals_per_path_causal_attention(P, H, G, D, E):
    parent = random_forest(P, num_roots=2, branchy=0.25, seed=P + H)
    pre, end = preorder(parent)
    q_rows, cu_q, kv_rows, cu_kv = branches(parent)
    x = qkv(P, H, G, D, E)
    scale = D**-0.5
    o_view = ancestor_view_attention(*x, q_rows=q_rows, cu_q=cu_q, kv_rows=kv_rows, cu_kv=cu_kv, scale=scale)
    o_mask = tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=scale, row_chunk=16)

    # oracle: expand every root-to-leaf path and run plain causal attention on it
    path_list = paths(parent)
    rows = torch.tensor([r for p in path_list for r in p])
    cu = torch.tensor([0] + [len(p) for p in path_list]).cumsum(0)
    o_paths = varlen_causal_attention(*(t[rows] for t in x), cu_seqlens=cu, scale=scale)
    torch.testing.assert_close(o_view[rows], o_paths, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o_mask[rows], o_paths, rtol=1e-12, atol=1e-12)

    # gradients: each compact row's output counted once (at its first occurrence on a path)
    first = torch.zeros(rows.numel(), dtype=torch.bool)
    seen: set[int] = set()
    for n, r in enumerate(rows.tolist()):
        first[n] = r not in seen
        seen.add(r)
    w = torch.randn(P, H, E, dtype=F64)
    g_view = grads(o_view, x, w)
    g_mask = grads(o_mask, x, w)
    g_paths = torch.autograd.grad((o_paths[first] * w[rows[first]]).sum(), x)
    assert_all_close(g_view, g_paths)
    assert_all_close(g_mask, g_paths)


@pytest.mark.parametrize("H,G,D,E", HEADS)
def test_ops_match_dense_references(H, G, D, E):
    P = 65
    parent = random_forest(P, num_roots=3, branchy=0.3, seed=7)
    pre, end = preorder(parent)
    q_rows, cu_q, kv_rows, cu_kv = branches(parent)
    x = qkv(P, H, G, D, E)
    w = torch.randn(P, H, E, dtype=F64)
    scale = 0.3
    cases = [
        (
            ancestor_view_attention(*x, q_rows=q_rows, cu_q=cu_q, kv_rows=kv_rows, cu_kv=cu_kv, scale=scale),
            ancestor_view_visibility(P, q_rows, cu_q, kv_rows, cu_kv),
        ),
        (tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=scale), tree_mask_visibility(pre, end)),
    ]
    cu = torch.tensor([0, 1, 30, 31, 65])
    cases.append((varlen_causal_attention(*x, cu_seqlens=cu, scale=scale), causal_visibility(cu)))
    for out, vis in cases:
        ref = naive_masked_attention(*x, vis, scale)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        assert_all_close(grads(out, x, w), grads(ref, x, w))


def test_bottom_right_alignment_is_required():
    """A side branch of 2 own rows over 3 ancestors: top-left alignment hides ancestors and is wrong."""
    assert bottom_right_causal_mask(2, 5).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    parent = torch.tensor([-1, 0, 1, 2, 3, 2, 5])  # trunk 0-1-2-3-4, branch 5-6 forks after row 2
    P, H, D = 7, 2, 4
    x = qkv(P, H, H, D, D)
    q_rows, cu_q, kv_rows, cu_kv = branches(parent)
    assert cu_q.tolist() == [0, 5, 7] and cu_kv.tolist() == [0, 5, 10]
    o = ancestor_view_attention(*x, q_rows=q_rows, cu_q=cu_q, kv_rows=kv_rows, cu_kv=cu_kv, scale=0.5)
    path = [0, 1, 2, 5, 6]
    o_path = varlen_causal_attention(*(t[path] for t in x), cu_seqlens=torch.tensor([0, 5]), scale=0.5)
    torch.testing.assert_close(o[[5, 6]], o_path[3:], rtol=1e-12, atol=1e-12)
    # the same branch with top-left alignment (query i sees kv j <= i) gives different outputs
    top_left = torch.ones(2, 5, dtype=torch.bool).tril()
    view = torch.tensor(path)
    from harts.ops.attention.core import attend

    wrong = attend(x[0][[5, 6]], x[1][view], x[2][view], top_left, 0.5)
    assert (wrong - o[[5, 6]]).abs().max() > 1e-3


def test_padding_rows_see_only_themselves_and_unowned_rows_are_zero():
    P, H, D = 6, 2, 4
    x = qkv(P, H, H, D, D)
    pre = torch.tensor([0, 1, -1, 2, -1, 3])
    end = torch.tensor([4, 3, -1, 3, -1, 4])
    o = tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=0.5)
    torch.testing.assert_close(o[[2, 4]], x[2][[2, 4]])
    ref = naive_masked_attention(*x, tree_mask_visibility(pre, end), 0.5)
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
    o_view = ancestor_view_attention(
        *x,
        q_rows=torch.tensor([0, 1]),
        cu_q=torch.tensor([0, 2]),
        kv_rows=torch.tensor([0, 1]),
        cu_kv=torch.tensor([0, 2]),
        scale=0.5,
    )
    assert torch.equal(o_view[2:], torch.zeros(4, H, D, dtype=F64))


def test_bad_inputs_raise():
    x = qkv(5, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="must divide"):
        varlen_causal_attention(*x, cu_seqlens=torch.tensor([0, 5]), scale=1.0)
    x = qkv(5, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="branch 0 has 3 query rows but only 2"):
        ancestor_view_attention(
            *x,
            q_rows=torch.tensor([0, 1, 2]),
            cu_q=torch.tensor([0, 3]),
            kv_rows=torch.tensor([0, 1]),
            cu_kv=torch.tensor([0, 2]),
            scale=1.0,
        )
    with pytest.raises(ValueError, match="impl"):
        tree_mask_attention(*x, tree_pre=torch.arange(5), tree_end=torch.arange(5) + 1, scale=1.0, impl="sdpa")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("D,E", [(64, 32), (192, 128)], ids=["D64-E32", "mla-D192-E128"])
@pytest.mark.parametrize("mask_on", ["device", "host"])
def test_flex_tree_mask_matches_dense_on_cuda(dtype, D, E, mask_on):
    # D192/E128 are the MLA head dims of ling3_tiny: torch 2.11's default float32 forward tile
    # for them needs more shared memory than a Hopper SM has (see flex_kernel_options).
    # mask_on: the BlockMask from the compiled device builder or built on the host (what both
    # execution contexts use)
    P, H, G = 700, 4, 2
    parent = random_forest(P, num_roots=3, branchy=0.05, seed=1)
    pre, end = preorder(parent)
    host = dict(tree_pre_host=pre.numpy(), tree_end_host=end.numpy()) if mask_on == "host" else {}
    x64 = [t.detach().cuda() for t in qkv(P, H, G, D, E)]
    x = [t.to(dtype).requires_grad_() for t in x64]
    w = torch.randn(P, H, E, device="cuda", dtype=torch.float64)
    out_flex = tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=D**-0.5, impl="flex", **host)
    x_ref = [t.clone().requires_grad_() for t in x64]
    out_ref = tree_mask_attention(*x_ref, tree_pre=pre, tree_end=end, scale=D**-0.5, impl="dense")
    # tolerance from the dense path run at the same low precision (flash-attention's rule)
    x_low = [t.detach().to(dtype).requires_grad_() for t in x64]
    out_low = tree_mask_attention(*x_low, tree_pre=pre, tree_end=end, scale=D**-0.5, impl="dense")
    err = lambda a: (a.double() - out_ref).abs().max().item()  # noqa: E731
    assert err(out_flex) <= 2 * err(out_low) + 1e-6
    g_ref = grads(out_ref, x_ref, w)
    g_flex = grads(out_flex.double(), x, w)
    g_low = grads(out_low.double(), x_low, w)
    for a, lo, r in zip(g_flex, g_low, g_ref):
        assert (a.double() - r).abs().max() <= 2 * (lo.double() - r).abs().max() + 1e-5


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler"
)
@pytest.mark.inductor_cpu
def test_flex_tree_mask_compiles_once_for_many_row_counts():
    """Every microbatch has its own P: the compiled FlexAttention must not recompile per P.

    With a static compile per P, dynamo hits its recompile limit (8) after a few microbatches
    and flex_attention silently runs eagerly, materializing [H, P, P] scores (OOM on CUDA at
    training sizes). Run on CPU, where inductor compiles FlexAttention too.
    """
    from torch._dynamo.utils import counters

    from harts.ops.attention.tree_mask import _compiled_block_mask, _compiled_flex

    torch._dynamo.reset()
    _compiled_flex.cache_clear()
    _compiled_block_mask.cache_clear()
    before = counters["stats"]["unique_graphs"]
    sizes = [130, 170, 200, 260, 300, 333, 345, 400, 410, 440]
    with torch.no_grad():
        for P in sizes:
            parent = random_forest(P, num_roots=2, branchy=0.1, seed=P)
            pre, end = preorder(parent)
            x = [t.detach().float() for t in qkv(P, 2, 1, 16, 8)]
            o_flex = tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=0.25, impl="flex")
            o_dense = tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=0.25, impl="dense")
            torch.testing.assert_close(o_flex, o_dense, rtol=1e-5, atol=1e-5)
    # a dynamic compile needs at most a few graphs (sizes 0/1/2 of the block-count dims are
    # specialized): <= 3 for flex_attention, <= 2 for the compiled block-mask builder; one
    # graph per P would be 2 * len(sizes) and the eager fallback beyond 8 each
    assert counters["stats"]["unique_graphs"] - before <= 5


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler"
)
@pytest.mark.inductor_cpu
def test_flex_block_mask_is_built_once_per_cache_and_matches_eager(monkeypatch):
    """Every attention layer of a microbatch shares one BlockMask (``mask_cache``), built by the
    compiled builder; its blocks equal those of eager create_block_mask."""
    from harts.ops.attention import tree_mask as tm

    P = 300
    parent = random_forest(P, num_roots=2, branchy=0.1, seed=7)
    pre, end = preorder(parent)
    compiled = tm.tree_block_mask(pre, end)
    eager = tm._build_block_mask(pre, end)
    assert torch.equal(compiled.kv_num_blocks, eager.kv_num_blocks)
    assert torch.equal(compiled.kv_indices, eager.kv_indices)
    assert torch.equal(compiled.full_kv_num_blocks, eager.full_kv_num_blocks)

    builds = []
    real = tm.tree_block_mask
    monkeypatch.setattr(tm, "tree_block_mask", lambda a, b, **kw: builds.append(1) or real(a, b, **kw))
    cache: dict = {}
    x = [t.detach().float() for t in qkv(P, 2, 1, 16, 8)]
    with torch.no_grad():
        outs = [
            tm.tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=0.25, impl="flex", mask_cache=cache)
            for _ in range(3)
        ]
        dense = tm.tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=0.25, impl="dense")
    assert len(builds) == 1 and "flex_block_mask" in cache
    for o in outs:
        torch.testing.assert_close(o, dense, rtol=1e-5, atol=1e-5)


def test_flex_kernel_options_float32_wide_heads_and_hopper_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 above head dim 128 gets a forward tile that fits shared memory on any GPU; half
    precision above 128 gets the measured Hopper tiles on sm 9.0 only; everything else torch's."""
    from harts.ops.attention.tree_mask import flex_kernel_options

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    opts = flex_kernel_options(cuda, torch.float32, 192, 128)
    assert opts is not None and opts["fwd_BLOCK_M"] * 192 * 4 + opts["fwd_BLOCK_N"] * (192 + 128) * 4 < 227 * 1024
    assert flex_kernel_options(cuda, torch.float32, 128, 128) is None
    assert flex_kernel_options(cpu, torch.float32, 192, 128) is None
    assert flex_kernel_options(cpu, torch.bfloat16, 192, 128) is None
    assert flex_kernel_options(cuda, torch.bfloat16, 128, 128) is None
    half = flex_kernel_options(cuda, torch.bfloat16, 192, 128)
    assert half is not None and half["bwd_BLOCK_N1"] % half["bwd_BLOCK_M1"] == 0  # the kernel's static asserts
    assert half["bwd_BLOCK_M2"] % half["bwd_BLOCK_N2"] == 0
    # bulk tensor copies in the forward only (measured slower in the backward)
    assert half["fwd_USE_TMA"] is True and "USE_TMA" not in half and "bwd_USE_TMA" not in half
    half["bwd_num_warps"] = 1  # a copy: the caller may not change the table
    assert flex_kernel_options(cuda, torch.float16, 192, 128) == {**half, "bwd_num_warps": 8}
    for other in [(8, 0), (10, 0)]:
        capability[0] = other
        assert flex_kernel_options(cuda, torch.bfloat16, 192, 128) is None


def test_flex_backend_choice_and_its_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` by default: Triton where FLASH cannot run (a CPU, float32, GQA, deterministic
    algorithms) and FLASH where it can; ``triton`` on request; ``flash`` where it cannot run names
    why; a bad value names itself. The KV block follows flash-attn-4's Hopper backward tile."""
    import harts.ops.attention.tree_mask as tm
    from harts.ops.attention.tree_mask import flash_kv_block, flex_backend

    cpu = torch.device("cpu")
    monkeypatch.delenv("HARTS_FLEX_BACKEND", raising=False)
    assert flex_backend(cpu, torch.bfloat16, 192, 128) == "triton"
    # where FLASH can run, auto takes it; where its probe failed, auto warns and runs Triton
    monkeypatch.setattr(tm, "_flash_unusable", lambda *a: None)
    assert flex_backend(cpu, torch.bfloat16, 192, 128) == "flash"
    monkeypatch.setattr(tm, "_flash_unusable", lambda *a: "its probe failed (RuntimeError: boom)")
    with pytest.warns(UserWarning, match="boom"):
        assert flex_backend(cpu, torch.bfloat16, 192, 128) == "triton"
    monkeypatch.setattr(tm, "_flash_unusable", lambda *a: "flash-attn-4 is not installed")
    assert flex_backend(cpu, torch.bfloat16, 192, 128) == "triton"
    monkeypatch.undo()
    monkeypatch.setenv("HARTS_FLEX_BACKEND", "auto")
    assert flex_backend(cpu, torch.bfloat16, 192, 128) == "triton"
    monkeypatch.setenv("HARTS_FLEX_BACKEND", "triton")
    assert flex_backend(cpu, torch.bfloat16, 192, 128) == "triton"
    monkeypatch.setenv("HARTS_FLEX_BACKEND", "flash")
    with pytest.raises(RuntimeError, match="not a CUDA device"):
        flex_backend(cpu, torch.bfloat16, 192, 128)
    monkeypatch.setenv("HARTS_FLEX_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="'cutlass'"):
        flex_backend(cpu, torch.bfloat16, 192, 128)
    assert [flash_kv_block(d, 128) for d in (64, 128, 192, 256)] == [128, 128, 96, 64]


def test_layers_of_other_head_dims_get_flashs_kv_block_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A microbatch's mask cache shared by MLA (qk 192: FLASH's KV block 96) and GQA layers (head
    dim 128: KV block 128): each gets a BlockMask of its own KV block, each built once."""
    from harts.ops.attention import tree_mask as tm

    P = 200
    pre, end = preorder(random_forest(P, num_roots=2, branchy=0.1, seed=3))
    seen = []
    monkeypatch.setattr(tm, "flex_backend", lambda *a, **k: "flash")
    monkeypatch.setattr(tm, "_flex", lambda q, k, v, block_mask, scale, flash=False: seen.append(block_mask) or q)
    cache: dict = {}
    for d in (192, 128, 192, 128):
        x = [t.detach().float() for t in qkv(P, 2, 1, d, 128)]
        tm.tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=0.1, impl="flex", mask_cache=cache)
    assert [m.BLOCK_SIZE for m in seen] == [(128, 96), (128, 128), (128, 96), (128, 128)]
    assert seen[0] is seen[2] and seen[1] is seen[3]
    assert sorted(cache) == ["flex_block_mask_flash_128", "flex_block_mask_flash_96"]


@pytest.mark.parametrize("kv_block", [96, 64, 128])
def test_block_mask_with_narrow_kv_blocks_covers_the_tree_mask(kv_block: int) -> None:
    """The (128, kv_block) BlockMask FLASH reads: its dense block map marks exactly the blocks
    holding a visible pair (and the diagonal's), its full blocks only fully visible ones."""
    from harts.ops.attention.tree_mask import _build_block_mask

    P = 700
    parent = random_forest(P, num_roots=3, branchy=0.1, seed=kv_block)
    pre, end = preorder(parent)
    bm = _build_block_mask(pre, end, kv_block)
    assert bm.BLOCK_SIZE == (128, kv_block)
    vis = (pre[None, :] <= pre[:, None]) & (pre[:, None] < end[None, :]) | torch.eye(P, dtype=torch.bool)
    nq, nk = -(-P // 128), -(-P // kv_block)
    padded = torch.zeros(nq * 128, nk * kv_block, dtype=torch.bool)
    padded[:P, :P] = vis
    blocks = padded.view(nq, 128, nk, kv_block)
    any_, all_ = blocks.any(dim=(1, 3)), blocks.all(dim=(1, 3))
    dense = bm.to_dense()[0, 0].bool()  # partial or full
    assert torch.equal(dense, any_)
    full = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        n = int(bm.full_kv_num_blocks[0, 0, i])
        full[i, bm.full_kv_indices[0, 0, i, :n].long()] = True
    assert not (full & ~all_).any()


@pytest.mark.gpu
@pytest.mark.parametrize("mask_on", ["device", "host"])
def test_flash_backend_matches_dense_tree_attention(monkeypatch: pytest.MonkeyPatch, mask_on: str) -> None:
    """On a GPU with flash-attn-4: FLASH's output and gradients on a branchy tree against the
    dense reference in float32 (bf16 inputs), as close as the Triton kernel gets, with its
    (128, 96) BlockMask built on the device and on the host (what both execution contexts do)."""
    from harts.ops.attention.tree_mask import flex_backend

    dev = torch.device("cuda")
    monkeypatch.setenv("HARTS_FLEX_BACKEND", "flash")
    try:
        flex_backend(dev, torch.bfloat16, 192, 128)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    P, H = 3000, 4
    parent = random_forest(P, num_roots=3, branchy=0.05, seed=3)
    pre, end = (t.to(dev) for t in preorder(parent))
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(P, H, 192, device=dev, generator=gen) for _ in range(2))
    v = torch.randn(P, H, 128, device=dev, generator=gen)
    go = torch.randn(P, H, 128, device=dev, generator=gen)
    host = {"tree_pre_host": pre.cpu().numpy(), "tree_end_host": end.cpu().numpy()} if mask_on == "host" else {}
    outs = {}
    for name, dtype, impl in [("ref", torch.float32, "dense"), ("flash", torch.bfloat16, "flex")]:
        x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        kw = host if impl == "flex" else {}
        o = tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=192**-0.5, impl=impl, **kw)
        o.backward(go.to(dtype))
        outs[name] = [o.detach().float(), *(t.grad.float() for t in x)]
    for got, ref in zip(outs["flash"], outs["ref"]):
        assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2


def _laid_out_tree(trunk: int, branch: int, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [P] tree_pre / tree_end of a trunk with two branches of ``branch`` rows, rows in
    preorder as harts lays them out, then ``padding`` rows: (128, 128) blocks of it are full
    (trunk against trunk), partial (the diagonal, the fork), empty (second branch against the
    first) and ragged (the last)."""
    n = trunk + 2 * branch
    pre = torch.cat([torch.arange(n), torch.full((padding,), -1)])
    end = torch.cat(
        [torch.full((trunk,), n), torch.full((branch,), trunk + branch), torch.full((branch,), n), torch.zeros(padding)]
    ).long()
    return pre, end


_WIDE_TREE = _laid_out_tree(200, 200, 3)
_WIDE_VISIBLE = functools.cache(lambda: tree_mask_visibility(*_WIDE_TREE))

HEAD_DIM_CASES = [
    pytest.param(D, G, torch.bfloat16, id=f"bf16-D{D}-H16-G{G}") for D in (64, 128, 192, 256) for G in (2, 4, 16)
] + [pytest.param(256, 2, torch.float32, id="f32-D256-H16-G2")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("D,G,dtype", HEAD_DIM_CASES)
def test_flex_tree_mask_every_head_dim_and_kv_heads_on_cuda(
    monkeypatch: pytest.MonkeyPatch, D: int, G: int, dtype: torch.dtype
) -> None:
    """The Triton "flex" path at head dims 64 to 256 with 16 query heads over 2, 4 and 16 KV heads
    (Qwen3-Next's GQA layers: 256 over 2), forward and backward, against the naive float64
    reference: as close as the dense path in the same precision gets (flash-attention's rule).
    At 192 and 256 this compiles the tiles ``flex_tiles`` picked to fit shared memory (the ones
    before needed 270,336 bytes on an H200 and did not compile)."""
    monkeypatch.setenv("HARTS_FLEX_BACKEND", "triton")
    H, dev = 16, torch.device("cuda")
    pre, end = _WIDE_TREE
    P = pre.numel()
    gen = torch.Generator(device=dev).manual_seed(D + G)
    x64 = [torch.randn(P, h, D, device=dev, dtype=F64, generator=gen) for h in (H, G, G)]
    go = torch.randn(P, H, D, device=dev, dtype=F64, generator=gen)
    scale = D**-0.5
    host = {"tree_pre_host": pre.numpy(), "tree_end_host": end.numpy()}
    runs = {}
    for name, dt in [("ref", F64), ("flex", dtype), ("low", dtype)]:
        x = [t.detach().to(dt).requires_grad_() for t in x64]
        if name == "ref":
            o = naive_masked_attention(*x, _WIDE_VISIBLE().to(dev), scale)
        else:
            impl, kw = ("flex", host) if name == "flex" else ("dense", {})
            o = tree_mask_attention(*x, tree_pre=pre, tree_end=end, scale=scale, impl=impl, **kw)
        o.backward(go.to(dt))
        runs[name] = [o.detach().double(), *(t.grad.double() for t in x)]
    for what, got, low, ref in zip(["out", "dq", "dk", "dv"], runs["flex"], runs["low"], runs["ref"]):
        assert torch.isfinite(got).all(), what
        err, err_low = (got - ref).abs().max().item(), (low - ref).abs().max().item()
        assert err <= 2 * err_low + 2e-3 * ref.abs().max().item(), (what, err, err_low)


VARLEN_CASES = [pytest.param(D, G, id=f"bf16-D{D}-H16-G{G}") for D in (64, 128, 256) for G in (2, 4, 16)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("D,G", VARLEN_CASES)
def test_flash_varlen_ancestor_views_and_packed_causal_on_cuda(D: int, G: int) -> None:
    """The CUDA path of ``ancestor_view_attention`` and ``varlen_causal_attention`` (one
    FlashAttention-2 varlen call, bottom-right causal; ``attention="gather"`` on CUDA) at head
    dims 64 to 256 over 2, 4 and 16 KV heads, forward and backward, against the naive float64
    reference: as close as the dense path in bf16 gets. The forest has branches whose own rows
    are not in physical order, so the query gather and output scatter run too."""
    from harts.ops.attention.flash_varlen import flash_varlen_refusal

    H, dev = 16, torch.device("cuda")
    assert flash_varlen_refusal(dev, torch.bfloat16, D, D, H, G) is None
    P = 333
    parent = random_forest(P, num_roots=3, branchy=0.3, seed=D + G)
    q_rows, cu_q, kv_rows, cu_kv = branches(parent)
    cu = torch.tensor([0, 1, 100, 101, 250, P])
    cases = {
        "views": (
            ancestor_view_visibility(P, q_rows, cu_q, kv_rows, cu_kv),
            dict(
                q_rows=q_rows.to(dev),
                cu_q=cu_q.to(dev),
                kv_rows=kv_rows.to(dev),
                cu_kv=cu_kv.to(dev),
                cu_q_host=cu_q.numpy(),
                cu_kv_host=cu_kv.numpy(),
                q_rows_host=q_rows.numpy(),
            ),  # fmt: skip
        ),
        "packed": (causal_visibility(cu), dict(cu_seqlens=cu.to(dev), cu_seqlens_host=cu.numpy())),
    }
    gen = torch.Generator(device=dev).manual_seed(D * G)
    x64 = [torch.randn(P, h, D, device=dev, dtype=F64, generator=gen) for h in (H, G, G)]
    go = torch.randn(P, H, D, device=dev, dtype=F64, generator=gen)
    scale = D**-0.5
    for case, (vis, kw) in cases.items():
        runs = {}
        for name, dt in [("ref", F64), ("flash", torch.bfloat16), ("low", torch.bfloat16)]:
            x = [t.detach().to(dt).requires_grad_() for t in x64]
            if name == "flash":
                op = ancestor_view_attention if case == "views" else varlen_causal_attention
                o = op(*x, scale=scale, **kw)
            else:
                o = naive_masked_attention(*x, vis.to(dev), scale)
            o.backward(go.to(dt))
            runs[name] = [o.detach().double(), *(t.grad.double() for t in x)]
        for what, got, low, ref in zip(["out", "dq", "dk", "dv"], runs["flash"], runs["low"], runs["ref"]):
            assert torch.isfinite(got).all(), (case, what)
            err, err_low = (got - ref).abs().max().item(), (low - ref).abs().max().item()
            assert err <= 2 * err_low + 2e-3 * ref.abs().max().item(), (case, what, err, err_low)


def test_flash_varlen_refusals_name_the_reason() -> None:
    """Where FlashAttention-2 cannot run, the reason is named (callers then keep their reference
    path; ``attention="auto"`` does not choose it)."""
    from harts.ops.attention.flash_varlen import flash_varlen_attention, flash_varlen_refusal

    assert "CUDA" in flash_varlen_refusal(torch.device("cpu"), torch.bfloat16, 128, 128, 16, 2)
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="CUDA"):
        flash_varlen_attention(
            x, x, x, cu_q=torch.tensor([0, 4]), cu_k=torch.tensor([0, 4]), max_q=4, max_k=4, scale=1.0
        )


def test_view_gather_sums_gradients_in_float32() -> None:
    """The K/V gather of the CUDA views path: index_select forward; its backward sums a row read
    by many views in float32 (float64 equal to index_select's own; bf16 closer to the float64 sum
    than bf16 accumulation gets)."""
    from harts.ops.attention.ancestor_view import _GatherRows

    rows = torch.tensor([0, 1, 0, 2, 0, 1] * 50)
    x = torch.randn(3, 2, 4, dtype=F64, requires_grad=True)
    g = torch.randn(rows.numel(), 2, 4, dtype=F64)
    (ref,) = torch.autograd.grad(x.index_select(0, rows), x, g)
    (got,) = torch.autograd.grad(_GatherRows.apply(x, rows), x, g)
    assert torch.equal(got, ref)
    xb = x.detach().bfloat16().requires_grad_()
    (got_b,) = torch.autograd.grad(_GatherRows.apply(xb, rows), xb, g.bfloat16())
    (plain_b,) = torch.autograd.grad(xb.index_select(0, rows), xb, g.bfloat16())
    assert (got_b.double() - ref).abs().max() <= (plain_b.double() - ref).abs().max()
    assert (got_b.double() - ref).abs().max() <= 2**-7 * ref.abs().max()
