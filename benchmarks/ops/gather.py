"""Row gathers ``x[index]`` as the MoE and compact linear attention issue them: which kernel is fastest.

    python -m benchmarks.ops.gather --device cuda --json out.json

The MoE gathers every (token, chosen expert) pair's row before its grouped GEMMs
(``x[src]``: T x K rows of width D, each row K times, in expert order), and compact execution
gathers every round's linear-attention input rows (``harts.ops.row_gather``: about one row each, in
nearly physical order). A profile of a training step found the first at about 1.75 TB/s on an
H200, well below the device's bandwidth. This times, on the same inputs and index:

* ``index``         ``x[index]`` (``aten::index``, what harts calls now);
* ``index_select``  ``torch.index_select(x, 0, index)`` (a row-gather kernel);
* ``take_along``    ``torch.gather`` with the index expanded over D;
* ``compiled``      ``x[index]`` under ``torch.compile`` (Inductor's generated gather, CUDA only).

Two index patterns: ``moe`` (``argsort`` of random expert choices, ``--topk`` copies of each of
``--rows`` rows) and ``rounds`` (a permutation that is the identity but for ``--shuffled`` of the
rows). Printed: milliseconds (median of ``--repeat`` after a warm-up) and TB/s (bytes read + written:
2 x index length x D x element size, the index ignored). Every variant's result is checked equal to
``index``'s, so only speed differs.
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
    write_json,
)

__all__ = ["GATHERS", "gather_indices", "main"]

GATHERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "index": lambda x, i: x[i],
    "index_select": lambda x, i: torch.index_select(x, 0, i),
    "take_along": lambda x, i: torch.gather(x, 0, i[:, None].expand(-1, x.shape[1])),
}


def gather_indices(
    pattern: str, rows: int, topk: int, experts: int, shuffled: float, generator: torch.Generator
) -> torch.Tensor:
    """int64 index of ``pattern`` ("moe": [rows * topk], "rounds": [rows]) into ``rows`` rows."""
    if pattern == "moe":
        scores = torch.rand(rows, experts, generator=generator)
        choice = scores.topk(topk, dim=1).indices.reshape(-1)
        return torch.argsort(choice, stable=True) // topk
    if pattern == "rounds":
        index = torch.arange(rows)
        moved = torch.randperm(rows, generator=generator)[: int(shuffled * rows)]
        index[moved] = moved[torch.randperm(moved.numel(), generator=generator)]
        return index
    raise ValueError(f"pattern must be 'moe' or 'rounds'; got {pattern!r}")


def _bound(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, i: torch.Tensor
) -> Callable[[], object]:
    return lambda: fn(x, i)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    add_device_argument(p, "cpu")
    p.add_argument("--rows", type=int, default=65_536, help="rows of x (tokens of a microbatch)")
    p.add_argument("--dim", type=int, default=1536, help="row width D (ling3_tiny's hidden size)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (moe pattern)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--shuffled", type=float, default=0.01, help="fraction of rows out of place (rounds pattern)")
    add_dtype_argument(p, ["bfloat16", "float32"], "bfloat16")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    add_json_argument(p)
    args = parse(p, argv)
    for name in ("rows", "dim", "topk", "experts", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive; got {getattr(args, name)}")
    if not 0 <= args.shuffled <= 1:
        p.error(f"--shuffled must lie in [0, 1]; got {args.shuffled}")
    if args.topk > args.experts:
        p.error(f"--topk ({args.topk}) cannot exceed --experts ({args.experts})")
    device = device_of(args.device)

    gathers = dict(GATHERS)
    if device.type == "cuda" and not args.no_compile:
        gathers["compiled"] = torch.compile(GATHERS["index"], dynamic=False)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.dim, generator=gen).to(device, dtype_of(args.dtype))
    report: dict = {"rows": args.rows, "dim": args.dim, "dtype": args.dtype, "device": str(device), "patterns": {}}
    print(f"x [{args.rows}, {args.dim}] {args.dtype} on {device}; ms (median of {args.repeat}) and TB/s")
    print(f"{'pattern':8} {'index len':>10} " + " ".join(f"{n:>22}" for n in gathers))
    for pattern in ("moe", "rounds"):
        index = gather_indices(pattern, args.rows, args.topk, args.experts, args.shuffled, gen).to(device)
        nbytes = 2 * index.numel() * args.dim * x.element_size()
        ref = GATHERS["index"](x, index)
        row = {}
        for name, fn in gathers.items():
            if not torch.equal(fn(x, index), ref):
                raise AssertionError(f"{name} gathers different values than x[index] ({pattern})")
            sec = median_seconds(_bound(fn, x, index), device, args.repeat)
            row[name] = {"ms": round(sec * 1e3, 4), "tb_per_s": round(nbytes / max(sec, 1e-12) / 1e12, 3)}
        report["patterns"][pattern] = {"index_length": index.numel(), "variants": row}
        cells = " ".join(f"{v['ms']:>12.3f} ms {v['tb_per_s']:>5.2f}" for v in row.values())
        print(f"{pattern:8} {index.numel():>10,} {cells}")
    write_json(args, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
