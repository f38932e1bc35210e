"""LM head + log-probs at a real vocabulary: fused vs eager element-wise passes, and the GEMM floor.

    python -m benchmarks.ops.lm_head --device cuda --rows 65536 --json out.json

``mapped_logprobs`` forward + backward (d_hidden and d_weight) on ``--rows`` random hidden rows
of width ``--dim`` against a ``--vocab`` x ``--dim`` head, in ``--dtype``, with a fork on every
``--fork-every``-th row (a second position reading the row with another target), timed with
CUDA events (host clocks on CPU), median of ``--repeat`` after one untimed warm-up (which
compiles the fused passes). Variants, on the same inputs:

* ``kept``   ``keep_probs=True``: the forward keeps every chunk's bf16 softmax, the backward
             recomputes no logits (three GEMMs per chunk);
* ``default`` ``keep_probs=None`` under the device's default budget (``head_budget``): the first
             chunks whose softmax fits in it kept, the others recomputed;
* ``fused``  ``keep_probs=False``: compiled one-read passes over each logits chunk, the backward
             recomputes the logits (four GEMMs per chunk);
* ``eager``  ``keep_probs=False, fused=False``: torch's logsumexp, then sub_/exp_/mul_ and a cast
             per chunk;
* ``gemms``  the floor of the recomputing variants: only the four chunk GEMMs (forward logits,
             recomputed logits, d_hidden, d_weight) on the same chunks, without any element-wise
             work.

Printed: milliseconds, useful TFLOP/s (3 GEMMs x 2 x rows x V x D: logits, d_hidden, d_weight)
and each variant's time over the floor; the largest differences of the kept and fused results
from the eager ones (log-probs and both gradients, relative to the largest entry) show they
compute the same thing.
"""

from __future__ import annotations

from collections.abc import Callable

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

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from harts.ops.logprob import mapped_logprobs

    p = parser(__doc__, __file__)
    p.add_argument("--rows", type=int, default=65536, help="unique hidden rows (default 65,536)")
    p.add_argument("--dim", type=int, default=1536, help="model width D (default: ling3_tiny's 1,536)")
    p.add_argument("--vocab", type=int, default=157_184, help="vocabulary V (default: the paper's 157,184)")
    p.add_argument("--fork-every", type=int, default=64, help="a second position on every k-th row (0: none)")
    p.add_argument("--row-chunk", type=int, default=4096)
    add_dtype_argument(p, ["bfloat16", "float16", "float32"], "bfloat16")
    add_device_argument(p)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    add_json_argument(p)
    p.add_argument(
        "--profile", default=None, metavar="FILE", help="top-30 operators of one fused run, by device and by host time"
    )
    args = parse(p, argv)
    for name in ("rows", "dim", "vocab", "row_chunk", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive; got {getattr(args, name)}")
    if args.fork_every < 0:
        p.error(f"--fork-every must be >= 0; got {args.fork_every}")
    device, dtype = device_of(args.device), dtype_of(args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    R, D, V = args.rows, args.dim, args.vocab
    hidden = (torch.randn(R, D, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=gen) * D**-0.5).to(device, dtype).requires_grad_()
    rows = torch.arange(R)
    if args.fork_every:
        rows = torch.cat([rows, rows[:: args.fork_every]]).sort().values
    targets = torch.randint(0, V, (rows.numel(),), generator=gen)
    upstream = torch.randn(rows.numel(), generator=gen).to(device)

    def head(fused: bool, keep: bool | None = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # chunks of exactly --row-chunk rows: a budget of one such chunk's float32 logits, but
        # the default budget where the default keeps what fits in it
        budget = None if keep is None else args.row_chunk * V * 4
        out = mapped_logprobs(
            hidden, weight, rows, targets, row_chunk=args.row_chunk, budget=budget, fused=fused, keep_probs=keep
        )
        dh, dw = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
        return out, dh, dw

    def gemms() -> None:
        h, w = hidden.detach(), weight.detach()
        half = device.type == "cuda" and dtype != torch.float32
        for lo in range(0, R, args.row_chunk):
            hc = h[lo : lo + args.row_chunk]
            for _ in range(2):  # forward logits, then the backward's recomputed logits
                logits = torch.mm(hc, w.T, out_dtype=torch.float32) if half else hc.float() @ w.float().T
            d = logits.to(dtype)
            torch.mm(d, w)
            torch.mm(d.T, hc)

    results: dict[str, float] = {}
    variants: list[tuple[str, Callable[[], object]]] = [
        ("kept", lambda: head(True, keep=True)),
        ("default", lambda: head(True, keep=None)),
        ("fused", lambda: head(True)),
        ("eager", lambda: head(False)),
        ("gemms", gemms),
    ]
    peaks: dict[str, float] = {}  # GiB above what was allocated before, CUDA only
    for name, fn in variants:
        base = _reset_peak(device)
        results[name] = median_seconds(fn, device, args.repeat)
        if device.type == "cuda":
            peaks[name] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            head(True)
            sync(device)
        keys = ["self_cuda_time_total", "self_cpu_time_total"] if device.type == "cuda" else ["self_cpu_time_total"]
        with open(args.profile, "w") as fh:
            for key in keys:
                fh.write(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60) + "\n")
    eager_out = head(False)
    diffs = {
        variant: {
            name: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
            for name, a, b in zip(
                ["logprobs", "d_hidden", "d_weight"], (t.detach() for t in out), (t.detach() for t in eager_out)
            )
        }
        for variant, out in (("kept", head(True, keep=True)), ("fused", head(True)))
    }
    flops = 3 * 2 * R * V * D
    print(f"rows {R:,} (+{rows.numel() - R:,} fork positions), D {D}, V {V:,}, {args.dtype}, {device}")
    print(f"{'variant':<8} {'ms':>10} {'TFLOP/s':>9} {'over floor':>11} {'peak GiB':>9}")
    for name, s in results.items():
        peak = f"{peaks[name]:>9.2f}" if name in peaks else f"{'n/a':>9}"
        print(f"{name:<8} {s * 1e3:>10.2f} {flops / s / 1e12:>9.1f} {s / results['gemms']:>10.2f}x {peak}")
    print(
        f"eager / fused: {results['eager'] / results['fused']:.2f}x; fused / kept: {results['fused'] / results['kept']:.2f}x"
    )
    for variant, d in diffs.items():
        print(f"{variant} vs eager, max relative difference: " + ", ".join(f"{k} {v:.2e}" for k, v in d.items()))
    write_json(
        args,
        dict(
            rows=R,
            positions=int(rows.numel()),
            dim=D,
            vocab=V,
            dtype=args.dtype,
            device=str(device),
            seconds=results,
            tflops={k: flops / s / 1e12 for k, s in results.items()},
            peak_gib=peaks,
            vs_eager=diffs,
        ),
        indent=1,
    )
    return 0


def _reset_peak(device: torch.device) -> int:
    """Bytes allocated on a CUDA ``device`` now, its peak counter reset to them (0 elsewhere)."""
    if device.type != "cuda":
        return 0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


if __name__ == "__main__":
    raise SystemExit(run(main))
