"""Physical layout: every view is checked against the compact trie (CompactBatch.parent)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.plan.calls import plan_calls
from harts.plan.layout import Layout, build_layout
from harts.tree.compact import CompactBatch, compact
from tests.strategies import batch_from_forest, compact_batches, spine_forest


def true_ancestors(cb: CompactBatch, c: int) -> list[int]:
    """Compact rows of c's ancestors, root first (by walking CompactBatch.parent)."""
    out = []
    c = int(cb.parent[c])
    while c >= 0:
        out.append(c)
        c = int(cb.parent[c])
    return out[::-1]


def check_layout(cb: CompactBatch, lay: Layout, b: int, pad_to: int, no_replay: bool) -> None:
    p = lay.num_rows
    c = cb.num_compact_tokens
    p2c = lay.phys_to_compact
    real = ~lay.is_pad
    assert np.array_equal(lay.is_pad, p2c < 0) and int(real.sum()) == c
    assert np.array_equal(lay.compact_to_phys[p2c[real]], np.flatnonzero(real))
    np.testing.assert_array_equal(lay.position[real], cb.position[p2c[real]])
    np.testing.assert_array_equal(lay.tokens[real], cb.tokens[p2c[real]])
    np.testing.assert_array_equal(lay.multiplicity[real], cb.multiplicity[p2c[real]])
    assert np.all(lay.multiplicity[lay.is_pad] == 0) and np.all(lay.position[lay.is_pad] == 0)

    # every physical row is written exactly once; every compact row once as a real output
    outs = np.concatenate([r.out_rows for r in lay.rounds])
    assert sorted(outs.tolist()) == list(range(p))
    assert sorted(p2c[outs][real[outs]].tolist()) == list(range(c))

    # boundary states: each id requested once, consumed only by later rounds
    req_where: dict[int, tuple[int, int, int]] = {}
    for k, r in enumerate(lay.rounds):
        for (s, cnt), rid in zip(r.requests.tolist(), r.request_ids.tolist()):
            assert rid not in req_where
            assert 0 < cnt <= r.cu_seqlens[s + 1] - r.cu_seqlens[s]
            if not no_replay:
                assert cnt % b == 0
            req_where[rid] = (k, s, cnt)
    assert sorted(req_where) == list(range(lay.num_boundary_states))

    for k, r in enumerate(lay.rounds):
        assert r.cu_seqlens[0] == 0 and r.cu_seqlens[-1] == r.la_rows.size
        assert np.array_equal(r.out_rows, r.la_rows[r.is_output])
        assert np.array_equal(r.out_rows, np.arange(r.out_rows[0], r.out_rows[-1] + 1)), "outputs contiguous"
        for i in range(r.num_sequences):
            rows = r.la_rows[r.cu_seqlens[i] : r.cu_seqlens[i + 1]]
            isout = r.is_output[r.cu_seqlens[i] : r.cu_seqlens[i + 1]]
            n_rep = int((~isout).sum())
            assert not isout[:n_rep].any() and isout[n_rep:].all(), "replay rows come first"
            own = rows[n_rep:]
            own_real = own[real[own]]
            assert real[own[: own_real.size]].all(), "padding only at the end of a sequence"
            assert own.size % pad_to == 0
            c0 = int(p2c[own_real[0]])
            pos0 = int(cb.position[c0])
            # own rows form one path of the trie
            oc = p2c[own_real]
            assert np.array_equal(cb.parent[oc[1:]], oc[:-1])
            # replay rows are exactly the ancestors at positions a(p) .. p-1
            anc = true_ancestors(cb, c0)
            expect = [] if no_replay else anc[pos0 // b * b :]
            assert p2c[rows[:n_rep]].tolist() == expect
            first_pos = int(lay.position[rows[0]])
            if no_replay:
                assert first_pos == pos0
            else:
                assert first_pos % b == 0, "LA input starts on the trajectory's chunk grid"
            # the initial state is the state right before the first LA row, from an earlier round
            init = int(r.init_state[i])
            if init < 0:
                assert first_pos == 0
            else:
                pk, ps, cnt = req_where[init]
                assert pk < k
                src = lay.rounds[pk]
                last = src.la_rows[src.cu_seqlens[ps] + cnt - 1]
                assert cb.parent[p2c[rows[0]]] == p2c[last]

    # attention view (a): |Q| = l, |KV| = h + l, bottom-right causal = ancestors-or-self
    qs = lay.attn_q_rows
    assert sorted(qs.tolist()) == np.flatnonzero(real).tolist()
    for bi in range(lay.attn_cu_q.size - 1):
        q = qs[lay.attn_cu_q[bi] : lay.attn_cu_q[bi + 1]]
        kv = lay.attn_kv_rows[lay.attn_cu_kv[bi] : lay.attn_cu_kv[bi + 1]]
        h = kv.size - q.size
        assert np.array_equal(kv[h:], q)
        assert h == lay.position[q[0]]
        for i in (0, q.size // 2, q.size - 1):
            seen = p2c[kv[: h + i + 1]].tolist()
            assert seen == true_ancestors(cb, int(p2c[q[i]])) + [int(p2c[q[i]])]

    # attention view (b): the tree mask is the ancestor-or-self relation
    mask = lay.tree_mask()
    ref = np.eye(p, dtype=bool)
    for i in np.flatnonzero(real):
        for a in true_ancestors(cb, int(p2c[i])):
            ref[i, lay.compact_to_phys[a]] = True
    assert np.array_equal(mask, ref)

    # causal-conv context: true ancestors, -1 beyond the root and on padding
    k = 3
    anc3 = lay.ancestors(k)
    for i in range(p):
        chain = [] if lay.is_pad[i] else true_ancestors(cb, int(p2c[i]))[::-1][:k]
        want = [int(lay.compact_to_phys[x]) for x in chain] + [-1] * (k - len(chain))
        assert anc3[i].tolist() == want

    # semantic positions
    batch = cb.batch
    np.testing.assert_array_equal(lay.tokens[lay.semantic_to_phys], batch.tokens)
    within = np.arange(batch.num_tokens) - np.repeat(batch.offsets[:-1], batch.lengths)
    np.testing.assert_array_equal(lay.position[lay.semantic_to_phys], within)


@given(compact_batches(), st.sampled_from([1, 3, 8]), st.booleans())
@settings(max_examples=40)
def test_layout_properties(cbb, pad_to, no_replay):
    cb, b = cbb
    plan = plan_calls(cb.segment_trees, b)
    lay = build_layout(cb, plan, pad_to=pad_to, no_replay=no_replay)
    check_layout(cb, lay, b, pad_to, no_replay)
    if not no_replay:
        assert lay.num_calls == plan.num_calls
        assert sum(int((~r.is_output).sum()) for r in lay.rounds) == plan.total_replay
        assert lay.num_boundary_states == plan.num_requests
    else:
        assert all((r.is_output).all() for r in lay.rounds)
        assert lay.num_calls >= plan.num_calls


@pytest.mark.parametrize("seed", range(6))
def test_layout_on_spine_forests(seed):
    """Long spines with side leaves and nested spines: deep sequence trees, whose ancestor
    ranges (view a), replay rows and parent rows cross several sequences."""
    rng = np.random.default_rng(100 + seed)
    b = int(rng.choice([2, 3, 4]))
    cb = compact(batch_from_forest(rng, *spine_forest(rng, b, max_spine=15)))
    plan = plan_calls(cb.segment_trees, b)
    for pad_to, no_replay in ((1, False), (4, False), (1, True), (3, True)):
        check_layout(cb, build_layout(cb, plan, pad_to=pad_to, no_replay=no_replay), b, pad_to, no_replay)


def test_multiple_trees_share_rounds():
    rng = np.random.default_rng(5)
    # three trees, each forking once across a chunk boundary (B = 4): 2 calls, 3 + 3 sequences
    lengths = [6, 3, 3] * 3
    parents = [-1, 0, 0, -1, 3, 3, -1, 6, 6]
    cb = compact(batch_from_forest(rng, lengths, parents))
    assert cb.segment_trees.num_trees == 3
    plan = plan_calls(cb.segment_trees, 4)
    lay = build_layout(cb, plan)
    assert lay.num_calls == 2
    assert [r.num_sequences for r in lay.rounds] == [3, 3]
    # round 2 sequences start from states of three different round-1 sequences
    assert sorted(lay.rounds[0].requests[:, 0].tolist()) == [0, 1, 2]
    assert sorted(lay.rounds[1].init_state.tolist()) == [0, 1, 2]
    check_layout(cb, lay, 4, 1, False)


def test_figure_style_replay_rows():
    """A fork at p = B + 3 (B = 8): the side branch replays rows at positions 8, 9, 10."""
    trajs = [list(range(1, 12)) + [20, 21], list(range(1, 12)) + [30, 31, 32]]
    cb = compact(harts.RolloutBatch.from_trajectories(trajs))
    plan = plan_calls(cb.segment_trees, 8)
    lay = build_layout(cb, plan, pad_to=4)
    assert lay.num_calls == 2
    r2 = lay.rounds[1]
    rep = r2.la_rows[~r2.is_output]
    assert lay.position[rep].tolist() == [8, 9, 10]
    assert lay.rounds[0].requests.tolist() == [[0, 8]]
    assert r2.init_state.tolist() == [0]
    check_layout(cb, lay, 8, 4, False)
    # no_replay: the side branch starts from the exact state after position 10
    nr = build_layout(cb, plan, no_replay=True)
    assert nr.rounds[0].requests.tolist() == [[0, 11]]
    assert not (~nr.rounds[1].is_output).any()


def test_layout_rejects_foreign_plan_and_bad_padding():
    a = compact(harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4]]))
    b = compact(harts.RolloutBatch.from_trajectories([[1, 2, 3, 5], [1, 2, 4]]))
    with pytest.raises(ValueError, match="different segment forest"):
        build_layout(b, plan_calls(a.segment_trees, 4))
    with pytest.raises(ValueError, match="pad_to"):
        build_layout(a, plan_calls(a.segment_trees, 4), pad_to=0)
