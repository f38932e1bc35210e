"""One MoE layer, forward + backward, as a training step runs it: time and where it goes.

    python -m benchmarks.modules.moe --device cuda --rows 65536 --json out.json

The MoE blocks are the largest component of a full ``ling3_tiny`` step on a GPU, while the
layer's GEMMs run near the device's GEMM rate: most of the block's time is outside them
(``benchmarks/results/ling3-tiny_h200_2026-12-01_flash-host-mask-moe.md``). This runs one
``harts.models.layers.moe.MoE`` layer of a model preset (default ``ling3_tiny``: 128 experts, top
8 in 4 of 8 groups, expert width 512, one shared expert, hidden 1,536) on ``--rows`` random rows,
after the layer's post-attention RMS norm (as a decoder layer runs it; the norm is not counted
as model FLOPs):

* ``plain``: forward, then backward of a random linear functional of the output plus the
  router's z and aux losses;
* ``recompute``: the same under ``torch.utils.checkpoint`` with the forward's expert choice
  carried to the recomputation (``kept_routing``), as ``ExecutionConfig(recompute=True)`` runs
  every layer: forward, recomputed forward, backward;
* ``kept``: under checkpoint with the block kept (``recompute_skip=("moe",)``): forward once,
  the routed experts lean (their backward recomputes the gather, the gate/up GEMM and the
  SwiGLU), no recomputed forward.

For each, every variant (``variants()``: the MoE's fast paths, ``FAST_PATHS`` of
``harts.models.layers.moe``, all off in ``reference``, all on in ``fast``, each alone in
``only-NAME``) runs on the same weights and rows: milliseconds (median of ``--repeat`` after a
warm-up), model TFLOP/s (useful FLOPs: 3 x the forward's matmuls, router included, as
``harts.models.flops`` counts; recomputation not counted), and the largest difference of the
output and of every gradient from the mode's first variant and from the first mode's first
variant, relative to its largest entry. ``--profile`` adds, per variant, the device time by
kernel family (GEMMs, grouped ones included; sort; top-k; gathers / scatters; compiled
element-wise; reductions; other) and the top kernels.
"""

from __future__ import annotations

from collections.abc import Callable
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
    write_json,
)
from harts.models.layers.moe import MoE

__all__ = ["KERNEL_FAMILIES", "MODES", "kernel_family", "main", "moe_flops", "run_moe", "variants"]

#: how the block runs: alone; under checkpoint (recomputed); under checkpoint, kept (lean)
MODES = ("plain", "recompute", "kept")


def variants() -> dict[str, frozenset[str]]:
    """Variant name -> the ``MoE.fast`` paths it turns on: "reference" none, "fast" all, and
    "only-NAME" each alone."""
    from harts.models.layers.moe import FAST_PATHS

    out = {"reference": frozenset(), "fast": frozenset(FAST_PATHS)}
    for name in FAST_PATHS:
        out[f"only-{name}"] = frozenset({name})
    return out


#: kernel family -> substrings of a CUDA kernel's name (first match wins, in this order)
KERNEL_FAMILIES: dict[str, tuple[str, ...]] = {
    "GEMM": ("gemm", "Gemm", "GEMM", "grouped", "Grouped", "sm90_xmma", "nvjet", "cutlass", "wgmma"),
    "sort": ("sort", "Sort", "radix", "Radix"),
    "top-k": ("topk", "TopK", "bitonic"),
    "gather / scatter": ("index", "Index", "gather", "Gather", "scatter", "Scatter"),
    "compiled element-wise": ("triton_",),
    "reduction": ("reduce", "Reduce"),
}


def kernel_family(name: str) -> str:
    """The ``KERNEL_FAMILIES`` entry a kernel name belongs to, else "other"."""
    for family, keys in KERNEL_FAMILIES.items():
        if any(k in name for k in keys):
            return family
    return "other"


def moe_flops(moe: MoE, rows: int) -> float:
    """Useful training FLOPs of ``moe`` on ``rows`` rows: 3 x 2 x rows x its active matmul
    parameters, as ``harts.models.flops`` counts them."""
    from harts.models.flops import active_matmul_params

    return 3 * 2 * rows * active_matmul_params(moe, moe.gate.top_k)


