"""Nemotron-H (NVIDIA Nemotron-H, Nemotron 3 Nano) <-> harts: Mamba-2 (S), NoPE GQA (A), relu2 MLP / MoE.

Every transformers ``NemotronHBlock`` is ONE block: ``h + mixer(norm h)`` with a mixer of one
kind per layer (``layers_block_type``). harts holds it as a decoder layer with one block:

    mamba / linear_attention    layer_pattern "S", ffn "-"   ``layers.i.mamba.*``, ``input_layernorm``
    attention / full_attention  layer_pattern "A", ffn "-"   ``layers.i.self_attn.*``, ``input_layernorm``
    mlp                         layer_pattern "-", ffn "D"   ``layers.i.mlp.*``, ``post_attention_layernorm``
    moe                         layer_pattern "-", ffn "E"   ``layers.i.mlp.*``, ``post_attention_layernorm``

Semantics honoured (transformers ``modeling_nemotron_h``):
    Mamba-2: in_proj to [z | x B C | dt], conv with bias over x B C, softplus(dt + dt_bias),
        A = -exp(A_log), D skip, gated RMS norm over n_groups groups (gate before norm);
        ``harts.models.layers.mamba2``.
    Attention: q/k/v/o projections, no RoPE, no q/k norm, no output gate, scale head_dim^-1/2.
    MLP and experts: ``down(relu(up x)^2)``; MoE: DeepSeek-V3's sigmoid router with
        ``e_score_correction_bias``, ``n_group`` / ``topk_group``, optional top-k
        normalization, ``routed_scaling_factor``, one shared expert of
        ``moe_shared_expert_intermediate_size``.

On disk (the Hub layout) tensors carry ``backbone.`` for ``model.`` and per-expert
``experts.{e}.up_proj.weight`` / ``down_proj.weight``; transformers' module state dict has
``model.`` and the stacked ``experts.up_proj`` [E, I, D] / ``experts.down_proj`` [E, D, I].
The multi-token-prediction layers (``mtp.*``) are left out.

Shapes: ``D`` hidden, ``H`` Mamba heads of ``P`` dims, ``G`` groups of ``N`` state dims.
"""

from __future__ import annotations

import math
from typing import Any

from harts.integrations.hf.base import HFAdapter, Problems, TensorGroup, UnsupportedConfigError, ident
from harts.models.config import HybridConfig

__all__ = ["NemotronHAdapter", "check_dt_limit", "nemotron_layer_kinds"]

#: transformers' layer kinds (current and legacy spellings) -> (harts mixer letter, FFN letter)
_KINDS = {
    "linear_attention": ("S", "-"),
    "mamba": ("S", "-"),
    "full_attention": ("A", "-"),
    "attention": ("A", "-"),
    "mlp": ("-", "D"),
    "moe": ("-", "E"),
}

_MAMBA = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")


def check_dt_limit(time_step_limit: Any, problems: Problems) -> None:  # noqa: ANN401 - a pair of numbers
    """Report a ``time_step_limit`` other than (0, inf): harts' Mamba-2 does not clamp dt."""
    limit = tuple(float(x) for x in time_step_limit)
    if limit != (0.0, math.inf):
        problems.add(f"time_step_limit={list(limit)} (harts supports (0.0, inf): no clamp of dt)")


def nemotron_layer_kinds(kinds: list[str], problems: Problems) -> tuple[str, str]:
    """(layer_pattern, ffn_pattern) of transformers' per-layer kinds; unknown kinds reported."""
    bad = sorted(set(kinds) - set(_KINDS))
    if bad:
        problems.add(f"layers_block_type: unknown entries {bad}")
    pairs = [_KINDS.get(k, ("S", "-")) for k in kinds]
    return "".join(m for m, _ in pairs), "".join(f for _, f in pairs)


