"""Launch configurations of the two kernels where harts' rows cost more than the baseline's.

    python -m benchmarks.ops.kernel_sweep --json out.json [--workload swe --step 5 --dp 8 --replica 0]

The profile of a ``swe`` microbatch (``harts bench --profile-only``) shows two kernel families
that take longer per row in harts than trajectory-wise, on the same row count:

* **state scans** (``harts.ops.linear_attn.tree_scan``): sequential over a sequence's chunks, so
  a call lasts as long as its longest sequence. harts runs one call per round, and its first
  round is often one long shared prefix; the GPU then holds only H x V / BV programs.
* **the short conv** (fla-core's ``causal_conv1d`` kernels): harts' runs carry initial states,
  a second compiled variant with its own pinned config (``fla_configs``). Timed here as fla
  runs it with the states; harts now runs the no-state variant plus a fix-up of the runs' first
  rows instead (``harts.ops.conv.runs``), which the ``harts_no_states`` column approximates.

This sweep times both, on the first microbatch each side runs of the given step and replica
(harts: its layout's rounds and conv runs; baseline: its packed trajectories), at every launch
configuration in the grid, with random inputs of ling3_tiny's shapes (16 heads of 128, conv
channels 3 x 16 x 128, width 4, bfloat16). Scans: each round's forward (exports on, initial
states where the layout has them) and backward (injection on), summed over the rounds; conv:
forward and backward with the activation. Printed: milliseconds (median of ``--repeat``) per
configuration and side; the JSON holds every figure. Every output is checked against the
default configuration's first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks._runner import add_json_argument, cuda_device, median_seconds, parse, parser, run, write_json

__all__ = ["main", "microbatch_shapes"]

H, K, V = 16, 128, 128
CONV_D, CONV_W = 3 * H * K, 4
CHUNK = 64


def microbatch_shapes(workload: str, step: int, dp: int, replica: int, capacity: int) -> dict[str, Any]:
    """The first microbatch each side runs of ``workload``'s step ``step`` on ``replica`` of ``dp``
    (host data only): harts' rounds (lengths, state requests, which sequences start from a state)
    and conv runs (boundaries, state rows), the baseline's trajectory lengths."""
    from harts.ops.conv import conv_runs_from_ancestors
    from harts.plan.baselines.trajectory_plan import plan_trajectory_step
    from harts.plan.layout import build_layout
    from harts.plan.step import plan_step
    from harts.tree.workloads import workload_steps

    steps = workload_steps(workload, None, seed=0)
    if not 0 <= step < len(steps):
        raise ValueError(f"--step {step}: the workload has steps 0..{len(steps) - 1}")
    batch = steps[step][1]()
    plan = plan_step(batch, dp=dp, capacity=capacity)
    cb, call_plan = plan.prepare_microbatch(plan.for_replica(replica)[0], CHUNK)
    layout = build_layout(cb, call_plan, no_replay=False)
    rounds = []
    for r in layout.rounds:
        cu = np.asarray(r.cu_seqlens, dtype=np.int64)
        rounds.append(
            {
                "lengths": np.diff(cu).tolist(),
                "requests": [tuple(map(int, q)) for q in np.asarray(r.requests, dtype=np.int64).reshape(-1, 2)],
                "has_init": (np.asarray(r.init_state) >= 0).tolist(),
            }
        )
    runs = conv_runs_from_ancestors(layout.ancestors(CONV_W - 1))
    raw = plan_trajectory_step(batch.lengths, dp=dp, capacity=capacity)
    group = raw.microbatches[raw.for_replica(replica)[0]]
    return {
        "rounds": rounds,
        "conv_cu": runs.cu_seqlens,
        "conv_state_rows": runs.state_rows,
        "baseline_lengths": [int(x) for x in np.asarray(batch.lengths)[group]],
    }


