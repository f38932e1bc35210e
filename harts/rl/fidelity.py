"""Replay fidelity of one microbatch (paper §5.4, Eqs. 24-27): the same weights and batch through
several execution paths, every path compared token by token with a reference path.

A *path* is one ``ExecutionConfig`` (trajectory-wise, compact with replay, compact without
replay, with or without recomputation). ``run_path`` runs one training step of it with
``harts.rl.verify.run_step`` (forward, GRPO loss, MoE objective, backward) and keeps the final
hidden states (the input of the LM head) so that full-vocabulary logits can be formed later.
``token_errors`` compares two paths position by position, per semantic predicting position t
(original batch order), with p^X_t = softmax(z^X_t) (Eq. 24):

    sym_kl[t]   = 1/2 (KL(p^A_t || p^X_t) + KL(p^X_t || p^A_t))     the summand of Eq. 25
    abs_dnll[t] = |NLL^X_t - NLL^A_t|, NLL^X_t = -log p^X_t(y_t)      the summand of Eq. 26
    cos[t]      = <z^A_t, z^X_t> / (||z^A_t|| ||z^X_t||)              the summand of Eq. 27

over the full vocabulary. Logits are formed for ``chunk_rows`` positions at a time (never
[S, V]) from the model's head in its own dtype and compared in float32 (float64 for a float64
model): in bfloat16 what is measured is the model's output logits upcast after the head.
``gradient_cosines`` gives the cosine of every parameter gradient against the reference.

Shapes: hidden_TD (T = S rows in trajectory mode, P physical rows in compact mode); rows [S - N]
(the row of each predicting position); head weight [V, D]; per-token results float64 [S - N].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import CompactInputs, HybridLM
from harts.rl.verify import StepResult, run_step

__all__ = ["PathRun", "run_path", "token_errors", "gradient_cosines", "TOKEN_METRICS"]

#: per-token metrics of ``token_errors`` (Eqs. 25, 26, 27 in that order)
TOKEN_METRICS = ("sym_kl", "abs_dnll", "cos")


@dataclass
class PathRun:
    """One path's training step on one microbatch."""

    #: final-norm hidden states [T, D] (detached), in the path's own row order
    hidden_TD: torch.Tensor
    #: int64 [S - N] on the hidden states' device: the row of each predicting position
    rows: torch.Tensor
    #: loss, log-probs and every parameter gradient (``run_step``)
    step: StepResult


@contextlib.contextmanager
def _final_hidden(model: HybridLM) -> Iterator[list[torch.Tensor]]:
    """Collect the output of the model's final norm (what the LM head reads) while active."""
    seen: list[torch.Tensor] = []

    def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        seen.append(output.detach())

    handle = model.norm.register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def run_path(model: HybridLM, inputs: CompactInputs, config: ExecutionConfig) -> PathRun:
    """One training step of ``inputs`` executed as ``config`` says, with its final hidden states.

    ``inputs`` must have been prepared with ``config.no_replay`` (``HybridLM.prepare_compact``);
    trajectory mode reads only ``inputs.batch``.
    """
    with _final_hidden(model) as seen:
        step = run_step(model, inputs, config)
    # one forward per step: recomputation re-runs decoder layers only, never the final norm
    assert len(seen) == 1, f"the final norm ran {len(seen)} times in one step"
    hidden = seen[0]
    pred = inputs.batch.predicting_positions()
    rows = pred if config.mode == "trajectory" else np.asarray(inputs.layout.semantic_to_phys)[pred]
    return PathRun(hidden_TD=hidden, rows=torch.as_tensor(rows, device=hidden.device), step=step)


@torch.no_grad()
def token_errors(
    ref: PathRun,
    other: PathRun,
    head_weight_VD: torch.Tensor,
    targets: np.ndarray,
    *,
    chunk_rows: int = 1024,
    ref_head_VD: torch.Tensor | None = None,
) -> dict[str, np.ndarray]:
    """Per predicting position: ``sym_kl``, ``abs_dnll`` and ``cos`` of ``other`` against ``ref``
    (module docstring; Eqs. 25-27 before their averages), each float64 [S - N] on the host.

    ``targets`` int64 [S - N] is ``batch.next_token_targets()``. ``ref_head_VD``: ``ref``'s own
    head when it ran on another copy of the weights (a higher-precision reference); default
    ``head_weight_VD`` for both. Peak extra memory is a few
    [chunk_rows, V] float32 blocks and two float64 ones (the cosine).
    """
    n = int(ref.rows.numel())
    if int(other.rows.numel()) != n or targets.shape != (n,):
        raise ValueError(
            f"paths and targets disagree on the predicting positions: {n}, {other.rows.numel()}, {targets.shape}"
        )
    w = head_weight_VD.detach()
    w_ref = w if ref_head_VD is None else ref_head_VD.detach()
    cmp_dtype = torch.float64 if torch.float64 in (w.dtype, w_ref.dtype) else torch.float32
    tgt = torch.as_tensor(targets, device=w.device)
    out = {k: torch.empty(n, dtype=torch.float64, device=w.device) for k in TOKEN_METRICS}
    for a in range(0, n, chunk_rows):
        b = min(n, a + chunk_rows)
        z_a = torch.nn.functional.linear(ref.hidden_TD[ref.rows[a:b]], w_ref).to(cmp_dtype)
        z_x = torch.nn.functional.linear(other.hidden_TD[other.rows[a:b]], w).to(cmp_dtype)
        lp_a = torch.log_softmax(z_a, dim=-1)
        lp_x = torch.log_softmax(z_x, dim=-1)
        # KL(a||x) + KL(x||a) = sum_v (p_a - p_x)(log p_a - log p_x): one pass, never negative
        out["sym_kl"][a:b] = 0.5 * ((lp_a.exp() - lp_x.exp()) * (lp_a - lp_x)).sum(-1).double()
        t = tgt[a:b, None]
        out["abs_dnll"][a:b] = (lp_x.gather(1, t) - lp_a.gather(1, t))[:, 0].abs().double()
        # float64 reductions: a float32 cosine of two equal 157k-vectors is off 1 by ~1e-7
        z_a, z_x = z_a.double(), z_x.double()
        norms = z_a.norm(dim=-1) * z_x.norm(dim=-1)
        out["cos"][a:b] = (z_a * z_x).sum(-1) / norms.clamp_min(torch.finfo(torch.float64).tiny)
    return {k: v.cpu().numpy() for k, v in out.items()}


def gradient_cosines(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict[str, float]:
    """Cosine of each parameter's gradient in ``other`` against ``ref`` (float64 reductions).

    Two all-zero gradients (an expert no token reached) agree: 1.0; one zero and one not: 0.0.
    """
    if set(ref) != set(other):
        missing = sorted(set(ref) ^ set(other))
        raise ValueError(f"the two runs have gradients for different parameters: {missing[:5]}")
    out = {}
    for name, g in ref.items():
        a, b = g.double().flatten(), other[name].double().flatten()
        na, nb = float(a.norm()), float(b.norm())
        if na == 0.0 or nb == 0.0:
            out[name] = 1.0 if na == nb else 0.0
        else:
            out[name] = float(a @ b) / (na * nb)
    return out
