"""Peak memory of one training step, estimated before anything is built.

``estimate_memory(config, execution, capacity=T, ...)`` is a pure function of the model's
``HybridConfig``, its ``ExecutionConfig``, the microbatch capacity, the parameter dtype, the
optimizer and how many ranks shard the model's state. Its result names every term in bytes, per
rank, on the chosen device:

    runtime      the process itself on the CPU: torch and harts loaded (``CPU_RUNTIME_BYTES``)
    parameters   every parameter, in the parameter dtype, / shards
    gradients    one gradient per parameter (training), / shards, plus the largest parameter's
                 once more: a microbatch's gradient is made before it is added to the last one
    optimizer    AdamW's two moments per parameter (with ``optimizer``), / shards
    activations  what autograd keeps from the forward for the backward, summed over the layers:
                 rows x the bytes each layer keeps per row (below); a layer under activation
                 checkpointing keeps its input row and what ``recompute_skip`` keeps of its cores
    views        compact attention through gathered ancestor views (``attention="gather"``, which
                 ``"auto"`` is on the CPU, and on CUDA in half precision where FlashAttention-2's
                 varlen kernel takes every attention kind; ``harts.ops.attention.ancestor_view``): each branch's
                 K and V gathered over its ancestors and own rows, kept for the backward. The
                 views of a microbatch hold ``view_rows`` rows (about its semantic positions,
                 ``"S-sized"`` in ``harts.plan.layout``), of which ``activations`` counts the
                 ``capacity`` own rows; this term is the rest, in every attention layer that
                 keeps its core
    allocator    on the CPU, what the C allocator keeps of the forward's freed temporaries
                 (glibc's heap below its mmap threshold): ``CPU_ALLOCATOR_SLACK`` of the
                 activations
    backward     the backward's working set above the activations: the gradients a layer makes
                 while its saved tensors still live (``BACKWARD_FRACTION`` of them), its
                 recomputed forward too when it is checkpointed, at the layer where that peaks
                 (the layers after it in the model have freed theirs by then), and the gradients
                 of one attention layer's gathered views (their K and V, and their
                 concatenation), its recomputed views too when it is checkpointed
    lm_head      the LM head's logits: the chunked head (``mapped_logprobs``) holds one chunk of
                 R rows x V at a time (R from its budget, ``ExecutionConfig.lm_head_budget``),
                 in its compute dtype: a chunk and its exp in the eager forward, and in the
                 backward the recomputed chunk turned into d(logits) in place; on CUDA in half
                 precision the fused passes hold a chunk and its half-precision softmax or
                 gradient instead. Beside it the softmax of the chunks it keeps (the first ones
                 within the budget under ``keep_lm_head_probs=None``, all under True), the
                 float32 [V, D] weight-gradient accumulator and [rows, D] d(hidden) for half
                 weights. The plain head (trajectory mode's oracle) holds three [rows, V] tensors

``total`` is the peak: the other terms plus the larger of the two transient terms (``backward`` and ``lm_head`` never hold memory at the same time: the head's
backward ends before the layers' begins).

Bytes per row: each layer's count is the tensors its forward leaves for autograd, by width,
counted from the torch reference path that runs on the CPU (``harts.ops.linear_attn.chunk``:
its in-chunk decay products hold ``H x c x K`` per row with c = 16, the sub-block; the CPU flash
attention of ``harts.ops.attention.core`` holds q, k, v and the output padded to one head dim).
On CUDA the linear-attention core is fla-core's, which keeps its inputs, the in-chunk matrices and
the chunk states, and FlexAttention keeps q, k, v, the output and its logsumexp. The counts are
checked against measured peaks in ``tests/models/test_memory_estimate.py``.

Shapes of the terms: T rows (the capacity), V vocabulary, D hidden size, H heads, K / V head
dims, B linear-attention chunk, E experts, k experts per token, I intermediate sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harts.models.config import HybridConfig
from harts.models.execution.config import ExecutionConfig, flash_views_run
from harts.models.layers.registry import mixer_spec
from harts.ops.logprob.mapped import ROW_CHUNK, chunk_rows, head_budget

__all__ = [
    "BACKWARD_FRACTION",
    "CPU_ALLOCATOR_SLACK",
    "CPU_RUNTIME_BYTES",
    "DTYPE_BYTES",
    "TERMS",
    "MemoryEstimate",
    "estimate_memory",
    "format_bytes",
    "gathered_view_rows",
    "parameter_count",
]

#: bytes per element of each parameter dtype name
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}
#: resident memory of a process with torch and harts loaded and a model built, before any step
CPU_RUNTIME_BYTES = 380 * 2**20
#: the C allocator's heap keeps about this fraction of the activations more resident on the CPU
CPU_ALLOCATOR_SLACK = 0.2
#: a layer's backward makes gradients of about this fraction of its saved tensors before they go
BACKWARD_FRACTION = 0.75
#: every term ``MemoryEstimate.terms`` holds, in this order
TERMS = (
    "runtime",
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "views",
    "allocator",
    "backward",
    "lm_head",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """An estimate of one rank's peak memory (module docstring)."""

    #: bytes by term, every name of ``TERMS``
    terms: dict[str, int]
    #: "cpu" or "cuda": the device the terms are for
    device_type: str
    #: rows per microbatch the activations were counted at
    capacity: int
    #: parameters of the whole model (before sharding)
    parameters: int
    #: bytes per row each decoder layer keeps, in layer order (before checkpointing)
    layer_row_bytes: tuple[int, ...] = field(default=())

    @property
    def total(self) -> int:
        """The peak: every term but the two transient ones, and the larger of those."""
        t = self.terms
        return sum(t[n] for n in TERMS if n not in ("backward", "lm_head")) + max(t["backward"], t["lm_head"])

    @property
    def largest(self) -> tuple[str, int]:
        """(name, bytes) of the largest term."""
        name = max(TERMS, key=lambda n: self.terms[n])
        return name, self.terms[name]

    def summary(self, *, skip: int = 0, top: int | None = None) -> str:
        """The terms as ``name size`` pairs, largest first (zero terms left out), from the
        ``skip``-th largest, at most ``top`` of them."""
        ordered = sorted((n for n in TERMS if self.terms[n]), key=lambda n: -self.terms[n])
        chosen = ordered[skip:] if top is None else ordered[skip : skip + top]
        return ", ".join(f"{n} {format_bytes(self.terms[n])}" for n in chosen)


