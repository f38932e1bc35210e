"""External anchor for the trajectory-wise baseline: transformers' own ``BailingHybridForCausalLM``
forward + backward on the baseline's packed microbatches, beside harts' trajectory mode.

    python -m benchmarks.modules.hf_anchor [--model ling3_tiny] [--pattern KKKM] [--workload medium] [--step 0]
        [--capacity 65536] [--microbatches N] [--device cuda] [--dtype bfloat16] [--recompute]
        [--repeat R] [--json FILE] [--overwrite]

What runs (same weights on both sides):

1. The preset's dimensions (``--model``, ``--pattern``, the workload's vocabulary) are written as a
   transformers ``BailingHybridConfig``; the harts model is built from that config through the
   BailingHybrid adapter (``harts.integrations.hf.bailing_hybrid``), so both models mean the same
   architecture, exported with ``save_hf_checkpoint`` and loaded with ``from_pretrained``. The harts
   presets are not BailingHybrid as they stand (``ling3_tiny``: low-rank KDA gates, no safe gate,
   an MLA output gate per channel instead of per head, RoPE not interleaved, MLA latent-norm eps);
   the fields the conversion changes are printed and written to the JSON (``changed_fields``):
   the harts side here is that converted model, not the preset ``harts bench`` runs.
2. The baseline's microbatches exactly as ``harts bench`` makes them
   (``plan_trajectory_step(batch.lengths, dp=1, capacity=T)``, the first ``--microbatches``);
   each runs as ONE packed row of its raw tokens through each model.
3. transformers keeps the trajectories of a row apart through ``position_ids`` restarting at
   0 in every trajectory (its causal-mask builder turns them into a document-causal mask for the
   MLA layers: ``masking_utils.find_packed_sequence_indices``) and a ``cu_seqlens`` keyword that
   BailingHybrid forwards to its KDA core and its short convolution. transformers honours
   ``cu_seqlens`` only through external kernels: fla-core's ``chunk_kda`` for the core, the
   ``causal-conv1d`` CUDA package for the convolution; its PyTorch fallbacks refuse packed rows
   (``ValueError``). Here (``packed_kernels``): on CUDA the core is transformers' own fla-core
   path and the convolution fla-core's varlen ``causal_conv1d`` (``causal-conv1d`` is a compiled
   CUDA extension the GPU machine does not have); on CPU both are transformers' own PyTorch
   references run once per trajectory. The JSON names the implementation of each.
4. Timing: forward + backward of the sum of the target log-probs, per side, after one untimed
   warm-up microbatch, CUDA-synchronized wall time over the ``--microbatches`` microbatches,
   ``--repeat`` times (the best counts). harts: ``ExecutionConfig(mode="trajectory", recompute, attention,
   linear_attention_backend, fused_logprobs=True)``, as ``harts bench``. transformers: its model
   body (``model.model``) in training mode, gradient checkpointing (``use_reentrant=False``) with
   ``--recompute``. Its own loss path would materialize [T, V] logits (20 GiB at T = 65,536,
   V = 157,184 in bf16), so its log-probs come from its last hidden state and its ``lm_head``
   weight through harts' chunked ``mapped_logprobs``: the comparison is of the model bodies
   with the same head. MoE experts: ``--experts auto`` is transformers' default choice
   (``grouped_mm`` where it can dispatch, else ``eager``); the one used is reported. Attention:
   ``--attn auto`` is ``sdpa``, under the dense [1, 1, T, T] packed mask transformers builds
   (4 GiB of bool at T = 65,536): transformers 5.24 refuses ``flex_attention`` for BailingHybrid
   ("does not support an attention implementation through torch's flex_attention"), and
   ``flash_attention_2`` (which would take ``position_ids`` as varlen boundaries) needs flash-attn,
   which the H200 machine lacks. harts' attention on CUDA is FlexAttention: the anchor's MLA
   layers are at a kernel disadvantage, to be read with the per-side figures. Both models stay
   on the device together, so each side's peak memory includes the other's weights.
   In bfloat16 transformers keeps the router, its correction bias, the conv weight, ``A_log`` and
   ``dt_bias`` in float32 (``_keep_in_fp32_modules_strict``; same values, upcast), and casts the
   KDA log-decay to bfloat16 before the core: the agreement figure (5.) then measures bf16
   rounding, not a different model.
5. Agreement: the warm-up microbatch's log-probs of both sides, |difference|: max, 99.9th percentile
   and mean (reported).

On the H200 (no registry access; transformers 5.17 there has no ``bailing_hybrid``: its wheel
has no ``transformers/models/bailing_hybrid``; 5.24.0 is what this was written and tested
against). transformers is pure Python; carry its wheel with fla-core's::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 -d .whl transformers==5.24.0 fla-core==0.6.0
    # there: 5.24 checks huggingface-hub >= 1.31 and tokenizers 0.23.x at import (5.17 needs hub >= 1.5
    # and the same tokenizers): python3 -c "import huggingface_hub as h; print(h.__version__)"; if older,
    # add huggingface-hub==1.31.0 to the download (pure Python; its own requirements then apply)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python -m benchmarks.modules.hf_anchor --model ling3_tiny --pattern KKKM --workload medium --step 0 \\
        --microbatches 4 --device cuda --dtype bfloat16 --recompute --repeat 2 --json out/hf_anchor.json

Shapes: T raw tokens of one packed microbatch, D model dim, V vocabulary, n = T - trajectories.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from benchmarks._runner import (
    add_dtype_argument,
    add_json_argument,
    device_of,
    parse,
    parser,
    run,
    sync,
    write_json,
)
from harts.errors import UserError

if TYPE_CHECKING:
    import torch

    from harts.models.config import HybridConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.tree.batch import RolloutBatch

__all__ = [
    "bailing_hybrid_config",
    "bailing_hybrid_pair",
    "build_anchor_models",
    "hf_packed_logprobs",
    "main",
    "packed_kernels",
]

#: transformers version this was written and tested against (5.17 has no bailing_hybrid)
TESTED_TRANSFORMERS = "5.24.0"


def _transformers() -> Any:
    """transformers with ``BailingHybridForCausalLM``, or a UserError saying what to install."""
    try:
        import transformers
    except ImportError:
        raise UserError(
            "hf_anchor needs transformers (pip install 'harts[hf]'; a GPU machine without a registry: "
            f"carry the transformers=={TESTED_TRANSFORMERS} wheel, see the module docstring)"
        ) from None
    if not hasattr(transformers, "BailingHybridForCausalLM"):
        raise UserError(
            f"transformers {transformers.__version__} has no BailingHybridForCausalLM (5.17 lacks it); "
            f"install transformers=={TESTED_TRANSFORMERS} (a pure-Python wheel, see the module docstring)"
        )
    return transformers


def bailing_hybrid_config(cfg: HybridConfig) -> dict[str, Any]:
    """A ``BailingHybridConfig`` dict with the dimensions of ``cfg`` (K/M layers only).

    BailingHybrid ties the KDA head count to the attention heads' (q, k and v alike), so the KDA
    layers get ``num_attention_heads`` heads of ``linear_key_head_dim``; semantics flags (gate
    forms, RoPE layout) are BailingHybrid's whatever ``cfg`` says. ``build_anchor_models`` reports
    every field that differs from ``cfg`` (``ling3_tiny``'s head counts already agree). A pattern
    with other layers than K and M, or different KDA key and value head dims, is a UserError.
    """
    bad = sorted(set(cfg.layer_pattern) - {"K", "M"})
    if bad:
        raise UserError(f"--pattern {cfg.layer_pattern}: BailingHybrid has KDA (K) and MLA (M) layers only, not {bad}")
    if cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        raise UserError(
            f"BailingHybrid's KDA key and value head dims are one field: {cfg.linear_key_head_dim} != "
            f"{cfg.linear_value_head_dim}"
        )
    if cfg.router_score != "sigmoid" or cfg.shared_expert_gate or cfg.norm_unit_offset:
        raise UserError("BailingHybrid routes by sigmoid scores, with ungated shared experts and plain RMSNorm weights")
    layers = cfg.num_hidden_layers
    return dict(
        model_type="bailing_hybrid",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=cfg.num_shared_experts,
        routed_scaling_factor=cfg.routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        num_experts_per_tok=cfg.num_experts_per_tok,
        num_local_experts=max(cfg.num_experts, 1),
        first_k_dense_replace=cfg.first_k_dense_replace,
        mlp_layer_types=["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(layers)],
        norm_topk_prob=cfg.norm_topk_prob,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        num_mtp_layers=0,
        head_dim=cfg.linear_key_head_dim,
        short_conv_kernel_size=cfg.linear_conv_kernel_dim,
        kda_safe_gate=True,
        kda_lower_bound=cfg.kda_lower_bound,
        layer_types=["full_attention" if c == "M" else "linear_attention" for c in cfg.layer_pattern],
        pad_token_id=None,
        eos_token_id=None,
        use_cache=False,
    )


def bailing_hybrid_pair(preset: HybridConfig) -> tuple[Any, HybridConfig]:
    """(``BailingHybridConfig``, the harts config the BailingHybrid adapter reads from it):
    ``preset``'s dimensions in BailingHybrid semantics, harts-only fields kept."""
    from harts.integrations.hf.api import adapter_for

    hf_config = _transformers().BailingHybridConfig(**bailing_hybrid_config(preset))
    cfg = adapter_for("bailing_hybrid").config_from_hf(
        hf_config, chunk_size=preset.chunk_size, dtype=preset.dtype, initializer_range=preset.initializer_range
    )
    return hf_config, cfg


def build_anchor_models(
    preset: HybridConfig,
    *,
    device: str,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    experts_implementation: str | None = None,
) -> tuple[HybridLM, Any, dict[str, Any]]:
    """(harts model, transformers ``BailingHybridForCausalLM``, info) with the same weights on
    ``device``: ``preset``'s dimensions in BailingHybrid semantics (module docstring, step 1).
    ``info["changed_fields"]``: {field: [preset value, value run]} where the two differ."""
    import torch

    from harts.integrations.hf.api import save_hf_checkpoint
    from harts.models.hybrid_lm import HybridLM

    transformers = _transformers()
    transformers.utils.logging.disable_progress_bar()
    hf_config, cfg = bailing_hybrid_pair(preset)
    # fields of gated-GQA (A) layers mean nothing here: BailingHybrid has none
    changed = {
        k: [v, getattr(cfg, k)]
        for k, v in preset.to_dict().items()
        if getattr(cfg, k) != v and k not in ("head_dim", "partial_rotary_factor", "attn_output_gate")
    }
    torch.manual_seed(seed)
    model = HybridLM(cfg, seed=seed).to(device)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(model, tmp, hf_config=hf_config.to_dict())
        hf = transformers.BailingHybridForCausalLM.from_pretrained(
            tmp,
            dtype=cfg.torch_dtype(),
            attn_implementation=attn_implementation,
            experts_implementation=experts_implementation,
        ).to(device)
    info = {
        "transformers_version": transformers.__version__,
        "attn_implementation": hf.config._attn_implementation,
        "experts_implementation": hf.config._experts_implementation,
        "changed_fields": changed,
        "parameters": {"harts": model.num_parameters(), "transformers": sum(p.numel() for p in hf.parameters())},
    }
    return model, hf, info


def _segments(cu_seqlens: torch.Tensor | None, total: int) -> list[tuple[int, int]]:
    bounds = [0, total] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    return list(zip(bounds[:-1], bounds[1:]))


@contextlib.contextmanager
def packed_kernels(device: torch.device, *, fla: bool | None = None) -> Iterator[dict[str, str]]:
    """Within: BailingHybrid's KDA core and short convolution keep the trajectories of a packed
    row apart (module docstring, step 3); yields which implementation runs each.

    ``fla`` (default: on CUDA) takes fla-core's kernels (transformers binds its ``chunk_kda``
    when fla-core was importable at its import); otherwise transformers' PyTorch references run
    once per trajectory."""
    import torch
    import transformers.models.bailing_hybrid.modeling_bailing_hybrid as mod

    saved = {"chunk": mod.chunk_kimi_delta_attention, "conv": mod.causal_conv1d_fn}
    ref_chunk, ref_conv = inspect.unwrap(saved["chunk"]), inspect.unwrap(saved["conv"])

    def chunk_per_trajectory(q, k, v, g, beta, cu_seqlens=None, **kw):  # noqa: ANN001, ANN202
        # [1, T, H, K] inputs; transformers' reference recurrence once per trajectory, zero state
        parts = [
            ref_chunk(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], **kw)[0]
            for a, b in _segments(cu_seqlens, q.shape[1])
        ]
        return torch.cat(parts, dim=1), None

    def conv_per_trajectory(x, weight, bias=None, activation=None, cu_seqlens=None, **kw):  # noqa: ANN001, ANN202
        # [1, C, T] channels-first, as transformers calls it
        parts = [ref_conv(x[..., a:b], weight, bias, activation) for a, b in _segments(cu_seqlens, x.shape[-1])]
        return torch.cat(parts, dim=-1)

    def conv_fla(x, weight, bias=None, activation=None, cu_seqlens=None, **kw):  # noqa: ANN001, ANN202
        from fla.modules.causal_conv1d import causal_conv1d

        # fla takes [B, T, C]; float32 like transformers' reference (its conv weight stays float32)
        y, _ = causal_conv1d(
            x.transpose(1, 2).float(), weight=weight.float(), bias=bias, activation=activation, cu_seqlens=cu_seqlens
        )
        return y.transpose(1, 2).to(x.dtype)

    if device.type == "cuda" if fla is None else fla:
        if importlib.util.find_spec("fla") is None:
            raise UserError(
                f"--device {device}: fla-core is not importable; transformers' BailingHybrid would run its PyTorch KDA "
                "reference, which refuses packed rows (carry the fla-core wheel, see the module docstring)"
            )
        from importlib.metadata import PackageNotFoundError, version

        try:
            fla_core = version("fla-core")
        except PackageNotFoundError:  # importable from a source tree
            fla_core = "(version unknown)"
        used = {
            "kda_core": f"transformers -> fla-core {fla_core} chunk_kda (cu_seqlens)",
            "conv": f"fla-core {fla_core} causal_conv1d (varlen)",
        }
        mod.causal_conv1d_fn = conv_fla
    else:
        used = {
            "kda_core": "transformers' PyTorch chunk_kimi_delta_attention, once per trajectory",
            "conv": "transformers' PyTorch causal_conv1d_fn, once per trajectory",
        }
        mod.chunk_kimi_delta_attention, mod.causal_conv1d_fn = chunk_per_trajectory, conv_per_trajectory
    try:
        yield used
    finally:
        mod.chunk_kimi_delta_attention, mod.causal_conv1d_fn = saved["chunk"], saved["conv"]


