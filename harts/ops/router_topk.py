"""Group-limited top-k expert choice in one kernel (DeepSeek-V3 / Ling / Kimi routing).

    choice  = scores + bias                                   [T, E]
    group   = sum of the top 2 of each of G groups of E / G   [T, G]
    kept    = the KG best groups of each row
    topk    = the K best experts of each row inside its kept groups, best first   [T, K]

The torch formulation (``TopKRouter.choose``'s reference) takes three ``topk`` calls, a scatter,
a masked fill and their temporaries (sorting kernels, ``gatherTopK`` and
``bitonicSortKVInPlace`` in a GPU profile), for an output of 8 indices per row. ``grouped_topk`` reads the [T, E] scores once: a Triton program
holds a block of rows in registers and takes the group maxima, the KG groups and the K experts
by repeated arg-max. Triton only: no maintained kernel does this choice (fla-core has no
routing; torch's ``topk`` is one of the three calls above).

Ties: among equal values the lowest index wins (torch's ``topk`` leaves that order unspecified);
values, and so every choice without ties, equal the reference exactly. The kernel needs E and G
powers of two, E / G >= 2 and K <= KG * E / G; ``grouped_topk`` falls back to the torch
reference otherwise, and off CUDA (on a CPU machine with Triton, the tests run the kernel
through Triton's interpreter).

Shapes: scores_TE float32 (the router's work dtype for half inputs), bias_E, out int64 [T, K].
"""

from __future__ import annotations

import math
import os

import torch

from harts.ops.kernel_check import kernel_passes

__all__ = ["grouped_topk", "grouped_topk_reference", "kernel_applies"]

try:  # Triton is a GPU extra; the torch reference runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None  # type: ignore[assignment]


def grouped_topk_reference(
    scores_TE: torch.Tensor, bias_E: torch.Tensor, n_group: int, topk_group: int, k: int
) -> torch.Tensor:
    """The torch formulation: int64 [T, K], best first."""
    choice = scores_TE + bias_E.to(scores_TE.dtype)
    if n_group > 1:
        t = choice.shape[0]
        grouped = choice.reshape(t, n_group, choice.shape[1] // n_group)  # (not -1: zero rows)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = group_score.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask[..., None], -math.inf).reshape(t, choice.shape[1])
    return choice.topk(k, dim=-1, sorted=True).indices


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kernel_applies(scores_TE: torch.Tensor, n_group: int, topk_group: int, k: int) -> bool:
    """Whether ``grouped_topk`` runs the kernel for these scores and settings (module docstring)."""
    if triton is None or scores_TE.dim() != 2 or scores_TE.dtype != torch.float32:
        return False
    e = scores_TE.shape[1]
    g = max(n_group, 1)
    return (
        _pow2(e)
        and _pow2(g)
        and e % g == 0
        and e // g >= 2
        and 1 <= topk_group <= g
        and 1 <= k <= topk_group * (e // g)
        and (scores_TE.is_cuda or _interpreted())
    )


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


#: per (device type, E, G, KG, K): whether the kernel's first run matched the reference
_checked: dict[tuple, bool] = {}


def grouped_topk(scores_TE: torch.Tensor, bias_E: torch.Tensor, n_group: int, topk_group: int, k: int) -> torch.Tensor:
    """int64 [T, K]: each row's K best experts on ``scores + bias``, best first, inside its
    ``topk_group`` best of ``n_group`` groups (group score: the sum of its top 2); the kernel
    where ``kernel_applies``, else ``grouped_topk_reference``.

    The first call of each shape in a process also runs the reference and compares the values
    chosen (equal up to the order of ties; one host synchronization); where the kernel fails or
    differs it warns once, naming why, and the reference runs from then on."""
    if not kernel_applies(scores_TE, n_group, topk_group, k):
        return grouped_topk_reference(scores_TE, bias_E, n_group, topk_group, k)
    key = (scores_TE.device.type, scores_TE.shape[1], n_group, topk_group, k)
    if not kernel_passes(
        _checked,
        key,
        lambda: grouped_topk_reference(scores_TE, bias_E, n_group, topk_group, k),
        lambda: _launch(scores_TE, bias_E, n_group, topk_group, k),
        lambda got, want: _same_choice(scores_TE, bias_E, got, want),
        name="grouped top-k",
        differs="its choice differed from the torch reference",
        fallback="routing runs torch's topk",
    ):
        return grouped_topk_reference(scores_TE, bias_E, n_group, topk_group, k)
    return _launch(scores_TE, bias_E, n_group, topk_group, k)


def _same_choice(scores_TE: torch.Tensor, bias_E: torch.Tensor, a_TK: torch.Tensor, b_TK: torch.Tensor) -> bool:
    """Whether two choices pick the same values, best first: equal up to the order of ties."""
    if a_TK.shape != b_TK.shape:
        return False
    choice = scores_TE + bias_E.to(scores_TE.dtype)
    return bool(torch.equal(choice.gather(1, a_TK), choice.gather(1, b_TK)))


def _launch(scores_TE: torch.Tensor, bias_E: torch.Tensor, n_group: int, topk_group: int, k: int) -> torch.Tensor:
    t, e = scores_TE.shape
    g = max(n_group, 1)
    scores = scores_TE.contiguous()
    bias = bias_E.to(device=scores.device, dtype=torch.float32).contiguous()
    out = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    if t:
        block = 32
        _grouped_topk_kernel[(triton.cdiv(t, block),)](
            scores, bias, out, t, E=e, G=g, EG=e // g, KG=topk_group if g > 1 else 1, K=k, BLOCK_T=block
        )
    return out


if triton is not None:

    @triton.jit
    def _grouped_topk_kernel(
        S,
        Bias,
        Out,
        T,
        E: tl.constexpr,
        G: tl.constexpr,
        EG: tl.constexpr,
        KG: tl.constexpr,
        K: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        live = rows < T
        cols = tl.arange(0, E)
        s = tl.load(S + rows[:, None].to(tl.int64) * E + cols[None, :], mask=live[:, None], other=0.0)
        s = s + tl.load(Bias + cols)[None, :]
        # group score: the sum of each group's two largest (the second after removing one
        # occurrence of the first, so equal maxima count twice, as topk(2) has them)
        grouped = tl.reshape(s, (BLOCK_T, G, EG))
        first = tl.max(grouped, axis=2)
        at = tl.argmax(grouped, axis=2, tie_break_left=True)
        within = tl.arange(0, EG)
        rest = tl.where(within[None, None, :] == at[:, :, None], -float("inf"), grouped)
        group_score = first + tl.max(rest, axis=2)
        # the KG best groups, by repeated arg-max
        gid = tl.arange(0, G)
        kept = tl.zeros((BLOCK_T, G), dtype=tl.int32)
        for _ in tl.static_range(KG):
            best = tl.argmax(group_score, axis=1, tie_break_left=True)
            hit = gid[None, :] == best[:, None]
            kept = tl.where(hit, 1, kept)
            group_score = tl.where(hit, -float("inf"), group_score)
        keep = tl.reshape(tl.broadcast_to(kept[:, :, None], (BLOCK_T, G, EG)), (BLOCK_T, E))
        choice = tl.where(keep != 0, s, -float("inf"))
        # the K best experts, best first
        for j in tl.static_range(K):
            best = tl.argmax(choice, axis=1, tie_break_left=True)
            tl.store(Out + rows.to(tl.int64) * K + j, best.to(tl.int64), mask=live)
            choice = tl.where(cols[None, :] == best[:, None], -float("inf"), choice)
