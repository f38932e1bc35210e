"""Element-wise layer glue compiled by ``torch.compile`` on CUDA, eager everywhere else.

A profile of one trajectory-wise microbatch on an H200 (ling3_tiny's dimensions, pattern KKKM,
bf16, recompute) spent about a third of the device time outside GEMMs and attention kernels:
RMS norms taken in float32, gates, l2 norms, SwiGLU products, casts, each a separate pass over
[T, D] rows in eager torch (``aten::mul`` alone was 16 %). Inductor fuses each small function
below into one or two Triton kernels per direction.

``cuda_compiled(fn)`` keeps ``fn`` itself as the reference: CPU tensors (every float64 test)
run it eagerly, CUDA tensors run ``torch.compile(fn, dynamic=True)``, so the row count T may
change from microbatch to microbatch without recompiling. ``HARTS_COMPILE=0`` in the
environment turns compilation off (eager on CUDA too), for before/after measurements and for
debugging; ``compile_enabled()`` says which is in force.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["compile_enabled", "cuda_compiled"]

F = TypeVar("F", bound=Callable[..., Any])


def compile_enabled() -> bool:
    """Whether CUDA glue is compiled (``HARTS_COMPILE`` unset, or anything but 0/false/no/off)."""
    return os.environ.get("HARTS_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def cuda_compiled(fn: F) -> F:
    """``fn`` compiled (dynamic shapes) when its first argument is a CUDA tensor; eager otherwise.

    The compiled function is built on first CUDA use, so importing a module that uses this
    decorator never starts the compiler."""
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        if not (isinstance(first, torch.Tensor) and first.is_cuda and compile_enabled()):
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True))
        return compiled[0](*args, **kwargs)

    wrapper.eager = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
