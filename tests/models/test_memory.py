"""Compact execution never allocates an S x hidden or S x vocab tensor (issue 5, memory)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harts.models import HybridConfig, HybridLM
from harts.rl.grpo import grpo_loss
from tests.models._trees import TreeBuilder, batch_of


class ShapeRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


def _big_shapes(shapes, n_sem: int, dims: set[int]) -> list[tuple[int, ...]]:
    """Shapes with a dimension >= n_sem together with a hidden- or vocab-sized dimension."""
    return [s for s in shapes if len(s) >= 2 and max(s) >= n_sem and any(d in dims for d in s if d < n_sem)]


def test_compact_execution_never_materializes_semantic_rows() -> None:
    t = TreeBuilder(vocab=72, seed=0)
    base = t.fresh(100)
    batch = batch_of([t.branch(base, 95 + (i % 5), 3 + i % 4) for i in range(24)], seed=0)
    s = batch.num_tokens
    torch.manual_seed(0)
    # hidden 40, vocab 72: no head/intermediate product collides with them
    cfg = HybridConfig.tiny(dtype="float64", hidden_size=40, vocab_size=72, layer_pattern="KGMA")
    model = HybridLM(cfg)
    inputs = model.prepare_compact(batch)
    assert inputs.cb.num_compact_tokens * 8 < s  # S >> C
    dims = {cfg.hidden_size, cfg.vocab_size}
    for attention in ("gather", "mask"):
        rec = ShapeRecorder()
        with rec:
            out = model(inputs, mode="compact", attention=attention, recompute=True)
            (grpo_loss(out.logprobs, batch).loss + out.moe_objective(1e-3, 1e-3)).backward()
        assert not _big_shapes(rec.shapes, batch.num_logprobs, dims), sorted(_big_shapes(rec.shapes, s - 30, dims))
    # the recorder does catch it in trajectory mode
    rec = ShapeRecorder()
    with rec:
        model(batch, mode="trajectory")
    assert _big_shapes(rec.shapes, batch.num_logprobs, dims)
