"""Qwen3.5 <-> harts: Gated DeltaNet (G) + gated GQA (A), dense SwiGLU or MoE with a gated shared expert.

Four transformers model types, one adapter class:

    qwen3_5_text        Qwen3_5ForCausalLM                    dense
    qwen3_5_moe_text    Qwen3_5MoeForCausalLM                 MoE on every layer
    qwen3_5             Qwen3_5ForConditionalGeneration       the dense language model of the VL model
    qwen3_5_moe         Qwen3_5MoeForConditionalGeneration    the MoE language model of the VL model

Semantics honoured (transformers ``modeling_qwen3_5`` / ``modeling_qwen3_5_moe``), as Qwen3-Next
(``harts.integrations.hf.qwen3_next``) except:
    GDN: four separate input projections ``in_proj_qkv`` (rows ``[q | k | v]``, heads in order),
         ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, where Qwen3-Next fuses them grouped per key
         head. harts' layer keeps the grouped layout (``in_proj_qkvz``, ``in_proj_ba``); the
         converters below permute rows both ways, so the same weights compute the same function.
    MoE: every layer is MoE (no ``decoder_sparse_step`` / ``mlp_only_layers``), the top-k weights
         are always renormalized, and the shared expert and its sigmoid gate always exist. On disk
         the experts are fused ``experts.gate_up_proj [E, 2I, D]`` / ``experts.down_proj [E, D, I]``
         (the module layout, no transpose); per-expert tensors, which ``save_pretrained`` writes,
         load too.
    RoPE: interleaved multimodal RoPE (``mrope_section``) picks each rotary frequency's position
         from the T, H or W axis; a text token has T = H = W = its 1-D position, so for text any
         ``mrope_section`` gives plain 1-D RoPE on ``partial_rotary_factor * head_dim`` dims, which
         is what harts computes (positions from 0 within each trajectory).

A VL checkpoint's config nests the language model in ``text_config`` and its tensors carry a
``model.language_model.`` prefix; harts trains the language model, leaves the vision tower
(``model.visual.*``) out of the model with one line on stderr, and ignores the multi-token-prediction
head (``mtp.*``). lm_head is tied as the VL model ties it (its top-level ``tie_word_embeddings``).
The vision tower is kept for export: ``hf_source["vision"]`` holds the VL config and the tower's
tensors (``from_hf``: the transformers model's own) or the checkpoint directory to read them from
at save time (``from_pretrained``), and ``save_hf_checkpoint`` writes the VL checkpoint back: the
trained language model beside the untouched vision tower (``vl_checkpoint``). A tower that can no
longer be read is a one-line ``UserError`` naming the directory, not a checkpoint without it.

Shapes: ``D`` hidden, ``Hk``/``Hv`` key/value heads, ``K``/``V`` their dims, ``r = Hv / Hk``.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch

from harts.errors import UserError
from harts.integrations.hf.base import HFAdapter, Problems, TensorGroup, UnsupportedConfigError, ident
from harts.integrations.hf.qwen3_next import gdn_gqa_fields
from harts.models.config import HybridConfig
from harts.models.presets import SOFTMAX_ROUTER

__all__ = ["Qwen3_5Adapter", "QWEN3_5_ADAPTERS", "gdn_projection_group"]

#: config fields whose transformers defaults are a full-size model's: a config.json without one
#: would build a model of the wrong shape, so each must be written out
_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)
_DENSE_FIELDS = ("intermediate_size",)
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")

_VISION_PREFIX = "model.visual."


def gdn_projection_group(prefix_harts: str, prefix_hf: str, hk: int, hv: int, k: int, v: int) -> TensorGroup:
    """harts' grouped ``in_proj_qkvz [Hk*(2K + 2rV), D]`` / ``in_proj_ba [Hk*2r, D]`` <-> Qwen3.5's
    ``in_proj_qkv [2*Hk*K + Hv*V, D]``, ``in_proj_z [Hv*V, D]``, ``in_proj_b / in_proj_a [Hv, D]``.

    Grouped per key head h: ``[q_h, k_h, v_{hr..hr+r-1}, z_{hr..hr+r-1}]`` and ``[b_{hr..}, a_{hr..}]``;
    value head ``hr + j`` reads key head h in both layouts (transformers' ``repeat_interleave``).
    """
    r = hv // hk

    def to_harts(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        qkv, z, b, a = ts
        d = qkv.shape[-1]
        q, kk, vv = torch.split(qkv, [hk * k, hk * k, hv * v], dim=0)
        parts = [q.reshape(hk, k, d), kk.reshape(hk, k, d), vv.reshape(hk, r * v, d), z.reshape(hk, r * v, d)]
        qkvz = torch.cat(parts, dim=1).reshape(-1, d)
        ba = torch.cat([b.reshape(hk, r, d), a.reshape(hk, r, d)], dim=1).reshape(-1, d)
        return [qkvz, ba]

    def to_hf(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        qkvz, ba = ts
        d = qkvz.shape[-1]
        q, kk, vv, z = torch.split(qkvz.reshape(hk, 2 * k + 2 * r * v, d), [k, k, r * v, r * v], dim=1)
        qkv = torch.cat([q.reshape(-1, d), kk.reshape(-1, d), vv.reshape(-1, d)], dim=0)
        b, a = torch.split(ba.reshape(hk, 2 * r, d), [r, r], dim=1)
        return [qkv, z.reshape(-1, d), b.reshape(-1, d), a.reshape(-1, d)]

    return TensorGroup(
        (f"{prefix_harts}.in_proj_qkvz.weight", f"{prefix_harts}.in_proj_ba.weight"),
        tuple(f"{prefix_hf}.{n}.weight" for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
        to_harts=to_harts,
        to_hf=to_hf,
    )


class Qwen3_5Adapter(HFAdapter):
    """One Qwen3.5 model type: dense or MoE (``moe``), text-only or the language model of the VL
    model (``vision``)."""

    def __init__(self, model_type: str, architecture: str, *, moe: bool, vision: bool, text_model_type: str) -> None:
        renames = [(r"^model\.language_model\.", "model.")]
        super().__init__(model_type=model_type, architecture=architecture, checkpoint_renames=renames)
        self.shared_expert_name = "shared_expert"
        self.moe = moe
        self.vision = vision
        #: the model type the weights export as (transformers' text-only causal LM)
        self.text_model_type = text_model_type

    # ------------------------------------------------------------------ config
    def text_config(self, hf_config: Any) -> Any:
        """The language model's config (``text_config`` of a VL config)."""
        if not self.vision:
            return hf_config
        text = getattr(hf_config, "text_config", None)
        if text is None:
            raise UnsupportedConfigError(f"{self.architecture}: the config has no text_config")
        return text

    def missing_config_fields(self, config: dict[str, Any]) -> list[str]:
        if self.vision:
            text = config.get("text_config")
            if not isinstance(text, dict):
                return ["text_config"]
            prefix = "text_config."
        else:
            text, prefix = config, ""
        need = _SHAPE_FIELDS + (_MOE_FIELDS if self.moe else _DENSE_FIELDS)
        missing = [prefix + n for n in need if n not in text]
        if "rope_parameters" not in text and "rope_theta" not in text:
            missing.append(prefix + "rope_parameters")
        return missing

    def tie_word_embeddings(self, hf_config: Any) -> bool:
        # the VL model ties by its own flag; transformers' text-only model by text_config's
        return bool(getattr(hf_config, "tie_word_embeddings", False))

    def num_hidden_layers_on_disk(self, hf_config: Any) -> int:
        return int(self.text_config(hf_config).num_hidden_layers)

    def hf_source(self, hf_config: Any) -> dict[str, Any]:
        """The text-only causal LM's config, and for a VL model ``vision``: its model type and
        config, to which ``keep_vision`` adds where the tower's tensors are (module docstring)."""
        text = self.text_config(hf_config).to_dict()
        text["model_type"] = self.text_model_type
        text["tie_word_embeddings"] = self.tie_word_embeddings(hf_config)
        source: dict[str, Any] = {"model_type": self.text_model_type, "config": text}
        if self.vision:
            source["vision"] = {"model_type": self.model_type, "config": hf_config.to_dict()}
        return source

    def keep_vision(
        self, source: dict[str, Any], *, hf_model: Any = None, checkpoint: str | None = None
    ) -> dict[str, Any]:
        """``source`` (``hf_source``) with where its vision tower is: the tensors of ``hf_model``
        (shared, not copied) or the ``checkpoint`` directory to read them from when saving."""
        vision = source.get("vision")
        if vision is None:
            return source
        if hf_model is not None:
            state = hf_model.state_dict()
            vision["tensors"] = {k: v.detach() for k, v in state.items() if k.startswith(_VISION_PREFIX)}
        else:
            vision["checkpoint"] = checkpoint
        return source

    def vision_tensors(self, vision: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The vision tower's tensors under their on-disk names, as loaded; UserError naming the
        source checkpoint when it no longer holds them."""
        if "tensors" in vision:
            return dict(vision["tensors"])
        from harts.integrations.hf.checkpoint import open_checkpoint

        path = vision.get("checkpoint")
        why = "the model keeps no copy of it"
        if path is not None:
            try:
                ck = open_checkpoint(path)
                names = sorted(n for n in ck.files if n.startswith(_VISION_PREFIX))
                if names:
                    return ck.read(names)
                why = f"{path} holds no {_VISION_PREFIX}* tensors any more"
            except UserError as err:
                why = f"it is read from {path}, the checkpoint the model was loaded from: {err}"
        raise UserError(
            f"{self.architecture}: cannot save the vision tower ({why}); restore that checkpoint, or save the "
            f"language model alone with save_hf_checkpoint(model, path, hf_config=model.hf_source['config'])"
        )

    def vl_checkpoint(
        self, text_config: dict[str, Any], tensors: dict[str, torch.Tensor], vision: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The VL checkpoint of a language model saved as ``text_config`` + ``tensors`` (the text-only
        causal LM's names): the VL config with that ``text_config``, the language model under
        ``model.language_model.`` (lm_head as it is) and the untouched vision tower."""
        config = copy.deepcopy(vision["config"])
        text = {k: v for k, v in text_config.items() if k != "architectures"}
        config["text_config"] = text
        config["model_type"] = self.model_type
        config["architectures"] = [self.architecture]
        config["tie_word_embeddings"] = bool(text.get("tie_word_embeddings", False))
        config["dtype"] = text.get("dtype", config.get("dtype"))
        out = {
            ("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
            for k, v in tensors.items()
        }
        out.update(self.vision_tensors(vision))
        return config, out

    def config_from_hf(self, hf_config: Any, **overrides: Any) -> HybridConfig:
        c = self.text_config(hf_config)
        p = Problems(self.architecture)
        fields = gdn_gqa_fields(c, p, tie_word_embeddings=self.tie_word_embeddings(hf_config))
        fields.update(self._moe_fields(c, p) if self.moe else self._dense_fields(c))
        p.raise_if_any()
        fields.update(self.check_overrides(overrides))
        try:
            return HybridConfig(**fields)
        except ValueError as err:  # a shape harts cannot run, named by HybridConfig's validation
            raise UnsupportedConfigError(f"{self.architecture}: {err}") from None

    @staticmethod
    def _dense_fields(c: Any) -> dict[str, Any]:
        return dict(
            intermediate_size=int(c.intermediate_size),
            num_experts=0,
            first_k_dense_replace=0,
            num_shared_experts=0,
            shared_expert_gate=False,
        )

    @staticmethod
    def _moe_fields(c: Any, p: Problems) -> dict[str, Any]:
        num_experts, shared = int(c.num_experts), int(c.shared_expert_intermediate_size or 0)
        if num_experts < 1:
            p.add(f"num_experts={num_experts} (Qwen3.5-MoE puts experts on every layer)")
        if shared < 1:
            p.add(f"shared_expert_intermediate_size={shared} (transformers always builds the shared expert)")
        return dict(
            # unused (no dense layer); HybridConfig wants a positive width
            intermediate_size=int(c.moe_intermediate_size),
            num_experts=num_experts,
            num_experts_per_tok=int(c.num_experts_per_tok),
            moe_intermediate_size=int(c.moe_intermediate_size),
            first_k_dense_replace=0,
            **SOFTMAX_ROUTER,
            norm_topk_prob=True,
            num_shared_experts=1,
            shared_expert_intermediate_size=shared,
            shared_expert_gate=True,
            router_aux_loss_coef=float(c.router_aux_loss_coef),
        )

    # ------------------------------------------------------------------ tensors
    def mixer_groups(self, cfg: HybridConfig, i: int) -> list[TensorGroup]:
        if cfg.layer_pattern[i] == "A":
            names = ["q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"]
            return [ident(f"layers.{i}.self_attn.{n}.weight", f"model.layers.{i}.self_attn.{n}.weight") for n in names]
        h, f = f"layers.{i}.linear_attn", f"model.layers.{i}.linear_attn"
        out = [
            gdn_projection_group(
                h,
                f,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
            )
        ]
        names = ["conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"]
        return out + [ident(f"{h}.{n}", f"{f}.{n}") for n in names]

    # ------------------------------------------------------------------ names
    def is_extra_layer(self, canonical: str, num_layers: int) -> bool:
        # the vision tower and the multi-token-prediction head are skipped on purpose
        if canonical.startswith((_VISION_PREFIX, "mtp.")):
            return True
        return super().is_extra_layer(canonical, num_layers)

    def canonical_state_dict(self, hf_model: Any) -> dict[str, torch.Tensor]:
        if not self.vision:
            return super().canonical_state_dict(hf_model)
        num_layers = self.num_hidden_layers_on_disk(hf_model.config)
        out: dict[str, torch.Tensor] = {}
        dropped: list[str] = []
        for name, t in hf_model.state_dict().items():
            canon = self.canonical_name(name)
            if self.is_extra_layer(canon, num_layers):
                dropped.append(name)
            else:
                out[canon] = t.detach()
        self.report_left_out(dropped)
        return out

    def report_left_out(self, names: list[str]) -> None:
        vision = [n for n in names if n.startswith(_VISION_PREFIX)]
        if vision:
            print(
                f"harts: {self.architecture}: the vision tower ({len(vision)} tensors, {_VISION_PREFIX}*) is left "
                "out; harts loads the language model (saving writes the tower back unchanged)",
                file=sys.stderr,
            )


QWEN3_5_ADAPTERS: tuple[Qwen3_5Adapter, ...] = (
    Qwen3_5Adapter("qwen3_5_text", "Qwen3_5ForCausalLM", moe=False, vision=False, text_model_type="qwen3_5_text"),
    Qwen3_5Adapter(
        "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", moe=True, vision=False, text_model_type="qwen3_5_moe_text"
    ),
    Qwen3_5Adapter(
        "qwen3_5", "Qwen3_5ForConditionalGeneration", moe=False, vision=True, text_model_type="qwen3_5_text"
    ),
    Qwen3_5Adapter(
        "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", moe=True, vision=True, text_model_type="qwen3_5_moe_text"
    ),
)
