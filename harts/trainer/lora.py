"""LoRA adapters on a ``HybridLM``: ``W -> W + scale * B @ A`` on the projections a ``LoraConfig``
selects, every base tensor frozen, and the two ways out (merged full weights, or PEFT's layout).

    params = apply_lora(model, LoraConfig(rank=32))    # the only tensors that require grad
    out = model(batch, mode="compact")                  # either mode, the same adapted weights
    plain = merged_model(model)                         # W + scale * B @ A, no adapters
    save_hf_checkpoint(plain, path)                     # the export (``harts.integrations.hf``)
    save_peft_adapter(model, path)                      # or the adapters alone, for PEFT / vLLM

**Exact in every execution mode, by construction.** Each adapted weight is a
``torch.nn.utils.parametrize`` parametrization of the stored tensor: wherever a layer reads
``module.weight`` (KDA's stacked q / k / v and gate GEMMs, the MoE grouped GEMMs and their lean
backward, the per-expert loop, the LM head's ``lm_head_weight``) it gets ``W + scale * B @ A``,
computed from the same tensors by the same op. Compact and trajectory-wise execution therefore
run on identical weights, and checkpoint's recomputation recomputes the adapted weight inside
the layer (no copy of it is kept between forward and backward then).

**An adapted ``nn.Linear`` called as a module computes in activation form**,
``x W^T + bias + scale * (x A^T) B^T``, the way PEFT's ``LoraLayer`` does: the frozen ``W``
needs no weight gradient, so its backward is the input gradient alone (``2 T in out`` FLOPs
instead of twice that) plus the adapter's rank-r GEMMs, and no merged ``[out, in]`` copy is
made per call. Through the merged weight the backward would form the full ``[out, in]`` weight
gradient ``dY^T X`` for every adapted projection on every row, only to reduce it to ``dA`` and
``dB``: the work a frozen base exists to skip. The two forms differ only by rounding (the
merged form rounds ``W + scale B A`` to the weight's dtype first; the activation form keeps the
adapter's contribution at the activations' precision, as PEFT and vLLM compute it). Weights
read outside the module's own call keep the merged form above, with two exceptions the
layers handle themselves: routed experts on the grouped path (``Experts._project``, for ranks
a multiple of 8, which the grouped GEMM's alignment takes) run in activation form too, and the
lean MoE backward under ``recompute_skip=("moe",)`` and KDA's stacked GEMMs merge.

**Which stored tensors get an adapter** (one ``A``, one ``B`` per stored tensor; a fused tensor
gets one rank-r adapter over all its rows, where Tinker's exports show one adapter per part of
a fused projection, e.g. Qwen3.5's ``in_proj_q`` / ``_k`` / ``_v``):

* ``train_attn``: every ``nn.Linear`` of a layer's mixer. GQA (A): ``q_proj`` (query and output
  gate rows), ``k_proj``, ``v_proj``, ``o_proj``. MLA (M): ``q_proj`` or ``q_a_proj`` /
  ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``g_proj`` (when present), ``o_proj``. KDA (K):
  ``q_proj``, ``k_proj``, ``v_proj``, ``b_proj``, the gates (``f_a_proj`` / ``f_b_proj`` /
  ``g_a_proj`` / ``g_b_proj``, or ``f_proj`` / ``g_proj``), ``o_proj``. GDN (G): the fused
  ``in_proj_qkvz`` and ``in_proj_ba``, ``out_proj``. Not the short convolutions, norms,
  ``A_log`` or ``dt_bias``.
* ``train_mlp``: the dense MLP's ``gate_proj`` / ``up_proj`` / ``down_proj``; in MoE layers every
  routed expert's own adapter on the stacked ``experts.gate_up_proj`` ``[E, 2I, D]`` and
  ``experts.down_proj`` ``[E, D, I]`` (``B [E, out, r] @ A [E, r, in]``, batched), and the shared
  experts' three projections. Not the router (``gate.weight``) nor the shared expert's scalar
  gate (``shared_expert_gate``).
* ``train_unembed``: the LM head, ``lm_head.weight``. With tied embeddings the adapter acts on
  the head only (the input embedding stays the base one): the head reads ``E + scale * B @ A``,
  and ``merged_model`` unties the two.

**Scale and initialisation.** ``scale = alpha / rank``, as PEFT's default (PEFT's ``lora_alpha``
defaults to 8 with r = 8; ``use_rslora`` would be ``alpha / sqrt(rank)``). The default
``alpha = 32`` at every rank is what Thinking Machines' "LoRA Without Regret" (the study behind
Tinker's LoRA) uses: constant alpha 32 with the 1/r factor, A uniform, B zero. The Tinker SDK
itself exposes rank, seed and the three flags only, not alpha. ``A`` is drawn uniform in +-1/sqrt(in_features)
(PEFT's default, kaiming-uniform with a = sqrt(5)) from a generator seeded by (``seed``, the
weight's name), so it does not depend on the order adapters are made in; ``B`` starts at zero, so
a fresh adapter leaves every weight bit for bit unchanged.

**Dtypes.** Adapters are stored in at least float32 (PEFT's ``autocast_adapter_dtype``): an
optimizer's small updates would be lost in bfloat16 adapters. The adapted weight is computed in
the base weight's dtype (one ``addmm`` / ``baddbmm``), so a bfloat16 model makes no float32
copy of its weights.

**Export.** The export is ``merged_model`` -> ``save_hf_checkpoint``: full weights transformers
loads without PEFT. ``save_peft_adapter`` also writes the adapters alone in PEFT's layout
(``adapter_config.json`` + ``adapter_model.safetensors``) for a model with an HF source, through
PEFT itself on the transformers model's structure (see its docstring for what PEFT can express);
``load_peft_adapter`` puts them back onto that base, bit for bit.

**State.** ``model.state_dict()`` of an adapted model names a base weight
``<module>.parametrizations.<name>.original`` and its adapter ``<module>.parametrizations.<name>.0
.lora_A`` / ``.lora_B`` (a tied head's: ``lm_head.adapter.lora_A`` / ``.lora_B``); it holds no
shared tensors, so it saves with safetensors and loads into a model given the same
``apply_lora``. ``adapter_module(model)`` holds the adapters alone under those names (a checkpoint
of the adapters without the frozen base). The model's ``LoraConfig`` is ``lora_config_of(model)``.

Not supported: adapters on a model already sharded (FSDP2 DTensors) or with expert parallelism
applied: apply LoRA to the whole model first.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from harts.errors import OutputPathError, UserError
from harts.models.hybrid_lm import DecoderLayer, HybridLM
from harts.models.init import tensor_seed
from harts.models.layers import MLP, MoE
from harts.models.layers.moe import Experts

__all__ = [
    "LORA_TARGETS",
    "LoraConfig",
    "LoraDelta",
    "adapted_view",
    "adapter_module",
    "adapter_parameters",
    "apply_lora",
    "load_peft_adapter",
    "lora_config_of",
    "lora_targets",
    "merged_model",
    "save_peft_adapter",
]

#: the instance attribute of an adapted model that holds its ``LoraConfig``
_CONFIG_ATTR = "lora_config"

#: the names of ``LoraConfig``'s three target flags (``train_<name>``), as ``--lora-targets`` takes them
LORA_TARGETS = ("attn", "mlp", "unembed")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Which projections of a ``HybridLM`` get low-rank adapters, and how (module docstring)."""

    #: rank r of every adapter (Tinker's default, 32)
    rank: int = 32
    #: scale = alpha / rank (PEFT's ``lora_alpha / r``); 32 as Thinking Machines uses for Tinker
    alpha: float = 32.0
    #: full attention (A, M layers) and linear attention (K, G layers) projections
    train_attn: bool = True
    #: dense MLP, shared experts, routed experts (per expert, grouped); not the router gate
    train_mlp: bool = True
    #: the LM head (``lm_head_weight``; the head only when the embeddings are tied)
    train_unembed: bool = True
    #: seed of the adapters' A draws (B starts at zero)
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def targets(self) -> tuple[str, ...]:
        """The target flags set, by ``LORA_TARGETS``' names (``("attn", "mlp", "unembed")`` by default)."""
        return tuple(t for t in LORA_TARGETS if getattr(self, f"train_{t}"))

    def validate(self) -> None:
        """``UserError`` naming the first bad field."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise UserError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise UserError(f"LoRA alpha must be a finite number > 0, got {alpha!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise UserError("LoRA: at least one of train_attn, train_mlp, train_unembed must be True")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UserError(f"LoRA seed must be an integer, got {self.seed!r}")


class LoraDelta(nn.Module):
    """The parametrization ``W -> W + scale * B @ A`` of one stored weight.

    Shapes: a matrix ``W [out, in]`` with ``A [r, in]``, ``B [out, r]``; a stack of expert
    matrices ``W [E, out, in]`` with ``A [E, r, in]``, ``B [E, out, r]`` (each expert its own).
    """

    def __init__(self, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(lora_A)
        self.lora_B = nn.Parameter(lora_B)
        self.scale = float(scale)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A.to(weight.dtype), self.lora_B.to(weight.dtype)
        if weight.dim() == 3:
            return torch.baddbmm(weight, b, a, alpha=self.scale)
        return torch.addmm(weight, b, a, alpha=self.scale)

    def activations(self, x_TI: torch.Tensor) -> torch.Tensor:
        """``scale * (x A^T) B^T`` [T, out] for ``x`` [T, in] (any leading dims), in ``x``'s dtype:
        the adapter's term of an adapted ``nn.Linear`` in activation form (module docstring)."""
        a, b = self.lora_A.to(x_TI.dtype), self.lora_B.to(x_TI.dtype)
        return F.linear(F.linear(x_TI, a) * self.scale, b)


