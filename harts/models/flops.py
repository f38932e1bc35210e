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
* linear attention (per row and head, chunk B, key dim K, value dim V), as each mixer's spec
  counts it (``MixerSpec.core_flops``): the delta rule (KDA, GDN) in-chunk Q K^T and K K^T
  (4 B K), the WY factors W and U (2 B K + 2 B V), the intra-chunk output (2 B V), the
  triangular solve (2/3 B^2) and the three state products Q S, W S, K^T delta (6 K V); the
  plain rule (Mamba-2's SSD) Q K^T (2 B K), the intra-chunk output (2 B V) and the state
  products Q S, K^T V (4 K V).
* Recomputation (``--recompute``) re-runs forwards: that work is not counted.

**A frozen base (LoRA).** Training counts only the work the gradients it needs take. A weight
that does not train (``requires_grad`` False, as ``harts.trainer.lora.apply_lora`` leaves every
base tensor) needs its forward and its input gradient, not its weight gradient; a rank-r adapter
``W + scale * B @ A`` on a weight [k out, n in] is counted as the two small matmuls a LoRA layer
adds, in full (forward, input and adapter gradients), whatever way the kernels compute it:

    frozen matmul, m rows    2 m n k (forward) + 2 m n k (input gradient)      = 2 x forward
    its adapter              3 x 2 m r (n + k)                                  = 3 x forward
    attention, linear attention cores and trained weights: 3 x forward, as above

Routed experts count top-k / E of their rows, as their base weights do. Hence

    training = 3 x forward - (forward FLOPs of the frozen matmuls)

where forward includes the adapters'. With every weight trained and no adapter this is 3 x
forward, the count above.

MFU = training FLOPs / seconds / peak; the peak is the device's dense bf16 tensor-core rate
(``PEAK_TFLOPS``) or a value the user gives. ``FlopModel.formula`` says which count a model gets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from harts.models.hybrid_lm import HybridLM
from harts.models.layers.registry import mixer_spec

__all__ = ["FlopModel", "LORA_MFU_FORMULA", "MFU_FORMULA", "PEAK_TFLOPS", "active_matmul_params", "peak_tflops"]

#: the count of a model that trains every weight, in words (``FlopModel.formula``)
MFU_FORMULA = (
    "MFU = training FLOPs / seconds / peak; training = 3 x forward (backward = 2 x forward); forward = rows x "
    "2 x active matmul parameters + LM-head rows x 2 V D + attention pairs x 2 H (d_qk + d_v) + rows x the "
    "linear-attention core's FLOPs; recomputation not counted"
)

#: the count of a model with a frozen base (LoRA), in words
LORA_MFU_FORMULA = (
    "MFU = training FLOPs / seconds / peak, counting only the work a frozen base needs: each frozen matmul "
    "[m rows, n in, k out] 2 m n k forward + 2 m n k input gradient (no weight gradient); each rank-r adapter "
    "3 x 2 m r (n + k) (forward, input and adapter gradients); attention and linear-attention cores 3 x forward; "
    "routed experts at top-k / E of the rows; recomputation not counted"
)

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
    #: the part of ``per_row_matmul`` whose weights do not train (no weight gradient)
    per_row_frozen: float = 0.0
    #: LoRA adapters' forward per row, 2 x r x (in + out) per adapted weight (routed experts at top-k / E)
    per_row_adapter: float = 0.0
    #: the LM head's frozen part of ``per_logit_row`` and its adapter's forward, per logits row
    per_logit_row_frozen: float = 0.0
    per_logit_row_adapter: float = 0.0

    @classmethod
    def from_model(cls, model: HybridLM) -> FlopModel:
        """The model's counts; its frozen weights and LoRA adapters are read from its
        parameters (``requires_grad``, the adapter parametrizations), never computed."""
        cfg = model.config
        top_k = cfg.num_experts_per_tok
        active, frozen, adapter = (sum(c) for c in zip(*(_active_counts(layer, top_k) for layer in model.layers)))
        head, head_adapter = _lm_head(model)
        v, d = head.shape
        per_pair = per_la = 0.0
        for letter in cfg.layer_pattern:
            spec = mixer_spec(letter)
            if spec is None:
                continue
            # each mixer's core, as its spec counts it (``MixerSpec.core_flops``)
            pair, row = spec.core_flops(cfg)
            per_pair += pair
            per_la += row
        return cls(
            per_row_matmul=2 * active,
            per_logit_row=2.0 * v * d,
            per_pair=per_pair,
            per_row_linear_attn=per_la,
            per_row_frozen=2 * frozen,
            per_row_adapter=2 * adapter,
            per_logit_row_frozen=0.0 if head.requires_grad else 2.0 * v * d,
            per_logit_row_adapter=2.0 * head_adapter,
        )

    @property
    def frozen_base(self) -> bool:
        """Whether some matmul weight does not train (its weight gradient is not counted)."""
        return self.per_row_frozen > 0 or self.per_logit_row_frozen > 0

    @property
    def formula(self) -> str:
        """The count this model gets, in words: ``LORA_MFU_FORMULA`` with a frozen base or
        adapters, else ``MFU_FORMULA``."""
        lora = self.frozen_base or self.per_row_adapter > 0 or self.per_logit_row_adapter > 0
        return LORA_MFU_FORMULA if lora else MFU_FORMULA

    def forward_flops(self, rows: int, logit_rows: int, pairs: int) -> float:
        """Forward FLOPs of ``rows`` rows, ``logit_rows`` LM-head rows and ``pairs`` visible
        attention pairs, adapters included."""
        return (
            rows * (self.per_row_matmul + self.per_row_adapter + self.per_row_linear_attn)
            + logit_rows * (self.per_logit_row + self.per_logit_row_adapter)
            + pairs * self.per_pair
        )

    def training_flops(self, rows: int, logit_rows: int, pairs: int) -> float:
        """Forward + backward FLOPs of ``rows`` rows, ``logit_rows`` LM-head rows and ``pairs``
        visible attention pairs: 3 x forward, less the weight gradients of frozen weights (one
        forward's worth of each; module docstring)."""
        frozen = rows * self.per_row_frozen + logit_rows * self.per_logit_row_frozen
        return 3.0 * self.forward_flops(rows, logit_rows, pairs) - frozen


def active_matmul_params(module: nn.Module, top_k: int) -> float:
    """Matmul parameters one row uses in ``module`` (module docstring): every ``nn.Linear``
    weight, the routers, and each ``Experts``' weights times ``top_k`` / E."""
    return _active_counts(module, top_k)[0]


def _active_counts(module: nn.Module, top_k: int) -> tuple[float, float, float]:
    """Per row of ``module``: (matmul parameters used, those of them that do not train, LoRA
    adapter parameters used), counted as ``active_matmul_params`` counts."""
    from harts.models.layers.moe import Experts, TopKRouter

    active = frozen = adapter = 0.0
    for m in module.modules():
        if isinstance(m, (nn.Linear, TopKRouter)):
            weights, share = [_stored(m, "weight")], 1.0
        elif isinstance(m, Experts):
            weights, share = [_stored(m, n) for n in m.weight_names], top_k / m.num_experts
        else:
            continue
        for weight, extra in weights:
            active += weight.numel() * share
            frozen += 0.0 if weight.requires_grad else weight.numel() * share
            adapter += extra * share
    return active, frozen, adapter


def _stored(module: nn.Module, name: str) -> tuple[torch.Tensor, int]:
    """``module``'s stored tensor ``name`` (under a parametrization, the original: reading the
    attribute would compute the adapted weight) and its LoRA adapter's parameter count (0 without
    one; an adapter is a parametrization holding ``lora_A`` and ``lora_B``)."""
    if not parametrize.is_parametrized(module, name):
        return getattr(module, name), 0
    chain = getattr(module.parametrizations, name)
    extra = sum(p.lora_A.numel() + p.lora_B.numel() for p in chain if hasattr(p, "lora_A"))
    return chain.original, int(extra)


def _lm_head(model: HybridLM) -> tuple[torch.Tensor, int]:
    """The LM head's stored weight [V, D] and its adapter's parameter count: an untied head
    (maybe parametrized), the embedding when tied, or the embedding with the head's own adapter
    (``harts.trainer.lora``'s tied head, which holds an ``adapter``)."""
    head = model.lm_head
    if head is None:
        return model.embed_tokens.weight, 0
    adapter = getattr(head, "adapter", None)
    if adapter is not None and hasattr(adapter, "lora_A"):
        return model.embed_tokens.weight, int(adapter.lora_A.numel() + adapter.lora_B.numel())
    return _stored(head, "weight")
