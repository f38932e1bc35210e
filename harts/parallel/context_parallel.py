"""Ulysses context parallelism: the C ranks of a ``cp`` group split one microbatch's rows.

    state = init_parallel(ParallelConfig(cp=2), device, num_experts)
    model = parallelize(model, state)       # apply_row_split, then EP and FSDP2 over all ranks

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

With tensor parallelism (``tensor_parallel.py``) the same split serves sequence parallelism:
the rows are cut in ``C * P`` blocks (``P`` = tp); the FFN, the norms and the head run on this
rank's block, and the tensor-parallel hooks gather the ``P`` blocks of the rank's CP block
before each mixer. So the context's mixer operations see those rows for the rank's heads, the
head's log-prob sum and the MoE statistics run over the whole row group (``cp x tp`` ranks),
and everything above holds with ``C * P`` in place of ``C`` for the rows.

Nothing here changes a model file: the model's class is swapped for a subclass that wraps its
row context, slices its token rows and runs its head on local rows (as ``fully_shard`` swaps a
module's class), and hooks on the MoE routers exchange their statistics.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
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
from harts.models.layers.registry import mixer_specs
from harts.ops.logprob.mapped import logprob_index
from harts.ops.row_gather import RowGatherPlan
from harts.ops.upload import upload
from harts.parallel.mesh import ParallelState

__all__ = ["RowSplit", "RowSplitLM", "UlyssesContext", "apply_row_split", "check_context_parallel", "is_row_split"]


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
@dataclass(frozen=True)
class RowSplit:
    """How one rank's row group splits a microbatch's rows: ``cp`` context-parallel ranks (the
    Ulysses all-to-alls over ``cp_group``) times ``tp`` tensor/sequence-parallel ranks (their row
    gathers and scatters run around the mixers and FFNs, ``tensor_parallel.py``)."""

    cp: int
    cp_rank: int
    tp: int
    tp_rank: int
    #: the cp ranks of this rank's context-parallel group (None when cp = 1)
    cp_group: dist.ProcessGroup | None
    #: all cp * tp ranks of the row group: the head's log-prob sum and MoE statistics
    rows_group: dist.ProcessGroup


#: fast paths that read a projection's whole weight (``torch.cat`` of q/k/v or gate weights):
#: under tensor parallelism the weights are shards (DTensors), so the layers take the separate
#: projections, which compute the same thing
_WHOLE_WEIGHT_FAST_PATHS = frozenset({"stacked_qkv", "stacked_gates"})


class UlyssesContext(RowContext):
    """The row context of one rank of a row group over ``inner``'s ``P`` rows (module docstring).

    Rows are split in ``cp * tp`` blocks of ``P_r = ceil(P / (cp tp))`` (padding past ``P``). A
    token mixer sees the ``num_rows = tp * P_r`` rows of this rank's CP block (``position`` is
    theirs: the tensor-parallel hooks gather them before the mixer); the FFN and the head see this
    rank's ``P_r`` rows (``row_weight`` is theirs, for the MoE statistics). ``inner`` is the
    one-process context of the whole microbatch."""

    def __init__(self, inner: RowContext, split: RowSplit) -> None:
        self.inner, self.split = inner, split
        self.full_rows = inner.num_rows
        self.rank_rows = math.ceil(inner.num_rows / (split.cp * split.tp))
        self.num_rows = split.tp * self.rank_rows
        self.cp_start = split.cp_rank * self.num_rows
        self.row_start = self.cp_start + split.tp_rank * self.rank_rows
        self.position = self._slice(inner.position, self.cp_start, self.num_rows)
        self.row_weight = self.local(inner.row_weight)
        self.chunk_size = inner.chunk_size
        backends = inner.backends
        if split.tp > 1:
            backends = dataclasses.replace(backends, fast_paths=backends.fast_paths - _WHOLE_WEIGHT_FAST_PATHS)
        self.backends = backends
        #: the short conv's channel blocks (q, k, v) of the mixer running now, set by the
        #: tensor-parallel hooks: each block is split over tp (None without tensor parallelism)
        self.conv_blocks: tuple[int, int, int] | None = None
        self._channel_index: dict[tuple[int, int, int], torch.Tensor] = {}

    def _slice(self, x_T: torch.Tensor, start: int, n: int) -> torch.Tensor:
        pad = self.split.cp * self.num_rows - x_T.shape[0]
        if pad:
            x_T = torch.cat([x_T, x_T.new_zeros(pad, *x_T.shape[1:])])
        return x_T[start : start + n]

    def local(self, x_T: torch.Tensor) -> torch.Tensor:
        """This rank's ``P_r`` rows of a per-row tensor over the ``P`` rows (zeros past ``P``)."""
        return self._slice(x_T, self.row_start, self.rank_rows)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        if self.split.cp == 1:
            return x[: self.full_rows]
        assert self.split.cp_group is not None
        return seq_to_heads(x, self.full_rows, self.split.cp_group, self.split.cp)

    def _to_rows(self, y: torch.Tensor) -> torch.Tensor:
        if self.split.cp == 1:
            pad = self.num_rows - y.shape[0]
            return torch.cat([y, y.new_zeros(pad, *y.shape[1:])]) if pad else y
        assert self.split.cp_group is not None
        return heads_to_seq(y, self.num_rows, self.split.cp_group, self.split.cp)

    def _tp_channels(self, weight_DW: torch.Tensor, bias_D: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The conv weight (and bias) rows of this rank's tensor-parallel channels: the
        ``tp_rank``-th part of each of the (q, k, v) blocks."""
        if self.conv_blocks is None or self.split.tp == 1:
            return (weight_DW,) if bias_D is None else (weight_DW, bias_D)
        index = self._channel_index.get(self.conv_blocks)
        if index is None:
            tp, t = self.split.tp, self.split.tp_rank
            parts, offset = [], 0
            for n in self.conv_blocks:
                parts.append(np.arange(offset + t * n // tp, offset + (t + 1) * n // tp))
                offset += n
            index = self._channel_index[self.conv_blocks] = upload(np.concatenate(parts), weight_DW.device, torch.int64)
        return tuple(w.index_select(0, index) for w in ((weight_DW,) if bias_D is None else (weight_DW, bias_D)))

    def short_conv(
        self, x_TD: torch.Tensor, weight_DW: torch.Tensor, bias_D: torch.Tensor | None, activation: str | None
    ) -> torch.Tensor:
        """[rows, Ch] -> the conv of this rank's Ch / cp channels over all rows -> [rows, Ch]
        (Ch: the channels of this rank's tensor-parallel heads)."""
        weight_DW, *rest = self._tp_channels(weight_DW, bias_D)
        bias = rest[0] if rest else None
        block = x_TD.shape[1] // self.split.cp
        mine = slice(self.split.cp_rank * block, (self.split.cp_rank + 1) * block)
        y = self.inner.short_conv(
            self._to_heads(x_TD), weight_DW[mine], None if bias is None else bias[mine], activation
        )
        return self._to_rows(y)

    def la_input_rows(self) -> RowGatherPlan | None:
        """None: the layers hand their rows, and the inner context gathers all rows."""
        return None

    def linear_attention(
        self,
        q_THK: torch.Tensor,
        k_THK: torch.Tensor,
        v_THV: torch.Tensor,
        g: torch.Tensor,
        beta_TH: torch.Tensor | None,
        *,
        rule: str = "delta",
        scale: float | None = None,
        qkv_gathered: bool = False,
    ) -> torch.Tensor:
        """[rows, H, V]: the inner core (``rule``, beta None for "plain") on all rows for this
        rank's H / cp heads."""
        assert not qkv_gathered, "la_input_rows is None under row splitting"
        q, k, v, gg = (self._to_heads(t) for t in (q_THK, k_THK, v_THV, g))
        b = None if beta_TH is None else self._to_heads(beta_TH)
        return self._to_rows(self.inner.linear_attention(q, k, v, gg, b, rule=rule, scale=scale))

    def attention(self, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGE: torch.Tensor, *, scale: float) -> torch.Tensor:
        """[rows, H, E]: the inner attention on all rows for this rank's H / cp query heads and
        the key-value heads they read (repeated first where fewer than cp)."""
        g, cp = k_TGD.shape[1], self.split.cp
        if g % cp:
            k_TGD = k_TGD.repeat_interleave(cp // g, dim=1)
            v_TGE = v_TGE.repeat_interleave(cp // g, dim=1)
        q, k, v = (self._to_heads(t) for t in (q_THD, k_TGD, v_TGE))
        return self._to_rows(self.inner.attention(q, k, v, scale=scale))


# ---------------------------------------------------------------------------------- the model
class RowSplitLM(HybridLM):
    """What ``apply_row_split`` makes a ``HybridLM``: its forward on this rank's rows."""

    _row_split: RowSplit

    def _context(self, inputs: ModelInputs, cfg: ExecutionConfig) -> tuple[RowContext, torch.Tensor, dict[str, Any]]:
        ctx, tokens, info = super()._context(inputs, cfg)
        local = UlyssesContext(ctx, self._row_split)
        info["cp"], info["tp"] = self._row_split.cp, self._row_split.tp
        info["rank_rows"] = local.rank_rows
        return local, local.local(tokens), info

    def _head(
        self, h_TD: torch.Tensor, inputs: ModelInputs, cfg: ExecutionConfig, info: dict[str, Any]
    ) -> torch.Tensor:
        """Log-probs [S - N] of every position, computed for the positions of this rank's rows and
        summed over the row group (module docstring); NaN where no rank computes one."""
        batch = inputs.batch
        head = inputs.head
        if head is None or not head.serves(cfg):
            layout = inputs.layout if isinstance(inputs, CompactInputs) else None
            head = head_inputs(batch, layout, cfg, self.config.vocab_size)
        entries = np.arange(head.rows.size) if head.entries is None else np.asarray(head.entries)
        p_r = h_TD.shape[0]
        start = self._row_split.cp_rank * self._row_split.tp * p_r + self._row_split.tp_rank * p_r
        sel = np.flatnonzero((head.rows >= start) & (head.rows < start + p_r))
        rows, targets = np.asarray(head.rows[sel]) - start, np.asarray(head.targets[sel])
        index = logprob_index(rows, targets, p_r, self.config.vocab_size) if head.fused else None
        mine = HeadInputs(head.logprob_positions, head.fused, rows, targets, entries[sel], index)
        logprobs = super()._head(h_TD, dataclasses.replace(inputs, head=mine), cfg, info)
        here = np.zeros(batch.num_logprobs, dtype=bool)
        here[entries[sel]] = True
        part = torch.where(upload(here, logprobs.device), logprobs, 0.0)
        if sel.size == 0:
            # a rank without a position still differentiates through its rows: its backward
            # must run every collective of the group's (the term is an exact zero)
            part = part + 0.0 * h_TD[:1, :1].sum()
        full = _SumOverGroup.apply(part, self._row_split.rows_group)
        if head.entries is None:
            return full
        computed = np.zeros(batch.num_logprobs, dtype=bool)
        computed[entries] = True
        return torch.where(upload(computed, full.device), full, float("nan"))


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
def check_context_parallel(config: HybridConfig, cp: int, tp: int = 1) -> None:
    """UserError naming both numbers when ``cp`` does not split what it must split evenly: the
    attention heads, the key-value heads (or cp a multiple of them), the linear-attention heads
    and the short conv's channels of every mixer in ``config``'s layer pattern; with tensor
    parallelism ``tp``, those of one tensor-parallel rank (``check_tensor_parallel`` checks
    that tp splits them first)."""
    if cp == 1:
        return
    per = f" per tensor-parallel rank (of --tp {tp})" if tp > 1 else ""
    need: list[tuple[str, int, str]] = []
    for spec in mixer_specs(config.layer_pattern):
        if spec.cp_divisors is None:
            raise UserError(
                f"--cp {cp}: context parallelism does not split {spec.description} layers ({spec.letter}), which "
                "this model has; use --cp 1"
            )
        need += [n for n in spec.cp_divisors(config, tp) if n not in need]
    for what, n, _ in (x for x in need if x[2] == "divides"):
        if n % cp:
            raise UserError(f"--cp {cp} does not divide the model's {n} {what}{per}")
    for what, n, _ in (x for x in need if x[2] == "divides_or_multiple"):
        if n % cp and cp % n:
            raise UserError(f"--cp {cp}: the {n} {what}{per} must be a multiple or a divisor of {cp}")


def is_row_split(model: nn.Module) -> bool:
    """Whether ``model`` runs on a share of each microbatch's rows (``apply_row_split``)."""
    return isinstance(model, RowSplitLM)


def apply_row_split(model: HybridLM, state: ParallelState) -> None:
    """Make ``model`` run its forward on this rank's rows of each microbatch (module docstring):
    the row context, token rows, head and MoE statistics of its row group (cp x tp ranks).
    Every rank of the group must call it and then run the same forwards. Tensor parallelism
    adds its sharded projections and row gathers on top (``apply_tensor_parallel``)."""
    check_context_parallel(model.config, state.cp, state.tp)
    assert state.rows_mesh is not None
    split = RowSplit(
        cp=state.cp,
        cp_rank=state.cp_rank,
        tp=state.tp,
        tp_rank=state.tp_rank,
        cp_group=state.group("cp") if state.cp > 1 else None,
        rows_group=state.rows_mesh.get_group("rows"),
    )
    cls = type(model)
    model.__class__ = type(f"RowSplit{cls.__name__}", (RowSplitLM, cls), {})
    cast(RowSplitLM, model)._row_split = split
    for m in model.modules():
        if isinstance(m, MoE):
            _hook_moe_statistics(m, split.rows_group)
