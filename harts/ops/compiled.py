"""Element-wise layer glue compiled by ``torch.compile`` on CUDA, eager everywhere else.

A profile of one trajectory-wise microbatch on an H200 (ling3_tiny's dimensions, pattern KKKM,
bf16, recompute) spent about a third of the device time outside GEMMs and attention kernels:
RMS norms taken in float32, gates, l2 norms, SwiGLU products, casts, each a separate pass over
[T, D] rows in eager torch (``aten::mul`` alone was 16 %). Inductor fuses each small function
below into one or two Triton kernels per direction.

``cuda_compiled(fn)`` keeps ``fn`` itself as the reference: CPU tensors (every float64 test)
always run it eagerly; CUDA tensors run ``torch.compile(fn, dynamic=True)`` when
``HARTS_COMPILE=1`` is set in the environment, so the row count T may change from microbatch to
microbatch without recompiling. It is off by default, because of what it measured on an H200
(``harts bench --workload medium --dp 8 --replica 0``, ling3_tiny's dimensions, pattern KKKM,
bf16, recompute): the trajectory-wise baseline's step went from 6.16 s to 5.47-5.54 s ("other"
1.75 -> 1.20-1.25 s), but harts' compact step went from 0.93 s to 6.5-7.1 s, with no Dynamo
recompilation during the timed step ("other" 0.27 -> 5.6-6.1 s, MoE 0.19 -> 0.41-0.48 s). The
cause is not found yet; until it is, turning it on would make the baseline faster and harts
slower. ``compile_enabled()`` says which is in force.
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
    """Whether CUDA glue is compiled: ``HARTS_COMPILE`` set to 1/true/yes/on (default off)."""
    return os.environ.get("HARTS_COMPILE", "0").strip().lower() in ("1", "true", "yes", "on")


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
