"""Compact execution: every layer reads and writes the P physical rows of a Layout (§3.4).

The Layout (``harts.plan.layout``) fixes one physical row order for the whole model. This
context maps the three row-coupling operations onto it:

* short conv: ``tree_causal_conv1d`` over each row's true ancestors (``layout.ancestors``),
  one post-conv result per physical row; replay never re-runs it.
* linear attention: one packed ``chunk_linear_attn`` call per round over
  ``x[round.la_rows]`` (all rounds' rows in one gather, ``harts.ops.row_gather``), or with the
  tree kernel and ``link_rounds`` every round in one op (``linked_tree_linear_attn``, same states); a sequence
  starts from zero (``init_state == -1``) or from a boundary state exported by an earlier
  round; the round exports ``round.requests`` into ``states[round.request_ids]``; outputs of
  non-replay positions go to ``round.out_rows``. Replay positions only update state. Autograd
  sums every consumer's gradient into the producing round through the shared state tensors.
* attention: ``ancestor_view_attention`` (gather each branch's ancestor K/V, bottom-right
  causal, scatter outputs) or ``tree_mask_attention`` (ancestor-or-self mask).

Everything is rebuilt from the same fixed Layout on every call, so full-layer activation
recomputation re-executes exactly the same rounds, replay and state handoffs.

Shapes (P physical rows, T_r rows of round r): x_PD; la_rows_r [T_r]; states [H, K, V] each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts.models.execution.backends import Backends
from harts.models.execution.base import RowContext
from harts.ops.conv import ConvRuns
from harts.ops.row_gather import RowGatherPlan, gather_rows, row_gather_plan
from harts.ops.upload import upload

__all__ = ["CompactContext", "RoundTensors"]


def _t(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 index array on ``device``, uploaded without waiting for the device."""
    return upload(a, device, torch.int64)


def _host(a: np.ndarray) -> torch.Tensor:
    """int64 metadata kept on the host: linear-attention ops read it without a device sync."""
    return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64)


@dataclass(frozen=True)
class RoundTensors:
    """One RoundView as device tensors (plus host copies of the small id arrays)."""

    num_la_rows: int  # T_r: the round's input rows (gathered for all rounds at once)
    cu_seqlens: torch.Tensor  # host (CPU) tensor: the op plans from it without a device sync
    out_pos: torch.Tensor | None  # positions within la_rows that produce output; None: all do
    out_rows: np.ndarray  # host: read only when the rounds are not in physical order
    init_state: np.ndarray
    requests: torch.Tensor | None  # host (CPU) tensor, like cu_seqlens
    request_ids: np.ndarray
    num_replay: int


