"""Linear-attention core on the rounds of real plans: tree kernel vs fla split path vs plain fla.

    python -m benchmarks.ops.la --workload medium --step 0 --device cuda --json out.json
    python -m benchmarks.ops.la --rule plain --model nemotron_3_nano_30b_a3b --backends tree,plain ...

Every microbatch of the step is planned as in training (``plan_step`` at capacity T,
compaction, Algorithm 1, layout); each of its rounds becomes one linear-attention call on
random inputs of the round's shape (rows, packed sequences, initial states where the round
starts from exported states, every requested boundary state). Backends, on the same rows:

* ``tree``      ``tree_chunk_linear_attn``: one pass, states exported and gradients injected;
* ``fla``       ``fla_chunk_linear_attn``: sequences split at the requested boundaries;
* ``plain``     fla's ``chunk_kda`` / ``chunk_gated_delta_rule`` (``--rule plain``:
                ``chunk_simple_gla``) with the same sequences and initial states and no states
                requested: the floor a one-pass kernel aims at;
* ``reference`` the torch reference (any device; the CPU smoke test uses it).

``--rule delta`` (default) times KDA (``--decay kda``) or GDN; ``--rule plain`` times Mamba-2's
SSD, the plain recurrence S_t = exp(g_t) S_{t-1} + k_t v_t^T with scale 1 (``harts.models.layers
.mamba2``): q = C and k = B (standard normal), v = x dt, g = -A dt with dt = softplus(N(0, 1) - 3)
and A ~ U(1, 16) per head, as the layer makes them. ``--model PRESET`` takes that preset's Mamba-2
shapes (heads, state size as the key dim, head dim as the value dim); the tree kernel's plain rule
checks itself against the reference operator once per shape (``tree_kernel.plain_on_tree``) and
the run says which one it ran.

Forward and forward + backward (loss: the outputs' sum plus 1e-3 times the final and requested
states' sums, gradients for every input) are timed with CUDA events (host clocks on CPU) after one untimed warm-up
per round, median of ``--repeat``. Printed per backend: totals over all rounds, totals over
rounds with >= 8 requests, the ratio row tree / plain beside them (the one-pass kernel's target:
within 1.15x), and fla / tree. ``--json`` writes every round.
"""

from __future__ import annotations

import argparse
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

__all__ = ["RoundShape", "mamba2_shapes", "round_shapes", "time_round", "main"]

