"""The host-built FlexAttention BlockMask equals ``create_block_mask``'s, list for list.

Cases: document-causal rows (trajectory mode), shuffled forests with padding, block-shuffled
trees with a long trunk (full blocks in a non-monotone order), and real compact layouts from
the planner (padding via ``pad_to``); P not a multiple of the block size.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from harts.ops.attention import tree_mask as tm
from harts.ops.attention.host_block_mask import block_lists, host_block_mask, tree_block_classes
from tests.ops._trees import preorder, random_forest
from tests.strategies import compact_batches

LISTS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)
needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler"
)


def reference_mask(pre: np.ndarray, end: np.ndarray, block: int) -> BlockMask:
    """create_block_mask, eager on CPU: the mask_mod on the whole [P, P] grid."""
    mod = tm.tree_mask_mod(torch.from_numpy(pre), torch.from_numpy(end))
    return create_block_mask(mod, None, None, len(pre), len(pre), device="cpu", BLOCK_SIZE=block)


def host_mask(pre: np.ndarray, end: np.ndarray, block: int) -> BlockMask:
    mod = tm.tree_mask_mod(torch.from_numpy(pre), torch.from_numpy(end))
    return host_block_mask(pre, end, mod, torch.device("cpu"), block)


def assert_same_block_mask(got: BlockMask, want: BlockMask) -> None:
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    for name in LISTS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.int32, name
        assert torch.equal(a, b), name
    # the q-side (backward) lists are what from_kv_blocks derives from the kv lists
    derived = BlockMask.from_kv_blocks(
        got.kv_num_blocks, got.kv_indices, got.full_kv_num_blocks, got.full_kv_indices, BLOCK_SIZE=got.BLOCK_SIZE
    )
    for name in LISTS[4:]:
        assert torch.equal(getattr(got, name), getattr(derived, name)), name


def document_causal(P_docs: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(P_docs)
    return np.arange(int(ends[-1]), dtype=np.int64), np.repeat(ends, P_docs).astype(np.int64)


def with_padding(pre: np.ndarray, end: np.ndarray, frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Insert padding rows (pre = end = -1) at random physical places."""
    rng = np.random.default_rng(seed)
    num_pad = max(1, int(frac * len(pre)))
    at = np.sort(rng.integers(0, len(pre) + 1, num_pad))
    return np.insert(pre, at, -1), np.insert(end, at, -1)