class _Ctx:
    """What ``kept_routing`` and ``run_core`` read of a row context: whether it checkpoints, the
    kept cores, a store for the forward's choices and outputs."""

    def __init__(self, checkpointing: bool, recompute_skip: tuple[str, ...] = ()) -> None:
        self.checkpointing = checkpointing
        self.recompute_skip = recompute_skip
        self.kept_for_recompute: dict = {}


def run_moe(
    moe: torch.nn.Module,
    x: torch.Tensor,
    w: torch.Tensor,
    gy: torch.Tensor,
    recompute: bool,
    kept: bool = False,
    norm: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, ...]:
    """Forward + backward of ``moe`` on rows ``x`` (row weights ``w``), after ``norm`` if given
    (the layer's post-attention norm), with output gradient ``gy``; returns (y, d_x, *parameter
    gradients) detached. ``recompute``: under checkpoint with the expert choice kept, as the
    model runs its layers; ``kept`` (with ``recompute`` and ``norm``): the block's forward kept
    through the recomputation, its routed experts lean, as ``recompute_skip=("moe",)`` runs it
    (``harts.models.recompute``; the norm's saved tensors are what makes checkpoint recompute,
    and the recomputation takes the kept output, as in a decoder layer)."""
    if kept and (norm is None or not recompute):
        raise ValueError("kept needs recompute=True and a norm before the block (as in a decoder layer)")
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    from harts.models.recompute import kept_routing, run_core

    moe.zero_grad(set_to_none=True)
    if norm is not None:
        norm.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    ctx = _Ctx(recompute, ("moe",) if kept else ())

    def moe_block(x_: torch.Tensor, w_: torch.Tensor) -> tuple[torch.Tensor, ...]:
        routing = None if kept else kept_routing(ctx, moe)
        return moe(x_, w_, routing=routing, lean=kept)

    def block(x_: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if norm is not None:
            x_ = norm(x_)
        y, z, aux, _ = run_core(ctx, moe, "moe", moe_block, x_, w)
        return y, z, aux

    if recompute:
        with set_checkpoint_early_stop(not kept):
            y, z, aux = checkpoint(block, x, use_reentrant=False)
    else:
        y, z, aux = block(x)
    (torch.sum(y.float() * gy) + z + aux).backward()
    if ctx.kept_for_recompute:
        raise AssertionError(f"the recomputation left kept entries behind: {list(ctx.kept_for_recompute)}")
    params = sorted(moe.named_parameters()) + (sorted(norm.named_parameters()) if norm is not None else [])
    grads = [p.grad for _, p in params if p.grad is not None]
    assert x.grad is not None
    return (y.detach(), x.grad, *grads)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.float().abs().max()) or 1.0
    return float((a.float() - b.float()).abs().max()) / scale


