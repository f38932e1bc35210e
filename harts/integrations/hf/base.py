"""Adapter machinery shared by every Hugging Face architecture: config checks and tensor maps.

An adapter translates one transformers architecture to and from harts:

* ``config_from_hf(hf_config) -> HybridConfig``: every config option is either translated
  exactly or reported; ``UnsupportedConfigError`` names EVERY offending option at once.
* ``tensor_groups(cfg) -> list[TensorGroup]``: how harts parameters relate to the tensors of
  transformers' module state dict (the "canonical" names, ``hf_model.state_dict()``). A group
  ties k harts tensors to m HF tensors with a converter each way (renames are 1:1 groups,
  the KDA conv is 3:1, ``A_log`` reshapes).
* ``checkpoint_renames`` / ``split_conv`` / expert naming: how ON-DISK names (the Hub layout,
  which transformers' ``save_pretrained`` also writes back) become canonical names. This
  works on names and shapes only, so ``harts convert`` can check a checkpoint without
  reading its data (see ``harts.integrations.hf.checkpoint``).

Shapes: experts ``gate_up_proj [E, 2I, D]`` (gate rows first), ``down_proj [E, D, I]``;
depthwise conv ``[C, 1, w]``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harts.errors import UserError
from harts.models.config import HybridConfig

__all__ = [
    "UnsupportedConfigError",
    "TensorGroup",
    "HFAdapter",
    "ident",
    "Problems",
    "dense_prefix",
    "ALLOWED_OVERRIDES",
]

#: HybridConfig fields that transformers configs do not carry; ``from_hf`` accepts them as overrides
ALLOWED_OVERRIDES = ("chunk_size", "dtype", "router_z_loss_coef", "router_aux_loss_coef", "initializer_range")

Convert = Callable[[list[torch.Tensor]], list[torch.Tensor]]


class UnsupportedConfigError(UserError):
    """A transformers config uses options harts does not implement; the message names each one."""


class Problems:
    """Collects every unsupported option so the error lists them all, not just the first."""

    def __init__(self, arch: str) -> None:
        self.arch = arch
        self.items: list[str] = []

    def expect(self, name: str, value: Any, allowed: Any, why: str = "") -> None:
        ok = value in allowed if isinstance(allowed, (tuple, list, set)) else value == allowed
        if not ok:
            want = " or ".join(map(repr, allowed)) if isinstance(allowed, (tuple, list, set)) else repr(allowed)
            self.items.append(f"{name}={value!r} (harts supports {want}{'; ' + why if why else ''})")

    def add(self, message: str) -> None:
        self.items.append(message)

    def raise_if_any(self) -> None:
        if self.items:
            lines = "\n  - ".join(self.items)
            raise UnsupportedConfigError(f"{self.arch}: unsupported config option(s):\n  - {lines}")


def dense_prefix(is_moe: Sequence[bool], option: str, problems: Problems) -> int:
    """harts puts dense FFNs on a prefix of layers: return its length, or report ``option``."""
    k = 0
    while k < len(is_moe) and not is_moe[k]:
        k += 1
    if any(not m for m in is_moe[k:]):
        dense = [i for i, m in enumerate(is_moe) if not m]
        problems.add(
            f"{option}: dense FFN layers {dense} are not a prefix of the layers (harts supports dense "
            "layers 0..k-1 followed by MoE layers only)"
        )
    return k


@dataclass(frozen=True)
class TensorGroup:
    """k harts tensors <-> m canonical HF tensors, with converters both ways (None = identity)."""

    harts: tuple[str, ...]
    hf: tuple[str, ...]
    to_harts: Convert | None = None
    to_hf: Convert | None = None

    def convert_to_harts(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors) if self.to_harts is None else self.to_harts(tensors)

    def convert_to_hf(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors) if self.to_hf is None else self.to_hf(tensors)


def ident(harts: str, hf: str) -> TensorGroup:
    return TensorGroup((harts,), (hf,))


def conv_group(harts_prefix: str, hf_name: str, sizes: tuple[int, int, int]) -> TensorGroup:
    """harts' separate q/k/v depthwise conv weights <-> one HF conv over ``cat(q, k, v)`` channels."""
    return TensorGroup(
        tuple(f"{harts_prefix}.{n}_conv1d.weight" for n in "qkv"),
        (hf_name,),
        to_harts=lambda ts: list(torch.split(ts[0], list(sizes), dim=0)),
        to_hf=lambda ts: [torch.cat(ts, dim=0)],
    )


def reshape_group(harts: str, hf: str, harts_shape: tuple[int, ...], hf_shape: tuple[int, ...]) -> TensorGroup:
    return TensorGroup(
        (harts,), (hf,), to_harts=lambda ts: [ts[0].reshape(harts_shape)], to_hf=lambda ts: [ts[0].reshape(hf_shape)]
    )