def trunk_tree_block_shuffled(seed: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """A 700-row trunk over a random forest, in preorder, then whole blocks permuted and rows
    shuffled inside each block, plus padding blocks: full blocks in a non-monotone order."""
    rng = np.random.default_rng(seed)
    below = random_forest(500, num_roots=3, branchy=0.2, seed=seed)
    trunk = 700
    parent = np.concatenate([np.arange(-1, trunk - 1), np.where(below.numpy() >= 0, below.numpy() + trunk, trunk - 1)])
    pre, end = (x.numpy() for x in preorder(torch.from_numpy(parent)))
    order = np.argsort(pre)
    pre, end = pre[order], end[order]
    n = len(pre) // block
    rows_nB = rng.permutation(n)[:, None] * block + rng.permutation(block)[None, :]
    idx = np.concatenate([rows_nB.reshape(-1), np.arange(n * block, len(pre))])
    pre, end = pre[idx], end[idx]
    pad = np.full(block + 17, -1, dtype=np.int64)
    cut = 3 * block
    return np.concatenate([pre[:cut], pad, pre[cut:]]), np.concatenate([end[:cut], pad, end[cut:]])


@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("seed", range(3))
def test_document_causal_rows(seed, block):
    rng = np.random.default_rng(seed)
    pre, end = document_causal(rng.integers(1, 700, size=int(rng.integers(3, 6))).tolist() + [300])
    assert len(pre) % 128
    got, want = host_mask(pre, end, block), reference_mask(pre, end, block)
    assert_same_block_mask(got, want)
    assert int(want.full_kv_num_blocks.sum()) > 0  # full blocks are exercised
    # block bounds are exact for document-causal rows
    for a, b in zip(tree_block_classes(pre, end, block), tree_block_classes(pre, end, block, exact=False)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("P", [300, 517, 1300])
def test_shuffled_forests_with_padding(P):
    pre, end = (x.numpy() for x in preorder(random_forest(P, num_roots=3, branchy=0.1, seed=P)))
    pre, end = with_padding(pre, end, 0.05, seed=P)
    for block in (128, 32):
        assert_same_block_mask(host_mask(pre, end, block), reference_mask(pre, end, block))


@pytest.mark.parametrize("seed", range(3))
def test_block_shuffled_trunk_trees(seed):
    for block in (128, 64):
        pre, end = trunk_tree_block_shuffled(seed, block)
        want = reference_mask(pre, end, block)
        assert_same_block_mask(host_mask(pre, end, block), want)
        assert int(want.full_kv_num_blocks.sum()) > 0


def planner_layouts(pad_to: int) -> list:
    from harts.plan.layout import build_layout
    from harts.plan.step import plan_step
    from harts.tree.workloads import generate

    plan = plan_step(generate("tiny", step=0), dp=1, capacity=1500)
    return [build_layout(cb, cp, pad_to=pad_to) for cb, cp in plan.prepare_replica(0, 16)]


def test_planner_compact_layouts():
    checked = 0
    for layout in planner_layouts(pad_to=8):
        pre, end = layout.tree_pre, layout.tree_end
        assert (pre < 0).any() and np.any(pre[1:] < pre[:-1])  # padding, non-monotone order
        for block in (128, 32):
            want = reference_mask(pre, end, block)
            assert_same_block_mask(host_mask(pre, end, block), want)
            # the conservative bounds never drop a block the exact rule keeps
            ep, ef = tree_block_classes(pre, end, block)
            bp, bf = tree_block_classes(pre, end, block, exact=False)
            assert np.array_equal(ef, bf) and not (ep & ~bp).any()
            checked += 1
    assert checked >= 2


@given(compact_batches(), st.sampled_from([1, 3, 8]), st.sampled_from([2, 4, 16]))
@settings(max_examples=30, deadline=None)
def test_random_compact_layouts(cbb, pad_to, block):
    """Layouts of random trees (several trees, forks at any position, padding), at block sizes
    small enough for many full, partial and empty blocks."""
    from harts.plan.calls import plan_calls
    from harts.plan.layout import build_layout

    cb, b = cbb
    layout = build_layout(cb, plan_calls(cb.segment_trees, b), pad_to=pad_to)
    pre, end = layout.tree_pre, layout.tree_end
    assert_same_block_mask(host_mask(pre, end, block), reference_mask(pre, end, block))


RECTANGLES = [(128, 96), (32, 24), (24, 40), (16, 6)]


@pytest.mark.parametrize("block", RECTANGLES)
def test_rectangular_blocks(block):
    """(q rows, kv rows) blocks, flash-attn-4's (128, 96) among them, on document-causal rows,
    padded shuffled forests, block-shuffled trunk trees and planner layouts: the same lists as
    ``create_block_mask`` with that BLOCK_SIZE (rows are then shared by blocks of different
    index on the two sides, so full and non-empty blocks lie off the block diagonal)."""
    cases = [document_causal([333, 517, 40, 300])]
    forest = (x.numpy() for x in preorder(random_forest(700, num_roots=3, branchy=0.1, seed=5)))
    cases.append(with_padding(*forest, 0.05, seed=5))
    cases.append(trunk_tree_block_shuffled(1, 48))
    cases += [(lay.tree_pre, lay.tree_end) for lay in planner_layouts(pad_to=8)]
    fulls = 0
    for pre, end in cases:
        want = reference_mask(pre, end, block)
        assert want.BLOCK_SIZE == block
        assert_same_block_mask(host_mask(pre, end, block), want)
        fulls += int(want.full_kv_num_blocks.sum())
        ep, ef = tree_block_classes(pre, end, block)
        bp, bf = tree_block_classes(pre, end, block, exact=False)
        assert np.array_equal(ef, bf) and not (ep & ~bp).any()
    assert fulls > 0


@given(compact_batches(), st.sampled_from([1, 3, 8]), st.sampled_from([(4, 2), (2, 6), (16, 12), (6, 4)]))
@settings(max_examples=30, deadline=None)
def test_random_compact_layouts_rectangular(cbb, pad_to, block):
    from harts.plan.calls import plan_calls
    from harts.plan.layout import build_layout

    cb, b = cbb
    layout = build_layout(cb, plan_calls(cb.segment_trees, b), pad_to=pad_to)
    pre, end = layout.tree_pre, layout.tree_end
    assert_same_block_mask(host_mask(pre, end, block), reference_mask(pre, end, block))


def test_bad_block_sizes_raise():
    pre, end = document_causal([5, 7])
    for bad in (1, (128,), (128, 96, 2), (128, 1), (128.0, 96), "128"):
        with pytest.raises(ValueError, match="block_size"):
            tree_block_classes(pre, end, bad)


def test_a_wrong_end_changes_the_full_blocks_and_is_caught():
    """Shorten one row's subtree inside a full block: that block must turn partial, and a mask
    built from the stale (unmutated) arrays no longer matches the reference."""
    pre, end = document_causal([600, 300, 250])
    _, full = tree_block_classes(pre, end)
    a, b = np.argwhere(full)[0]
    j = 128 * b + 5  # a kv row of the full block: it now ends before the queries of block a
    bad_end = end.copy()
    bad_end[j] = pre[j] + 1
    _, bad_full = tree_block_classes(pre, bad_end)
    assert full[a, b] and not bad_full[a, b]
    want = reference_mask(pre, bad_end, 128)
    assert_same_block_mask(host_mask(pre, bad_end, 128), want)
    with pytest.raises(AssertionError):
        assert_same_block_mask(host_mask(pre, end, 128), want)


def test_block_lists_order():
    blocks = np.array([[True, False, True], [False, False, False], [False, True, True]])
    num, idx = block_lists(blocks)
    assert num.tolist() == [2, 0, 2] and idx.tolist() == [[0, 2, 1], [0, 1, 2], [1, 2, 0]]
    assert num.dtype == idx.dtype == np.int32


def test_bad_host_arrays_raise():
    pre, end = document_causal([5, 7])
    with pytest.raises(ValueError, match="distinct"):
        tree_block_classes(np.r_[pre, 3], np.r_[end, 12])
    with pytest.raises(ValueError, match="exceed"):
        tree_block_classes(pre, np.where(pre == 4, 4, end))
    with pytest.raises(ValueError, match=r"\[P\]"):
        tree_block_classes(pre, end[:-1])
    x = [torch.randn(12, 2, 4), torch.randn(12, 1, 4), torch.randn(12, 1, 4)]
    t_pre, t_end = torch.from_numpy(pre), torch.from_numpy(end)
    with pytest.raises(ValueError, match="both or neither"):
        tm.tree_mask_attention(*x, tree_pre=t_pre, tree_end=t_end, scale=1.0, impl="flex", tree_pre_host=pre)
    with pytest.raises(ValueError, match="P=12"):
        tm.tree_mask_attention(
            *x, tree_pre=t_pre, tree_end=t_end, scale=1.0, impl="flex", tree_pre_host=pre[:-1], tree_end_host=end[:-1]
        )


def test_execution_contexts_pass_their_host_arrays(monkeypatch):
    """Both execution contexts hand tree_mask_attention host copies equal to the device tensors
    (so the flex path builds the mask on the host)."""
    import harts.ops.attention as attention_ops
    from harts.models.execution.backends import Backends
    from harts.models.execution.compact import CompactContext
    from harts.models.execution.trajectory import TrajectoryContext
    from harts.tree.workloads import generate

    seen = []

    def spy(*args, **kw):  # noqa: ANN002, ANN003
        seen.append(kw)
        return torch.zeros_like(args[0])

    monkeypatch.setattr(attention_ops, "tree_mask_attention", spy)
    cpu = torch.device("cpu")
    contexts = [
        TrajectoryContext(generate("tiny", step=0), 16, cpu, Backends(attention="mask")),
        CompactContext(planner_layouts(pad_to=8)[0], device=cpu, backends=Backends(attention="mask")),
    ]
    for ctx in contexts:
        P = ctx.num_rows
        ctx.attention(torch.zeros(P, 2, 4), torch.zeros(P, 1, 4), torch.zeros(P, 1, 4), scale=1.0)
    assert len(seen) == 2
    for kw in seen:
        assert np.array_equal(kw["tree_pre_host"], kw["tree_pre"].numpy())
        assert np.array_equal(kw["tree_end_host"], kw["tree_end"].numpy())


@needs_compiler
@pytest.mark.inductor_cpu
def test_flex_with_host_masks_matches_dense_reference_without_recompiling(monkeypatch):
    """FlexAttention (compiled for CPU: float32 only) under host-built masks against the float64
    dense reference, err <= 2 x the float32 dense error. The device builder is never called,
    the mask is cached, and masks of five row counts share the dynamic-shape graph (one graph
    per P would hit dynamo's recompile limit and fall back to eager [H, P, P] scores). A
    partial block marked full is visible in the output (the kernel skips its mask_mod)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(tm, "tree_block_mask", lambda *a: pytest.fail("device builder called"))
    torch._dynamo.reset()
    tm._compiled_flex.cache_clear()
    before = counters["stats"]["unique_graphs"]
    cases = [document_causal([600, 300, 250]), trunk_tree_block_shuffled(0, 128)]
    for P in (130, 333, 520):
        pre, end = (x.numpy() for x in preorder(random_forest(P, num_roots=2, branchy=0.1, seed=P)))
        cases.append(with_padding(pre, end, 0.05, seed=P))
    for pre, end in cases:
        P = len(pre)
        x64 = [torch.randn(P, 2, 16, dtype=torch.float64), torch.randn(P, 1, 16, dtype=torch.float64)]
        x64.append(torch.randn(P, 1, 8, dtype=torch.float64))
        x32 = [t.float() for t in x64]
        t_pre, t_end = torch.from_numpy(pre), torch.from_numpy(end)
        cache: dict = {}
        with torch.no_grad():
            outs = [
                tm.tree_mask_attention(
                    *x32,
                    tree_pre=t_pre,
                    tree_end=t_end,
                    scale=0.25,
                    impl="flex",
                    mask_cache=cache,
                    tree_pre_host=pre,
                    tree_end_host=end,
                )  # fmt: skip
                for _ in range(2)
            ]
        assert isinstance(cache["flex_block_mask"], BlockMask)
        ref = tm.tree_mask_attention(*x64, tree_pre=t_pre, tree_end=t_end, scale=0.25, impl="dense")
        low = tm.tree_mask_attention(*x32, tree_pre=t_pre, tree_end=t_end, scale=0.25, impl="dense")
        err_low = (low.double() - ref).abs().max().item()
        for o in outs:
            assert (o.double() - ref).abs().max().item() <= 2 * err_low + 1e-6
    assert counters["stats"]["unique_graphs"] - before <= 3

    # the kernel skips the mask_mod on full blocks: one partial block marked full shows
    pre, end = cases[0]
    P = len(pre)
    partial, full = tree_block_classes(pre, end)
    a, b = np.argwhere(partial & ~np.eye(len(partial), dtype=bool))[0]
    partial[a, b], full[a, b] = False, True
    lists = [torch.from_numpy(x[None, None]) for x in (*block_lists(partial), *block_lists(full))]
    t_pre, t_end = torch.from_numpy(pre), torch.from_numpy(end)
    wrong = BlockMask.from_kv_blocks(
        *lists, BLOCK_SIZE=128, mask_mod=tm.tree_mask_mod(t_pre, t_end), seq_lengths=(P, P)
    )
    x32 = [torch.randn(P, 2, 16), torch.randn(P, 1, 16), torch.randn(P, 1, 8)]
    with torch.no_grad():
        o_wrong = tm._flex(*x32, wrong, 0.25)
        ref = tm.tree_mask_attention(*x32, tree_pre=t_pre, tree_end=t_end, scale=0.25, impl="dense")
    assert (o_wrong - ref).abs().max().item() > 1e-2
