"""Causal short convolutions against loop references: outputs and every gradient."""

from __future__ import annotations

import pytest
import torch

from harts.ops.conv import (
    causal_conv1d_varlen,
    naive_causal_conv1d_varlen,
    naive_tree_causal_conv1d,
    tree_causal_conv1d,
)
from tests.ops._trees import ancestors, paths, random_forest

F64 = torch.float64


def grads(y, inputs, w):
    return torch.autograd.grad((y * w).sum(), inputs)


@pytest.mark.parametrize("act", [None, "silu"], ids=["linear", "silu"])
@pytest.mark.parametrize(
    "P,D,W", [pytest.param(*c, id="P{}-D{}-W{}".format(*c)) for c in [(63, 8, 4), (65, 5, 2), (130, 16, 4), (40, 3, 1)]]
)
def test_tree_conv_matches_parent_walk(P, D, W, act):
    parent = random_forest(P, num_roots=3, seed=P)
    x = torch.randn(P, D, dtype=F64, requires_grad=True)
    w = torch.randn(D, W, dtype=F64, requires_grad=True)
    b = torch.randn(D, dtype=F64, requires_grad=True)
    y = tree_causal_conv1d(x, w, ancestors(parent, W - 1), b, activation=act)
    ref = naive_tree_causal_conv1d(x, w, parent, b, activation=act)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(ref)
    for a, r in zip(grads(y, (x, w, b), up), grads(ref, (x, w, b), up)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_tree_conv_equals_plain_conv_on_every_path():
    """Each root-to-leaf path, run as its own sequence by the baseline conv, gives the same rows."""
    P, D, W = 90, 6, 4
    parent = random_forest(P, num_roots=2, branchy=0.4, seed=3)
    x = torch.randn(P, D, dtype=F64, requires_grad=True)
    w = torch.randn(D, W, dtype=F64, requires_grad=True)
    y = tree_causal_conv1d(x, w, ancestors(parent, W - 1))
    rows = [r for p in paths(parent) for r in p]
    cu = torch.tensor([0] + [len(p) for p in paths(parent)]).cumsum(0)
    y_paths = causal_conv1d_varlen(x[rows], w, cu)
    torch.testing.assert_close(y_paths, y[rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("act", [None, "silu"], ids=["linear", "silu"])
@pytest.mark.parametrize("T,W", [pytest.param(t, w, id=f"T{t}-W{w}") for t, w in [(63, 4), (65, 3), (130, 4)]])
def test_varlen_conv_matches_conv1d(T, W, act):
    D = 7
    cu = torch.tensor([0, 1, T // 3, T // 3 + 2, T])
    x = torch.randn(T, D, dtype=F64, requires_grad=True)
    w = torch.randn(D, W, dtype=F64, requires_grad=True)
    b = torch.randn(D, dtype=F64, requires_grad=True)
    y = causal_conv1d_varlen(x, w, cu, bias=b, activation=act)
    ref = naive_causal_conv1d_varlen(x, w, cu, bias=b, activation=act)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(ref)
    for a, r in zip(grads(y, (x, w, b), up), grads(ref, (x, w, b), up)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_varlen_conv_never_reads_the_previous_sequence():
    T, D, W = 20, 4, 4
    cu = torch.tensor([0, 9, 20])
    x = torch.randn(T, D, dtype=F64)
    w = torch.randn(D, W, dtype=F64)
    y = causal_conv1d_varlen(x, w, cu)
    x2 = x.clone()
    x2[:9] = 1e6
    assert torch.equal(causal_conv1d_varlen(x2, w, cu)[9:], y[9:])


def test_bad_inputs_raise():
    x = torch.randn(5, 3)
    w = torch.randn(3, 4)
    with pytest.raises(ValueError, match="ancestors must be"):
        tree_causal_conv1d(x, w, torch.full((5, 2), -1))
    with pytest.raises(ValueError, match=r"row ids in \[-1, 5\)"):
        tree_causal_conv1d(x, w, torch.full((5, 3), 7))
    with pytest.raises(ValueError, match="activation"):
        tree_causal_conv1d(x, w, torch.full((5, 3), -1), activation="relu")
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d_varlen(x, w, torch.tensor([0, 4]))
