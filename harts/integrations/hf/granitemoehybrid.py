"""Granite 4.0-H (``granitemoehybrid``) <-> harts: Mamba-2 (S) or GQA (A), then MoE plus a shared MLP.

Semantics honoured (transformers ``modeling_granitemoehybrid``): every decoder layer is a
mixer block and an FFN block, each ``h + multiplier * block(norm h)``:
    Mamba-2: as Nemotron-H's (``harts.models.layers.mamba2``); heads ``mamba_n_heads`` of
        ``mamba_d_head`` (= ``mamba_expand * hidden_size``), conv with bias.
    Attention: q/k/v/o projections, no q/k norm, no gate, softmax scale ``attention_multiplier``,
        RoPE on every dim when ``position_embedding_type`` is "rope", none otherwise (Granite 4.0-H).
    FFN: with experts, top-k of the router's logits softmaxed over the chosen (= harts' softmax
        router with normalized top-k), SwiGLU experts, plus the always-present shared MLP
        (``shared_mlp.input_linear`` = [gate; up], ``output_linear``); without experts the shared
        MLP alone (a dense layer).
    Scalings: ``embedding_multiplier``, ``residual_multiplier``, ``logits_scaling``.

On disk (the Hub layout) the experts are ``block_sparse_moe.input_linear`` [E, 2I, D] /
``output_linear`` [E, D, I] and the router ``block_sparse_moe.router.layer``; transformers'
module names are ``experts.gate_up_proj`` / ``experts.down_proj`` and ``router``.
"""

from __future__ import annotations

from typing import Any

import torch

from harts.integrations.hf.bailing_hybrid import rope_theta_of
from harts.integrations.hf.base import HFAdapter, Problems, TensorGroup, UnsupportedConfigError, ident
from harts.integrations.hf.nemotron_h import check_dt_limit
from harts.models.config import HybridConfig
from harts.models.presets import SOFTMAX_ROUTER

__all__ = ["GraniteMoeHybridAdapter"]

_KINDS = {"linear_attention": "S", "mamba": "S", "full_attention": "A", "attention": "A"}
_MAMBA = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")


def shared_mlp_group(harts_prefix: str, hf_prefix: str) -> TensorGroup:
    """harts' ``gate_proj`` / ``up_proj`` / ``down_proj`` <-> Granite's ``input_linear`` [gate; up]
    and ``output_linear``."""
    return TensorGroup(
        tuple(f"{harts_prefix}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")),
        (f"{hf_prefix}.input_linear.weight", f"{hf_prefix}.output_linear.weight"),
        to_harts=lambda ts: [*torch.chunk(ts[0], 2, dim=0), ts[1]],
        to_hf=lambda ts: [torch.cat(ts[:2], dim=0), ts[2]],
    )


