"""Expert parallelism: each MoE layer's experts split over the ``ep`` ranks, tokens sent by all-to-all.

``apply_expert_parallel`` replaces every ``MoE.experts`` (an ``Experts``) with an
``ExpertParallelExperts`` holding this rank's contiguous block of ``E / ep`` experts. The
parameter names stay the experts' own (``Experts.weight_names``: ``gate_up_proj`` / ``down_proj``
for SwiGLU, ``up_proj`` / ``down_proj`` for Nemotron-H's relu2) and become DTensors on the expert mesh
(``ParallelState.expert_mesh``: [dp x cp, ep]) with placements ``[Replicate(), Shard(0)]``, so state dicts and DCP checkpoints keep the
one-process names and full shapes. The router, the shared experts and the MoE statistics are
untouched: routing is computed on the rank's own rows with the replicated router, and the
architecture file ``models/layers/moe.py`` knows nothing of this.

Forward of one layer (rows T, top-k K, this rank r of ep, E_l = E / ep local experts):

1. the T*K (row, slot) pairs are sorted by expert (stable): destination rank e // E_l, and
   within it by local expert;
2. counts [ep, E_l] are exchanged (``all_to_all_single``), so each rank knows how many rows
   every source sends for each of its experts; the row exchange is torch's autograd-aware
   functional ``all_to_all_single_autograd`` (its backward is the reverse exchange);
3. the received rows are grouped by local expert and each expert (SwiGLU or relu2) runs on its rows
   (``torch._grouped_mm`` where ``grouped_mm_supported``, else one GEMM pair per expert);
4. results travel back by the reverse exchange, are weighted by the rows' top-k weights on the
   source rank (so the router's gradient stays local), and each row sums its K slots in slot
   order: the combine is exact, no atomics.

All ranks of an ep group must call every MoE layer the same number of times in the same order:
the loop guarantees it (every replica runs the same number of microbatches, slot by slot).
The expert gradients are complete on each rank for its block after backward, up to the sum
over the ``dp x cp`` ranks that hold the same block (``finish_gradients``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Replicate, Shard

from harts.models.layers.moe import Experts, MoE, grouped_mm_supported
from harts.parallel.mesh import ParallelState

__all__ = ["ExpertParallelExperts", "apply_expert_parallel", "expert_parameters"]


class ExpertParallelExperts(nn.Module):
    """This rank's block of an ``Experts`` module; same function, tokens exchanged over ``ep``."""

    def __init__(self, experts: Experts, state: ParallelState) -> None:
        super().__init__()
        mesh = state.expert_mesh
        assert mesh is not None
        self.activation = experts.activation
        self.weight_names = experts.weight_names
        self.num_experts = e = experts.num_experts
        self.ep = state.ep
        self.num_local = e // self.ep
        self.group = mesh.get_group("ep")
        r = dist.get_rank(self.group)
        block = slice(r * self.num_local, (r + 1) * self.num_local)
        placements = [Replicate(), Shard(0)]
        for name in self.weight_names:
            shard = getattr(experts, name).detach()[block].clone()
            self.register_parameter(name, nn.Parameter(DTensor.from_local(shard, mesh, placements, run_check=False)))

    def forward(self, x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """y_TD = sum_k topk_w[t, k] * expert_{topk_idx[t, k]}(x_t) (``Experts.forward``'s contract)."""
        t, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert = by rank
        send = torch.bincount(flat, minlength=self.num_experts).view(self.ep, self.num_local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        xs = x_TD[order // k]
        xr = _exchange(xs, recv_rows, send_rows, self.group)
        hr = self._local_experts(xr, recv)
        h = _exchange(hr, send_rows, recv_rows, self.group)
        h = h * topk_w.reshape(-1)[order, None].to(h.dtype)
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return h[back].view(t, k, -1).sum(1)

    def _local_experts(self, xr_RD: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert. Rows arrive by (source, local expert);
        ``recv`` [ep, E_l] holds how many for each."""
        w_in, w_down = (getattr(self, n).to_local() for n in self.weight_names)
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_local, device=recv.device).repeat(self.ep), recv.reshape(-1)
        )
        by_expert = torch.argsort(expert_of_row, stable=True)
        xs = xr_RD[by_expert]
        per_expert = recv.sum(0)
        if xs.shape[0] and grouped_mm_supported(xs):
            offs = per_expert.cumsum(0).to(torch.int32)
            h = self._act(torch._grouped_mm(xs, w_in.to(xs.dtype).transpose(1, 2), offs=offs))
            hs = torch._grouped_mm(h, w_down.to(xs.dtype).transpose(1, 2), offs=offs)
        else:
            outs, start = [], 0
            for e, n in enumerate(per_expert.tolist()):
                outs.append(F.linear(self._act(F.linear(xs[start : start + n], w_in[e])), w_down[e]))
                start += n
            hs = torch.cat(outs) if outs else xs.new_zeros(0, w_down.shape[1])
        inverse = torch.empty_like(by_expert).scatter_(
            0, by_expert, torch.arange(by_expert.numel(), device=by_expert.device)
        )
        return hs[inverse]

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        """The experts' activation on their first projection's output: SwiGLU on [gate | up]
        (``Experts``' ``gate_up_proj`` rows), or relu(up)^2 (Nemotron-H)."""
        if self.activation == "silu":
            g, u = h.chunk(2, dim=-1)
            return F.silu(g) * u
        return F.relu(h).square()


def _exchange(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of rows with autograd (the backward is the reverse exchange)."""
    out = all_to_all_single_autograd(x.contiguous(), out_rows, in_rows, group)
    return out.wait() if hasattr(out, "wait") else out


def apply_expert_parallel(model: nn.Module, state: ParallelState) -> None:
    """Replace every MoE layer's experts by this rank's block (``ExpertParallelExperts``)."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.experts = ExpertParallelExperts(m.experts, state)  # type: ignore[assignment]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters (DTensors on the expert mesh), in module order."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()]