def _adapted_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` of a module whose ``weight`` carries a ``LoraDelta``, in activation
    form: the frozen base weight (the parametrization's ``original``, not the merged value) and
    the adapter's rank-r term (module docstring). Bound to the module instance by ``apply_lora``."""
    plist: Any = self.parametrizations["weight"]  # type: ignore[index]
    return F.linear(x, plist.original, self.bias) + plist[0].activations(x)


class _TiedHead(nn.Module):
    """The LM head of a model with tied embeddings, adapted: ``weight`` is ``E + scale * B @ A``
    for the embedding matrix ``E`` [V, D], which stays the input embedding unadapted. ``E`` is
    referenced, not registered, so the state dict holds the adapter only (no shared tensors)."""

    def __init__(self, embedding: nn.Embedding, adapter: LoraDelta) -> None:
        super().__init__()
        self.adapter = adapter
        # a plain attribute, not a submodule: the model registers the embedding already
        object.__setattr__(self, "_embedding", embedding)

    @property
    def weight(self) -> torch.Tensor:
        embedding: nn.Embedding = self.__dict__["_embedding"]
        return self.adapter(embedding.weight)


def lora_targets(model: HybridLM, cfg: LoraConfig) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, attribute)`` of every weight ``cfg`` adapts, in model order; ``name`` is
    the weight's name in the plain model's state dict (``lm_head.weight`` for a tied head too).

    Raises ``UserError`` for MoE experts that are not ``Experts`` (expert parallelism applied)."""
    out: list[tuple[str, nn.Module, str]] = []
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        mixer, spec = layer.mixer, layer.spec
        if cfg.train_attn and mixer is not None and spec is not None:
            # the mixer's LoRA targets, as its spec declares them (``MixerSpec.lora_targets``)
            prefix = f"layers.{i}.{spec.attribute}"
            out += [(f"{prefix}.{n}.weight", m, "weight") for n, m in spec.lora_targets(mixer)]
        mlp = layer.mlp
        if not cfg.train_mlp or mlp is None:
            continue
        if isinstance(mlp, MLP):
            out += [(f"layers.{i}.mlp.{n}.weight", m, "weight") for n, m in _linears(mlp)]
            continue
        assert isinstance(mlp, MoE)
        if not isinstance(mlp.experts, Experts):
            raise UserError(
                f"LoRA: layers.{i}.mlp.experts is {type(mlp.experts).__name__}, not harts' Experts "
                "(expert parallelism applied?); apply LoRA to the whole model before parallelizing it"
            )
        out += [(f"layers.{i}.mlp.experts.{n}", mlp.experts, n) for n in mlp.experts.weight_names]
        if mlp.shared_experts is not None:
            out += [(f"layers.{i}.mlp.shared_experts.{n}.weight", m, "weight") for n, m in _linears(mlp.shared_experts)]
    if cfg.train_unembed:
        out.append(("lm_head.weight", model.lm_head if model.lm_head is not None else model.embed_tokens, "weight"))
    return out


def adapter_parameters(model: HybridLM, cfg: LoraConfig) -> int:
    """The number of adapter entries ``apply_lora(model, cfg)`` would add (``A`` [.., r, in] and
    ``B`` [.., out, r] of every target), counted from the weights' shapes alone: ``model`` may be
    on the meta device (``harts serve`` checks a run's memory before building it)."""
    cfg.validate()
    total = 0
    for _, module, attr in lora_targets(model, cfg):
        *lead, n_out, n_in = getattr(module, attr).shape
        total += math.prod(lead) * cfg.rank * (n_in + n_out)
    return total


def _linears(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]


def _adapter(name: str, weight: torch.Tensor, cfg: LoraConfig) -> LoraDelta:
    """A fresh adapter for ``weight`` ([out, in] or [E, out, in]): A uniform in +-1/sqrt(in) from
    the generator of (``cfg.seed``, ``name``), B zero; float32 at least, on the weight's device."""
    *lead, n_out, n_in = weight.shape
    dtype = torch.promote_types(weight.dtype, torch.float32)
    gen = torch.Generator().manual_seed(tensor_seed(cfg.seed, f"{name}.lora_A"))
    bound = 1.0 / math.sqrt(n_in)
    a = torch.empty(*lead, cfg.rank, n_in).uniform_(-bound, bound, generator=gen)
    a = a.to(device=weight.device, dtype=dtype)
    b = torch.zeros(*lead, n_out, cfg.rank, device=weight.device, dtype=dtype)
    return LoraDelta(a, b, cfg.scale)


def _check_model(model: HybridLM) -> None:
    if lora_config_of(model) is not None:
        raise UserError("apply_lora: the model already has LoRA adapters (use merged_model for a plain copy)")
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if p.is_meta:
            raise UserError(f"apply_lora: parameter {name} has no storage (meta device); initialise the model first")
        if isinstance(p, DTensor):
            raise UserError(
                f"apply_lora: parameter {name} is sharded (DTensor); apply LoRA to the whole model before parallelizing"
            )


def apply_lora(model: HybridLM, cfg: LoraConfig) -> list[torch.nn.Parameter]:
    """Freeze every base parameter, add the adapters ``cfg`` selects (module docstring), return the
    adapter parameters in model order, ``A`` before ``B`` of each weight: the only parameters
    that require grad.

    Raises ``UserError`` for a bad ``cfg`` (rank < 1, alpha not > 0, no flag set), a model that
    already has adapters, and a model on the meta device, sharded, or with expert parallelism
    applied, before changing anything.
    """
    cfg.validate()
    _check_model(model)
    targets = lora_targets(model, cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    params: list[nn.Parameter] = []
    for name, module, attr in targets:
        adapter = _adapter(name, getattr(module, attr), cfg)
        if module is model.embed_tokens:  # tied head: adapt the head only
            model.lm_head = _TiedHead(model.embed_tokens, adapter)  # type: ignore[assignment]
        else:
            parametrize.register_parametrization(module, attr, adapter)
            if isinstance(module, nn.Linear) and attr == "weight":
                # the instance's own forward: deepcopy rebinds it to the copy (adapted_view)
                module.forward = _adapted_linear_forward.__get__(module)  # type: ignore[method-assign]
        params += [adapter.lora_A, adapter.lora_B]
    setattr(model, _CONFIG_ATTR, cfg)
    return params


def adapted_view(base: HybridLM, cfg: LoraConfig) -> HybridLM:
    """A new model over ``base``'s parameter tensors (the same storage, not copies) with fresh
    adapters ``cfg`` on it: the modules and buffers are its own, the base weights are shared, so
    any number of LoRA runs over one served model hold its weights once (``harts serve``).

    ``base`` keeps no adapters, and its parameters end frozen (``requires_grad`` False: they are
    the view's frozen base). Nothing may write the shared tensors while views use them: adapted
    training never does, and ``Engine.load_state`` of a view compares them instead of copying.

    Raises ``UserError`` as ``apply_lora`` does, for ``base`` (adapters already on it, meta
    device, sharded) and for ``cfg``, before anything is built.
    """
    cfg.validate()
    _check_model(base)
    # deepcopy makes new modules and buffers; each parameter maps to itself through the memo
    memo: dict[int, Any] = {id(p): p for p in base.parameters()}
    view = copy.deepcopy(base, memo)
    apply_lora(view, cfg)
    return view


def lora_config_of(model: HybridLM) -> LoraConfig | None:
    """The ``LoraConfig`` ``apply_lora`` gave ``model``, None for a plain model."""
    cfg = model.__dict__.get(_CONFIG_ATTR)
    return cfg if isinstance(cfg, LoraConfig) else None


def adapter_module(model: HybridLM) -> nn.Module:
    """A module whose parameters are exactly ``model``'s adapters (the same tensors, not copies),
    each under its name in ``model.state_dict()`` (``layers.0.self_attn.q_proj.parametrizations.
    weight.0.lora_A``; a tied head's ``lm_head.adapter.lora_A``): what a checkpoint of the
    adapters alone saves and loads in place (``harts train --lora``'s run directory), without the
    frozen base, which the run rebuilds from its ``--model`` and ``--seed``."""
    if lora_config_of(model) is None:
        raise UserError("adapter_module: the model has no LoRA adapters (apply_lora adds them)")
    root = nn.Module()
    for name, module in model.named_modules():
        if not isinstance(module, LoraDelta):
            continue
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            child = parent._modules.get(part)
            if child is None:
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        parent.add_module(leaf, module)
    return root


def _adapters(model: HybridLM) -> list[tuple[str, LoraDelta]]:
    """(plain weight name, adapter) of every adapter of ``model``, in model order."""
    out: list[tuple[str, LoraDelta]] = []
    for mod_name, module in model.named_modules():
        if isinstance(module, _TiedHead):
            out.append(("lm_head.weight", module.adapter))
        elif parametrize.is_parametrized(module):
            for attr, plist in module.parametrizations.items():
                delta = [p for p in plist if isinstance(p, LoraDelta)]
                out += [(f"{mod_name}.{attr}", d) for d in delta]
    return out


def merged_model(model: HybridLM, *, device: str | torch.device | None = None) -> HybridLM:
    """A plain ``HybridLM`` (no adapters) with ``W + scale * B @ A`` in every adapted weight.

    A new model: ``model`` is unchanged and shares no tensor with the result (which holds a full
    copy of the weights, on ``model``'s devices, or all on ``device``: each merged tensor is made
    where ``model``'s is and moved there at once, so ``device="cpu"`` merges a model that fills its
    GPU, which needs room for one merged tensor at a time). ``hf_source`` is carried over; its parameters
    require grad, as a fresh model's do. With tied embeddings and an adapted head the result is
    untied (``config.tie_word_embeddings`` and ``hf_source``'s ``tie_word_embeddings`` False): its
    head is ``E + scale * B @ A`` and its embedding ``E``, which one tied matrix cannot hold. Its
    state dict has exactly a plain model's keys (of that config), so ``save_hf_checkpoint`` takes
    it. The merged weights are the ones the adapted model computes, by the same op: its log-probs
    equal the adapted model's.
    """
    if lora_config_of(model) is None:
        raise UserError("merged_model: the model has no LoRA adapters (apply_lora adds them)")
    tied_head = isinstance(model.lm_head, _TiedHead)
    config = model.config.replace(tie_word_embeddings=False) if tied_head else model.config
    with torch.device("meta"):  # the structure only; every tensor comes from ``model``
        merged = HybridLM(config, seed=0)
    merged.load_state_dict(_merged_state_dict(model, device), strict=True, assign=True)
    with torch.no_grad():  # buffers outside the state dict (a router bias that is not persistent)
        for mod_name, module in model.named_modules():
            for name in module._non_persistent_buffers_set:
                buf = module._buffers.get(name)
                if buf is not None:
                    merged.get_submodule(mod_name)._buffers[name] = _copy(buf, device)
    if model.hf_source is not None:
        source = copy.deepcopy(model.hf_source)
        if tied_head:
            source.setdefault("config", {})["tie_word_embeddings"] = False
        merged.hf_source = source
    for p in merged.parameters():
        p.requires_grad_(True)
    return merged


def _copy(t: torch.Tensor, device: str | torch.device | None) -> torch.Tensor:
    """A copy of ``t`` of its own, on ``device`` (None: ``t``'s)."""
    return t.detach().clone() if device is None else t.detach().to(device, copy=True)


def _merged_state_dict(model: HybridLM, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """The plain model's state dict of an adapted ``model``: each adapted weight merged (as the
    model reads it), every other tensor copied, onto ``device`` (None: where it is)."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.startswith("lm_head.adapter."):
                continue
            module_name, sep, rest = name.partition(".parametrizations.")
            if not sep:
                out[name] = _copy(t, device)
                continue
            attr, _, leaf = rest.partition(".")
            if leaf == "original":  # the adapters ("0.lora_A", "0.lora_B") are in the merged value
                out[f"{module_name}.{attr}"] = _copy(getattr(model.get_submodule(module_name), attr), device)
        if isinstance(model.lm_head, _TiedHead):
            out["lm_head.weight"] = _copy(model.lm_head.weight, device)
    return out


def save_peft_adapter(model: HybridLM, path: str) -> None:
    """Write ``model``'s adapters in PEFT's layout: ``adapter_config.json`` and
    ``adapter_model.safetensors`` in directory ``path``, which ``peft.PeftModel.from_pretrained``
    loads onto the transformers model of ``model.hf_source`` (its checkpoint, as
    ``save_hf_checkpoint`` of the base weights writes it).

    The layout is PEFT's own: the transformers model is built on the meta device, PEFT adds
    its LoRA modules there (``r = rank``, ``lora_alpha = alpha``), each gets its harts adapter's
    factors and PEFT saves them. ``nn.Linear`` weights are ``target_modules``; the stacked
    experts, and MLP projections named like the experts (``gate_proj`` / ``up_proj`` /
    ``down_proj``, which PEFT's transformers-v5 conversion would retarget at the experts), are
    ``target_parameters`` (PEFT's ``ParamWrapper``; its 3-D ``lora_A [E * r, in]``, row
    ``e * r + j``, and ``lora_B [out, r * E]``, column ``j * E + e``).

    Raises ``UserError`` for a model without adapters or without an HF source, an adapted
    tensor that transformers stores under another layout, or an adapter PEFT places elsewhere.
    """
    cfg = lora_config_of(model)
    if cfg is None:
        raise UserError("save_peft_adapter: the model has no LoRA adapters (apply_lora adds them)")
    source = model.hf_source
    if not source or not source.get("config"):
        raise UserError("save_peft_adapter: the model has no HF source (PEFT adapters need a transformers model)")
    if os.path.isfile(path):
        raise OutputPathError(f"save_peft_adapter: {path} is a file; pass a directory")
    hf_names = _hf_names(model, source["model_type"])
    peft_model, factors = _peft_model_for(model, cfg, source["config"], hf_names)
    with torch.no_grad():
        for module, a, b in factors:
            module.lora_A["default"].weight = nn.Parameter(a.detach().cpu().contiguous(), requires_grad=False)
            module.lora_B["default"].weight = nn.Parameter(b.detach().cpu().contiguous(), requires_grad=False)
    os.makedirs(path, exist_ok=True)
    peft_model.save_pretrained(path, save_embedding_layers=False)


def load_peft_adapter(model: HybridLM, path: str) -> list[nn.Parameter]:
    """The adapters ``save_peft_adapter`` wrote to directory ``path``, put on ``model``: a plain
    model of the same transformers source (the base they were trained over). ``apply_lora`` with
    the saved ``r`` and ``lora_alpha`` and the targets its modules name, then every factor read
    from PEFT's file (``_peft_factors`` undone), so the adapters are the saved ones bit for bit.
    Returns ``apply_lora``'s parameters.

    Raises ``UserError`` naming ``path``: a model without an HF source, a directory without a
    PEFT LoRA adapter, adapters on weights harts cannot adapt or a selection of them that no
    ``LoraConfig`` makes (attention projections but not all of them, say), before ``model``
    changes; a factor missing or of another shape, after (``model`` then has fresh adapters).
    """
    import json

    from safetensors.torch import load_file

    source = model.hf_source
    if not source or not source.get("config"):
        raise UserError(
            f"{path}: a PEFT adapter loads onto a model loaded from transformers (this one has no HF source)"
        )
    try:
        with open(os.path.join(path, "adapter_config.json")) as fh:
            saved = json.load(fh)
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not a readable PEFT adapter ({err})") from None
    if not isinstance(saved, dict) or saved.get("peft_type") != "LORA":
        raise UserError(f"{path}/adapter_config.json: not a PEFT LoRA adapter's config")
    cfg = _saved_lora_config(model, saved, source["model_type"], path)
    params = apply_lora(model, cfg)
    peft_model, factors = _peft_model_for(model, cfg, source["config"], _hf_names(model, source["model_type"]))
    # PEFT's file names each factor after its LoRA layer's module, without the adapter's name
    key = {id(m): name for name, m in peft_model.named_modules()}
    with torch.no_grad():
        for (name, delta), (module, a, b) in zip(_adapters(model), factors):
            got_a, got_b = (tensors.get(f"{key[id(module)]}.lora_{x}.weight") for x in "AB")
            if got_a is None or got_b is None or got_a.shape != a.shape or got_b.shape != b.shape:
                raise UserError(f"{path}/adapter_model.safetensors: no rank-{cfg.rank} factors for {name}")
            if delta.lora_A.dim() == 3:  # PEFT's [E r, in] and [out, r E]: _peft_factors undone
                e, r, n_in = delta.lora_A.shape
                got_a = got_a.reshape(e, r, n_in)
                got_b = got_b.reshape(got_b.shape[0], r, e).permute(2, 0, 1)
            delta.lora_A.copy_(got_a)
            delta.lora_B.copy_(got_b)
    return params


def _saved_lora_config(model: HybridLM, saved: dict[str, Any], model_type: str, path: str) -> LoraConfig:
    """The ``LoraConfig`` of a PEFT adapter's config: its rank and alpha, and the target flags
    whose weights its ``target_modules`` / ``target_parameters`` name (all of them, or refused)."""
    hf = {f"{m}.weight" for m in saved.get("target_modules") or ()} | set(saved.get("target_parameters") or ())
    to_harts = {v: k for k, v in _one_to_one(model, model_type, path).items()}
    unknown = sorted(hf - set(to_harts))
    if unknown:
        raise UserError(f"{path}: the adapter targets {unknown[0]}, which harts does not adapt")
    names = {to_harts[h] for h in hf}
    flags = {f"train_{t}": False for t in LORA_TARGETS}
    for name in names:
        target = "unembed" if name == "lm_head.weight" else "mlp" if ".mlp." in name else "attn"
        flags[f"train_{target}"] = True
    try:
        rank: Any = saved.get("r")
        alpha: Any = saved.get("lora_alpha")
        cfg = LoraConfig(rank=rank, alpha=alpha, **flags)
    except UserError as err:
        raise UserError(f"{path}/adapter_config.json: {err}") from None
    adapted = {n for n, _, _ in lora_targets(model, cfg)}
    if names - adapted:
        raise UserError(f"{path}: the adapter targets {min(names - adapted)}, which harts does not adapt")
    missing = sorted(adapted - names)
    if missing:
        raise UserError(
            f"{path}: the adapter leaves {missing[0]} without an adapter, which LoRA on {', '.join(cfg.targets)} "
            "adapts; harts adapts every projection of a target"
        )
    return cfg


def _one_to_one(model: HybridLM, model_type: str, where: str) -> dict[str, str]:
    """harts name -> transformers name of every weight stored the same way in both (one-to-one
    tensor groups, no layout change), the head included."""
    from harts.integrations.hf import adapter_for

    try:
        groups = adapter_for(model_type).tensor_groups(model.config)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None
    one_to_one = {g.harts[0]: g.hf[0] for g in groups if len(g.harts) == 1 and len(g.hf) == 1 and g.to_hf is None}
    if model.config.tie_word_embeddings:
        one_to_one["lm_head.weight"] = "lm_head.weight"
    return one_to_one


def _hf_names(model: HybridLM, model_type: str) -> dict[str, str]:
    """harts name -> transformers name of every adapted weight (one-to-one tensor groups only)."""
    one_to_one = _one_to_one(model, model_type, "save_peft_adapter")
    names = {}
    for name, _ in _adapters(model):
        if name not in one_to_one:
            raise UserError(f"save_peft_adapter: {name} has no one-to-one {model_type} tensor; export merged weights")
        names[name] = one_to_one[name]
    return names


def _peft_factors(delta: LoraDelta) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's (lora_A, lora_B) weights of one harts adapter: [r, in] and [out, r] for a matrix;
    for E stacked experts ``A [E, r, in] -> [E * r, in]`` and ``B [E, out, r] -> [out, r * E]``
    (PEFT's ``ParamWrapper`` reads column ``j * E + e`` as expert e's j-th)."""
    a, b = delta.lora_A, delta.lora_B
    if a.dim() == 2:
        return a, b
    e, r, n_in = a.shape
    return a.reshape(e * r, n_in), b.permute(1, 2, 0).reshape(b.shape[1], r * e)


def _peft_model_for(
    model: HybridLM, cfg: LoraConfig, hf_config: dict[str, Any], hf_names: dict[str, str]
) -> tuple[Any, list[tuple[Any, torch.Tensor, torch.Tensor]]]:
    """The PEFT model over transformers' structure (meta device) and, for each of its LoRA
    layers, the factors it takes from ``model``."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from transformers import AutoModelForCausalLM

    from harts.integrations.hf.api import hf_config_from_dict

    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config_from_dict(dict(hf_config)))
    shapes = {n: tuple(p.shape) for n, p in hf_model.named_parameters()}
    leaf = {"gate_proj", "up_proj", "down_proj"}
    modules, params = [], []
    for hf in hf_names.values():
        if not hf.endswith(".weight") or len(shapes.get(hf, ())) == 3 or hf.split(".")[-2] in leaf:
            params.append(hf)
        else:
            modules.append(hf.removesuffix(".weight"))
    # PEFT types lora_alpha as int (its scaling divides it by r either way)
    alpha: Any = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=sorted(modules) or None,
        target_parameters=sorted(params) or None,
    )
    peft_model: Any = get_peft_model(hf_model, peft_cfg)
    by_hf: dict[str, Any] = {}
    for mod_name, module in peft_model.base_model.model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = mod_name.replace(".base_layer", "")
        attr = module.parameter_name if isinstance(module, ParamWrapper) else "weight"
        by_hf[f"{base}.{attr}"] = module
    factors = []
    for name, delta in _adapters(model):
        hf, module = hf_names[name], by_hf.get(hf_names[name])
        a, b = _peft_factors(delta)
        want = None
        if module is not None:
            want = (tuple(module.lora_A["default"].weight.shape), tuple(module.lora_B["default"].weight.shape))
        if want != (tuple(a.shape), tuple(b.shape)):
            raise UserError(
                f"save_peft_adapter: PEFT does not place a rank-{cfg.rank} adapter on {hf} as harts has it on "
                f"{name}; export merged weights (merged_model + save_hf_checkpoint)"
            )
        factors.append((module, a, b))
    return peft_model, factors