def hf_packed_logprobs(hf: Any, sub: RolloutBatch) -> torch.Tensor:
    """[n] next-token log-probs of ``sub`` run as one packed row through transformers' model
    body (inside ``packed_kernels``), head by ``mapped_logprobs``; n = T - trajectories, in
    ``RolloutBatch`` log-prob order (what harts' ``ModelOutput.logprobs`` holds)."""
    import numpy as np
    import torch

    from harts.ops.logprob import mapped_logprobs

    device = hf.lm_head.weight.device
    ids_1T = torch.as_tensor(sub.tokens, device=device)[None]
    pos_1T = torch.as_tensor(np.concatenate([np.arange(n) for n in sub.lengths]), device=device)[None]
    cu = torch.as_tensor(sub.offsets, dtype=torch.int64, device=device)
    h_TD = hf.model(input_ids=ids_1T, position_ids=pos_1T, cu_seqlens=cu, use_cache=False).last_hidden_state[0]
    rows = torch.as_tensor(sub.predicting_positions())
    targets = torch.as_tensor(sub.next_token_targets())
    return mapped_logprobs(h_TD, hf.lm_head.weight, rows, targets)


def _time_side(
    step: Callable[[RolloutBatch], torch.Tensor],
    subs: list[RolloutBatch],
    zero_grad: Callable[[], None],
    device: torch.device,
    repeat: int,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """(warm-up log-probs, timings): ``step`` does forward + backward of one microbatch and
    returns its log-probs; untimed on ``subs[0]``, then ``repeat`` timed passes over ``subs``."""
    import torch

    logprobs = step(subs[0]).detach()
    zero_grad()
    seconds, peak = [], None
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        for sub in subs:
            step(sub)
        sync(device)
        seconds.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) / 2**30
        zero_grad()
    tokens = sum(s.num_tokens for s in subs)
    best = min(seconds)
    return logprobs, {
        "seconds": [round(s, 4) for s in seconds],
        "best_seconds": round(best, 4),
        "tokens_per_second": round(tokens / max(best, 1e-12), 1),
        "peak_memory_gb": None if peak is None else round(peak, 3),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build both models, run the anchor, return every figure (``main`` prints and writes them)."""
    import torch

    from harts.models.config import HybridConfig
    from harts.models.execution.config import ExecutionConfig
    from harts.plan.baselines.trajectory_plan import plan_trajectory_step
    from harts.tree.workloads import load_workload

    _transformers()
    device = device_of(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch = load_workload(args.workload, step=args.step, seed=args.seed)
    vocab = max(int(batch.tokens.max()) + 1, batch.vocab_size or 0)
    try:
        preset = HybridConfig.preset(args.model, vocab_size=vocab, dtype=args.dtype, layer_pattern=args.pattern)
        plan = plan_trajectory_step(batch.lengths, dp=1, capacity=args.capacity)
    except ValueError as err:
        raise UserError(str(err)) from None
    groups = plan.microbatches[: args.microbatches] if args.microbatches else plan.microbatches
    subs = [batch.select(g) for g in groups]
    attn = "sdpa" if args.attn == "auto" else args.attn
    experts = None if args.experts == "auto" else args.experts
    model, hf, info = build_anchor_models(
        preset, device=args.device, seed=args.seed, attn_implementation=attn, experts_implementation=experts
    )
    hf.train()
    if args.recompute:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    execution = ExecutionConfig(
        mode="trajectory",
        recompute=args.recompute,
        attention=args.attention,
        linear_attention_backend=args.la_backend,
        fused_logprobs=True,
    )

    def harts_step(sub: RolloutBatch) -> torch.Tensor:
        lp = model(sub, execution).logprobs
        lp.sum().backward()
        return lp

    def hf_step(sub: RolloutBatch) -> torch.Tensor:
        lp = hf_packed_logprobs(hf, sub)
        lp.sum().backward()
        return lp

    with packed_kernels(device) as kernels:
        harts_lp, harts_t = _time_side(harts_step, subs, lambda: model.zero_grad(set_to_none=True), device, args.repeat)
        try:
            hf_lp, hf_t = _time_side(hf_step, subs, lambda: hf.zero_grad(set_to_none=True), device, args.repeat)
        except ValueError as err:
            # transformers' PyTorch fallbacks refuse cu_seqlens: fla-core failed to import there
            if "packed sequences" not in str(err):
                raise
            raise UserError(f"transformers: {err}") from None
    return {
        "model": args.model,
        "pattern": preset.layer_pattern,
        "workload": args.workload,
        "step": args.step,
        "capacity": args.capacity,
        "device": str(device),
        "dtype": args.dtype,
        "recompute": args.recompute,
        "microbatches": len(subs),
        "microbatches_in_step": len(plan.microbatches),
        "trajectories": sum(s.num_trajectories for s in subs),
        "raw_tokens": sum(s.num_tokens for s in subs),
        **info,
        **kernels,
        "harts_execution": {"attention": args.attention, "la_backend": args.la_backend, "fused_logprobs": True},
        **_agreement(harts_lp, hf_lp),
        "harts": harts_t,
        "transformers": hf_t,
        "harts_over_transformers_speed": round(hf_t["best_seconds"] / max(harts_t["best_seconds"], 1e-12), 4),
    }


def _agreement(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """|a - b| of two sides' log-probs [n]: its max, mean and 99.9th percentile (in bf16 a few
    tokens whose router choice flips can dominate the max; the percentile says how few)."""
    import numpy as np

    d = (a.double() - b.double()).abs().cpu().numpy()
    if d.size == 0:
        d = np.zeros(1)
    return {
        "warmup_max_abs_logprob_diff": float(d.max()),
        "warmup_mean_abs_logprob_diff": float(d.mean()),
        "warmup_p999_abs_logprob_diff": float(np.percentile(d, 99.9)),
    }


def _parser() -> argparse.ArgumentParser:
    p = parser(__doc__, __file__)
    p.add_argument("--model", default="ling3_tiny", help="harts preset whose dimensions both models take")
    p.add_argument("--pattern", default="KKKM", help="layer pattern (K and M only)")
    p.add_argument("--workload", default="medium", help="workload preset or batch file")
    p.add_argument("--step", type=int, default=0, help="workload step")
    p.add_argument("--seed", type=int, default=0, help="workload and model-init seed")
    p.add_argument("--capacity", type=int, default=65_536, help="baseline microbatch capacity T (raw tokens)")
    p.add_argument("--microbatches", type=int, default=4, help="time the first N microbatches (0: all)")
    p.add_argument("--device", default="cuda")
    add_dtype_argument(p, ["float32", "float64", "bfloat16"], "bfloat16")
    p.add_argument("--recompute", action="store_true", help="recompute layers in backward, both sides")
    p.add_argument("--repeat", type=int, default=2, help="timed passes per side (the best counts)")
    p.add_argument("--attention", default="auto", choices=["auto", "gather", "mask"], help="harts' full attention")
    p.add_argument("--la-backend", default="auto", choices=["reference", "fla", "tree", "auto"], help="harts' KDA core")
    p.add_argument(
        "--attn", default="auto", help="transformers attn_implementation (auto: sdpa; see the module docstring)"
    )
    p.add_argument("--experts", default="auto", choices=["auto", "grouped_mm", "batched_mm", "eager"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    add_json_argument(p, overwrite=True)
    return p


def _print(r: dict[str, Any]) -> None:
    from harts.commands._table import format_table

    print(
        f"{r['model']} ({r['pattern']}) {r['dtype']} on {r['device']}, recompute {'on' if r['recompute'] else 'off'}: "
        f"{r['microbatches']} of {r['microbatches_in_step']} microbatches, {r['raw_tokens']:,} raw tokens; "
        f"transformers {r['transformers_version']} ({r['attn_implementation']}, experts {r['experts_implementation']})"
    )
    if r["changed_fields"]:
        print(f"BailingHybrid semantics in place of the preset's: {r['changed_fields']}")
    print(f"packed rows: KDA core {r['kda_core']}; conv {r['conv']}")
    rows = [
        [name, " ".join(f"{s:.3f}" for s in t["seconds"]), f"{t['best_seconds']:.3f}", f"{t['tokens_per_second']:,.0f}"]
        + [t["peak_memory_gb"] if t["peak_memory_gb"] is not None else "n/a"]
        for name, t in (("harts trajectory", r["harts"]), ("transformers", r["transformers"]))
    ]
    print(format_table(["side", "seconds per pass", "best s", "tokens/s", "peak GiB"], rows))
    print(
        f"harts trajectory mode is {r['harts_over_transformers_speed']:.2f}x transformers' speed; "
        f"warm-up log-probs |difference|: max {r['warmup_max_abs_logprob_diff']:.3g}, "
        f"99.9th percentile {r['warmup_p999_abs_logprob_diff']:.3g}, mean {r['warmup_mean_abs_logprob_diff']:.3g}"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(_parser(), argv)
        for name in ("capacity", "repeat"):
            if getattr(args, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
        if args.microbatches < 0:
            raise UserError(f"--microbatches must be >= 0, got {args.microbatches}")
        result = measure(args)
    except UserError as err:
        print(f"harts: error: {err}", file=sys.stderr)
        return 2
    _print(result)
    write_json(args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