#: the one-pass kernel's aim: forward + backward within this factor of plain fla on the same rows
TREE_OVER_PLAIN_TARGET = 1.15


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
    shape: RoundShape,
    H: int,
    K: int,
    V: int,
    rule: str,
    scalar_decay: bool,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Random q, k, v, g [, beta] of one round (module docstring), and its initial states [N, H, K, V]."""
    g = torch.Generator().manual_seed(seed)
    T, N = shape.rows, len(shape.cu_seqlens) - 1

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    q = rnd(T, H, K)
    if rule == "plain":
        k = rnd(T, H, K)
        dt = torch.nn.functional.softplus(rnd(T, H) - 3)
        v = rnd(T, H, V) * dt[..., None]
        gate = -torch.empty(H).uniform_(1, 16, generator=g) * dt
        beta = None
    else:
        k = torch.nn.functional.normalize(rnd(T, H, K), dim=-1)
        v = rnd(T, H, V)
        gate = -torch.nn.functional.softplus(rnd(*((T, H) if scalar_decay else (T, H, K)))) * 0.2
        beta = torch.rand(T, H, generator=g).clamp(0.05, 0.95).to(device=device, dtype=dtype)
    xs = [t.to(device=device, dtype=dtype) for t in (q, k, v, gate)]
    h0 = None
    if any(shape.has_initial):
        mask = torch.tensor(shape.has_initial, dtype=torch.float32)[:, None, None, None]
        h0 = (rnd(N, H, K, V) * 0.1 * mask).to(device)
    return xs, beta, h0


def _op(backend: str, device: torch.device, rule: str = "delta") -> Callable:
    """The operator ``backend`` names, with ``chunk_linear_attn``'s signature (``rule`` and
    ``scale`` passed by the caller); "plain" is fla's own chunked kernel of the rule, which
    exports no requested states (an empty tensor in their place)."""
    if backend == "plain":
        from harts.ops.linear_attn.fla import _import_fla

        _import_fla()
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda
        from fla.ops.simple_gla import chunk_simple_gla

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
            rule="delta",
        ):
            cu = cu_seqlens.to(q.device)
            if rule == "plain":
                o, ht = chunk_simple_gla(
                    *(t.unsqueeze(0) for t in (q, k, v, g)),
                    scale=scale,
                    initial_state=initial_state,
                    output_final_state=True,
                    cu_seqlens=cu,
                    cu_seqlens_cpu=cu_seqlens.cpu(),
                    chunk_size=chunk_size,
                )
            else:
                fn = chunk_gated_delta_rule if g.dim() == 2 else chunk_kda
                o, ht = fn(
                    *(t.unsqueeze(0) for t in (q, k, v, g, beta)),
                    initial_state=initial_state,
                    output_final_state=True,
                    cu_seqlens=cu,
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
    rule: str = "delta",
) -> RoundTiming:
    """Forward and forward + backward milliseconds of one round for every backend (``rule``
    "plain": Mamba-2's SSD at scale 1, ``scalar_decay`` implied)."""
    xs, beta, h0 = _inputs(shape, H, K, V, rule, scalar_decay, dtype, device, seed)
    cu = torch.tensor(shape.cu_seqlens, dtype=torch.int64)  # host: the ops plan without a device sync
    req = torch.tensor(shape.requests, dtype=torch.int64).reshape(-1, 2)
    # the delta rule's default scale (K ** -0.5) is every backend's; the SSD has none
    kw = {"rule": "plain", "scale": 1.0} if rule == "plain" else {}
    timing = RoundTiming(shape=shape)
    for backend in backends:
        op = _op(backend, device)
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        b = None if beta is None else beta.detach().clone().requires_grad_()
        init = None if h0 is None else h0.detach().clone().requires_grad_()
        requests = None if backend == "plain" or not len(req) else req

        def forward() -> tuple[torch.Tensor, ...]:
            return op(
                *leaves, b, cu_seqlens=cu, initial_state=init, chunk_size=chunk_size, state_requests=requests, **kw
            )

        def fwd_bwd() -> None:
            o, final, states = forward()
            loss = o.float().sum() + final.sum() * 1e-3 + states.sum() * 1e-3
            params = [t for t in [*leaves, b, init] if t is not None]
            torch.autograd.grad(loss, params)

        def fwd_only() -> None:
            with torch.no_grad():
                forward()

        # device time (CUDA events) after one warm-up run: compile, caches
        timing.forward_ms[backend] = 1e3 * median_seconds(fwd_only, device, repeat, events=True)
        if backend == "plain" and (scalar_decay or rule == "plain") and _gdn_backward_refused(device):
            # fla #640: no GDN / simple_gla backward on this setup
            timing.forward_backward_ms[backend] = float("nan")
            continue
        timing.forward_backward_ms[backend] = 1e3 * median_seconds(fwd_bwd, device, repeat, events=True)
    return timing


def mamba2_shapes(model: str) -> tuple[int, int, int]:
    """(heads, key dim, value dim) of the Mamba-2 layers of preset ``model``: the SSD's heads, its
    state size (B and C, expanded from groups to heads) and its head dim (x dt)."""
    from harts.errors import UserError
    from harts.models.config import HybridConfig

    c = HybridConfig.preset(model)
    if "S" not in c.layer_pattern:
        raise UserError(f"--model {model} has no Mamba-2 layers ('S' in its pattern {c.layer_pattern})")
    return c.mamba_num_heads, c.ssm_state_size, c.mamba_head_dim


def _plain_kernels(H: int, K: int, V: int, dtype: torch.dtype, device: torch.device) -> str:
    """Which operator the tree backend's plain rule ran on (its once-per-shape check's verdict)."""
    from harts.ops.linear_attn.tree_kernel import plain_on_tree

    q, v = torch.empty(1, H, K, dtype=dtype, device=device), torch.empty(1, H, V, dtype=dtype, device=device)
    on_tree = plain_on_tree(q, v, torch.empty(1, H, dtype=dtype, device=device))
    return "fla-core's simple_gla kernels around harts' scans" if on_tree else "the reference operator (check differed)"


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from harts.tree.workloads import PRESETS

    p.add_argument("--workload", default="medium", choices=sorted(PRESETS))
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity", type=int, default=65_536)
    p.add_argument("--microbatches", type=int, default=None, help="only the first N microbatches")
    p.add_argument("--rule", choices=["delta", "plain"], default="delta", help="delta: KDA / GDN; plain: Mamba-2's SSD")
    p.add_argument(
        "--model",
        default=None,
        metavar="PRESET",
        help="with --rule plain: the heads, state size (key dim) and head dim (value dim) of this preset's "
        "Mamba-2 layers, in place of --heads, --key-dim and --dim",
    )
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="value head dim (and key head dim unless --key-dim)")
    p.add_argument("--key-dim", type=int, default=None, help="key head dim (default: --dim)")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--decay", choices=["kda", "gdn"], default="kda", help="with --rule delta: the decay's kind")
    add_dtype_argument(p, ["bfloat16", "float32", "float64"], "bfloat16")
    add_device_argument(p, "cuda")
    p.add_argument("--backends", default="tree,fla,plain", help="comma-separated: tree, fla, plain, reference")
    p.add_argument("--repeat", type=int, default=3)
    add_json_argument(p)


