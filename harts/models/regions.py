"""Per-component time of a training step, forward, backward and recomputation.

The model marks its expensive components as named regions (the linear-attention core, the
full-attention core, the MoE block, the LM head with its log-probs). While a ``RegionTimer``
is active (``with RegionTimer(device) as timer:``), every region records its time:

* forward: an event before the region and one after it;
* backward: ``enter`` routes the region's inputs through an identity autograd node and
  ``exit`` routes its outputs through another. Autograd runs the output node's backward first
  (the start of the region's backward) and the input node's backward once every input
  gradient exists (its end), so the pair brackets the region's backward kernels;
* recomputation (``torch.utils.checkpoint`` re-running a layer inside backward) is recorded
  under its own phase, so a reader can see what recompute costs. The whole recomputed layer
  also runs in region ``LAYER`` (``recompute_span``): the layer's work outside every core
  region (projections, norms, the short conv) is timed there, as a child of whichever region's
  backward asked for the recomputation, instead of inside that region's backward (the last
  block of a layer, usually the MoE, would otherwise carry its whole layer's recomputation).

On CUDA the marks are ``torch.cuda.Event``s (recorded on the current stream, read after the
step's final synchronization: no host sync inside the step); on CPU they are host clocks.
With no active timer ``enter`` / ``exit`` return their arguments untouched.

``RegionTimer(device, annotate=True)`` also opens a profiler range ``harts/<region>/<phase>``
(``ANNOTATION_PREFIX``) on the launching thread for each region it times, so a torch profiler
trace can attribute every kernel to the region that launched it
(``harts.models.region_trace.device_time_by_region``).

Usage in a module::

    q, k = regions.enter("attention", q, k)
    o = core(q, k)
    (o,) = regions.exit("attention", o)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["ANNOTATION_PREFIX", "LAYER", "RegionTimer", "enter", "exit", "PHASES", "recompute_span", "recomputing"]

PHASES = ("forward", "backward", "recompute")
#: the region of a checkpointed layer's recomputation as a whole (``recompute_span``); its
#: exclusive time is the recomputed work outside every core region, reported with "other"
LAYER = "layer"
#: profiler ranges of an annotating timer are named f"{ANNOTATION_PREFIX}{region}/{phase}"
ANNOTATION_PREFIX = "harts/"

_ACTIVE: RegionTimer | None = None


class RegionTimer:
    """Collects region times while active; ``totals()`` after the work has finished.

    Times are exclusive: a region that runs inside another (checkpoint's recomputation of a
    layer runs inside the backward of the region that first unpacks a recomputed tensor) is
    subtracted from its parent, so the regions' times add up to at most the step's time.
    A region left open by an aborted recomputation (checkpoint stops recomputing once it has
    every tensor it needs) is recorded as ending where the recomputation stopped when that
    recomputation runs in a ``recompute_span`` (every checkpointed layer of ``HybridLM``: the
    work it ran is its own); a region closed by ``stop`` without ``keep_inner`` drops those
    still open inside it, and their time stays with it.
    """

    def __init__(self, device: torch.device | str, *, annotate: bool = False) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._annotate = annotate
        # closed regions: (name, phase, start, end, [(child start, child end), ...])
        self._closed: list[tuple[str, str, object, object, list]] = []
        # open regions, innermost last: (name, phase, start, children, profiler range or None)
        self._stack: list[tuple[str, str, object, list, Any]] = []

    def __enter__(self) -> RegionTimer:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a RegionTimer is already active")
        _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = None
        while self._stack:  # profiler ranges of regions never closed (an aborted step)
            span = self._stack.pop()[4]
            if span is not None:
                span.__exit__(None, None, None)

    def _mark(self) -> object:
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self, name: str, phase: str) -> None:
        span = None
        if self._annotate:
            span = torch.autograd.profiler.record_function(f"{ANNOTATION_PREFIX}{name}/{phase}")
            span.__enter__()
        self._stack.append((name, phase, self._mark(), [], span))

    def stop(self, name: str, phase: str, *, keep_inner: bool = False) -> None:
        """Close region ``name`` / ``phase``. Regions still open inside it are dropped (their
        time stays with it), or with ``keep_inner`` recorded as ending now (a recomputation that
        checkpoint stopped early: the work they ran is theirs)."""
        if not any(n == name and p == phase for n, p, _, _, _ in self._stack):
            return  # a backward end whose start never ran (no gradient reached the outputs)
        end = self._mark()
        while True:
            n, p, start, children, span = self._stack.pop()
            if span is not None:  # regions dropped on the way are closed too, innermost first
                span.__exit__(None, None, None)
            if n == name and p == phase:
                break
            if keep_inner:
                self._closed.append((n, p, start, end, children))
                self._stack[-1][3].append((start, end))
        self._closed.append((name, phase, start, end, children))
        if self._stack:
            self._stack[-1][3].append((start, end))

    def _seconds(self, a: Any, b: Any) -> float:
        """Seconds between two marks: CUDA events (``elapsed_time`` in ms) or perf_counter floats."""
        return a.elapsed_time(b) / 1e3 if self._cuda else b - a

    def totals(self) -> dict[str, dict[str, float]]:
        """``{region: {phase: exclusive seconds}}``; synchronizes the device first."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        out: dict[str, dict[str, float]] = {}
        for name, phase, a, b, children in self._closed:
            sec = self._seconds(a, b) - sum(self._seconds(c, d) for c, d in children)
            out.setdefault(name, dict.fromkeys(PHASES, 0.0))[phase] += sec
        return out


def recomputing() -> bool:
    """Whether a forward runs as checkpoint's recomputation (inside a running backward graph task)."""
    return torch._C._current_graph_task_id() != -1


@contextmanager
def recompute_span(name: str = LAYER) -> Iterator[None]:
    """Region ``name``, phase "recompute", around a checkpointed layer's recomputation (module
    docstring); closed when it ends or when checkpoint stops it early (its exception passes
    through), the core regions it had open then recorded up to that point. Nothing outside a
    recomputation or without an active timer."""
    timer = _ACTIVE
    if timer is None or not recomputing():
        yield
        return
    timer.start(name, "recompute")
    try:
        yield
    finally:
        timer.stop(name, "recompute", keep_inner=True)


def _phase() -> str:
    return "recompute" if recomputing() else "forward"


class _BackwardMark(torch.autograd.Function):
    """Identity on tensors; its backward marks the start (on a region's outputs) or the end (on
    its inputs) of the region's backward."""

    @staticmethod
    def forward(ctx, name: str, timer: RegionTimer, is_end: bool, *xs: torch.Tensor):  # type: ignore[override]
        ctx.name, ctx.timer, ctx.is_end = name, timer, is_end
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        (ctx.timer.stop if ctx.is_end else ctx.timer.start)(ctx.name, "backward")
        return (None, None, None, *grads)


def _differentiable(xs: tuple[torch.Tensor, ...]) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def enter(name: str, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Start region ``name`` on inputs ``xs`` (returned, possibly wrapped for backward timing)."""
    timer = _ACTIVE
    if timer is None:
        return xs
    phase = _phase()
    timer.start(name, phase)
    if phase == "forward" and _differentiable(xs):
        return _BackwardMark.apply(name, timer, True, *xs)
    return xs


def exit(name: str, *ys: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: A001
    """End region ``name`` with outputs ``ys`` (returned, possibly wrapped for backward timing)."""
    timer = _ACTIVE
    if timer is None:
        return ys
    phase = _phase()
    timer.stop(name, phase)
    if phase == "forward" and _differentiable(ys):
        return _BackwardMark.apply(name, timer, False, *ys)
    return ys