def _profile(fn: Callable[[], object], device: torch.device, top: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1e3  # us -> ms
    families: dict[str, float] = {}
    for name, ms in kernels.items():
        families[kernel_family(name)] = families.get(kernel_family(name), 0.0) + ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {
        "device_ms": round(sum(kernels.values()), 3),
        "families_ms": {k: round(v, 3) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": [[name[:90], round(ms, 3)] for name, ms in ranked],
    }


def main(argv: list[str] | None = None) -> int:
    from harts.models.config import HybridConfig
    from harts.models.layers.norms import RMSNorm

    known = variants()
    p = parser(__doc__, __file__)
    add_device_argument(p)
    p.add_argument("--model", default="ling3_tiny", help="model preset whose MoE layer runs (default ling3_tiny)")
    p.add_argument("--rows", type=int, default=65_536, help="rows of the microbatch (default 65,536)")
    add_dtype_argument(p, ["bfloat16", "float32", "float64"], "bfloat16")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--modes", default="plain,recompute,kept", help="comma-separated: plain, recompute, kept")
    p.add_argument("--variants", default=",".join(known), help=f"comma-separated, of: {', '.join(known)}")
    p.add_argument("--profile", action="store_true", help="device time by kernel family and the top kernels")
    p.add_argument("--seed", type=int, default=0)
    add_json_argument(p)
    args = parse(p, argv)
    if args.rows < 1 or args.repeat < 1:
        p.error("--rows and --repeat must be positive")
    modes = [m for m in args.modes.split(",") if m]
    names = [v for v in args.variants.split(",") if v]
    for m in modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r} ({', '.join(MODES)})")
    for v in names:
        if v not in known:
            p.error(f"--variants: unknown variant {v!r} (known: {', '.join(known)})")
    if not modes or not names:
        p.error("--modes and --variants need at least one entry each")
    device = device_of(args.device)
    try:
        cfg = HybridConfig.preset(args.model, dtype=args.dtype)
    except ValueError as exc:
        p.error(f"--model: {exc}")
    if not cfg.num_experts:
        p.error(f"--model {args.model} has no MoE layers")

    dtype = dtype_of(args.dtype)
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        moe = MoE(cfg)
    moe = moe.to_empty(device=device).to(dtype)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset).to(device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    with torch.no_grad():
        for _, t in sorted(moe.named_parameters()):
            t.copy_(torch.randn(t.shape, generator=gen) * cfg.initializer_range)
        moe.gate.e_score_correction_bias.zero_()
    x = torch.randn(args.rows, cfg.hidden_size, generator=gen).to(device, dtype)
    gy = torch.randn(args.rows, cfg.hidden_size, generator=gen).to(device, torch.float32)
    w = torch.ones(args.rows, device=device, dtype=torch.float32)
    flops = moe_flops(moe, args.rows)
    report: dict[str, Any] = {
        "model": args.model,
        "rows": args.rows,
        "dtype": args.dtype,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "model_tflop": flops / 1e12,
        "modes": {},
    }
    print(
        f"MoE layer of {args.model}: {cfg.num_experts} experts, top {cfg.num_experts_per_tok}, expert width "
        f"{cfg.moe_intermediate_size}, hidden {cfg.hidden_size}; {args.rows:,} rows, {args.dtype} on {device}; "
        f"{flops / 1e12:.3f} model TFLOP per forward + backward"
    )
    print(
        f"{'mode':10} {'variant':22} {'ms':>9} {'TFLOP/s':>8} {'max rel diff (y, d_x, grads)':>30} {'vs first mode':>14}"
    )
    very_first: tuple[torch.Tensor, ...] | None = None
    for mode in modes:
        rows: dict[str, Any] = {}
        first: tuple[torch.Tensor, ...] | None = None
        for name in names:
            moe.fast = known[name]

            def fn(mode: str = mode) -> tuple[torch.Tensor, ...]:
                return run_moe(moe, x, w, gy, recompute=mode != "plain", kept=mode == "kept", norm=norm)

            out = fn()
            diff = 0.0 if first is None else max(_rel(a, b) for a, b in zip(out, first))
            first = out if first is None else first
            # every mode computes the same function: against the first mode's first variant
            across = 0.0 if very_first is None else max(_rel(a, b) for a, b in zip(out, very_first))
            very_first = out if very_first is None else very_first
            sec = median_seconds(fn, device, args.repeat)
            entry: dict[str, Any] = {
                "ms": round(sec * 1e3, 3),
                "tflop_per_s": round(flops / sec / 1e12, 1),
                "max_rel_diff_vs_first": diff,
                "max_rel_diff_vs_first_mode": across,
            }
            if args.profile and device.type == "cuda":
                entry["profile"] = _profile(fn, device, top=12)
            rows[name] = entry
            print(f"{mode:10} {name:22} {sec * 1e3:9.3f} {flops / sec / 1e12:8.1f} {diff:30.2e} {across:14.2e}")
        report["modes"][mode] = rows
    if args.profile and device.type == "cuda":
        for mode, rows in report["modes"].items():
            for name, entry in rows.items():
                prof = entry["profile"]
                fam = ", ".join(f"{k} {v:.2f}" for k, v in prof["families_ms"].items())
                print(f"\n{mode} / {name}: device {prof['device_ms']:.2f} ms: {fam}")
                for kname, ms in prof["top_kernels_ms"]:
                    print(f"  {ms:8.3f} ms  {kname}")
    write_json(args, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
