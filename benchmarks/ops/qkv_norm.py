"""One linear-attention layer's split of ``[q | k | v]`` and q / k l2 norms: kernel against reference.

    python -m benchmarks.ops.qkv_norm --device cuda --json out.json

Times ``split_l2norm_qkv`` (``harts.ops.qkv_norm``: one kernel each way) and
``split_l2norm_qkv_reference`` (``split``, the two compiled l2 norms, and, as the linear attention
wants them, a contiguous v) on the same ``[T, 2HK + HV]`` input: the forward alone and forward +
backward (the backward of the reference ends in the concatenation of the three gradients).
Defaults: one ``ling3_tiny`` KDA layer (16 heads of 128) at 65,536 rows, bfloat16. Printed:
milliseconds (median of ``--repeat`` after a warm-up) and the bytes each side moves at least;
the two sides' outputs and gradients are checked close first.

With fla-core there (CUDA), it then times where the short conv's SiLU runs, the conv included
(``runs_causal_conv1d`` over ``--sequences`` equal trajectories, the conv's input ``[T, 2HK +
HV]``): "silu in conv" (fla-core's conv with its activation, then the split) against "silu in
split" (the conv without it, then the split kernel's SiLU: ``KimiDeltaAttention.silu_in_split``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
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
from harts.ops.conv import conv_runs_from_offsets, conv_uses_fla, runs_causal_conv1d
from harts.ops.qkv_norm import kernel_applies, split_l2norm_qkv, split_l2norm_qkv_reference

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    add_device_argument(p)
    p.add_argument("--rows", type=int, default=65_536)
    p.add_argument("--heads", type=int, default=16, help="q / k heads (and v heads)")
    p.add_argument("--head-dim", type=int, default=128)
    add_dtype_argument(p, ["bfloat16", "float16", "float32"], "bfloat16")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument(
        "--sequences", type=int, default=16, help="trajectories the conv comparison splits the rows into (equal)"
    )
    add_json_argument(p)
    args = parse(p, argv)
    for name in ("rows", "heads", "head_dim", "repeat", "sequences"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive; got {getattr(args, name)}")
    device, dtype = device_of(args.device), dtype_of(args.dtype)
    t, h, d = args.rows, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    mixed = torch.randn(t, 3 * h * d, generator=gen).to(device, dtype)
    if not kernel_applies(mixed, h, d, h, d):
        p.error(f"the kernel does not apply here ({device}, {args.dtype}, head dim {d}): nothing to compare")
    grads = tuple(torch.randn(t, h, d, generator=gen).to(device, dtype) for _ in range(3))

    def reference(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = split_l2norm_qkv_reference(x, h, d, h, d)
        return q, k, v.contiguous()  # what the linear attention's kernels are handed

    sides = {"reference": reference, "kernel": lambda x: split_l2norm_qkv(x, h, d, h, d)}

    def fwd_bwd(fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> Callable[[], torch.Tensor]:
        return _forward_backward(fn, mixed, grads)

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with warnings.catch_warnings():  # a kernel that fell back to the reference would time the reference twice
        warnings.filterwarnings("error", message=".*split-l2norm kernel is off")
        want, got = fwd_bwd(reference)(), fwd_bwd(sides["kernel"])()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for a, b in zip(sides["kernel"](mixed), reference(mixed), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)

    elem = mixed.element_size()
    least = {"forward": 2 * mixed.numel() * elem, "forward_backward": (2 + 4) * mixed.numel() * elem}
    report: dict = {"rows": t, "heads": h, "head_dim": d, "dtype": args.dtype, "device": str(device), "ms": {}}
    print(f"[{t}, 3 x {h} x {d}] {args.dtype} on {device}; ms (median of {args.repeat})")
    print(f"{'pass':18} {'reference':>10} {'kernel':>10} {'least GB':>9}")
    for name, make in (("forward", lambda fn: lambda: fn(mixed)), ("forward_backward", fwd_bwd)):
        row = {side: round(median_seconds(make(fn), device, args.repeat) * 1e3, 4) for side, fn in sides.items()}
        report["ms"][name] = row
        print(f"{name:18} {row['reference']:>10.3f} {row['kernel']:>10.3f} {least[name] / 1e9:>9.2f}")
    report["least_bytes"] = least
    if conv_uses_fla("fla", device):
        report["conv_ms"] = _time_conv_silu(mixed, grads, h, d, min(args.sequences, t), args.repeat, tol)
    else:
        print("(the conv comparison needs fla-core's conv: CUDA with fla-core installed)")
    write_json(args, report)
    return 0


def _forward_backward(
    fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], x0: torch.Tensor, grads: tuple[torch.Tensor, ...]
) -> Callable[[], torch.Tensor]:
    """A timed pass: ``fn`` on a fresh leaf copy of ``x0``, backward from ``grads``; returns x's
    gradient."""

    def one() -> torch.Tensor:
        x = x0.detach().requires_grad_(True)
        torch.autograd.backward(fn(x), grads)
        assert x.grad is not None
        return x.grad

    return one


def _time_conv_silu(
    pre_TC: torch.Tensor, grads: tuple[torch.Tensor, ...], h: int, d: int, sequences: int, repeat: int, tol: float
) -> dict[str, dict[str, float]]:
    """ms of conv + split with the SiLU in fla-core's conv against in the split kernel (module
    docstring); their outputs and the input's gradient checked close first."""
    t, c = pre_TC.shape
    device = pre_TC.device
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(c, 4, generator=gen) * 0.5).to(device, pre_TC.dtype)
    runs = conv_runs_from_offsets(np.linspace(0, t, sequences + 1).astype(np.int64))

    def silu_in_conv(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return split_l2norm_qkv(runs_causal_conv1d(x, weight, runs, None, "silu"), h, d, h, d)

    def silu_in_split(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return split_l2norm_qkv(runs_causal_conv1d(x, weight, runs, None, None), h, d, h, d, activation="silu")

    sides = {"silu in conv": silu_in_conv, "silu in split": silu_in_split}

    def fwd_bwd(fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> Callable[[], torch.Tensor]:
        return _forward_backward(fn, pre_TC, grads)

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*split-l2norm kernel is off")
        torch.testing.assert_close(fwd_bwd(silu_in_split)(), fwd_bwd(silu_in_conv)(), rtol=tol, atol=tol)
        for a, b in zip(silu_in_split(pre_TC), silu_in_conv(pre_TC), strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    out: dict[str, dict[str, float]] = {}
    print(f"conv (width 4, {sequences} trajectories) + split; ms (median of {repeat})")
    print(f"{'pass':18} {'silu in conv':>13} {'silu in split':>14}")
    for name, make in (("forward", lambda fn: lambda: fn(pre_TC)), ("forward_backward", fwd_bwd)):
        row = {side: round(median_seconds(make(fn), device, repeat) * 1e3, 4) for side, fn in sides.items()}
        out[name] = row
        print(f"{name:18} {row['silu in conv']:>13.3f} {row['silu in split']:>14.3f}")
    return out


if __name__ == "__main__":
    raise SystemExit(run(main))
