"""Ulysses context parallelism: the C ranks of a ``cp`` group split one microbatch's rows.

    state = init_parallel(ParallelConfig(cp=2), device, num_experts)
    model = parallelize(model, state)       # apply_context_parallel, then FSDP2 over all ranks

Every rank of a CP group prepares the same microbatch (same compaction, call plan and layout:
the plan is deterministic) and holds the rows ``[c * P_l, (c + 1) * P_l)`` of its ``P`` physical
rows, ``P_l = ceil(P / C)`` (the last rank's tail, past ``P``, is padding: weight 0, position 0,
never read by a mixer or the head). Embedding, norms, residuals, MLPs and MoE run on the local
rows. The three row-coupling operations of the row context (``RowContext``) run on the whole
sequence for a ``1/C`` slice of their heads or channels, with an all-to-all before and after:

* ``short_conv``: ``[P_l, Ch]`` -> ``[P, Ch / C]`` (its depthwise channels are independent), the
  tree-causal conv with the matching weight rows, and back;
* ``linear_attention``: q / k / v / g / beta ``[P_l, H, ...]`` -> ``[P, H / C, ...]``, the same
  rounds, replay and state handoffs as one process (heads are independent), and back;
* ``attention``: q ``[P_l, H, D]`` -> ``[P, H / C, D]``; k / v with G key-value heads split the
  same way when C divides G, else (G divides C) each KV head repeated C / G times first, so that
  each rank gets the one its query heads read; the tree attention, and back.

So the plan, the layout and the exactness argument of compact execution carry over unchanged:
each core computes exactly what it computes on one process, for its heads.

The LM head runs on the local rows: each rank computes the log-probs of the positions whose row
it holds, and a sum over the group (backward: the identity, since every rank then computes the
same loss from the same log-probs and that loss counts once) gives every rank all log-probs.
The RL objective is therefore unchanged and needs nothing from this module.

MoE statistics (``moe_statistics``: z-loss, aux-loss) normalise by the microbatch's total row
weight W and assignment fractions f_e, which no rank sees alone: after each router runs, its
q-weighted counts and W are summed over the group and handed to the layer as step statistics
(``MoE.step_statistics``), so each rank's z-loss and aux-loss are its rows' share and the shares
add up to the one-process values. Its expert counts are its rows' (they add up over ranks too).
Under ``moe_statistics="step"`` the trainer's step statistics are already global and are kept.

Nothing here changes a model file: the model's class is swapped for a subclass that wraps its
row context, slices its token rows and runs its head on local rows (as ``fully_shard`` swaps a
module's class), and hooks on the MoE routers exchange their statistics.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from harts.errors import UserError
from harts.models.config import HybridConfig
from harts.models.execution.base import RowContext
from harts.models.execution.config import ExecutionConfig
from harts.models.execution.inputs import CompactInputs, HeadInputs, ModelInputs, head_inputs
from harts.models.hybrid_lm import HybridLM
from harts.models.layers.moe import MoE
from harts.ops.logprob.mapped import logprob_index
from harts.ops.row_gather import RowGatherPlan
from harts.parallel.mesh import ParallelState

__all__ = ["UlyssesContext", "apply_context_parallel", "check_context_parallel", "is_context_parallel"]


# ---------------------------------------------------------------------------------- exchange
def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal-split all-to-all of ``x``'s dim 0 with autograd (backward: the reverse exchange)."""
    out = all_to_all_single_autograd(x.contiguous(), None, None, group)
    return out.wait() if hasattr(out, "wait") else out


