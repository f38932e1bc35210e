"""Element-wise passes compiled by ``torch.compile`` on CUDA, eager everywhere else.

One mechanism for two uses: the LM head's fused passes (``harts.ops.logprob.mapped``, always
compiled on CUDA: ``opt_in=False``) and the layer glue below (``HARTS_COMPILE=0`` turns it off).

In eager torch the glue between GEMMs and attention kernels (RMS norms taken in float32,
gates, l2 norms, SwiGLU products, casts) is a separate pass over [T, D] rows per operation, and
on a GPU profile it is a large share of the device time. Inductor fuses each small function
below into one or two Triton kernels per direction.

``cuda_compiled(fn)`` keeps ``fn`` itself as the reference: CPU tensors (every float64 test)
always run it eagerly; CUDA tensors run ``torch.compile(fn, dynamic=True)`` unless
``HARTS_COMPILE=0`` (``compile_enabled()``). Both sides of ``harts bench`` get it (a step
eager and compiled: ``benchmarks/results/ling3-tiny-kkkm_h200_2026-12-01_compiled-glue.md``).

**Row counts never recompile.** Every microbatch has its own row count T, and a tree step's
microbatches differ widely. With dynamic shapes Inductor still guards on T's size class
(``4096 <= T``, ``T * 768 >= 5242880``: fusion and indexing heuristics evaluated at the first T
it saw), so a smaller microbatch would recompile the glue in the middle of a timed step, at
seconds per compilation (``TORCH_LOGS=recompiles`` shows it). A call whose row-first arguments (positions
``rows``, all with the same T) have fewer than ``MIN_ROWS`` rows is therefore zero-padded up to
it (an element-wise pass over ``MIN_ROWS`` rows costs microseconds) and its result cut back to
T: every call, and the first one the kernels are compiled for, lies above those thresholds, so
the guards hold for all of them. (Declaring the range with ``torch._dynamo.mark_dynamic(min=,
max=)`` instead does not work: Inductor's 32-bit indexing guards depend on the inputs' strides,
and a declared upper bound above them is a constraint violation. ``harts bench`` reports the
graphs built inside each timed step, so a recompilation there shows.) Recompilation is
left for what changes the kernel: the feature width, dtype, and whether an argument is a view
-- a handful of variants per function, compiled once per process.

**Only the row count is symbolic.** ``torch.compile(fn, dynamic=True)`` makes *every* size
symbolic, feature widths included, and Inductor then indexes each element with 64-bit divisions
and remainders by runtime widths, which leaves the compiled passes several times slower than
their bytes allow (``python -m benchmarks.modules.moe --device cuda`` times a MoE layer both ways:
``benchmarks/results/ling3-tiny_h200_2026-12-01_flash-host-mask-moe.md``). So a row-bounded call
(``rows`` given) compiles with ``dynamic=None`` and marks its arguments itself: dim 0 of each
row-first tensor dynamic (``maybe_mark_dynamic``), every other dim of every tensor argument
static (``mark_static``). One graph serves every row count; each distinct feature width or
layout gets its own specialised graph (a handful per function). ``HARTS_COMPILE_DYNAMIC=all``
restores ``dynamic=True`` (every size symbolic) for comparison.

If compiling fails on this torch / device, the function runs eagerly from then on, with a one-line
warning that says why (training goes on, at the eager speed). That catches failures in the
forward only: a backward graph that fails to compile fails in ``loss.backward()``.

**Float64 always runs eagerly, on CUDA too** (``COMPILED_DTYPES``). It is the precision
reference (``harts compare --dtype float64``, float64 twins in the GPU tests), not a speed path,
and Inductor in torch 2.11 does not compile a float64 split reduction: the backward of the glue's
norms fails (``triton_per_fused_add_div_expand_mul_pow_sum_0``: "Loop-carried variable accum0 has
initial type fp32 but is re-assigned to fp64"), where the fallback above cannot catch it.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = [
    "COMPILED_DTYPES",
    "MIN_ROWS",
    "RowMismatchError",
    "compile_enabled",
    "compiles_dtypes",
    "cuda_compiled",
    "dynamic_setting",
    "env_opt_in",
    "env_switch",
    "failure_summary",
    "mark_row_dynamic",
    "run_row_bounded",
]

F = TypeVar("F", bound=Callable[..., Any])

#: the most characters of a failure a fallback warning quotes
SUMMARY_CHARS = 300


def failure_summary(exc: BaseException) -> str:
    """One line for a warning about a fallback: ``Type: first line`` of ``exc`` and of each
    exception it was raised from (``__cause__``, a compiler wrapper's ``inner_exception``), at
    most ``SUMMARY_CHARS``. A compiler's failure quotes its whole command line and output,
    hundreds of lines; that text goes to the ``harts`` logger at DEBUG level instead."""
    logging.getLogger("harts").debug("the whole failure behind a fallback: %r", exc)
    parts: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        first = next((line.strip() for line in str(cur).splitlines() if line.strip()), "")
        parts.append(f"{type(cur).__name__}: {first}" if first else type(cur).__name__)
        cur = cur.__cause__ or getattr(cur, "inner_exception", None)
    text = " <- ".join(parts)
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 3] + "..."


#: floating-point dtypes that ``cuda_compiled`` compiles for (float64 runs eagerly: module
#: docstring)
COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def compiles_dtypes(args: tuple[Any, ...]) -> bool:
    """Whether every floating-point tensor in ``args`` has a ``COMPILED_DTYPES`` dtype (integer
    tensors, such as ``sum_slots``' index, do not count)."""
    return all(x.dtype in COMPILED_DTYPES for x in args if isinstance(x, torch.Tensor) and x.is_floating_point())


#: rows every compiled row-first call sees at least (smaller calls are zero-padded up to it)
MIN_ROWS = 16_384


def env_switch(name: str) -> bool:
    """An on-by-default switch from the environment: False when ``name`` is set to
    0/false/no/off (any case), True otherwise (unset included)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def env_opt_in(name: str) -> bool:
    """An off-by-default switch from the environment: True for 1, False for 0 or unset (or empty);
    raises ``ValueError`` naming the variable for any other value, so a misspelt choice
    (``true``, ``on``) is an error rather than silently the default (``harts.cli`` checks these
    before a command runs)."""
    want = os.environ.get(name, "").strip()
    if want not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1; got {want!r}")
    return want == "1"


def compile_enabled() -> bool:
    """Whether CUDA glue is compiled: on unless ``HARTS_COMPILE`` is 0/false/no/off."""
    return env_switch("HARTS_COMPILE")


class RowMismatchError(ValueError):
    """Row-first arguments of a ``cuda_compiled`` call with different row counts (a caller's bug,
    raised as it is rather than taken for a compiler failure)."""


def _padded(args: tuple[Any, ...], rows: tuple[int, ...]) -> tuple[list[Any], int, int]:
    """``args`` with the row-first tensors at ``rows`` zero-padded to ``MIN_ROWS`` rows; with the
    original row count T and the padded one."""
    out = list(args)
    t = out[rows[0]].shape[0]
    n = max(t, MIN_ROWS)
    for i in rows:
        x = out[i]
        if not isinstance(x, torch.Tensor):
            continue
        if x.ndim == 0 or x.shape[0] != t:
            raise RowMismatchError(
                f"argument {i} has {tuple(x.shape)} rows-first, expected {t} rows like argument {rows[0]}"
            )
        if n > t:
            out[i] = torch.cat([x, x.new_zeros((n - t, *x.shape[1:]))])
    return out, t, n


def dynamic_setting() -> str:
    """``HARTS_COMPILE_DYNAMIC``: "rows" (the default: only row counts symbolic) or "all"
    (``dynamic=True``); raises ``ValueError`` naming any other value."""
    want = os.environ.get("HARTS_COMPILE_DYNAMIC", "rows").strip().lower() or "rows"
    if want not in ("rows", "all"):
        raise ValueError(f"HARTS_COMPILE_DYNAMIC must be 'rows' or 'all'; got {want!r}")
    return want


def mark_row_dynamic(args: list[Any], rows: tuple[int, ...]) -> None:
    """Mark dim 0 of the tensors at positions ``rows`` dynamic and every other dim of every
    tensor in ``args`` static, for ``torch.compile(dynamic=None)`` (module docstring). The marks
    stay on the tensors: a tensor passed outside ``rows`` must be of fixed shape (the glue's are
    weights), or a later call with it as a row-first argument would specialise its rows."""
    for i, x in enumerate(args):
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            continue
        row_first = i in rows
        for d in range(1 if row_first else 0, x.ndim):
            torch._dynamo.mark_static(x, d)
        if row_first:
            torch._dynamo.maybe_mark_dynamic(x, 0)


def run_row_bounded(
    compiled: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rows: tuple[int, ...] | None,
    mark: bool = False,
) -> Any:
    """``compiled(*args, **kwargs)`` with the row-first arguments at ``rows`` zero-padded to
    ``MIN_ROWS`` rows (module docstring); the result cut back to the original rows. ``mark``:
    only the row count is symbolic (``mark_row_dynamic``)."""
    if rows is None:
        return compiled(*args, **kwargs)
    call_args, t, n = _padded(args, rows)
    if mark:
        mark_row_dynamic(call_args, rows)
    out = compiled(*call_args, **kwargs)
    if n == t:
        return out
    return tuple(o[:t] for o in out) if isinstance(out, tuple) else out[:t]


def cuda_compiled(
    fn: F | None = None, *, opt_in: bool = True, dynamic: bool | None = True, rows: tuple[int, ...] | None = (0,)
) -> Any:
    """``fn`` compiled when its first argument is a CUDA tensor and every floating-point tensor
    argument has a ``COMPILED_DTYPES`` dtype; eager otherwise (CPU, float64).

    ``opt_in``: compiled only when ``compile_enabled()`` (the layer glue); False: always on CUDA.
    ``dynamic``: ``torch.compile``'s (True: symbolic sizes from the start; None: the first shape
    static, symbolic after a second one) where ``rows`` is None. ``rows``: positions of the
    positional arguments whose dim 0 is the row count T (the same for all of them; ``fn``
    returns one row-first tensor or a tuple of them): calls below ``MIN_ROWS`` rows are padded, so one compiled
    kernel serves every T, and only T is symbolic (module docstring; ``dynamic`` applies only
    under ``HARTS_COMPILE_DYNAMIC=all``); None passes the arguments as they are. Usable bare (``@cuda_compiled``) or with
    keywords. The compiled function is built on first CUDA use, so importing a module that uses
    this decorator never starts the compiler; ``wrapper.eager`` is ``fn`` itself."""
    if fn is None:
        return functools.partial(cuda_compiled, opt_in=opt_in, dynamic=dynamic, rows=rows)
    compiled: list[Callable[..., Any]] = []
    marks: list[bool] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        if not (isinstance(first, torch.Tensor) and first.is_cuda and (compile_enabled() or not opt_in)):
            return fn(*args, **kwargs)
        if not compiles_dtypes(args):
            return fn(*args, **kwargs)
        if not compiled:
            mark = rows is not None and dynamic_setting() == "rows"
            compiled.append(torch.compile(fn, dynamic=None if mark else dynamic))
            marks.append(mark)
        try:
            return run_row_bounded(compiled[0], args, kwargs, rows, marks[0])
        except (torch.OutOfMemoryError, RowMismatchError):
            raise
        except Exception as exc:  # noqa: BLE001 - any compiler failure: keep training, say why
            warnings.warn(f"compiling {fn.__name__} failed ({failure_summary(exc)}); running it eagerly", stacklevel=2)
            compiled[0] = fn
            return fn(*args, **kwargs)

    wrapper.eager = fn  # type: ignore[attr-defined]
    return wrapper