@dataclass
class HFAdapter:
    """Base class; one subclass per transformers architecture (see module docstring)."""

    #: transformers ``model_type`` and the causal-LM class name
    model_type: str = ""
    architecture: str = ""
    #: regex renames from on-disk (Hub) names to canonical module names, applied in order
    checkpoint_renames: list[tuple[str, str]] = field(default_factory=list)
    #: on-disk expert weight names: (gate, up, down) leaf names; gate "" for ungated experts
    expert_names: tuple[tuple[str, str, str], ...] = (("gate_proj", "up_proj", "down_proj"),)

    # ------------------------------------------------------------------ to implement
    def config_from_hf(self, hf_config: Any, **overrides: Any) -> HybridConfig:
        raise NotImplementedError

    def mixer_groups(self, cfg: HybridConfig, i: int) -> list[TensorGroup]:
        raise NotImplementedError

    #: canonical HF module name of the shared expert MLP and its gate (Qwen3-Next differs)
    shared_expert_name: str = "shared_experts"
    #: whether transformers really ties lm_head to the embedding when ``tie_word_embeddings``
    #: is set (BailingHybrid and Kimi Linear declare no tied weights: their lm_head stays separate)
    ties_embeddings: bool = True

    def tie_word_embeddings(self, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "tie_word_embeddings", False)) and self.ties_embeddings

    def num_hidden_layers_on_disk(self, hf_config: Any) -> int:
        """Layers past this index on disk (e.g. multi-token-prediction heads) are ignored."""
        return int(hf_config.num_hidden_layers)

    def missing_config_fields(self, config: dict[str, Any]) -> list[str]:
        """Fields a config.json must spell out (dotted for nested ones): those whose transformers
        default would silently give a model of another shape. None by default."""
        return []

    def hf_source(self, hf_config: Any) -> dict[str, Any]:
        """What travels with the model as ``model.hf_source``: the model type and config that
        ``save_hf_checkpoint`` writes back."""
        return {"model_type": self.model_type, "config": hf_config.to_dict()}

    def canonical_state_dict(self, hf_model: Any) -> dict[str, torch.Tensor]:
        """An instantiated transformers model's tensors under the canonical names ``tensor_groups``
        uses (its module state dict, unless the architecture nests the language model)."""
        return {k: v.detach() for k, v in hf_model.state_dict().items()}

    def report_left_out(self, names: list[str]) -> None:
        """Say in one line what a load leaves out on purpose, given the skipped names (silent by
        default: MTP layers and tied heads need no word)."""

    # ------------------------------------------------------------------ shared
    def check_overrides(self, overrides: dict[str, Any]) -> dict[str, Any]:
        bad = sorted(set(overrides) - set(ALLOWED_OVERRIDES))
        if bad:
            raise ValueError(
                f"{self.architecture}: cannot override {bad}: they are fixed by the checkpoint's config "
                f"(overridable: {list(ALLOWED_OVERRIDES)})"
            )
        return overrides

    def tensor_groups(self, cfg: HybridConfig) -> list[TensorGroup]:
        groups = [ident("embed_tokens.weight", "model.embed_tokens.weight"), ident("norm.weight", "model.norm.weight")]
        if not cfg.tie_word_embeddings:
            groups.append(ident("lm_head.weight", "lm_head.weight"))
        for i in range(cfg.num_hidden_layers):
            h, f = f"layers.{i}", f"model.layers.{i}"
            groups += [
                ident(f"{h}.{n}.weight", f"{f}.{n}.weight") for n in ("input_layernorm", "post_attention_layernorm")
            ]
            groups += self.mixer_groups(cfg, i)
            groups += self.ffn_groups(cfg, i)
        return groups

    def ffn_groups(self, cfg: HybridConfig, i: int) -> list[TensorGroup]:
        h, f = f"layers.{i}.mlp", f"model.layers.{i}.mlp"
        if not cfg.is_moe_layer(i):
            return [ident(f"{h}.{n}.weight", f"{f}.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")]
        out = [ident(f"{h}.gate.weight", f"{f}.gate.weight")]
        if cfg.router_bias:
            out.append(ident(f"{h}.gate.e_score_correction_bias", f"{f}.gate.e_score_correction_bias"))
        out += [ident(f"{h}.experts.{n}", f"{f}.experts.{n}") for n in ("gate_up_proj", "down_proj")]
        if cfg.num_shared_experts:
            s = self.shared_expert_name
            out += [
                ident(f"{h}.shared_experts.{n}.weight", f"{f}.{s}.{n}.weight")
                for n in ("gate_proj", "up_proj", "down_proj")
            ]
            if cfg.shared_expert_gate:
                out.append(ident(f"{h}.shared_expert_gate.weight", f"{f}.shared_expert_gate.weight"))
        return out

    def ignored_hf_names(self, cfg: HybridConfig) -> set[str]:
        """Canonical tensors transformers' state dict holds that carry no extra information."""
        return {"lm_head.weight"} if cfg.tie_word_embeddings else set()

    # ------------------------------------------------------------------ on-disk names
    def canonical_name(self, disk_name: str) -> str:
        for pattern, repl in self.checkpoint_renames:
            disk_name = re.sub(pattern, repl, disk_name)
        return disk_name

    def is_extra_layer(self, canonical: str, num_layers: int) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", canonical)
        return m is not None and int(m.group(1)) >= num_layers