class CompactContext(RowContext):
    def __init__(
        self,
        layout,  # noqa: ANN001
        *,
        device: torch.device,
        backends: Backends = Backends(),  # noqa: B008 - frozen
    ) -> None:
        from harts.ops.linear_attn import linear_attn_op

        self.backends = backends
        self.la_op = linear_attn_op(backends.linear_attention, device, int(layout.chunk_size))
        # the tree kernel with the rounds linked into one op per layer ("auto" on CUDA)
        self._link_rounds = backends.link_rounds
        self._linked = None  # LinkedPlan, made on the first linear attention (host work)
        if backends.attention not in ("gather", "mask"):
            raise ValueError(f"attention must be 'gather' or 'mask', got {backends.attention!r}")
        self.layout = layout
        self.attention_impl = backends.attention
        self._mask_cache: dict = {}  # one FlexAttention BlockMask for every layer of this layout
        self.device = device
        self.num_rows = int(layout.num_rows)
        self.chunk_size = int(layout.chunk_size)
        self.position = _t(layout.position, device)
        self.row_weight = upload(layout.multiplicity, device, torch.float64)
        self.rounds = [self._round(r) for r in layout.rounds]
        # linked rounds: the positions within all rounds' input rows that produce output, as a
        # row gather (its backward a gather, not a zero fill and an index_add); None: every one does
        self._out_pos_all = None
        if self._link_rounds:
            is_out = np.concatenate([np.asarray(r.is_output, dtype=bool) for r in layout.rounds] or [np.ones(0, bool)])
            if not is_out.all():
                self._out_pos_all = row_gather_plan(np.flatnonzero(is_out), is_out.size, device)
        # the planner lays rounds out in physical order (each round's output rows one range,
        # the ranges consecutive): the output is then the rounds' outputs concatenated
        self._out_rows = np.concatenate([r.out_rows for r in self.rounds] or [np.zeros(0, np.int64)])
        self.outputs_in_order = bool(np.array_equal(self._out_rows, np.arange(self.num_rows)))
        self._out_rows_dev: torch.Tensor | None = None  # uploaded on first use (rounds out of order only)
        self._la_gather = row_gather_plan(
            np.concatenate([np.asarray(r.la_rows, dtype=np.int64) for r in layout.rounds] or [np.zeros(0, np.int64)]),
            self.num_rows,
            device,
        )
        self.num_boundary_states = int(layout.num_boundary_states)
        self._ancestors: dict[int, torch.Tensor] = {}
        self._conv_runs: dict[int, ConvRuns] = {}
        self.conv_fla = backends.conv == "fla"
        self._attn: dict[str, torch.Tensor] = {}

    def _round(self, r) -> RoundTensors:  # noqa: ANN001
        is_output = np.asarray(r.is_output, dtype=bool)
        requests = np.asarray(r.requests, dtype=np.int64).reshape(-1, 2)
        return RoundTensors(
            num_la_rows=int(np.asarray(r.la_rows).shape[0]),
            cu_seqlens=_host(r.cu_seqlens),
            out_pos=None if is_output.all() else _t(np.flatnonzero(is_output), self.device),
            out_rows=np.asarray(r.out_rows, dtype=np.int64),
            init_state=np.asarray(r.init_state, dtype=np.int64),
            requests=_host(requests) if requests.shape[0] else None,
            request_ids=np.asarray(r.request_ids, dtype=np.int64),
            num_replay=int((~is_output).sum()),
        )

    # ------------------------------------------------------------------ stats
    @property
    def num_calls(self) -> int:
        return len(self.rounds)

    @property
    def num_replay_rows(self) -> int:
        return sum(r.num_replay for r in self.rounds)

    # ------------------------------------------------------------------ ops
    def short_conv(self, x_TD, weight_DW, bias_D, activation):  # type: ignore[override]
        from harts.ops.conv import conv_runs_from_ancestors, runs_causal_conv1d, tree_causal_conv1d

        k = weight_DW.shape[-1] - 1
        if self.conv_fla:
            # runs of consecutive rows with their ancestors as initial states (harts.ops.conv.runs)
            if k not in self._conv_runs:
                self._conv_runs[k] = conv_runs_from_ancestors(self.layout.ancestors(k))
            return runs_causal_conv1d(x_TD, weight_DW, self._conv_runs[k], bias_D, activation)
        if k not in self._ancestors:
            self._ancestors[k] = _t(self.layout.ancestors(k), self.device)
        return tree_causal_conv1d(x_TD, weight_DW, self._ancestors[k], bias_D, activation=activation)

    def _linked_plan(self):  # noqa: ANN202 - a LinkedPlan, or None where the rounds stay apart
        if self._linked is None:
            from harts.ops.linear_attn.tree_kernel import plan_linked_rounds

            rounds = [
                (np.asarray(r.cu_seqlens), np.asarray(r.init_state), np.asarray(r.requests), np.asarray(r.request_ids))
                for r in self.layout.rounds
            ]
            self._linked = plan_linked_rounds(rounds, self.chunk_size) or False
        return self._linked or None

    def la_input_rows(self) -> RowGatherPlan:  # every round's input rows (replayed ones again)
        return self._la_gather

    def _la_inputs(self, q_THK, k_THK, v_THV, g, beta_TH, qkv_gathered: bool) -> list[torch.Tensor | None]:  # noqa: ANN001
        """Every round's input rows of the five inputs (q / k / v as given when already gathered;
        beta None for the plain rule)."""
        qkv = (
            [q_THK, k_THK, v_THV] if qkv_gathered else [gather_rows(t, self._la_gather) for t in (q_THK, k_THK, v_THV)]
        )
        beta = None if beta_TH is None else gather_rows(beta_TH, self._la_gather)
        return [*qkv, gather_rows(g, self._la_gather), beta]

    def linear_attention(self, q_THK, k_THK, v_THV, g, beta_TH, *, rule="delta", scale=None, qkv_gathered=False):  # type: ignore[override]
        from harts.ops.linear_attn.utils import check_rule

        check_rule(rule, beta_TH)
        h, kd, vd = q_THK.shape[1], q_THK.shape[2], v_THV.shape[2]
        inputs = self._la_inputs(q_THK, k_THK, v_THV, g, beta_TH, qkv_gathered)
        linked = self._linked_plan() if self._link_rounds and self._links_rule(rule, q_THK, v_THV, g) else None
        if linked is not None:
            from harts.ops.linear_attn.tree_kernel import linked_tree_linear_attn

            # every round's rows in one gather per input, every round in one op
            o = linked_tree_linear_attn(
                *inputs,
                plan=linked,
                chunk_size=self.chunk_size,
                scale=scale,
                rule=rule,
            )
            o = o if self._out_pos_all is None else gather_rows(o, self._out_pos_all)
            return o if self.outputs_in_order else self._scatter_outputs(o, h, vd)
        states: list[torch.Tensor | None] = [None] * self.num_boundary_states
        out_vals = []
        # every round's input rows in one gather per input (harts.ops.row_gather: one
        # deterministic backward instead of a [P, ...] zero fill, scatter and add per round)
        sizes = [r.num_la_rows for r in self.rounds]
        q_r, k_r, v_r, g_r, b_r = (torch.split(t, sizes) if t is not None else [None] * len(sizes) for t in inputs)
        for i, r in enumerate(self.rounds):
            init = None
            if (r.init_state >= 0).any():
                zero = q_THK.new_zeros(h, kd, vd)
                init = torch.stack([states[s] if s >= 0 else zero for s in r.init_state.tolist()])
            o, _, req = self.la_op(
                q_r[i],
                k_r[i],
                v_r[i],
                g_r[i],
                b_r[i],
                cu_seqlens=r.cu_seqlens,
                initial_state=init,
                chunk_size=self.chunk_size,
                state_requests=r.requests,
                scale=scale,
                rule=rule,
            )
            for j, sid in enumerate(r.request_ids.tolist()):
                states[sid] = req[j]
            out_vals.append(o if r.out_pos is None else o[r.out_pos])
        if self.outputs_in_order:
            return torch.cat(out_vals) if out_vals else v_THV.new_zeros(0, h, vd)
        return self._scatter_outputs(torch.cat(out_vals), h, vd)

    @staticmethod
    def _links_rule(rule: str, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> bool:
        """Whether linked rounds run ``rule`` on these inputs: the delta rule always, the plain
        one where the tree kernel runs it (``plain_on_tree``; else the rounds stay apart and the
        per-round operator picks its path)."""
        if rule == "delta":
            return True
        from harts.ops.linear_attn.tree_kernel import plain_on_tree

        return plain_on_tree(q, v, g)

    def _scatter_outputs(self, o: torch.Tensor, h: int, vd: int) -> torch.Tensor:
        """The rounds' outputs ``o`` [sum of outputs, H, V], in round order, at their physical rows."""
        out = o.new_zeros(self.num_rows, h, vd)
        if self._out_rows_dev is None:
            self._out_rows_dev = _t(self._out_rows, self.device)
        return out.index_copy(0, self._out_rows_dev, o)

    def _attn_index(self, name: str) -> torch.Tensor:
        if name not in self._attn:
            self._attn[name] = _t(getattr(self.layout, name), self.device)
        return self._attn[name]

    def attention(self, q_THD, k_TGD, v_TGE, *, scale):  # type: ignore[override]
        if self.attention_impl == "gather":
            from harts.ops.attention import ancestor_view_attention

            return ancestor_view_attention(
                q_THD,
                k_TGD,
                v_TGE,
                q_rows=self._attn_index("attn_q_rows"),
                cu_q=self._attn_index("attn_cu_q"),
                kv_rows=self._attn_index("attn_kv_rows"),
                cu_kv=self._attn_index("attn_cu_kv"),
                scale=scale,
                cu_q_host=self.layout.attn_cu_q,
                cu_kv_host=self.layout.attn_cu_kv,
                q_rows_host=self.layout.attn_q_rows,
            )
        from harts.ops.attention import tree_mask_attention

        return tree_mask_attention(
            q_THD,
            k_TGD,
            v_TGE,
            tree_pre=self._attn_index("tree_pre"),
            tree_end=self._attn_index("tree_end"),
            scale=scale,
            mask_cache=self._mask_cache,
            tree_pre_host=self.layout.tree_pre,
            tree_end_host=self.layout.tree_end,
            backend=self.backends.flex_backend(q_THD, k_TGD, v_TGE),
        )
