"""Element-wise passes compiled by ``torch.compile`` on CUDA, eager everywhere else.

One mechanism for two uses: the LM head's fused passes (``harts.ops.logprob.mapped``, always
compiled on CUDA: ``opt_in=False``) and the layer glue below (opt-in).

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

If compiling fails on this torch / device, the function runs eagerly from then on, with a
warning that says why (training goes on, at the eager speed).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["compile_enabled", "cuda_compiled"]

F = TypeVar("F", bound=Callable[..., Any])


def compile_enabled() -> bool:
    """Whether CUDA glue is compiled: ``HARTS_COMPILE`` set to 1/true/yes/on (default off)."""
    return os.environ.get("HARTS_COMPILE", "0").strip().lower() in ("1", "true", "yes", "on")


def cuda_compiled(fn: F | None = None, *, opt_in: bool = True, dynamic: bool | None = True) -> Any:
    """``fn`` compiled when its first argument is a CUDA tensor; eager otherwise.

    ``opt_in``: compiled only when ``compile_enabled()`` (the layer glue); False: always on CUDA.
    ``dynamic``: ``torch.compile``'s (True: symbolic sizes from the start; None: the first shape
    static, symbolic after a second one). Usable bare (``@cuda_compiled``) or with keywords. The
    compiled function is built on first CUDA use, so importing a module that uses this decorator
    never starts the compiler; ``wrapper.eager`` is ``fn`` itself."""
    if fn is None:
        return functools.partial(cuda_compiled, opt_in=opt_in, dynamic=dynamic)
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        if not (isinstance(first, torch.Tensor) and first.is_cuda and (compile_enabled() or not opt_in)):
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=dynamic))
        try:
            return compiled[0](*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any compiler failure: keep training, say why
            warnings.warn(f"compiling {fn.__name__} failed ({exc!r}); running it eagerly", stacklevel=2)
            compiled[0] = fn
            return fn(*args, **kwargs)

    wrapper.eager = fn  # type: ignore[attr-defined]
    return wrapper