# ---------------------------------------------------------------------------------- scans
def _scan_calls(rounds: list[dict], device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[dict]:
    """Device inputs of one scan call per round."""
    from harts.ops.linear_attn.tree_kernel import _device_meta

    calls = []
    for r in rounds:
        lengths = r["lengths"]
        t = int(sum(lengths))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
        meta = _device_meta(starts, lengths, r["requests"], CHUNK, device)

        def rnd(*shape: int, scale: float = 0.05) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

        pos = torch.arange(t) % CHUNK  # decays cumulated within each chunk (log2 units)
        gk = (-(0.02 * (pos + 1)).float()[:, None, None].expand(t, H, K)).to(device, torch.float32)[None]
        has_init = any(r["has_init"])
        n = len(lengths)
        calls.append(
            {
                "meta": meta,
                "kg": rnd(1, t, H, K),
                "w": rnd(1, t, H, K),
                "u": rnd(1, t, H, V, scale=1.0),
                "qg": rnd(1, t, H, K),
                "do": rnd(1, t, H, V, scale=1.0),
                "dv": rnd(1, t, H, V, scale=1.0),
                "gk": gk.contiguous(),
                "h0": (torch.randn(n, H, K, V, generator=gen) * 0.1).to(device) if has_init else None,
                "dht": (torch.randn(n, H, K, V, generator=gen) * 0.1).to(device),
                "inject": (torch.randn(meta.io.num_exported, H, K, V, generator=gen) * 0.1).to(device),
            }
        )
    return calls


def _scan_runners(calls: list[dict], config) -> tuple[Callable[[], list], Callable[[], list]]:  # noqa: ANN001
    from harts.ops.linear_attn.tree_scan import tree_scan_bwd, tree_scan_fwd

    def fwd() -> list:
        out = []
        for c in calls:
            m = c["meta"]
            out.append(
                tree_scan_fwd(
                    c["kg"],
                    c["w"],
                    c["u"],
                    c["gk"],
                    cu_seqlens=m.cu_seqlens,
                    chunk_offsets=m.chunk_offsets,
                    num_chunks=m.io.num_chunks,
                    chunk_size=CHUNK,
                    initial_state=c["h0"],
                    export_index=m.export_index,
                    num_exported=m.io.num_exported,
                    config=config,
                )
            )
        return out

    def bwd() -> list:
        out = []
        for c in reversed(calls):
            m = c["meta"]
            out.append(
                tree_scan_bwd(
                    c["qg"],
                    c["kg"],
                    c["w"],
                    c["gk"],
                    c["do"],
                    c["dv"],
                    scale=K**-0.5,
                    cu_seqlens=m.cu_seqlens,
                    chunk_offsets=m.chunk_offsets,
                    num_chunks=m.io.num_chunks,
                    chunk_size=CHUNK,
                    dht=c["dht"],
                    inject=c["inject"],
                    inject_index=m.inject_index,
                    want_initial_state_grad=c["h0"] is not None,
                    config=config,
                )
            )
        return out

    return fwd, bwd


def _close(got: list, want: list, what: str) -> None:
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a, b, strict=True):
            if x is None or y is None:
                continue
            torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: {m}")


