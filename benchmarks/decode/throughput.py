"""Decode throughput: harts' batched decoder beside the reference decoder and transformers'
``generate`` on the same weights, against the memory-bandwidth bound, with prefill MFU.

    python -m benchmarks.decode.throughput [--preset qwen3_5_9b] [--layers N] [--prompt 2048]
        [--new 512] [--batch 1 16 64 256] [--reference-max-batch 16] [--agreement-batch 4]
        [--cuda-graphs] [--no-hf] [--override FIELD=VALUE] [--device cuda] [--dtype bfloat16] [--json FILE]

Per batch size B (B prompts of ``--prompt`` random tokens, ``--new`` sampled tokens each at
temperature 1, no stop token, so every sequence decodes the full length):

    prefill          ``FastDecoder.extend`` of the B prompts (the chunked kernels); MFU =
                     2 x active matmul parameters x B x prompt / seconds / the card's bf16 peak
    harts decode     ``FastDecoding`` steps (one forward per token for all B), tokens/s = B x new / s;
                     with ``--cuda-graphs`` also the steps captured in CUDA graphs (``harts.rollout.graphs``)
    reference        ``harts.rollout.decode`` + ``generate`` (up to ``--reference-max-batch``)
    transformers ``generate`` (``min_new_tokens`` = ``max_new_tokens`` = new) of the transformers
                     model the harts one is converted from (``from_hf``: the same weights), for a
                     Qwen3.5 dense text shape; any other preset reports why it did not run
    bound            tokens/s if a step only read memory at the card's copy bandwidth:
                     bytes per step = parameter bytes + B x (linear-attention state + conv
                     state bytes per sequence + KV bytes per token x (prompt + new / 2))
                     bound = B / (bytes per step / copy bandwidth); copy bandwidth = 2 x bytes
                     of a 1 GiB (CPU: 64 MiB) copy / its median seconds

Weights are random (transformers' or ``HybridLM``'s initialization): speed does not depend on them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks._runner import (
    add_device_argument,
    add_dtype_argument,
    add_json_argument,
    device_of,
    dtype_of,
    median_seconds,
    parse,
    parser,
    run,
    sync,
    write_json,
)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, 5)
    return 2 * n / seconds


def cache_bytes(model: Any, batch: int, length: float) -> float:
    """Bytes of every sequence's caches a decode step reads: recurrent + conv states per
    sequence, keys and values per token, at ``length`` tokens (the module docstring)."""
    from harts.rollout.fast import FastDecoder

    probe = FastDecoder(model)
    (seq,) = probe.open()
    probe.extend([seq], [[0, 1]])
    per_seq = per_token = 0.0
    for cache in probe.cache.layers.values():
        for name, t in cache.items():
            row = t[0].numel() * t.element_size()
            if name in ("k", "v"):
                per_token += row
            else:
                per_seq += row
    return batch * (per_seq + per_token * length)


def harts_rows(
    model: Any, prompts: torch.Tensor, new: int, device: torch.device, graphs: bool = False
) -> dict[str, float]:
    """Prefill seconds and decode seconds of the batched decoder (``graphs``: its steps in CUDA
    graphs)."""
    from harts.rollout.fast import DecodeBatch, FastDecoder, FastDecoding
    from harts.rollout.sampler import SamplingConfig

    decoder = FastDecoder(model, cuda_graphs=graphs)
    ids = decoder.open(prompts.shape[0])
    sync(device)
    t0 = time.perf_counter()
    decoder.extend(ids, prompts.tolist())
    sync(device)
    t1 = time.perf_counter()
    batch = DecodeBatch(decoder)
    gen = torch.Generator(device).manual_seed(0)
    batch.add(FastDecoding(decoder, ids, SamplingConfig(max_tokens=new)), gen)
    while batch.jobs:
        batch.step()
    sync(device)
    return {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1}


def reference_seconds(model: Any, prompts: torch.Tensor, new: int, device: torch.device) -> float:
    """Decode seconds of the reference decoder (prompt excluded)."""
    from harts.rollout.decode import extend, new_branch
    from harts.rollout.sampler import SamplingConfig, generate

    branches = extend(model, [new_branch(model)] * prompts.shape[0], prompts.tolist())
    sync(device)
    t0 = time.perf_counter()
    generate(model, branches, SamplingConfig(max_tokens=new), torch.Generator().manual_seed(0))
    sync(device)
    return time.perf_counter() - t0


def qwen3_5_text_config(config: Any) -> Any:
    """transformers' ``Qwen3_5TextConfig`` of a harts config of Qwen3.5's dense text shape
    (G and A layers only); mrope's sections reduce to plain RoPE for text positions."""
    import transformers

    rotary_half = int(config.head_dim * config.partial_rotary_factor) // 2
    sections = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    return transformers.Qwen3_5TextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=len(config.layer_pattern),
        layer_types=["linear_attention" if c == "G" else "full_attention" for c in config.layer_pattern],
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
            "mrope_section": sections,
            "mrope_interleaved": True,
        },
    )


