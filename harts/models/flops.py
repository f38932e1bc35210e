"""Model FLOPs of a training step, for tokens/s, TFLOP/s and MFU in ``harts bench``.

The formula counts useful model work on the rows each side executes, the same way for both:

    forward = rows        x 2 x (active matmul parameters of the decoder layers)
            + logit_rows  x 2 x V x D                                   (LM head)
            + pairs       x sum_attention_layers 2 x H x (d_qk + d_v)     (QK^T and PV)
            + rows        x sum_linear_layers H x (6 B K + 4 B V + 2/3 B^2 + 6 K V)
    training = 3 x forward                          (backward = 2 x forward, by convention)

* rows: the baseline's raw tokens; harts' compact rows (each shared token once; padding and
  chunk-boundary replay rows are executed but not counted as useful work).
* active matmul parameters: every ``nn.Linear`` weight of the decoder layers (attention and
  linear-attention projections, gates, dense MLPs, shared experts), the router, and the routed
  experts' weights times top-k / E. Embedding lookups, depthwise convs, norms and element-wise
  gates are not counted.
* logit_rows: rows whose logits the LM head computes (the baseline: every predicting
  position; harts: each compact row with a prediction, once, however many positions share it).
* pairs: visible (query, key) pairs of full attention: a row at trajectory position p sees
  p + 1 keys, causally in a trajectory, its ancestors-or-self in a tree. Sum of p + 1 over rows.
* linear attention (per row and head, chunk B, key dim K, value dim V): in-chunk Q K^T and
  K K^T (4 B K), the WY factors W and U (2 B K + 2 B V), the intra-chunk output (2 B V), the
  triangular solve (2/3 B^2) and the three state products Q S, W S, K^T delta (6 K V).
* Recomputation (``--recompute``) re-runs forwards: that work is not counted.

MFU = training FLOPs / seconds / peak; the peak is the device's dense bf16 tensor-core rate
(``PEAK_TFLOPS``) or a value the user gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from harts.models.hybrid_lm import HybridLM

__all__ = ["FlopModel", "PEAK_TFLOPS", "active_matmul_params", "peak_tflops"]

#: dense bf16 tensor-core peak (TFLOP/s) by device-name substring (vendor data sheets)
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` when known, else None (CPU, unknown GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


@dataclass(frozen=True)
class FlopModel:
    """Forward FLOPs per unit of work for one model (see the module docstring)."""

    #: 2 x active matmul parameters of the decoder layers, per row
    per_row_matmul: float
    #: 2 x V x D, per logits row
    per_logit_row: float
    #: summed over full-attention layers, per visible pair
    per_pair: float
    #: summed over linear-attention layers, per row
    per_row_linear_attn: float

    @classmethod
    def from_model(cls, model: HybridLM) -> FlopModel:
        cfg = model.config
        active = sum(active_matmul_params(layer, cfg.num_experts_per_tok) for layer in model.layers)
        v, d = model.lm_head_weight.shape
        per_pair = per_la = 0.0
        b = cfg.chunk_size
        for letter in cfg.layer_pattern:
            if letter == "M":
                per_pair += 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
            elif letter == "A":
                per_pair += 2 * cfg.num_attention_heads * 2 * cfg.head_dim
            else:  # K or G
                k, vd, h = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
                per_la += h * (6 * b * k + 4 * b * vd + 2 / 3 * b * b + 6 * k * vd)
        return cls(per_row_matmul=2 * active, per_logit_row=2.0 * v * d, per_pair=per_pair, per_row_linear_attn=per_la)

    def forward_flops(self, rows: int, logit_rows: int, pairs: int) -> float:
        return (
            rows * (self.per_row_matmul + self.per_row_linear_attn)
            + logit_rows * self.per_logit_row
            + pairs * self.per_pair
        )

    def training_flops(self, rows: int, logit_rows: int, pairs: int) -> float:
        """Forward + backward FLOPs (3 x forward) of ``rows`` rows, ``logit_rows`` LM-head rows
        and ``pairs`` visible attention pairs."""
        return 3.0 * self.forward_flops(rows, logit_rows, pairs)


def active_matmul_params(module: nn.Module, top_k: int) -> float:
    """Matmul parameters one row uses in ``module`` (module docstring): every ``nn.Linear``
    weight, the routers, and each ``Experts``' weights times ``top_k`` / E."""
    from harts.models.layers.moe import Experts, TopKRouter

    active = 0.0
    for m in module.modules():
        if isinstance(m, (nn.Linear, TopKRouter)):
            active += m.weight.numel()
        elif isinstance(m, Experts):
            active += (m.gate_up_proj.numel() + m.down_proj.numel()) / m.num_experts * top_k
    return active
