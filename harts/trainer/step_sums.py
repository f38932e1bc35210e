"""A training step's running sums over its microbatches, kept on the device until the step ends
(``harts.trainer.step.accumulate_step_gradients``): the loss, the MoE router objective, the
objective's metrics and the q-weighted expert counts, reduced over ranks in the step's one host
sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harts.models.hybrid_lm import ModelOutput

__all__ = ["StepSums"]


class StepSums:
    """A step's sums over this rank's microbatches. The scalars stay on the device until the
    step ends (no host sync between microbatches, so the host prepares microbatch k + 1 while the
    device runs k): the loss, the MoE objective, then the objective's metric sums; and the
    q-weighted expert counts [L_moe, E]. The execution counts (rows, calls, replay rows) are host
    numbers. ``reports``: whether this rank's loss and metrics count in the step's sums (False
    on the ranks of a context-parallel group but its first, which compute the same loss; their
    MoE objective and counts are their rows' shares and always count)."""

    def __init__(self, device: torch.device, z_coef: float, aux_coef: float, *, reports: bool = True) -> None:
        self.device = device
        self.reports = reports
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        self.z_coef, self.aux_coef = z_coef, aux_coef
        self.sums: torch.Tensor | None = None
        self.names: list[str] = []
        self.counts: torch.Tensor | None = None
        self.rows = self.calls = self.replay_rows = 0

    def add(
        self, out: ModelOutput, loss: torch.Tensor, metrics: dict[str, torch.Tensor], *, router_share: float
    ) -> torch.Tensor:
        """Add one microbatch's forward ``out`` and its objective's ``loss`` and ``metrics``;
        returns the loss to differentiate: ``loss`` plus ``router_share`` of the MoE objective."""
        total = loss
        moe = torch.zeros((), dtype=self.dtype, device=self.device)
        if out.moe_losses is not None:
            router = router_share * out.moe_objective(self.z_coef, self.aux_coef)
            total = total + router
            moe = torch.as_tensor(router, device=self.device).detach().to(self.dtype)
            assert out.expert_counts is not None, "MoE losses come with expert counts"
            c = out.expert_counts.detach()
            self.counts = c.clone() if self.counts is None else self.counts + c
        if self.sums is None:
            self.names = list(metrics)
            self.sums = torch.zeros(2 + len(metrics), dtype=self.dtype, device=self.device)
        values = [loss.detach().to(self.dtype), moe, *(metrics[name].to(self.dtype) for name in self.names)]
        if not self.reports:
            values = [torch.zeros_like(values[0]), moe, *(torch.zeros_like(v) for v in values[2:])]
        self.sums += torch.stack(values)
        self.rows += int(out.info["rows"])
        self.calls += int(out.info["calls"])
        self.replay_rows += int(out.info["replay_rows"])
        return total

    def reduce(self, world: int) -> tuple[float, float, dict[str, float]]:
        """The step's loss, MoE objective and metric sums, summed over ``world`` ranks (the
        expert counts in place): the step's one host sync."""
        if self.sums is None:  # no microbatch ran here: the objective's metrics are unknown, hence 0
            self.sums = torch.zeros(2, dtype=self.dtype, device=self.device)
        if world > 1:
            dist.all_reduce(self.sums)
            if self.counts is not None:
                dist.all_reduce(self.counts)
        loss_sum, moe_sum, *metric_sums = self.sums.tolist()
        return loss_sum, moe_sum, dict(zip(self.names, metric_sums))