class GraniteMoeHybridAdapter(HFAdapter):
    def __init__(self) -> None:
        super().__init__(
            model_type="granitemoehybrid",
            architecture="GraniteMoeHybridForCausalLM",
            checkpoint_renames=[
                (r"block_sparse_moe\.input_linear\.weight$", "block_sparse_moe.experts.gate_up_proj"),
                (r"block_sparse_moe\.output_linear\.weight$", "block_sparse_moe.experts.down_proj"),
                (r"block_sparse_moe\.router\.layer\.weight$", "block_sparse_moe.router.weight"),
            ],
        )

    # ------------------------------------------------------------------ config
    def missing_config_fields(self, config: dict[str, Any]) -> list[str]:
        need = ["vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"]
        need += ["mamba_n_heads", "mamba_d_head", "mamba_d_state", "layer_types"]
        return [n for n in need if n not in config]

    def config_from_hf(self, hf_config: Any, **overrides: Any) -> HybridConfig:
        c = hf_config
        p = Problems(self.architecture)
        kinds = [str(k) for k in list(c.layer_types)[: c.num_hidden_layers]]
        bad = sorted(set(kinds) - set(_KINDS))
        if bad:
            p.add(f"layer_types: unknown entries {bad}")
        for name in ("attention_bias", "mamba_proj_bias"):
            p.expect(name, bool(getattr(c, name, False)), False)
        p.expect("hidden_act", c.hidden_act, "silu")
        p.expect("attention_dropout", float(c.attention_dropout or 0.0), 0.0, "harts has no dropout")
        p.expect("position_embedding_type", c.position_embedding_type, (None, "nope", "rope"))
        check_dt_limit(c.time_step_limit, p)
        heads, head_dim = int(c.mamba_n_heads), int(c.mamba_d_head)
        if heads * head_dim != int(c.mamba_expand * c.hidden_size):
            p.add(f"mamba_n_heads x mamba_d_head = {heads * head_dim} differs from mamba_expand x hidden_size")
        rope = c.position_embedding_type == "rope"
        theta, _ = rope_theta_of(c, p) if rope else (10000.0, 1.0)
        num_heads = int(c.num_attention_heads)
        fields: dict[str, Any] = dict(
            layer_pattern="".join(_KINDS.get(k, "S") for k in kinds),
            vocab_size=int(c.vocab_size),
            hidden_size=int(c.hidden_size),
            rms_norm_eps=float(c.rms_norm_eps),
            tie_word_embeddings=self.tie_word_embeddings(c),
            embedding_multiplier=float(c.embedding_multiplier),
            residual_multiplier=float(c.residual_multiplier),
            logits_scaling=float(c.logits_scaling),
            linear_conv_kernel_dim=int(c.mamba_d_conv),
            mamba_num_heads=heads,
            mamba_head_dim=head_dim,
            ssm_state_size=int(c.mamba_d_state),
            mamba_n_groups=int(c.mamba_n_groups),
            mamba_conv_bias=bool(c.mamba_conv_bias),
            num_attention_heads=num_heads,
            num_key_value_heads=int(c.num_key_value_heads),
            head_dim=int(c.hidden_size) // num_heads,
            partial_rotary_factor=1.0 if rope else 0.0,
            rope_theta=theta,
            attn_output_gate=False,
            attn_qk_norm=False,
            attn_scale=float(c.attention_multiplier),
            hidden_act="silu",
            **self._ffn_fields(c),
        )
        p.raise_if_any()
        fields.update(self.check_overrides(overrides))
        try:
            return HybridConfig(**fields)
        except ValueError as err:  # a shape harts cannot run, named by HybridConfig's validation
            raise UnsupportedConfigError(f"{self.architecture}: {err}") from None

    @staticmethod
    def _ffn_fields(c: Any) -> dict[str, Any]:
        shared = int(c.shared_intermediate_size)
        if not int(c.num_local_experts):  # the shared MLP alone: a dense layer
            return dict(intermediate_size=shared, num_experts=0, first_k_dense_replace=0, num_shared_experts=0)
        return dict(
            intermediate_size=shared,  # unused: every layer is MoE
            num_experts=int(c.num_local_experts),
            num_experts_per_tok=int(c.num_experts_per_tok),
            moe_intermediate_size=int(c.intermediate_size),
            first_k_dense_replace=0,
            **SOFTMAX_ROUTER,
            norm_topk_prob=True,
            num_shared_experts=1,
            shared_expert_intermediate_size=shared,
            shared_expert_gate=False,
            router_aux_loss_coef=float(c.router_aux_loss_coef),
        )

    # ------------------------------------------------------------------ tensors
    def mixer_groups(self, cfg: HybridConfig, i: int) -> list[TensorGroup]:
        h, f = f"layers.{i}", f"model.layers.{i}"
        if cfg.layer_pattern[i] == "S":
            return [ident(f"{h}.mamba.{n}", f"{f}.mamba.{n}") for n in _MAMBA]
        return [
            ident(f"{h}.self_attn.{n}.weight", f"{f}.self_attn.{n}.weight")
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]

    def ffn_groups(self, cfg: HybridConfig, i: int) -> list[TensorGroup]:
        h, f = f"layers.{i}.mlp", f"model.layers.{i}"
        if not cfg.is_moe_layer(i):
            return [shared_mlp_group(h, f"{f}.shared_mlp")]
        m = f"{f}.block_sparse_moe"
        return [
            ident(f"{h}.gate.weight", f"{m}.router.weight"),
            ident(f"{h}.experts.gate_up_proj", f"{m}.experts.gate_up_proj"),
            ident(f"{h}.experts.down_proj", f"{m}.experts.down_proj"),
            shared_mlp_group(f"{h}.shared_experts", f"{f}.shared_mlp"),
        ]
