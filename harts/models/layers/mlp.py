"""Dense MLP (rows independent). Shapes: x_TD.

silu  (SwiGLU)         down_proj(silu(gate_proj x) * up_proj x)
relu2 (Nemotron-H)     down_proj(relu(up_proj x)^2)              no gate projection
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harts.ops.compiled import cuda_compiled

__all__ = ["MLP", "swiglu"]


@cuda_compiled(rows=(0, 1))
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (one fused pass on CUDA). gate, up: [..., I]."""
    return F.silu(gate) * up


class MLP(nn.Module):
    """The dense MLP of ``activation`` "silu" (SwiGLU, three projections) or "relu2" (two)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        if activation == "silu":
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.activation == "relu2":
            return self.down_proj(F.relu(self.up_proj(x_TD)).square())
        return self.down_proj(swiglu(self.gate_proj(x_TD), self.up_proj(x_TD)))
