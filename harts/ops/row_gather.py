"""Rows gathered once for several consumers, with one deterministic backward.

Compact execution feeds each linear-attention round the rows ``x[la_rows_r]``: every physical
row once as the round's output row, and a few rows (replay rows, a fork's last rows) again in
the rounds of the branches that replay them. Gathering each round separately makes autograd
scatter each round's gradient into its own zero tensor of all P rows and add those up: per
round and input a full [P, ...] fill, scatter and add. ``gather_rows`` gathers every round's
rows in one call and computes the gradient as

    dx = g[primary]                                  (a gather: each row's first occurrence)
    dx[extra_rows] += g[extra_slots]                 (index_put, accumulate: sorted, deterministic)

with rows that no slot reads left at zero. Callers split the result into pieces with
``torch.split`` (views; its backward is one concatenation).

Shapes: P rows of x, N gathered slots, E slots beyond each row's first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts.ops.upload import upload

__all__ = ["RowGatherPlan", "gather_rows", "row_gather_plan"]


@dataclass(frozen=True)
class RowGatherPlan:
    """Where each slot reads from, and each row's slots (``row_gather_plan``)."""

    #: int64 [N] row read by each slot
    index: torch.Tensor
    #: int64 [P] slot of each row's first occurrence (0 for a row no slot reads)
    primary: torch.Tensor
    #: int64 [P - rows read]: rows no slot reads (their gradient is zero), or None
    unread: torch.Tensor | None
    #: int64 [P]: ``primary`` with -1 for a row no slot reads (for kernels that gather by row)
    primary_or_unread: torch.Tensor
    #: int64 [E] rows and slots of every occurrence after a row's first, or None
    extra_rows: torch.Tensor | None
    extra_slots: torch.Tensor | None
    num_rows: int


def row_gather_plan(index: np.ndarray, num_rows: int, device: torch.device) -> RowGatherPlan:
    """Plan of ``gather_rows`` for slots reading rows ``index`` (int [N], values in [0, P)),
    built on the host and uploaded without waiting for the device.

    Raises:
        ValueError: an index outside [0, ``num_rows``).
    """
    index = np.asarray(index, dtype=np.int64)
    if index.ndim != 1:
        raise ValueError(f"index must be 1-d; got shape {index.shape}")
    if index.size and (index.min() < 0 or index.max() >= num_rows):
        bad = int(np.flatnonzero((index < 0) | (index >= num_rows))[0])
        raise ValueError(f"slot {bad} reads row {int(index[bad])}, outside [0, {num_rows})")
    rows, first = np.unique(index, return_index=True)
    primary = np.zeros(num_rows, dtype=np.int64)
    primary[rows] = first
    is_extra = np.ones(index.size, dtype=bool)
    is_extra[first] = False
    extra_slots = np.flatnonzero(is_extra)
    unread = np.setdiff1d(np.arange(num_rows, dtype=np.int64), rows, assume_unique=True)
    primary_or_unread = primary.copy()
    primary_or_unread[unread] = -1
    return RowGatherPlan(
        index=upload(index, device),
        primary=upload(primary, device),
        unread=upload(unread, device) if unread.size else None,
        primary_or_unread=upload(primary_or_unread, device),
        extra_rows=upload(index[extra_slots], device) if extra_slots.size else None,
        extra_slots=upload(extra_slots, device) if extra_slots.size else None,
        num_rows=num_rows,
    )


def gather_rows(x_P: torch.Tensor, plan: RowGatherPlan) -> torch.Tensor:
    """``x[plan.index]``: [P, ...] -> [N, ...], differentiable with the module's backward."""
    if x_P.shape[0] != plan.num_rows:
        raise ValueError(f"the plan gathers from {plan.num_rows} rows; x has {x_P.shape[0]}")
    return _GatherRows.apply(x_P, plan)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: RowGatherPlan):  # type: ignore[override]  # noqa: ANN001, ANN205
        ctx.plan = plan
        return x[plan.index]

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]  # noqa: ANN001, ANN205
        plan: RowGatherPlan = ctx.plan
        if g.shape[0] == 0:  # no slot: no row is read
            return g.new_zeros((plan.num_rows, *g.shape[1:])), None
        dx = g[plan.primary]
        if plan.unread is not None:
            dx.index_fill_(0, plan.unread, 0)
        if plan.extra_rows is not None:
            dx.index_put_((plan.extra_rows,), g[plan.extra_slots], accumulate=True)
        return dx, None