def seq_to_heads(x: torch.Tensor, rows: int, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """``x`` [P_l, H, ...] (this rank's rows, all heads) -> [rows, H / cp, ...] (all rows, this
    rank's heads: block ``cp_rank`` of H), the padding rows past ``rows`` dropped."""
    p_l, h = x.shape[0], x.shape[1]
    blocks = x.reshape(p_l, cp, h // cp, *x.shape[2:]).transpose(0, 1)  # [cp, P_l, H / cp, ...]
    out = _all_to_all(blocks.reshape(cp * p_l, h // cp, *x.shape[2:]), group)
    return out[:rows]


def heads_to_seq(y: torch.Tensor, local_rows: int, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """``y`` [P, h, ...] (all rows, this rank's heads) -> [P_l, cp * h, ...] (this rank's rows,
    all heads in order): the inverse of ``seq_to_heads``."""
    rows, h = y.shape[0], y.shape[1]
    pad = cp * local_rows - rows
    if pad:
        y = torch.cat([y, y.new_zeros(pad, *y.shape[1:])])
    out = _all_to_all(y, group).reshape(cp, local_rows, h, *y.shape[2:])
    return out.transpose(0, 1).reshape(local_rows, cp * h, *y.shape[2:])


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum of ``x`` over ``group`` (disjoint supports: a gather). Backward: the
    incoming gradient as is: every rank computes the same loss from the sum, counted once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN401
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN401
        return g, None


# ---------------------------------------------------------------------------------- context
class UlyssesContext(RowContext):
    """The row context of one CP rank: its ``P_l`` local rows over ``inner``'s ``P`` rows
    (module docstring). ``inner`` is the one-process context of the whole microbatch."""

    def __init__(self, inner: RowContext, group: dist.ProcessGroup, cp: int, cp_rank: int) -> None:
        self.inner, self.group, self.cp = inner, group, cp
        self.full_rows = inner.num_rows
        self.num_rows = math.ceil(inner.num_rows / cp)
        self.row_start = cp_rank * self.num_rows
        self.position = self.local(inner.position)
        self.row_weight = self.local(inner.row_weight)
        self.chunk_size = inner.chunk_size
        self.backends = inner.backends
        self.cp_rank = cp_rank

    def local(self, x_T: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a per-row tensor over the ``P`` rows (zeros past ``P``)."""
        pad = self.cp * self.num_rows - x_T.shape[0]
        if pad:
            x_T = torch.cat([x_T, x_T.new_zeros(pad, *x_T.shape[1:])])
        return x_T[self.row_start : self.row_start + self.num_rows]

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        return seq_to_heads(x, self.full_rows, self.group, self.cp)

    def _to_rows(self, y: torch.Tensor) -> torch.Tensor:
        return heads_to_seq(y, self.num_rows, self.group, self.cp)

    def short_conv(
        self, x_TD: torch.Tensor, weight_DW: torch.Tensor, bias_D: torch.Tensor | None, activation: str | None
    ) -> torch.Tensor:
        """[P_l, Ch] -> the conv of this rank's Ch / cp channels over all rows -> [P_l, Ch]."""
        block = x_TD.shape[1] // self.cp
        mine = slice(self.cp_rank * block, (self.cp_rank + 1) * block)
        y = self.inner.short_conv(
            self._to_heads(x_TD), weight_DW[mine], None if bias_D is None else bias_D[mine], activation
        )
        return self._to_rows(y)

    def la_input_rows(self) -> RowGatherPlan | None:
        """None: the layers hand the local rows, and the inner context gathers all rows."""
        return None

    def linear_attention(
        self,
        q_THK: torch.Tensor,
        k_THK: torch.Tensor,
        v_THV: torch.Tensor,
        g: torch.Tensor,
        beta_TH: torch.Tensor,
        *,
        scale: float | None = None,
        qkv_gathered: bool = False,
    ) -> torch.Tensor:
        """[P_l, H, V]: the inner core on all rows for this rank's H / cp heads."""
        assert not qkv_gathered, "la_input_rows is None under context parallelism"
        q, k, v, gg, b = (self._to_heads(t) for t in (q_THK, k_THK, v_THV, g, beta_TH))
        return self._to_rows(self.inner.linear_attention(q, k, v, gg, b, scale=scale))

    def attention(self, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGE: torch.Tensor, *, scale: float) -> torch.Tensor:
        """[P_l, H, E]: the inner attention on all rows for this rank's H / cp query heads and the
        key-value heads they read (repeated first where fewer than cp)."""
        g = k_TGD.shape[1]
        if g % self.cp:
            k_TGD = k_TGD.repeat_interleave(self.cp // g, dim=1)
            v_TGE = v_TGE.repeat_interleave(self.cp // g, dim=1)
        q, k, v = (self._to_heads(t) for t in (q_THD, k_TGD, v_TGE))
        return self._to_rows(self.inner.attention(q, k, v, scale=scale))


# ---------------------------------------------------------------------------------- the model
class ContextParallelLM(HybridLM):
    """What ``apply_context_parallel`` makes a ``HybridLM``: its forward on this rank's rows."""

    _cp_group: dist.ProcessGroup
    _cp: int
    _cp_rank: int

    def _context(self, inputs: ModelInputs, cfg: ExecutionConfig) -> tuple[RowContext, torch.Tensor, dict[str, Any]]:
        ctx, tokens, info = super()._context(inputs, cfg)
        local = UlyssesContext(ctx, self._cp_group, self._cp, self._cp_rank)
        info["cp"] = self._cp
        info["cp_rows"] = local.num_rows
        return local, local.local(tokens), info

    def _head(
        self, h_TD: torch.Tensor, inputs: ModelInputs, cfg: ExecutionConfig, info: dict[str, Any]
    ) -> torch.Tensor:
        """Log-probs [S - N] of every position, computed for the positions of this rank's rows and
        summed over the group (module docstring); NaN where no rank computes one."""
        batch = inputs.batch
        head = inputs.head
        if head is None or not head.serves(cfg):
            layout = inputs.layout if isinstance(inputs, CompactInputs) else None
            head = head_inputs(batch, layout, cfg, self.config.vocab_size)
        entries = np.arange(head.rows.size) if head.entries is None else np.asarray(head.entries)
        p_l = h_TD.shape[0]
        start = self._cp_rank * p_l
        sel = np.flatnonzero((head.rows >= start) & (head.rows < start + p_l))
        rows, targets = np.asarray(head.rows[sel]) - start, np.asarray(head.targets[sel])
        index = logprob_index(rows, targets, p_l, self.config.vocab_size) if head.fused else None
        mine = HeadInputs(head.logprob_positions, head.fused, rows, targets, entries[sel], index)
        logprobs = super()._head(h_TD, dataclasses.replace(inputs, head=mine), cfg, info)
        here = torch.zeros(batch.num_logprobs, dtype=torch.bool)
        here[torch.as_tensor(entries[sel])] = True
        part = torch.where(here.to(logprobs.device), logprobs, 0.0)
        if sel.size == 0:
            # a rank without a position still differentiates through its rows: its backward
            # must run every exchange of the group's (the term is an exact zero)
            part = part + 0.0 * h_TD[:1, :1].sum()
        full = _SumOverGroup.apply(part, self._cp_group)
        if head.entries is None:
            return full
        computed = torch.zeros(batch.num_logprobs, dtype=torch.bool)
        computed[torch.as_tensor(entries)] = True
        return torch.where(computed.to(full.device), full, float("nan"))


# ---------------------------------------------------------------------------------- MoE statistics
def _hook_moe_statistics(moe: MoE, group: dist.ProcessGroup) -> None:
    """Hooks that give ``moe`` the group's counts and row weight (module docstring) for each call
    that has no step statistics of its own."""

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        w = args[1] if len(args) > 1 else kwargs["w_T"]
        module._cp_weight = w if module.step_statistics is None else None  # type: ignore[assignment]

    def routed(gate: nn.Module, args: tuple, out: tuple) -> None:
        w = moe.__dict__.get("_cp_weight")
        if w is None:
            return
        logits, _, topk_idx, _ = out
        with torch.no_grad():
            w = w.to(logits.dtype)
            assigned = torch.zeros_like(logits).scatter_(1, topk_idx, 1.0)
            stats = torch.cat([(w[:, None] * assigned).sum(0), w.sum()[None]])
            dist.all_reduce(stats, group=group)
        moe.step_statistics = (stats[:-1], stats[-1])  # type: ignore[assignment]

    def after(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:  # noqa: ANN401
        if module.__dict__.pop("_cp_weight", None) is not None:
            module.step_statistics = None  # type: ignore[assignment]

    moe.register_forward_pre_hook(before, with_kwargs=True)
    moe.gate.register_forward_hook(routed)
    moe.register_forward_hook(after, with_kwargs=True, always_call=True)


# ---------------------------------------------------------------------------------- apply / checks
def check_context_parallel(config: HybridConfig, cp: int) -> None:
    """UserError naming both numbers when ``cp`` does not split what it must split evenly: the
    attention heads, the key-value heads (or cp a multiple of them), the linear-attention heads
    and the short conv's channels of every mixer in ``config``'s layer pattern."""
    if cp == 1:
        return
    need: list[tuple[str, int]] = []
    letters = set(config.layer_pattern)
    if letters & {"A", "M"}:
        need.append(("attention heads (num_attention_heads)", config.num_attention_heads))
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    kd, vd = config.linear_key_head_dim, config.linear_value_head_dim
    if letters & {"K", "G"}:
        need.append(("linear-attention heads (linear_num_value_heads)", hv))
    if "K" in letters:
        need.append(("KDA conv channels", 2 * hv * kd + hv * vd))
    if "G" in letters:
        need.append(("GDN conv channels", 2 * hk * kd + hv * vd))
    for what, n in need:
        if n % cp:
            raise UserError(f"--cp {cp} does not divide the model's {n} {what}")
    if "A" in letters:
        g = config.num_key_value_heads
        if g % cp and cp % g:
            raise UserError(
                f"--cp {cp}: the {g} key-value heads (num_key_value_heads) must be a multiple or a divisor of {cp}"
            )


def is_context_parallel(model: nn.Module) -> bool:
    return isinstance(model, ContextParallelLM)


def apply_context_parallel(model: HybridLM, state: ParallelState) -> None:
    """Make ``model`` run its forward on this rank's rows of each microbatch (module docstring);
    every rank of the ``cp`` group must call it and then run the same forwards."""
    check_context_parallel(model.config, state.cp)
    group = state.group("cp")
    cls = type(model)
    model.__class__ = type(f"ContextParallel{cls.__name__}", (ContextParallelLM, cls), {})
    cp_model = cast(ContextParallelLM, model)
    cp_model._cp_group, cp_model._cp, cp_model._cp_rank = group, state.cp, state.cp_rank
    for m in model.modules():
        if isinstance(m, MoE):
            _hook_moe_statistics(m, group)
