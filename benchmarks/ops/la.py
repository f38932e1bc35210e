"""Linear-attention core on the rounds of real plans: tree kernel vs fla split path vs plain fla.

    python -m benchmarks.ops.la --workload medium --step 0 --device cuda --json out.json

Every microbatch of the step is planned as in training (``plan_step`` at capacity T,
compaction, Algorithm 1, layout); each of its rounds becomes one linear-attention call on
random inputs of the round's shape (rows, packed sequences, initial states where the round
starts from exported states, every requested boundary state). Backends, on the same rows:

* ``tree``      ``tree_chunk_linear_attn``: one pass, states exported and gradients injected;
* ``fla``       ``fla_chunk_linear_attn``: sequences split at the requested boundaries;
* ``plain``     fla's ``chunk_kda`` / ``chunk_gated_delta_rule`` with the same sequences and
                initial states and no states requested: the floor a one-pass kernel aims at;
* ``reference`` the torch reference (any device; the CPU smoke test uses it).

Forward and forward + backward (loss: outputs, final and requested states, each against a
fixed random weight) are timed with CUDA events (host clocks on CPU) after one untimed warm-up
per round, median of ``--repeat``. Printed per backend: totals over all rounds, totals over
rounds with >= 8 requests, and the ratios the one-pass kernel is judged by (tree / plain,
fla / tree). ``--json`` writes every round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

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

__all__ = ["RoundShape", "round_shapes", "time_round", "main"]


@dataclass(frozen=True)
class RoundShape:
    """One linear-attention call of a plan: its packed sequences and state traffic."""

    microbatch: int
    round: int
    cu_seqlens: list[int]
    #: per sequence: starts from an exported state (True) or from zeros
    has_initial: list[bool]
    requests: list[tuple[int, int]]

    @property
    def rows(self) -> int:
        return self.cu_seqlens[-1]


def round_shapes(batch, *, capacity: int, chunk_size: int, max_microbatches: int | None = None) -> list[RoundShape]:  # noqa: ANN001
    """The rounds of every microbatch of ``batch`` planned as in training (dp = 1)."""
    from harts.plan.calls import plan_calls
    from harts.plan.layout import build_layout
    from harts.plan.step import plan_step
    from harts.tree.compact import compact

    plan = plan_step(batch, dp=1, capacity=capacity)
    out = []
    for m, mb in enumerate(plan.microbatches[:max_microbatches]):
        cb = compact(batch.select(mb))
        layout = build_layout(cb, plan_calls(cb.segment_trees, chunk_size))
        for r, view in enumerate(layout.rounds):
            req = np.asarray(view.requests, dtype=np.int64).reshape(-1, 2)
            out.append(
                RoundShape(
                    microbatch=m,
                    round=r,
                    cu_seqlens=[int(x) for x in view.cu_seqlens],
                    has_initial=[bool(i >= 0) for i in np.asarray(view.init_state)],
                    requests=[(int(a), int(b)) for a, b in req],
                )
            )
    return out


@dataclass
class RoundTiming:
    shape: RoundShape
    forward_ms: dict[str, float] = field(default_factory=dict)
    forward_backward_ms: dict[str, float] = field(default_factory=dict)


def _inputs(
    shape: RoundShape, H: int, K: int, V: int, scalar_decay: bool, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    T, N = shape.rows, len(shape.cu_seqlens) - 1

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    q = rnd(T, H, K)
    k = torch.nn.functional.normalize(rnd(T, H, K), dim=-1)
    v = rnd(T, H, V)
    gate = -torch.nn.functional.softplus(rnd(*((T, H) if scalar_decay else (T, H, K)))) * 0.2
    beta = torch.rand(T, H, generator=g).clamp(0.05, 0.95)
    xs = [t.to(device=device, dtype=dtype) for t in (q, k, v, gate, beta)]
    h0 = None
    if any(shape.has_initial):
        mask = torch.tensor(shape.has_initial, dtype=torch.float32)[:, None, None, None]
        h0 = (rnd(N, H, K, V) * 0.1 * mask).to(device)
    return xs, h0


def _op(backend: str, device: torch.device) -> Callable:
    if backend == "plain":
        from harts.ops.linear_attn.fla import _import_fla

        _import_fla()
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda

        def plain(
            q,
            k,
            v,
            g,
            beta,
            *,
            cu_seqlens,
            initial_state=None,
            chunk_size=64,
            state_requests=None,  # noqa: ANN001, ANN202
            scale=None,
        ):
            fn = chunk_gated_delta_rule if g.dim() == 2 else chunk_kda
            o, ht = fn(
                *(t.unsqueeze(0) for t in (q, k, v, g, beta)),
                initial_state=initial_state,
                output_final_state=True,
                cu_seqlens=cu_seqlens.to(q.device),
            )
            return o[0], ht, ht.new_zeros(0, *ht.shape[1:])

        return plain
    from harts.ops.linear_attn.dispatch import linear_attn_op

    return linear_attn_op(backend, device)


def _gdn_backward_refused(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    from harts.ops.linear_attn.fla import _gdn_backward_broken

    return _gdn_backward_broken()


def time_round(
    shape: RoundShape,
    backends: list[str],
    *,
    H: int,
    K: int,
    V: int,
    scalar_decay: bool,
    dtype: torch.dtype,
    device: torch.device,
    chunk_size: int,
    repeat: int,
    seed: int = 0,
) -> RoundTiming:
    """Forward and forward + backward milliseconds of one round for every backend."""
    xs, h0 = _inputs(shape, H, K, V, scalar_decay, dtype, device, seed)
    cu = torch.tensor(shape.cu_seqlens, dtype=torch.int64)  # host: the ops plan without a device sync
    req = torch.tensor(shape.requests, dtype=torch.int64).reshape(-1, 2)
    timing = RoundTiming(shape=shape)
    for backend in backends:
        op = _op(backend, device)
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        init = None if h0 is None else h0.detach().clone().requires_grad_()
        requests = None if backend == "plain" or not len(req) else req

        def forward() -> tuple[torch.Tensor, ...]:
            return op(*leaves, cu_seqlens=cu, initial_state=init, chunk_size=chunk_size, state_requests=requests)

        def fwd_bwd() -> None:
            o, final, states = forward()
            loss = o.float().sum() + final.sum() * 1e-3 + states.sum() * 1e-3
            params = [t for t in [*leaves, init] if t is not None]
            torch.autograd.grad(loss, params)

        def fwd_only() -> None:
            with torch.no_grad():
                forward()

        # device time (CUDA events) after one warm-up run: compile, caches
        timing.forward_ms[backend] = 1e3 * median_seconds(fwd_only, device, repeat, events=True)
        if backend == "plain" and scalar_decay and _gdn_backward_refused(device):
            timing.forward_backward_ms[backend] = float("nan")  # fla #640: no GDN backward on this setup
            continue
        timing.forward_backward_ms[backend] = 1e3 * median_seconds(fwd_bwd, device, repeat, events=True)
    return timing


def main(argv: list[str] | None = None) -> int:
    from harts.commands._table import format_table
    from harts.tree.workloads import PRESETS, generate

    p = parser(__doc__, __file__)
    p.add_argument("--workload", default="medium", choices=sorted(PRESETS))
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity", type=int, default=65_536)
    p.add_argument("--microbatches", type=int, default=None, help="only the first N microbatches")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="key and value head dim")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--decay", choices=["kda", "gdn"], default="kda")
    add_dtype_argument(p, ["bfloat16", "float32", "float64"], "bfloat16")
    add_device_argument(p, "cuda")
    p.add_argument("--backends", default="tree,fla,plain", help="comma-separated: tree, fla, plain, reference")
    p.add_argument("--repeat", type=int, default=3)
    add_json_argument(p)
    args = parse(p, argv)
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in ("tree", "fla", "plain", "reference")]
    if bad:
        p.error(f"unknown backend(s) {bad}; choose from tree, fla, plain, reference")
    device = device_of(args.device)
    batch = generate(args.workload, step=args.step, seed=args.seed)
    shapes = round_shapes(batch, capacity=args.capacity, chunk_size=args.chunk_size, max_microbatches=args.microbatches)
    print(
        f"{args.workload}[{args.step}]: {len(shapes)} rounds, {sum(s.rows for s in shapes):,} rows, "
        f"{sum(len(s.requests) for s in shapes):,} requested states; H {args.heads}, K = V = {args.dim}, "
        f"{args.decay}, {args.dtype} on {device}",
        flush=True,
    )
    timings = [
        time_round(
            s,
            backends,
            H=args.heads,
            K=args.dim,
            V=args.dim,
            scalar_decay=args.decay == "gdn",
            dtype=dtype_of(args.dtype),
            device=device,
            chunk_size=args.chunk_size,
            repeat=args.repeat,
            seed=i,
        )
        for i, s in enumerate(shapes)
    ]
    many = [t for t in timings if len(t.shape.requests) >= 8]
    rows = []
    for b in backends:
        rows.append(
            [
                b,
                f"{sum(t.forward_ms[b] for t in timings):.2f}",
                f"{sum(t.forward_backward_ms[b] for t in timings):.2f}",
                f"{sum(t.forward_ms[b] for t in many):.2f}",
                f"{sum(t.forward_backward_ms[b] for t in many):.2f}",
            ]
        )
    print(
        format_table(
            ["backend", "fwd ms (all)", "fwd+bwd ms (all)", f"fwd ms (>=8 req, {len(many)})", "fwd+bwd ms (>=8 req)"],
            rows,
        )
    )
    summary = {}
    if "tree" in backends and "plain" in backends:
        summary["tree_over_plain_fwd_bwd"] = sum(t.forward_backward_ms["tree"] for t in timings) / max(
            sum(t.forward_backward_ms["plain"] for t in timings), 1e-9
        )
    if "tree" in backends and "fla" in backends and many:
        summary["split_over_tree_fwd_bwd_ge8"] = sum(t.forward_backward_ms["fla"] for t in many) / max(
            sum(t.forward_backward_ms["tree"] for t in many), 1e-9
        )
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    write_json(
        args,
        {
            "args": {k: v for k, v in vars(args).items() if k != "command_line"},
            "summary": summary,
            "rounds": [
                {**asdict(t.shape), "forward_ms": t.forward_ms, "forward_backward_ms": t.forward_backward_ms}
                for t in timings
            ],
        },
        indent=1,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