def _ratio(timings: list[RoundTiming], num: str, den: str, forward: bool) -> float:
    """sum(num) / sum(den) over ``timings``, forward or forward + backward milliseconds."""

    def total(b: str) -> float:
        return sum((t.forward_ms if forward else t.forward_backward_ms)[b] for t in timings)

    return total(num) / max(total(den), 1e-9)


def main(argv: list[str] | None = None) -> int:
    from harts.commands._table import format_table
    from harts.tree.workloads import generate

    p = parser(__doc__, __file__)
    _add_arguments(p)
    args = parse(p, argv)
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in ("tree", "fla", "plain", "reference")]
    if bad:
        p.error(f"unknown backend(s) {bad}; choose from tree, fla, plain, reference")
    if args.model is not None and args.rule != "plain":
        p.error("--model takes a preset's Mamba-2 shapes: it needs --rule plain")
    H, K, V = (
        mamba2_shapes(args.model) if args.model else (args.heads, args.key_dim or args.dim, args.dim)
    )  # before any work
    device = device_of(args.device)
    dtype = dtype_of(args.dtype)
    batch = generate(args.workload, step=args.step, seed=args.seed)
    shapes = round_shapes(batch, capacity=args.capacity, chunk_size=args.chunk_size, max_microbatches=args.microbatches)
    kind = f"plain (Mamba-2 SSD{f', {args.model}' if args.model else ''})" if args.rule == "plain" else args.decay
    print(
        f"{args.workload}[{args.step}]: {len(shapes)} rounds, {sum(s.rows for s in shapes):,} rows, "
        f"{sum(len(s.requests) for s in shapes):,} requested states; H {H}, K {K}, V {V}, "
        f"{kind}, {args.dtype} on {device}",
        flush=True,
    )
    timings = [
        time_round(
            s,
            backends,
            H=H,
            K=K,
            V=V,
            scalar_decay=args.decay == "gdn",
            dtype=dtype,
            device=device,
            chunk_size=args.chunk_size,
            repeat=args.repeat,
            seed=i,
            rule=args.rule,
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
    summary: dict[str, float | str] = {}
    if "tree" in backends and "plain" in backends:
        cells = [
            f"{_ratio(ts, 'tree', 'plain', fwd):.3f}x" if ts else "-" for ts in (timings, many) for fwd in (True, False)
        ]
        rows.append(["tree / plain", *cells])
        summary["tree_over_plain_fwd"] = _ratio(timings, "tree", "plain", True)
        summary["tree_over_plain_fwd_bwd"] = _ratio(timings, "tree", "plain", False)
    if "tree" in backends and "fla" in backends and many:
        summary["split_over_tree_fwd_bwd_ge8"] = _ratio(many, "fla", "tree", False)
    print(
        format_table(
            ["backend", "fwd ms (all)", "fwd+bwd ms (all)", f"fwd ms (>=8 req, {len(many)})", "fwd+bwd ms (>=8 req)"],
            rows,
        )
    )
    if args.rule == "plain" and "tree" in backends and device.type == "cuda":
        summary["tree_plain_kernels"] = _plain_kernels(H, K, V, dtype, device)
    for k, v in summary.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if "tree_over_plain_fwd_bwd" in summary:
        print(f"target: tree / plain fwd+bwd within {TREE_OVER_PLAIN_TARGET}x")
    write_json(
        args,
        {
            "args": {k: v for k, v in vars(args).items() if k != "command_line"},
            "shapes": {"heads": H, "key_dim": K, "value_dim": V, "rule": args.rule},
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
