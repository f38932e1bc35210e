"""Autotune fla-core's kernels on ling3_tiny's shapes and write harts' pinned configs.

    python -m benchmarks.ops.tune_fla --out harts/ops/linear_attn/fla_configs [--kernels conv]

Runs fla's ``chunk_kda`` and its fused KDA gate (bfloat16; ``--dtypes bfloat16,float32`` for both) and
``chunk_gated_delta_rule`` forward and backward (GDN backward only where fla allows it) on
packed varlen sequences with initial and final states (lengths 1, 63, 64, 65, 1000, 4096, then
8192 each up to ``--rows`` rows in all, default 65,536: a microbatch at the capacity harts'
benchmarks run; fla's autotune keys leave the row count out, so the configs chosen at one size
serve every size), heads H = 16 of K = V = 128, chunk 64, and the short conv's varlen kernels
over 3 x H x K channels of width ``--conv-width`` with and without initial states
(``harts.ops.conv.runs``) -- the calls harts makes -- with
``HARTS_FLA_AUTOTUNE=1`` so fla autotunes, then writes every autotuned kernel's chosen configs
into ``OUT/<GPU name>/`` (see ``harts.ops.linear_attn.fla_configs``). Needs CUDA and fla-core.
"""

from __future__ import annotations

import os
import time

from benchmarks._runner import cuda_device, parse, parser, run


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--out", required=True, help="root directory; configs go to OUT/<GPU name>/")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16,float32 (default bfloat16)")
    p.add_argument(
        "--rows",
        type=int,
        default=65536,
        help="packed rows the kernels are tuned on (at least 5,289, the short sequences' total; default 65,536)",
    )
    p.add_argument(
        "--conv-width",
        type=int,
        default=4,
        help="short-conv kernel width W (linear_conv_kernel_dim); the conv channels are 3 x heads x dim",
    )
    p.add_argument(
        "--kernels",
        default="kda,gdn,conv",
        help="comma-separated subset of kda,gdn,conv to tune (default all); the JSON files of the "
        "others in OUT are left as they are",
    )
    args = parse(p, argv)
    try:
        lengths = tuning_lengths(args.rows)
    except ValueError as e:
        p.error(f"--rows: {e}")
    kernels = set(args.kernels.split(","))
    if not kernels or not kernels <= {"kda", "gdn", "conv"}:
        p.error(f"--kernels: expected a subset of kda,gdn,conv; got {args.kernels!r}")
    os.environ["HARTS_FLA_AUTOTUNE"] = "1"

    import torch

    cuda_device("fla-core's Triton kernels are tuned there")
    from harts.ops.linear_attn.fla import _gdn_backward_broken, _import_fla
    from harts.ops.linear_attn.fla_configs import dump_fla_autotune, gpu_dir_name

    _import_fla()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    out = os.path.join(args.out, gpu_dir_name(torch.cuda.get_device_name(0)))
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    H, D, dev = args.heads, args.dim, "cuda"
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    T, N = sum(lengths), len(lengths)
    names: list[str] = []
    for dtype in dtypes:
        for gdn in [g for g in (False, True) if ("gdn" if g else "kda") in kernels]:
            t0 = time.perf_counter()
            torch.manual_seed(0)
            q = torch.nn.functional.normalize(torch.randn(1, T, H, D, device=dev), dim=-1).to(dtype).requires_grad_()
            k = torch.nn.functional.normalize(torch.randn(1, T, H, D, device=dev), dim=-1).to(dtype).requires_grad_()
            v = torch.randn(1, T, H, D, device=dev, dtype=dtype, requires_grad=True)
            g = (-torch.rand(1, T, H, *(() if gdn else (D,)), device=dev) * 0.1).to(dtype).requires_grad_()
            beta = torch.rand(1, T, H, device=dev, dtype=dtype).requires_grad_()
            h0 = torch.randn(N, H, D, D, device=dev, requires_grad=True)
            fn = chunk_gated_delta_rule if gdn else chunk_kda
            o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
            if not (gdn and _gdn_backward_broken()):
                (o.float().square().sum() + ht.square().sum()).backward()
            if not gdn:  # KDA's log-decay (``KimiDeltaAttention.fla_gate``): fla's fused gate each way
                from fla.ops.kda.gate import fused_kda_gate

                f = torch.randn(T, H, D, device=dev, dtype=dtype, requires_grad=True)
                a_log = torch.zeros(H, device=dev, dtype=dtype, requires_grad=True)
                dt_bias = torch.zeros(H * D, device=dev, dtype=dtype, requires_grad=True)
                fused_kda_gate(f, a_log, dt_bias, None, output_dtype=dtype).float().square().sum().backward()
            torch.cuda.synchronize()
            names = dump_fla_autotune(out)  # after every stage: a time limit keeps what was tuned
            print(
                f"{'GDN' if gdn else 'KDA'} {dtype}: {time.perf_counter() - t0:.1f} s; "
                f"{len(names)} kernel configs in {out}",
                flush=True,
            )
        # the short conv (harts.ops.conv.runs): fla's varlen kernels without states (trajectory
        # rows) and with them (compact runs); fla keys them on (channels, width) and the variant
        if "conv" not in kernels:
            continue
        t0 = time.perf_counter()
        _tune_short_conv(3 * H * D, args.conv_width, dtype, lengths)
        torch.cuda.synchronize()
        names = dump_fla_autotune(out)
        print(f"short conv {dtype}: {time.perf_counter() - t0:.1f} s; {len(names)} kernel configs in {out}", flush=True)
    print(f"kernels: {', '.join(names)}")
    return 0


def tuning_lengths(rows: int) -> list[int]:
    """Sequence lengths summing to ``rows``: 1, 63, 64, 65 (chunk edges), 1000, 4096, then 8192
    each (the last one shorter); ValueError below the short ones' 5,289 rows."""
    lengths = [1, 63, 64, 65, 1000, 4096]
    left = rows - sum(lengths)
    if left < 0:
        raise ValueError(f"at least {sum(lengths):,} rows are needed; got {rows:,}")
    while left > 0:
        lengths.append(min(8192, left))
        left -= lengths[-1]
    return lengths


def _tune_short_conv(channels: int, width: int, dtype, lengths: list[int]) -> None:  # noqa: ANN001
    """Forward + backward of ``runs_causal_conv1d`` on packed rows, with and without states."""
    import numpy as np
    import torch

    from harts.models.layers.kda import silu_in_split
    from harts.ops.conv import ConvRuns, runs_causal_conv1d

    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    P = int(cu[-1])
    x = torch.randn(P, channels, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(channels, width, device="cuda") * 0.5).to(dtype).requires_grad_()
    # states from the previous run's last rows (-1 before the first): a chain, as in a layout
    starts = cu[:-1]
    states = np.stack([starts - width + 1 + j for j in range(width - 1)], 1)
    states = np.where(states < 0, -1, states)
    for runs in (ConvRuns(cu_seqlens=cu, state_rows=None), ConvRuns(cu_seqlens=cu, state_rows=states)):
        y = runs_causal_conv1d(x, w, runs, None, None if silu_in_split() else "silu")  # the model's variant
        y.float().square().sum().backward()


if __name__ == "__main__":
    raise SystemExit(run(main))
