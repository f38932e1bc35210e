"""The first-call check that harts' own Triton kernels share (``router_topk``, ``qkv_norm``,
``moe_swiglu``): the first time a kernel meets a key (device, dtype, shape of the call), it runs
beside its torch reference; where it fails or its result differs, it warns once, naming why, and
the reference runs for that key from then on."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

__all__ = ["kernel_passes", "own_autograd"]

R = TypeVar("R")


def kernel_passes(
    checked: dict[tuple, bool],
    key: tuple[Hashable, ...],
    reference: Callable[[], R],
    kernel: Callable[[], R],
    same: Callable[[R, R], bool],
    *,
    name: str,
    differs: str,
    fallback: str,
) -> bool:
    """Whether the kernel may run for ``key``, checked once per key and remembered in ``checked``.

    The first time: ``reference()``, then ``kernel()``; a kernel that raises, or whose result is
    not ``same`` as the reference's, is off for the key, with one warning "harts' {name} kernel is
    off for {key}: {why}; {fallback}" (``differs`` is the why of a differing result). An error of
    the reference itself propagates: it is not the kernel's."""
    if key not in checked:
        want = reference()
        try:
            why = None if same(kernel(), want) else differs
        except Exception as e:  # noqa: BLE001 - any compile or launch failure means: use the reference
            why = f"it failed ({type(e).__name__}: {e})"
        checked[key] = why is None
        if why is not None:
            warnings.warn(f"harts' {name} kernel is off for {key}: {why}; {fallback}", stacklevel=3)
    return checked[key]


@contextmanager
def own_autograd() -> Iterator[None]:
    """A graph of the check's own, built and differentiated inside whatever runs around it: grad
    on, inference mode off, and identity saved-tensor hooks innermost, so that a non-reentrant
    checkpoint's forward or recomputation around a first call neither packs nor counts the
    check's tensors (it would see a different number of saved tensors in its recomputation, or
    stop the check's backward as its own)."""
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    ):
        yield
