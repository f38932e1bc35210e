"""``own_autograd``: a first-call check that differentiates a graph of its own inside a
checkpointed block (``harts.ops.linear_attn.tree_kernel.gdn_native`` runs in the first GDN
layer's forward, under ``torch.utils.checkpoint``) leaves the block's recomputation and
gradients as they are."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

from harts.ops.kernel_check import own_autograd


def _block(checked: list[bool], isolate: bool):  # noqa: ANN202
    """x -> tanh(x @ w) * x, running a small differentiated check on its first call only."""

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not checked:
            with own_autograd() if isolate else torch.enable_grad():
                a = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
                (grad,) = torch.autograd.grad((a.sin() * a).sum(), a)
            checked.append(bool(torch.isfinite(grad).all()))
        return torch.tanh(x @ w) * x

    return run


def _grads(isolate: bool, use_checkpoint: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    block = _block([], isolate)
    y = checkpoint(block, x, w, use_reentrant=False) if use_checkpoint else block(x, w)
    return list(torch.autograd.grad(block(y, w).square().sum(), (x, w)))


def test_check_inside_a_checkpoint_keeps_its_gradients() -> None:
    want = _grads(isolate=True, use_checkpoint=False)
    got = _grads(isolate=True, use_checkpoint=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_without_it_the_checkpoint_breaks() -> None:
    """The negative control: the same check with plain grad mode is packed by the checkpoint's
    forward and not by its recomputation, and the backward fails."""
    with pytest.raises(CheckpointError):
        _grads(isolate=False, use_checkpoint=True)


def test_check_runs_under_no_grad_and_inference_mode() -> None:
    for ctx in (torch.no_grad(), torch.inference_mode(), contextlib.nullcontext()):
        done: list[bool] = []
        with ctx:
            _block(done, isolate=True)(torch.ones(2, 2), torch.ones(2, 2))
        assert done == [True]