class NemotronHAdapter(HFAdapter):
    def __init__(self) -> None:
        super().__init__(
            model_type="nemotron_h",
            architecture="NemotronHForCausalLM",
            checkpoint_renames=[(r"^backbone\.", "model.")],
            expert_names=(("", "up_proj", "down_proj"),),
        )
        self.ties_embeddings = False  # transformers declares no tied weights for Nemotron-H

    # ------------------------------------------------------------------ config
    def missing_config_fields(self, config: dict[str, Any]) -> list[str]:
        need = ["vocab_size", "hidden_size", "num_attention_heads", "head_dim", "mamba_num_heads", "mamba_head_dim"]
        need += ["ssm_state_size", "n_groups", "intermediate_size"]
        missing = [n for n in need if n not in config]
        if "hybrid_override_pattern" not in config and "layers_block_type" not in config:
            missing.append("hybrid_override_pattern")
        return missing

    def config_from_hf(self, hf_config: Any, **overrides: Any) -> HybridConfig:
        c = hf_config
        p = Problems(self.architecture)
        layer_pattern, ffn_pattern = nemotron_layer_kinds([str(k) for k in c.layers_block_type], p)
        for name in ("use_bias", "mamba_proj_bias", "attention_bias", "mlp_bias"):
            p.expect(name, bool(getattr(c, name, False)), False)
        p.expect("mamba_hidden_act", c.mamba_hidden_act, "silu")
        p.expect("mlp_hidden_act", c.mlp_hidden_act, "relu2")
        check_dt_limit(c.time_step_limit, p)
        p.expect("attention_dropout", float(c.attention_dropout or 0.0), 0.0, "harts has no dropout")
        p.expect("sliding_window", c.sliding_window, None)
        fields: dict[str, Any] = dict(
            layer_pattern=layer_pattern,
            ffn_pattern=ffn_pattern,
            vocab_size=int(c.vocab_size),
            hidden_size=int(c.hidden_size),
            rms_norm_eps=float(c.layer_norm_epsilon),
            tie_word_embeddings=self.tie_word_embeddings(c),
            linear_conv_kernel_dim=int(c.conv_kernel),
            mamba_num_heads=int(c.mamba_num_heads),
            mamba_head_dim=int(c.mamba_head_dim),
            ssm_state_size=int(c.ssm_state_size),
            mamba_n_groups=int(c.n_groups),
            mamba_conv_bias=bool(c.use_conv_bias),
            num_attention_heads=int(c.num_attention_heads),
            num_key_value_heads=int(c.num_key_value_heads),
            head_dim=int(c.head_dim),
            partial_rotary_factor=0.0,
            attn_output_gate=False,
            attn_qk_norm=False,
            hidden_act="relu2",
            intermediate_size=int(c.intermediate_size),
            **self._moe_fields(c, "E" in ffn_pattern, p),
        )
        p.raise_if_any()
        fields.update(self.check_overrides(overrides))
        try:
            return HybridConfig(**fields)
        except ValueError as err:  # a shape harts cannot run, named by HybridConfig's validation
            raise UnsupportedConfigError(f"{self.architecture}: {err}") from None

    @staticmethod
    def _moe_fields(c: Any, moe: bool, p: Problems) -> dict[str, Any]:
        if not moe:
            return dict(num_experts=0, first_k_dense_replace=0, num_shared_experts=0)
        p.expect("moe_latent_size", c.moe_latent_size, None, "the latent expert projections are not implemented")
        num_experts, n_group = int(c.n_routed_experts), int(c.n_group)
        if n_group > 1 and num_experts // n_group < 2:
            p.add(f"n_group={n_group}: groups of one expert (transformers scores groups by their top-2)")
        shared = int(c.n_shared_experts or 0)
        if shared not in (0, 1):
            p.add(f"n_shared_experts={shared} (transformers builds one shared expert MLP)")
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=int(c.num_experts_per_tok),
            moe_intermediate_size=int(c.moe_intermediate_size),
            first_k_dense_replace=0,
            router_score="sigmoid",
            router_bias=True,
            norm_topk_prob=bool(c.norm_topk_prob),
            routed_scaling_factor=float(c.routed_scaling_factor),
            n_group=n_group,
            topk_group=int(c.topk_group),
            # transformers always builds the shared expert (n_shared_experts only documents it)
            num_shared_experts=1,
            shared_expert_intermediate_size=int(c.moe_shared_expert_intermediate_size),
            shared_expert_gate=False,
        )

    def num_hidden_layers_on_disk(self, hf_config: Any) -> int:
        return len(hf_config.layers_block_type)

    # ------------------------------------------------------------------ tensors
    def tensor_groups(self, cfg: HybridConfig) -> list[TensorGroup]:
        groups = [ident("embed_tokens.weight", "model.embeddings.weight"), ident("norm.weight", "model.norm_f.weight")]
        if not cfg.tie_word_embeddings:
            groups.append(ident("lm_head.weight", "lm_head.weight"))
        for i in range(cfg.num_hidden_layers):
            groups += self.layer_groups(cfg, i)
        return groups

    def layer_groups(self, cfg: HybridConfig, i: int) -> list[TensorGroup]:
        """One transformers block ``model.layers.i`` <-> harts' one-block decoder layer i."""
        h, f = f"layers.{i}", f"model.layers.{i}"
        letter = cfg.layer_pattern[i]
        if letter == "S":
            out = [ident(f"{h}.mamba.{n}", f"{f}.mixer.{n}") for n in _MAMBA]
            return [ident(f"{h}.input_layernorm.weight", f"{f}.norm.weight"), *out]
        if letter == "A":
            out = [
                ident(f"{h}.self_attn.{n}.weight", f"{f}.mixer.{n}.weight")
                for n in ("q_proj", "k_proj", "v_proj", "o_proj")
            ]
            return [ident(f"{h}.input_layernorm.weight", f"{f}.norm.weight"), *out]
        out = [ident(f"{h}.post_attention_layernorm.weight", f"{f}.norm.weight")]
        if not cfg.is_moe_layer(i):
            return out + [ident(f"{h}.mlp.{n}.weight", f"{f}.mixer.{n}.weight") for n in ("up_proj", "down_proj")]
        out += [
            ident(f"{h}.mlp.gate.weight", f"{f}.mixer.gate.weight"),
            ident(f"{h}.mlp.gate.e_score_correction_bias", f"{f}.mixer.gate.e_score_correction_bias"),
            ident(f"{h}.mlp.experts.up_proj", f"{f}.mixer.experts.up_proj"),
            ident(f"{h}.mlp.experts.down_proj", f"{f}.mixer.experts.down_proj"),
        ]
        return out + [
            ident(f"{h}.mlp.shared_experts.{n}.weight", f"{f}.mixer.shared_experts.{n}.weight")
            for n in ("up_proj", "down_proj")
        ]

    def mixer_groups(self, cfg: HybridConfig, i: int) -> list[TensorGroup]:
        return self.layer_groups(cfg, i)

    def is_extra_layer(self, canonical: str, num_layers: int) -> bool:
        # the multi-token-prediction layers are skipped on purpose
        return canonical.startswith("mtp.") or super().is_extra_layer(canonical, num_layers)
