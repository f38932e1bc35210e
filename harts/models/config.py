"""HybridConfig: the architecture of a hybrid-attention LM, plus presets.

One config describes every layer type harts executes. ``layer_pattern`` holds one letter
per decoder layer, naming its token mixer (``harts.models.layers.registry``: K KDA, G GDN,
S Mamba-2, M MLA, A GQA; ``-`` none).

FFN: by default every layer has one: layers ``< first_k_dense_replace`` (or every layer when
``num_experts == 0``) a dense MLP of ``intermediate_size``, the rest a no-drop top-k MoE.
``ffn_pattern``, when given, says it per layer instead (``D`` dense, ``E`` MoE, ``-`` none), so
a decoder layer may be a mixer only, an FFN only, or both (Nemotron-H's layers are one block
each). Field names follow transformers where one exists so state-dict adapters stay thin.

Presets (``HybridConfig.preset(name, layers=N)``): ``tiny``, ``ling3_tiny`` and the real models
of ``harts.models.presets`` (Qwen3.5, Qwen3-Next, Kimi Linear, Nemotron 3 Nano, Granite 4.0-H);
``layers`` keeps the first N decoder layers of the real layer pattern (``first_layers``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harts.errors import UserError
from harts.models.presets import MODEL_FIELDS

if TYPE_CHECKING:
    import torch

__all__ = ["HybridConfig", "PRESET_NAMES", "preset_key"]

#: every name ``HybridConfig.preset`` takes
PRESET_NAMES: tuple[str, ...] = ("tiny", "ling3_tiny", *MODEL_FIELDS)


def preset_key(name: str) -> str:
    """The preset ``name`` spells, case-insensitive with ``-`` or ``.`` for ``_`` (``Qwen3.5-9B``
    -> ``qwen3_5_9b``); UserError listing ``PRESET_NAMES`` when it names none."""
    key = name.strip().lower().replace("-", "_").replace(".", "_")
    if key not in PRESET_NAMES:
        raise UserError(f"unknown model preset {name!r}; known: {', '.join(PRESET_NAMES)}")
    return key


#: the letters of ``layer_pattern``: the mixer registry's (``harts.models.layers.registry.MIXERS``,
#: which imports the layers, which import this module: the registry's test checks the two agree)
#: and "-" for no mixer
LAYER_LETTERS = "KGMAS-"
#: the FFN letters of ``ffn_pattern``: dense MLP, MoE, none
FFN_LETTERS = "DE-"


@dataclass(kw_only=True)
class HybridConfig:
    """Hyperparameters of a ``HybridLM``; see the module docstring for the layer letters."""

    #: one letter per decoder layer: its mixer (``harts.models.layers.registry.MIXERS``) or "-"
    layer_pattern: str = "KGMA"
    #: one letter per decoder layer, its FFN: "D" dense, "E" MoE, "-" none; "" (the default):
    #: every layer has one, MoE from ``first_k_dense_replace`` on when ``num_experts`` > 0
    ffn_pattern: str = ""
    vocab_size: int = 64
    hidden_size: int = 32
    rms_norm_eps: float = 1e-6
    #: Qwen3-Next stores RMSNorm weights zero-centred and applies ``1 + weight``
    norm_unit_offset: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    #: parameter dtype name, "float32" or "float64"
    dtype: str = "float32"
    #: Granite's scalings (1.0: none): the embeddings times ``embedding_multiplier``, each block's
    #: output times ``residual_multiplier`` before its residual add, the logits divided by
    #: ``logits_scaling``
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    # ---- linear attention (K and G layers)
    #: linear-attention execution chunk B (a power of two >= 8 in the reference path)
    chunk_size: int = 64
    #: short causal conv width w
    linear_conv_kernel_dim: int = 4
    #: GDN key heads (KDA uses ``linear_num_value_heads`` for q, k and v)
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 2
    linear_key_head_dim: int = 8
    linear_value_head_dim: int = 8
    #: KDA gates: low-rank ``f_a_proj/f_b_proj`` and ``g_a_proj/g_b_proj`` (Kimi Linear, rank
    #: ``linear_value_head_dim``); False = full-rank ``f_proj`` and ``g_proj`` (Ling 3.0 / BailingHybrid)
    kda_low_rank_gates: bool = True
    #: KDA safe gate (Ling 3.0): ``g = kda_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``
    #: instead of ``-exp(A_log) * softplus(f + dt_bias)``
    kda_safe_gate: bool = False
    kda_lower_bound: float = -5.0

    # ---- Mamba-2 (S layers; the conv width is linear_conv_kernel_dim, the norm eps rms_norm_eps)
    mamba_num_heads: int = 4
    mamba_head_dim: int = 8
    ssm_state_size: int = 8
    #: groups of B / C (and of the gated norm's channels)
    mamba_n_groups: int = 2
    mamba_conv_bias: bool = True

    # ---- full attention: A layers (gated GQA)
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    #: fraction of ``head_dim`` rotated by RoPE in A layers; 0: no position encoding (NoPE:
    #: Nemotron-H, Granite 4.0-H)
    partial_rotary_factor: float = 0.5
    attn_output_gate: bool = True
    #: RMSNorm of q and k per head (Qwen3-Next); False: none (Nemotron-H)
    attn_qk_norm: bool = True
    #: the softmax scale of A layers; None: head_dim ** -0.5 (Granite's ``attention_multiplier``)
    attn_scale: float | None = None
    rope_theta: float = 10000.0

    # ---- full attention: M layers (MLA); heads = num_attention_heads
    q_lora_rank: int | None = 16
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 4
    v_head_dim: int = 8
    #: Ling 3.0's gated MLA: ``o_proj(attn * sigmoid(g_proj(x)))``
    mla_output_gate: bool = True
    #: DeepSeek-V3 checkpoints store the rope dims interleaved
    rope_interleave: bool = False
    #: False = MLA without RoPE (Kimi Linear: the ``qk_rope_head_dim`` part is not rotated)
    mla_rope: bool = True
    #: Ling 3.0 gates MLA per head: ``g_proj`` outputs one gate per head (broadcast over v_head_dim)
    mla_head_gate: bool = False
    #: eps of ``q_a_layernorm``/``kv_a_layernorm``; None = ``rms_norm_eps``
    mla_norm_eps: float | None = None

    # ---- FFN
    #: "silu": SwiGLU (gate, up, down); "relu2": relu(up x)^2 through down, no gate (Nemotron-H);
    #: for the dense MLPs, the routed and the shared experts alike
    hidden_act: str = "silu"
    intermediate_size: int = 64
    #: 0 = every FFN is dense
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 16
    first_k_dense_replace: int = 1
    num_shared_experts: int = 1
    #: per shared expert; default ``moe_intermediate_size``
    shared_expert_intermediate_size: int | None = None
    #: Qwen3-Next: the shared expert output is scaled by sigmoid(shared_expert_gate(x))
    shared_expert_gate: bool = False
    #: "softmax" (Qwen3-Next) or "sigmoid" (DeepSeek-V3 / Ling / Kimi)
    router_score: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    #: expert-bias (aux-loss-free) balancing: an ``e_score_correction_bias`` buffer added to
    #: the scores used for expert choice only
    router_bias: bool = True
    router_z_loss_coef: float = 1e-3
    router_aux_loss_coef: float = 1e-3

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_pattern)

    def is_moe_layer(self, i: int) -> bool:
        if self.ffn_pattern:
            return self.ffn_pattern[i] == "E"
        return self.num_experts > 0 and i >= self.first_k_dense_replace

    def has_ffn(self, i: int) -> bool:
        """Whether decoder layer ``i`` has an FFN block (``ffn_pattern``)."""
        return not self.ffn_pattern or self.ffn_pattern[i] != "-"

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def attention_head_dims(self) -> dict[str, tuple[int, int, bool]]:
        """{letter: (query/key head dim, value head dim, grouped-query)} of the full-attention
        layer kinds in the pattern (MLA "M": nope + rope and v, never grouped; GQA "A":
        head_dim both, grouped when it has fewer kv heads than query heads)."""
        dims = {}
        if "M" in self.layer_pattern:
            dims["M"] = (self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim, False)
        if "A" in self.layer_pattern:
            dims["A"] = (self.head_dim, self.head_dim, self.num_key_value_heads != self.num_attention_heads)
        return dims

    @property
    def min_attention_head_dim(self) -> int | None:
        """The smallest query/key or value head dim of the full-attention layers
        (``attention_head_dims``); None without full attention. FlexAttention on CUDA needs >= 16."""
        dims = [d for qk, v, _ in self.attention_head_dims.values() for d in (qk, v)]
        return min(dims) if dims else None

    def torch_dtype(self) -> torch.dtype:
        import torch

        return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[self.dtype]

    def replace(self, **overrides: Any) -> HybridConfig:
        """A copy with ``overrides`` applied (validated)."""
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"HybridConfig: unknown field(s) {unknown}")
        return cls(**d)

    #: fields that may be 0 (every other integer size must be positive)
    _MAY_BE_ZERO = frozenset({"num_experts", "first_k_dense_replace", "num_shared_experts"})

    def _validate_types(self) -> None:
        """Every field of its declared type and every size positive (a config.json field that is a
        string, NaN or negative names itself here, before any tensor is made)."""
        import math

        for f in dataclasses.fields(self):
            v, kind = getattr(self, f.name), str(f.type)
            if v is None and kind.endswith("| None"):
                continue
            kind = kind.removesuffix(" | None")
            if kind == "bool":
                ok = isinstance(v, bool)
            elif kind == "int":
                ok = isinstance(v, int) and not isinstance(v, bool)
                ok = ok and (v >= 0 if f.name in self._MAY_BE_ZERO or f.name.endswith("_coef") else v > 0)
            elif kind == "float":
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            else:
                ok = isinstance(v, str)
            if not ok:
                need = {"int": "a positive integer", "float": "a finite number", "bool": "true or false"}.get(
                    kind, "a string"
                )
                if f.name in self._MAY_BE_ZERO:
                    need = "an integer >= 0"
                raise UserError(f"HybridConfig.{f.name} must be {need}, got {v!r}")

    def validate(self) -> None:
        self._validate_types()
        bad = sorted(set(self.layer_pattern) - set(LAYER_LETTERS))
        if not self.layer_pattern or bad:
            raise UserError(
                f"layer_pattern {self.layer_pattern!r}: letters must be from {LAYER_LETTERS}"
                + (f", got {bad}" if bad else ", got an empty pattern")
            )
        self._validate_blocks()
        if self.dtype not in ("float32", "float64", "bfloat16"):
            raise UserError(f"dtype must be float32, float64 or bfloat16, got {self.dtype!r}")
        if self.chunk_size < 8 or self.chunk_size & (self.chunk_size - 1):
            raise UserError(f"chunk_size must be a power of two >= 8, got {self.chunk_size}")
        if self.linear_conv_kernel_dim < 1:
            raise UserError(f"linear_conv_kernel_dim must be >= 1, got {self.linear_conv_kernel_dim}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UserError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rot = int(self.head_dim * self.partial_rotary_factor)
        if rot % 2 or not 0 <= self.partial_rotary_factor <= 1:
            raise UserError(
                f"partial_rotary_factor {self.partial_rotary_factor} x head_dim {self.head_dim} must give an "
                "even number of rotary dims (0: no RoPE)"
            )
        if self.qk_rope_head_dim % 2:
            raise UserError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.router_score not in ("softmax", "sigmoid"):
            raise UserError(f"router_score must be 'softmax' or 'sigmoid', got {self.router_score!r}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise UserError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}"
                )
            if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise UserError(
                    f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and "
                    f"1 <= topk_group ({self.topk_group}) <= n_group"
                )
            if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
                raise UserError("topk_group groups hold fewer experts than num_experts_per_tok")
        if self.hidden_act not in ("silu", "relu2"):
            raise UserError(f"hidden_act must be 'silu' or 'relu2', got {self.hidden_act!r}")

    def _validate_blocks(self) -> None:
        """``ffn_pattern`` one known letter per layer, every layer with a block, MoE layers only
        with experts, and Mamba-2's heads in whole groups."""
        fp, n = self.ffn_pattern, self.num_hidden_layers
        if fp and (len(fp) != n or set(fp) - set(FFN_LETTERS)):
            raise UserError(f"ffn_pattern {fp!r}: one letter of {FFN_LETTERS} per layer of layer_pattern ({n} layers)")
        empty = [i for i in range(n) if self.layer_pattern[i] == "-" and not self.has_ffn(i)]
        if empty:
            raise UserError(f"decoder layers {empty} have neither a mixer nor an FFN (layer_pattern / ffn_pattern)")
        if "E" in fp and not self.num_experts:
            raise UserError("ffn_pattern has MoE layers ('E') but num_experts is 0")
        if "S" in self.layer_pattern and self.mamba_num_heads % self.mamba_n_groups:
            raise UserError(
                f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of mamba_n_groups ({self.mamba_n_groups})"
            )

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny(cls, **overrides: Any) -> HybridConfig:
        """A few-thousand-parameter model with every layer type, for tests and CPU demos."""
        base: dict[str, Any] = dict(
            layer_pattern="KGMA",
            vocab_size=64,
            hidden_size=32,
            chunk_size=8,
            linear_conv_kernel_dim=4,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            num_shared_experts=1,
            initializer_range=0.2,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def ling3_tiny(cls, **overrides: Any) -> HybridConfig:
        """Ling-3.0-tiny as in the HARTS paper's Table 1 (24 layers, 6 x (3 KDA + 1 MLA))."""
        base: dict[str, Any] = dict(
            layer_pattern="KKKM" * 6,
            vocab_size=157_184,
            hidden_size=1536,
            chunk_size=64,
            linear_conv_kernel_dim=4,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=128,
            q_lora_rank=768,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            mla_output_gate=True,
            intermediate_size=4608,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            first_k_dense_replace=1,
            num_shared_experts=1,
            router_score="sigmoid",
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            dtype="bfloat16",
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def preset(cls, name: str, *, layers: int | None = None, **overrides: Any) -> HybridConfig:
        """``HybridConfig.preset("qwen3_next_80b_a3b", layers=4)``: the preset ``name``
        (``PRESET_NAMES``) with field ``overrides``, cut to its first ``layers`` decoder layers
        when given (``first_layers``). UserError for an unknown name or ``layers`` outside 1 ..
        the depth."""
        key = preset_key(name)
        if key in MODEL_FIELDS:
            config = cls(**{**MODEL_FIELDS[key], **overrides})
        else:
            config = cls.tiny(**overrides) if key == "tiny" else cls.ling3_tiny(**overrides)
        return config if layers is None else config.first_layers(layers, name=key)

    def first_layers(self, layers: int, *, name: str = "the model", option: str = "layers") -> HybridConfig:
        """A copy with the first ``layers`` decoder layers: the layer pattern's prefix, and the
        dense prefix and MoE layers that fall inside it. Where no MoE layer is left every FFN is
        dense (``num_experts`` 0), as a transformers config of that depth converts.

        UserError naming ``option`` and ``name`` unless 1 <= ``layers`` <= the depth."""
        depth = self.num_hidden_layers
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= depth:
            raise UserError(f"{option} {layers!r}: {name} has {depth} decoder layers; use 1 .. {depth}")
        moe = any(self.is_moe_layer(i) for i in range(layers))
        return self.replace(
            layer_pattern=self.layer_pattern[:layers],
            ffn_pattern=self.ffn_pattern[:layers],
            first_k_dense_replace=min(self.first_k_dense_replace, layers) if moe else 0,
            num_experts=self.num_experts if moe else 0,
        )