def sweep_scans(shapes: dict, device: torch.device, repeat: int, grid: list) -> list[dict]:  # noqa: ANN001
    """Milliseconds of the forward and backward scans per configuration and side."""
    from harts.ops.linear_attn.tree_scan import ScanConfig

    gen = torch.Generator().manual_seed(0)
    sides = {
        "harts": _scan_calls(shapes["rounds"], device, torch.bfloat16, gen),
        "baseline": _scan_calls(
            [{"lengths": shapes["baseline_lengths"], "requests": [], "has_init": [False]}], device, torch.bfloat16, gen
        ),
    }
    want = {s: [f() for f in _scan_runners(c, ScanConfig())] for s, c in sides.items()}
    rows = []
    for cfg in grid:
        row: dict[str, Any] = {"block_v": cfg.block_v, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        try:
            for side, calls in sides.items():
                fwd, bwd = _scan_runners(calls, cfg)
                _close(fwd(), want[side][0], f"{side} forward {cfg}")
                _close(bwd(), want[side][1], f"{side} backward {cfg}")
                row[f"{side}_fwd_ms"] = round(median_seconds(fwd, device, repeat) * 1e3, 4)
                row[f"{side}_bwd_ms"] = round(median_seconds(bwd, device, repeat) * 1e3, 4)
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile (shared memory)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
        print(_scan_line(row), flush=True)
    return rows


def _scan_line(row: dict) -> str:
    head = f"BV {row['block_v']:>3} warps {row['num_warps']} stages {row['num_stages'] or '-'}"
    if "error" in row:
        return f"{head}  {row['error']}"
    return (
        f"{head}  harts fwd {row['harts_fwd_ms']:7.3f} bwd {row['harts_bwd_ms']:7.3f}"
        f"   baseline fwd {row['baseline_fwd_ms']:7.3f} bwd {row['baseline_bwd_ms']:7.3f}"
    )


# ---------------------------------------------------------------------------------- conv
def _jit(kernel):  # noqa: ANN001, ANN202
    """The JITFunction under fla's heuristics / autotune wrappers."""
    import triton

    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def _conv_case(cu: np.ndarray, state_rows: np.ndarray | None, device: torch.device, gen: torch.Generator) -> dict:
    import torch.nn.functional as F

    from harts.ops.conv.runs import ConvRuns, _gather_states

    runs = ConvRuns(cu_seqlens=np.asarray(cu, dtype=np.int64), state_rows=state_rows)
    dev = runs.on(device)
    t = int(cu[-1])
    x = torch.randn(1, t, CONV_D, generator=gen).to(device, torch.bfloat16)
    # fla's initial state [R, D, W]: entry W-1 the row just before the run, entry 0 never read
    states = None if state_rows is None else F.pad(_gather_states(x[0], dev).transpose(1, 2), (1, 0)).contiguous()
    return {
        "dev": dev,
        "x": x,
        "dy": torch.randn(1, t, CONV_D, generator=gen).to(device, torch.bfloat16),
        "weight": (torch.randn(CONV_D, CONV_W, generator=gen) * 0.3).to(device, torch.bfloat16),
        "bias": (torch.randn(CONV_D, generator=gen) * 0.1).to(device, torch.bfloat16),
        "states": states,
    }


def _conv_runners(c: dict, bd: int | None, warps: int | None) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Forward and backward at (BD, warps), or through fla's functions (pinned config) for None."""
    import triton
    from fla.modules.causal_conv1d.ops import (
        causal_conv1d_bwd,
        causal_conv1d_bwd_kernel,
        causal_conv1d_fwd,
        causal_conv1d_fwd_kernel,
    )

    from harts.models.layers.kda import silu_in_split

    act = None if silu_in_split() else "silu"  # the model's variant of the conv
    x, dy, w, b, s, dev = c["x"], c["dy"], c["weight"], c["bias"], c["states"], c["dev"]
    kw = dict(cu_seqlens=dev.cu_seqlens, cu_seqlens_cpu=dev.cu_seqlens_host, chunk_indices=dev.chunk_indices)
    if bd is None:

        def fwd() -> Any:
            return causal_conv1d_fwd(x=x, weight=w, bias=b, residual=None, initial_state=s, activation=act, **kw)[0]

        def bwd() -> Any:
            out = causal_conv1d_bwd(x=x, dy=dy, dht=None, weight=w, bias=b, initial_state=s, activation=act, **kw)
            return out[0], out[1], out[2]

        return fwd, bwd
    nt, t = int(dev.chunk_indices.shape[0]), x.shape[1]
    grid = (triton.cdiv(CONV_D, bd), nt, 1)
    common = dict(D=CONV_D, W=CONV_W, BT=64, BW=4, BD=bd, num_warps=warps, num_stages=3)
    fk, bk = _jit(causal_conv1d_fwd_kernel), _jit(causal_conv1d_bwd_kernel)

    def raw_fwd(activation: str | None) -> torch.Tensor:
        y = torch.empty_like(x)
        fk[grid](
            x, y, w, b, None, dev.cu_seqlens, s, dev.chunk_indices, 1, t, *x.stride(),
            ACTIVATION=activation, HAS_WEIGHT=True, HAS_BIAS=True, HAS_RESIDUAL=False,
            USE_INITIAL_STATE=s is not None, IS_VARLEN=True, **common,
        )  # fmt: skip
        return y

    def raw_bwd() -> Any:
        y = raw_fwd(None)
        dx = torch.empty_like(x)
        dw = w.new_empty(nt, *w.shape, dtype=torch.float)
        db = b.new_empty(nt, *b.shape, dtype=torch.float)
        bk[grid](
            x, y, w, s, None, dy, dx, dw, db, dev.cu_seqlens, dev.chunk_indices, 1, t,
            *x.stride(), *dx.stride(), *dy.stride(),
            ACTIVATION=act, HAS_WEIGHT=True, HAS_BIAS=True, USE_INITIAL_STATE=s is not None,
            USE_FINAL_STATE=False, IS_VARLEN=True, **common,
        )  # fmt: skip
        return dx, dw.sum(0).to(w), db.sum(0).to(b)

    return (lambda: raw_fwd(act)), raw_bwd


def sweep_conv(shapes: dict, device: torch.device, repeat: int, grid: list[tuple[int, int]]) -> list[dict]:
    """Milliseconds of the conv's forward and backward per (BD, warps) and case."""
    gen = torch.Generator().manual_seed(1)
    cases = {
        "harts_states": _conv_case(shapes["conv_cu"], shapes["conv_state_rows"], device, gen),
        "harts_no_states": _conv_case(shapes["conv_cu"], None, device, gen),
        "baseline": _conv_case(np.concatenate([[0], np.cumsum(shapes["baseline_lengths"])]), None, device, gen),
    }
    want = {name: [f() for f in _conv_runners(c, None, None)] for name, c in cases.items()}
    rows = []
    for bd, warps in [(None, None), *grid]:
        row: dict[str, Any] = {"BD": bd or "pinned", "num_warps": warps or "pinned"}
        try:
            for name, c in cases.items():
                fwd, bwd = _conv_runners(c, bd, warps)
                torch.testing.assert_close(fwd().float(), want[name][0].float(), rtol=2e-2, atol=2e-2)
                _close([bwd()], [want[name][1]], f"conv {name} backward BD {bd}")
                row[f"{name}_fwd_ms"] = round(median_seconds(fwd, device, repeat) * 1e3, 4)
                row[f"{name}_bwd_ms"] = round(median_seconds(bwd, device, repeat) * 1e3, 4)
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
        head = f"BD {row['BD']!s:>6} warps {row['num_warps']!s:>6}"
        if "error" in row:
            print(f"{head}  {row['error']}", flush=True)
        else:
            print(
                head + "".join(f"  {n} {row[n + '_fwd_ms']:6.3f}/{row[n + '_bwd_ms']:6.3f}" for n in cases), flush=True
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--workload", default="swe")
    p.add_argument("--step", type=int, default=5)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--capacity", type=int, default=65_536)
    p.add_argument("--kernels", default="scan,conv", help="comma-separated subset of scan,conv")
    p.add_argument("--repeat", type=int, default=10)
    add_json_argument(p)
    args = parse(p, argv)
    kernels = set(args.kernels.split(","))
    if not kernels or not kernels <= {"scan", "conv"}:
        p.error(f"--kernels: expected a subset of scan,conv; got {args.kernels!r}")
    device = cuda_device("the sweep times Triton kernels")
    from harts.ops.linear_attn.fla import _import_fla
    from harts.ops.linear_attn.tree_scan import ScanConfig

    _import_fla()
    try:
        shapes = microbatch_shapes(args.workload, args.step, args.dp, args.replica, args.capacity)
    except ValueError as e:
        p.error(str(e))
    r = shapes["rounds"]
    print(
        f"{args.workload} step {args.step}, replica {args.replica} of {args.dp}: harts rounds "
        + ", ".join(f"{len(x['lengths'])} seqs / {sum(x['lengths'])} rows (longest {max(x['lengths'])})" for x in r)
        + f"; baseline {len(shapes['baseline_lengths'])} trajectories / {sum(shapes['baseline_lengths'])} rows"
        f" (longest {max(shapes['baseline_lengths'])}); conv runs {len(shapes['conv_cu']) - 1}",
        flush=True,
    )
    report: dict[str, Any] = {"workload": args.workload, "step": args.step, "dp": args.dp, "replica": args.replica}
    if "scan" in kernels:
        # value block x warps at the default pipelining, then the pipelining at the small blocks
        grid = [ScanConfig(bv, w) for bv, w in itertools.product((16, 32, 64), (2, 4, 8))]
        grid += [ScanConfig(16, 4, 1), ScanConfig(32, 4, 1), ScanConfig(16, 4, 3)]
        print("state scans, ms per microbatch layer (all rounds), median of", args.repeat, flush=True)
        report["scan"] = sweep_scans(shapes, device, args.repeat, grid)
    if "conv" in kernels:
        conv_grid = list(itertools.product((16, 32, 64, 128), (4, 8)))
        print("short conv, ms fwd/bwd per layer, median of", args.repeat, flush=True)
        report["conv"] = sweep_conv(shapes, device, args.repeat, conv_grid)
    write_json(args, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
