"""Count the aten operators one training step issues, trajectory-wise vs compact, by call site.

On a GPU, a step whose kernels are small is bound by how many operators it launches, not by
its FLOPs; this benchmark shows where each execution mode issues them. One forward + backward
of the GRPO-free sum of log-probs (with ``--recompute``: full-layer recomputation) runs under
a ``TorchDispatchMode`` that attributes every aten call to the innermost harts function on
the Python stack (``other`` = autograd internals and code outside harts)::

    python -m benchmarks.step.op_count --workload small --pattern KKKM [--recompute] [--json out.json]

It prints the total per mode and the top call sites side by side. Counts, not times: the
same on any machine for the same inputs and backend.
"""

from __future__ import annotations

import collections
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

import harts
from benchmarks._runner import (
    add_device_argument,
    add_dtype_argument,
    add_json_argument,
    device_of,
    parse,
    parser,
    run,
    write_json,
)

if TYPE_CHECKING:
    from harts.models.execution.config import ExecutionConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.tree.batch import RolloutBatch

__all__ = ["call_site", "count_ops", "main"]

#: The harts package's own directory, with a trailing separator. A call site is a frame whose
#: file lies under it: matching ``/harts/`` anywhere in the path would also take in torch's
#: frames when the clone is named ``harts`` and its venv lives inside it.
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(harts.__file__)), "")


def call_site(filename: str, function: str) -> str | None:
    """``"ops/attention/varlen.py:varlen_causal_attention"`` for a frame in the harts package
    (its path relative to the package, with ``/``), or None for any other file (this benchmark's
    own included: it lies outside the package)."""
    path = os.path.abspath(filename)
    if not path.startswith(PACKAGE_DIR):
        return None
    return f"{os.path.relpath(path, PACKAGE_DIR).replace(os.sep, '/')}:{function}"


def count_ops(model: HybridLM, batch: RolloutBatch, execution: ExecutionConfig) -> collections.Counter:
    """Counter {call site: aten operator calls} for one forward + backward of ``model``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sites: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            frame = sys._getframe(1)
            site = None
            while frame is not None and site is None:
                site = call_site(frame.f_code.co_filename, frame.f_code.co_name)
                frame = frame.f_back
            self.sites[site or "other"] += 1
            return func(*args, **(kwargs or {}))

    model.zero_grad(set_to_none=True)
    with _Count() as counter:
        out = model(batch, execution)
        out.logprobs.sum().backward()
    return counter.sites


def main(argv: list[str] | None = None) -> int:
    from harts.integrations.loading import load_model
    from harts.models.execution.config import ExecutionConfig
    from harts.tree.workloads import load_workload

    p = parser(__doc__, __file__)
    p.add_argument("--workload", default="small", help="preset name or a RolloutBatch file")
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny", metavar="PRESET|PATH", help="model preset or checkpoint directory")
    p.add_argument("--pattern", default=None, help="override a preset's layer pattern, e.g. KKKM")
    p.add_argument("--layers", type=int, default=None, help="a preset's first N decoder layers")
    add_dtype_argument(p, ["float32", "float64", "bfloat16"], "float32")
    add_device_argument(p, "cpu")
    p.add_argument("--la-backend", default="reference", help="linear-attention core (see harts.ops.linear_attn)")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--top", type=int, default=12, help="call sites to print")
    add_json_argument(p)
    args = parse(p, argv)
    device_of(args.device)

    batch = load_workload(args.workload, step=args.step, seed=args.seed)
    model = load_model(
        args.model,
        vocab_size=int(batch.vocab_size or batch.tokens.max() + 1),
        dtype=args.dtype,
        layer_pattern=args.pattern,
        layers=args.layers,
        seed=args.seed,
        device=args.device,
    )
    # per-trajectory / per-branch attention calls, as the counts were always taken
    execution = ExecutionConfig(attention="gather", recompute=args.recompute, linear_attention_backend=args.la_backend)
    counts = {mode: count_ops(model, batch, replace(execution, mode=mode)) for mode in ("trajectory", "compact")}
    totals = {mode: sum(c.values()) for mode, c in counts.items()}
    print(
        f"{args.workload}[{args.step}]: {batch.num_trajectories} paths, {batch.num_tokens:,} tokens; "
        f"aten operators per forward + backward{' (recompute)' if args.recompute else ''}"
    )
    print(
        f"  total: trajectory {totals['trajectory']:,}  compact {totals['compact']:,}  "
        f"(compact / trajectory {totals['compact'] / max(totals['trajectory'], 1):.2f}x)"
    )
    sites = sorted(
        set(counts["trajectory"]) | set(counts["compact"]),
        key=lambda s: -(counts["trajectory"][s] + counts["compact"][s]),
    )
    width = max(len(s) for s in sites[: args.top])
    print(f"  {'call site':<{width}}  trajectory     compact")
    for s in sites[: args.top]:
        print(f"  {s:<{width}}  {counts['trajectory'][s]:>10,}  {counts['compact'][s]:>10,}")
    write_json(
        args,
        {
            "workload": args.workload,
            "step": args.step,
            "totals": totals,
            "sites": {m: dict(c) for m, c in counts.items()},
        },
        indent=1,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
