"""Synthetic workloads: deterministic, valid, and shaped like the paper's trees."""

from __future__ import annotations

import numpy as np
import pytest

from harts.tree.compact import compact
from harts.tree.stats import batch_stats
from harts.tree.workloads import PRESETS, generate


def test_deterministic_in_seed_and_step():
    a = generate("small", step=1, seed=5)
    b = generate("small", step=1, seed=5)
    c = generate("small", step=2, seed=5)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.num_tokens != c.num_tokens or not np.array_equal(a.tokens, c.tokens)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_presets_are_valid_and_tree_shaped(name):
    spec = PRESETS[name]
    for step in range(spec.steps):
        batch = generate(name, step=step)
        cb = compact(batch)
        st = batch_stats(cb, spec.chunk_size)
        assert st.compression > 1.5
        assert st.max_path <= spec.max_path_tokens
        assert st.short_segments > 0 and st.forks > 0
        assert batch.group_ids is not None and batch.group_ids.max() < spec.tasks[1]
        # every trajectory starts with the shared header: one segment tree per step
        assert cb.segment_trees.num_trees == 1
        # the explicit tree equals the token trie (sibling first tokens are distinct)
        tree = batch.tree
        first = tree.tokens[tree.offsets[:-1]]
        assert np.unique(np.stack([tree.parent, first], 1), axis=0).shape[0] == tree.num_nodes
        # advantages are constant within each trajectory and centred within each group
        adv = batch.advantages[batch.offsets[:-1]]
        for g in np.unique(batch.group_ids):
            assert abs(adv[batch.group_ids == g].mean()) < 1e-6


def test_swe_shape_on_few_tasks():
    batch = generate("swe", step=0, tasks=(3, 3))
    cb = compact(batch)
    st = batch_stats(cb, 64)
    assert st.max_path <= PRESETS["swe"].max_path_tokens
    assert st.max_segment > 10_000 and st.short_segments > 0
    assert st.mean_path > 5_000


def test_forks_land_on_and_beside_chunk_boundaries():
    residues = set()
    for step in range(4):
        cb = compact(generate("medium", step=step, tasks=(2, 2)))
        f = cb.segment_trees
        residues |= set((f.end[f.num_children >= 2] % 64).tolist())
    assert {63, 0, 1} <= residues


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        generate("nope")


def test_late_forks_raise_prefix_sharing():
    """late_forks > 0 moves trunk forks toward the end: more shared prefix, same task count."""
    for step in range(3):
        uniform = generate("medium", step=step)
        late = generate("medium", step=step, late_forks=3.0)
        assert np.unique(late.tree_ids).size == np.unique(uniform.tree_ids).size
        ratio_u = uniform.num_tokens / compact(uniform).num_compact_tokens
        ratio_l = late.num_tokens / compact(late).num_compact_tokens
        assert ratio_l > ratio_u