def build_models(config: Any, device: torch.device, dtype: torch.dtype, hf: bool) -> tuple[Any, Any, str | None]:
    """(harts model, transformers model or None, why transformers does not run or None). A
    Qwen3.5 dense text shape is built by transformers and converted (``from_hf``: the same
    weights); any other preset is harts' alone."""
    from harts.models.hybrid_lm import HybridLM

    torch.manual_seed(0)
    dense_qwen = set(config.layer_pattern) <= {"G", "A"} and not config.num_experts
    if hf and dense_qwen:
        from transformers import AutoModelForCausalLM

        from harts.integrations.hf import from_hf

        hf_cfg = qwen3_5_text_config(config)
        with torch.device(device):
            hf_model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
        model = from_hf(hf_model, device=device, chunk_size=config.chunk_size).eval()
        return model, hf_model, None
    with torch.device(device):
        model = HybridLM(config).to(dtype).eval()
    why = "--no-hf" if not hf else f"not a Qwen3.5 dense text shape (layer pattern {config.layer_pattern})"
    return model, None, why


def hf_seconds(hf_model: Any, prompts: torch.Tensor, new: int, device: torch.device) -> float:
    """Seconds of transformers' ``generate`` (prompt included: it has no separate prefill call)."""
    with torch.no_grad():  # untimed first, as harts' rows
        hf_model.generate(prompts, max_new_tokens=2, min_new_tokens=2, do_sample=True, top_k=0)
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        hf_model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0)
    sync(device)
    return time.perf_counter() - t0


def _override(text: str) -> tuple[str, Any]:
    """``FIELD=VALUE`` of ``--override``, the value read as a Python literal where it is one."""
    import ast

    from harts.errors import UserError

    field, sep, value = text.partition("=")
    if not sep:
        raise UserError(f"--override {text!r}: write FIELD=VALUE")
    try:
        return field, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return field, value