def format_bytes(n: float) -> str:
    """``n`` bytes as GiB (MiB below one GiB), e.g. "13.2 GiB"."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def estimate_memory(
    config: HybridConfig,
    execution: ExecutionConfig | None = None,
    *,
    capacity: int,
    device_type: str = "cpu",
    dtype: str | None = None,
    training: bool = True,
    optimizer: bool = True,
    shards: int = 1,
    logit_rows: int | None = None,
    device_total_bytes: int | None = None,
    frozen_base: bool = False,
    view_rows: int | None = None,
    models: int = 1,
) -> MemoryEstimate:
    """One rank's peak memory for a forward + backward of ``capacity`` rows (module docstring).

    Args:
        config: the model's architecture (its ``vocab_size`` the one it is built with).
        execution: how it runs (recomputation, which log-prob head, kept head softmax); None:
            ``ExecutionConfig()``.
        capacity: T, rows per microbatch (compact rows in compact mode, tokens in trajectory mode).
        device_type: "cpu" or "cuda" ("mps" counts as "cuda": no CPU reference kernels).
        dtype: parameter dtype name ("float32", "float64", "bfloat16"); None: ``config.dtype``.
        training: a backward runs (gradients, activations kept); False: forward only, no grad.
        optimizer: AdamW state is held (training runs; ``harts bench --optimizer``).
        shards: ranks the parameters, gradients and optimizer state are split over (FSDP).
        logit_rows: positions the LM head computes per microbatch; None: ``capacity``.
        device_total_bytes: the device's total memory, which sets the LM head's default budget on
            CUDA (``harts.ops.logprob.mapped.head_budget``: its chunk rows, and the chunks whose
            softmax it keeps in half precision under ``keep_lm_head_probs=None``); None: chunks
            of ``ROW_CHUNK`` rows, none kept unless ``lm_head_budget`` gives the budget.
        frozen_base: the model's weights are frozen (LoRA training): no gradient and no
            optimizer state for them (the adapters' own are left out: a small fraction).
        view_rows: K/V rows the gathered ancestor views of one compact microbatch hold (the
            sum over its branches of ancestor and own rows; ``gathered_view_rows`` estimates it
            from a step's compression); None: ``capacity`` (no shared ancestors). Counts only
            where those views are made (compact mode, attention "gather", or "auto" on the CPU).
        models: copies of the model held at once, each with its own parameters, gradients and
            optimizer state (a server's training engines; ``harts serve --max-models``); the
            microbatch's activations are counted once (one step runs at a time).

    Returns:
        ``MemoryEstimate`` with every term of ``TERMS``.
    """
    cfg = ExecutionConfig() if execution is None else execution
    dev = "cpu" if device_type == "cpu" else "cuda"
    e = DTYPE_BYTES[dtype or config.dtype]
    n_params = parameter_count(config)
    largest_param = config.vocab_size * config.hidden_size
    share = -(-n_params // max(1, shards))
    rows = capacity if training else 0
    depth = config.num_hidden_layers
    layer_rows = tuple(_layer_row_bytes(config, i, dev, e) for i in range(depth))
    # (a recompute_layers above the depth is the command's error to report, not the estimate's)
    n_ckpt = (
        0
        if not (training and cfg.recompute)
        else min(depth, depth if cfg.recompute_layers is None else cfg.recompute_layers)
    )
    kept_rows = [
        _checkpointed_row_bytes(config, i, dev, e, cfg, moe_rank=sum(map(config.is_moe_layer, range(i))))
        if i < n_ckpt
        else b
        for i, b in enumerate(layer_rows)
    ]
    kept = sum(kept_rows) + _head_row_bytes(config, e)
    # the backward runs the layers last to first, freeing each one's saved tensors after it: at
    # layer i, layers 0..i still hold theirs (a checkpointed layer its recomputed forward too)
    reach, before = 0.0, 0
    for i, b in enumerate(layer_rows):
        before += kept_rows[i]
        reach = max(reach, before + b * BACKWARD_FRACTION + (b if i < n_ckpt else 0) - sum(kept_rows))
    views, views_backward = _view_bytes(config, cfg, dev, e, n_ckpt, rows, view_rows)
    terms = {
        "runtime": CPU_RUNTIME_BYTES if dev == "cpu" else 0,
        "parameters": models * share * e,
        "gradients": models * (share + largest_param // max(1, shards)) * e if training and not frozen_base else 0,
        "optimizer": models * 2 * share * e if optimizer and not frozen_base else 0,
        "activations": rows * kept,
        "views": views,
        "allocator": int((rows * kept + views) * CPU_ALLOCATOR_SLACK) if dev == "cpu" else 0,
        "backward": int(rows * max(0.0, reach)) + views_backward,
        "lm_head": _lm_head_bytes(
            config, cfg, capacity if logit_rows is None else logit_rows, dev, e, device_total_bytes
        ),
    }
    return MemoryEstimate(
        terms=terms, device_type=dev, capacity=capacity, parameters=n_params, layer_row_bytes=layer_rows
    )


# ---------------------------------------------------------------------------------- parameters
def parameter_count(config: HybridConfig) -> int:
    """Parameters of ``HybridLM(config)``, counted from the config (no model is built): each
    mixer's from its spec (``harts.models.layers.registry``), a norm per block."""
    c, d = config, config.hidden_size
    total = c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + d  # embedding, head, final norm
    for i, letter in enumerate(c.layer_pattern):
        spec = mixer_spec(letter)
        if spec is not None:
            total += d + spec.parameters(c)
        if c.has_ffn(i):
            total += d + _ffn_params(c, i)
    return total


def _ffn_params(c: HybridConfig, i: int) -> int:
    d = c.hidden_size
    if not c.is_moe_layer(i):
        return (3 if c.hidden_act == "silu" else 2) * d * c.intermediate_size
    shared_i = c.shared_expert_intermediate_size or c.moe_intermediate_size
    mats = 3 if c.hidden_act == "silu" else 2  # relu2: no gate projection
    shared = c.num_shared_experts * mats * d * shared_i + (d if c.shared_expert_gate and c.num_shared_experts else 0)
    return c.num_experts * d + c.num_experts * mats * d * c.moe_intermediate_size + shared


# --------------------------------------------------------------------------------- activations
def _layer_row_bytes(c: HybridConfig, i: int, dev: str, e: int) -> int:
    """Bytes one decoder layer keeps for the backward per row: its norms, its mixer (the core in
    the compute dtype, at least float32 on the CPU; counted by the mixer's spec) and its FFN."""
    d, spec = c.hidden_size, mixer_spec(c.layer_pattern[i])
    cdt = max(e, 4) if dev == "cpu" else e
    outside, core = spec.row_elements(c, dev) if spec is not None else (0.0, 0.0)
    norms = d * ((spec is not None) + c.has_ffn(i)) + 1
    ffn = _ffn_row_elements(c, i) if c.has_ffn(i) else 0
    return int((norms + outside + ffn) * e + core * cdt)


def _checkpointed_row_bytes(c: HybridConfig, i: int, dev: str, e: int, cfg: ExecutionConfig, moe_rank: int) -> int:
    """Bytes a checkpointed layer keeps per row: its input, and what ``recompute_skip`` keeps of
    its cores (a skipped attention or linear-attention core its saved tensors, a skipped MoE
    block its output, its routed experts' inputs and routing, and with ``moe_keep_gate_up`` the
    first MoE layers their experts' gate/up output)."""
    d, spec = c.hidden_size, mixer_spec(c.layer_pattern[i])
    cdt = max(e, 4) if dev == "cpu" else e
    kept = d * e
    if spec is not None and spec.core_region in cfg.recompute_skip:
        kept += int(spec.row_elements(c, dev)[1] * cdt)
    if "moe" in cfg.recompute_skip and c.is_moe_layer(i):
        k = c.num_experts_per_tok
        kept += (k * d + d + 2 * c.num_experts + 6 * k) * e
        if moe_rank < cfg.moe_keep_gate_up:
            kept += 2 * k * c.moe_intermediate_size * e
    return kept


def _ffn_row_elements(c: HybridConfig, i: int) -> float:
    d = c.hidden_size
    if not c.is_moe_layer(i):  # SwiGLU: gate, up, their product, silu; relu2: up, relu, its square
        return (4 if c.hidden_act == "silu" else 3) * c.intermediate_size + d
    k, shared_i = c.num_experts_per_tok, c.shared_expert_intermediate_size or c.moe_intermediate_size
    routed = k * d + 5 * k * c.moe_intermediate_size + 6 * k
    return routed + d + 4 * c.num_shared_experts * shared_i + 2 * c.num_experts + 8


def gathered_view_rows(capacity: int, compression: float) -> int:
    """The K/V rows of a compact microbatch's gathered ancestor views (``view_rows``) at
    ``capacity`` compact rows and ``compression`` semantic / compact positions of its step: a
    branch's view is its trajectory's positions up to its last row, so the views together hold
    about the microbatch's semantic positions."""
    return int(capacity * max(1.0, compression))


def _view_bytes(
    c: HybridConfig, cfg: ExecutionConfig, dev: str, e: int, n_ckpt: int, rows: int, view_rows: int | None
) -> tuple[int, int]:
    """(kept, backward) bytes of the gathered ancestor views beyond each branch's own rows
    (module docstring, ``views``); zero where no view is gathered."""
    # "auto" gathers on CUDA where FlashAttention-2 takes every attention kind (half precision here)
    auto_gathers = dev == "cpu" or flash_views_run(
        c.attention_head_dims, torch.device("cuda"), torch.bfloat16 if e == 2 else torch.float32
    )
    gathers = cfg.mode == "compact" and (cfg.attention == "gather" or (cfg.attention == "auto" and auto_gathers))
    extra = max(0, (view_rows or rows) - rows) if rows else 0
    if not (gathers and extra):
        return 0, 0
    cdt = max(e, 4) if dev == "cpu" else e
    kept, backward = 0, 0
    for i, letter in enumerate(c.layer_pattern):
        spec = mixer_spec(letter)
        if spec is None or spec.family == "linear":
            continue
        layer = extra * spec.view_row_elements(c, dev) * cdt
        keeps = i >= n_ckpt or "attention" in cfg.recompute_skip
        kept += layer if keeps else 0
        # its backward: d(K), d(V) of the views and their concatenation; recomputed views beside
        backward = max(backward, 2 * layer + (0 if keeps else layer))
    return kept, backward


def _head_row_bytes(c: HybridConfig, e: int) -> int:
    """The final norm and the head's input per row, and the head's int64 index plan."""
    return (3 * c.hidden_size + 4) * e + 6 * 8


# ------------------------------------------------------------------------------------- LM head
def _lm_head_bytes(c: HybridConfig, cfg: ExecutionConfig, n: int, dev: str, e: int, device_total: int | None) -> int:
    """The LM head's transient bytes for ``n`` positions (module docstring)."""
    v, d = c.vocab_size, c.hidden_size
    cdt = 8 if e == 8 else 4
    if not cfg.use_fused_logprobs:  # logits, their log_softmax and its gradient
        return 3 * n * v * cdt
    budget = head_budget(dev, device_total) if cfg.lm_head_budget is None else cfg.lm_head_budget
    chunk = min(ROW_CHUNK if budget is None else chunk_rows(v, cdt, budget, ROW_CHUNK), max(n, 1))
    half = dev == "cuda" and e == 2
    # a chunk of float32 logits and, on CUDA in half precision, its half softmax (forward) or
    # d(logits) (backward) from the fused passes; elsewhere logsumexp's exp of it (eager forward)
    held = chunk * v * (cdt + e if half else 2 * cdt)
    if half:
        # the float32 weight-gradient accumulator beside the half gradient, and d(hidden)
        held += v * d * 4 + n * d * cdt
    # the kept softmax, in the GEMM dtype: the first chunks whose softmax fits in the budget
    # (``kept_chunks``; by default only in half precision on CUDA), or all of them
    kept_item = e if half else cdt
    if cfg.keep_lm_head_probs is None:
        fit = budget // (v * kept_item) if half and budget is not None else 0
        kept_rows = n if fit >= n else fit // chunk * chunk
    else:
        kept_rows = n if cfg.keep_lm_head_probs else 0
    return int(held + kept_rows * v * kept_item)