def _unless_out_of_memory(fn: Any, row: dict[str, Any], name: str) -> Any:
    """``fn()``, or None with ``row["not_run"][name]`` saying why when the device ran out of
    memory (a row of the matrix that could not be run is a result too)."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        row.setdefault("not_run", {})[name] = "out of device memory"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def batch_row(model: Any, hf_model: Any, prompts: torch.Tensor, args: Any, device: torch.device) -> dict[str, Any]:
    """One batch size's timings (the module docstring's rows), each side after an untimed run."""
    b, new = prompts.shape[0], args.new
    tokens = b * new
    row: dict[str, Any] = {"batch": b, "prefill_s": None, "harts_tok_s": None, "fraction_of_bound": None}
    row |= {"prefill_mfu": None, "harts_graphs_tok_s": None, "reference_tok_s": None, "hf_tok_s": None}

    def harts(graphs: bool) -> dict[str, float]:
        harts_rows(model, prompts, 2, device, graphs)  # compiled and autotuned at these shapes
        return harts_rows(model, prompts, new, device, graphs)

    eager = _unless_out_of_memory(lambda: harts(False), row, "harts")
    if eager is not None:
        row["prefill_s"], row["harts_tok_s"] = eager["prefill_s"], tokens / eager["decode_s"]
    if args.cuda_graphs:
        graphs = _unless_out_of_memory(lambda: harts(True), row, "harts_graphs")
        row["harts_graphs_tok_s"] = None if graphs is None else tokens / graphs["decode_s"]
    if b <= args.reference_max_batch:
        seconds = _unless_out_of_memory(lambda: reference_seconds(model, prompts, new, device), row, "reference")
        row["reference_tok_s"] = None if seconds is None else tokens / seconds
    if hf_model is not None:
        seconds = _unless_out_of_memory(lambda: hf_seconds(hf_model, prompts, new, device), row, "transformers")
        row["hf_tok_s"] = None if seconds is None else tokens / seconds
    return row


def forward_gap(model: Any, prompts: torch.Tensor, samples: list[list[int]], logprobs: list[list[float]]) -> dict:
    """Mean and max |sampler log-prob - the training forward's| over the sampled tokens of
    ``prompts[b] + samples[b]`` (trajectory-wise forward, the trainer's)."""
    import numpy as np

    from harts.tree.batch import RolloutBatch

    trajs = [p + s for p, s in zip(prompts.tolist(), samples)]
    batch = RolloutBatch.from_trajectories(trajs, vocab_size=model.config.vocab_size)
    with torch.no_grad():
        lp = model(batch, mode="trajectory").logprobs.double().cpu().numpy()
    ends = np.cumsum([len(t) - 1 for t in trajs])
    forward = np.concatenate([lp[e - len(s) : e] for e, s in zip(ends, samples)])
    gap = np.abs(forward - np.concatenate(logprobs))
    return {"mean_abs": float(gap.mean()), "max_abs": float(gap.max()), "tokens": int(gap.size)}


def agreement(model: Any, hf_model: Any, prompts: torch.Tensor, new: int, device: torch.device) -> dict:
    """``forward_gap`` of harts' batched decoder's samples, and of transformers' ``generate``'s
    (its raw logits' log-softmax at the tokens it drew), at temperature 1."""
    from harts.rollout.fast import FastDecoder, FastDecoding
    from harts.rollout.sampler import SamplingConfig

    decoder = FastDecoder(model)
    ids = decoder.open(prompts.shape[0])
    decoder.extend(ids, prompts.tolist())
    decoding = FastDecoding(decoder, ids, SamplingConfig(max_tokens=new))
    gen = torch.Generator(device).manual_seed(1)
    while not decoding.done:
        decoding.step(gen)
    out = {
        "harts": forward_gap(model, prompts, [t.tokens for t in decoding.turns], [t.logprobs for t in decoding.turns])
    }
    del decoder, decoding
    if hf_model is not None:
        with torch.no_grad():
            res = hf_model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0,
                                    output_logits=True, return_dict_in_generate=True)  # fmt: skip
        tokens = res.sequences[:, prompts.shape[1] :]
        logits = torch.stack(res.logits, dim=1).float()  # [B, new, V]
        lps = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
        out["transformers"] = forward_gap(model, prompts, tokens.tolist(), lps.double().tolist())
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--preset", default="qwen3_5_9b")
    p.add_argument("--layers", type=int, default=None, help="first N decoder layers (default: all)")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--reference-max-batch", type=int, default=16)
    p.add_argument("--agreement-batch", type=int, default=4, help="sequences of the log-prob agreement (0: none)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument("--cuda-graphs", action="store_true", help="also time harts' steps in CUDA graphs")
    p.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE", help="a config field")
    add_device_argument(p)
    add_dtype_argument(p, ["bfloat16", "float32", "float64"], "bfloat16")
    add_json_argument(p)
    args = parse(p, argv)
    device, dtype = device_of(args.device), dtype_of(args.dtype)

    from harts.models.config import HybridConfig
    from harts.models.flops import active_matmul_params, peak_tflops

    overrides = dict(_override(o) for o in args.override)
    config = HybridConfig.preset(args.preset, layers=args.layers, dtype=args.dtype, **overrides)
    model, hf_model, hf_why = build_models(config, device, dtype, not args.no_hf)
    params = sum(t.numel() * t.element_size() for t in model.parameters())
    active = active_matmul_params(model, config.num_experts_per_tok or 1)
    bandwidth = copy_bandwidth(device)
    peak = peak_tflops(device)
    print(f"{args.preset} ({len(model.layers)} layers), {args.dtype}, {device}: {params / 2**30:.2f} GiB of "
          f"parameters, copy bandwidth {bandwidth / 1e9:.0f} GB/s")  # fmt: skip
    print("bound = B / ((parameter bytes + B x cache bytes per sequence at prompt + new/2) / copy bandwidth)")
    rows = []
    for b in args.batch:
        gen = torch.Generator().manual_seed(b)
        prompts = torch.randint(0, config.vocab_size, (b, args.prompt), generator=gen).to(device)
        row = batch_row(model, hf_model, prompts, args, device)
        row["bound_tok_s"] = b / ((params + cache_bytes(model, b, args.prompt + args.new / 2)) / bandwidth)
        if row["harts_tok_s"] is not None:
            row["fraction_of_bound"] = row["harts_tok_s"] / row["bound_tok_s"]
        if row["prefill_s"] is not None and peak is not None:
            row["prefill_mfu"] = 2 * active * b * args.prompt / row["prefill_s"] / (peak * 1e12)
        rows.append(row)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}
        print(" ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    fractions = [r["fraction_of_bound"] for r in rows if r["fraction_of_bound"] is not None]
    gaps = None
    if args.agreement_batch:
        gen = torch.Generator().manual_seed(-1 % 2**31)
        prompts = torch.randint(0, config.vocab_size, (args.agreement_batch, args.prompt), generator=gen).to(device)
        gaps = agreement(model, hf_model, prompts, args.new, device)
        print(f"|sampled log-prob - training forward's| (mean / max): {gaps}")
    write_json(args, {"logprob_gap": gaps, "preset": args.preset, "layers": len(model.layers), "dtype": args.dtype,
                      "device": str(device), "hf_not_run": hf_why, "parameter_bytes": params, "copy_bandwidth_Bps": bandwidth,
                      "prompt": args.prompt, "new": args.new, "median_fraction_of_bound":
                      statistics.median(fractions) if fractions else None, "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
