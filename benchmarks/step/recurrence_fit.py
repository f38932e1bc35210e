"""The linear-attention recurrence's price in a ``harts bench`` result, after the fact.

    python -m benchmarks.step.recurrence_fit RESULT.json --workload swe [--seed 0] [--chunk-size 64]

``harts bench`` now records each microbatch's sequential chunk steps (``microbatch_chain``) and
prints ``StepBench.recurrence_fit``. For a result written before that (or on another machine),
this plans every step of ``RESULT.json`` again on the CPU as ``bench_step`` does (the workload
preset, ``--seed``, the JSON's capacity, dp and replica), checks that each microbatch has the
rows the JSON timed (so the plans are the ones that ran), counts the chains, and prints the
same fit. Planning a paper-scale ``swe`` step takes a few minutes on two cores.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from benchmarks._runner import add_json_argument, parse, parser, run, write_json
from harts.experiments.bench_result import BenchSide, StepBench, recurrence_words
from harts.experiments.counts import layout_chunk_steps, trajectory_chunk_steps

__all__ = ["chains_of_step", "fit_result", "main"]


def chains_of_step(
    batch,  # noqa: ANN001 - a harts.tree.batch.RolloutBatch
    *,
    capacity: int,
    dp: int,
    replica: int,
    chunk_size: int,
) -> dict[str, tuple[list[int], list[int]]]:
    """{"baseline": (rows, chains), "harts": (rows, chains)} of replica ``replica``'s microbatches,
    planned as ``bench_step`` plans them; rows as ``BenchSide.microbatch_rows``."""
    from harts.plan.baselines.trajectory_plan import plan_trajectory_step
    from harts.plan.layout import build_layout
    from harts.plan.step import plan_step

    plan = plan_step(batch, dp=dp, capacity=capacity)
    harts_rows, harts_chain = [], []
    for cb, calls in plan.prepare_replica(replica, chunk_size):
        harts_rows.append(int(cb.num_compact_tokens))
        harts_chain.append(layout_chunk_steps(build_layout(cb, calls), chunk_size))
    raw = plan_trajectory_step(batch.lengths, dp=dp, capacity=capacity)
    base_rows, base_chain = [], []
    for k in raw.for_replica(replica):
        lengths = batch.lengths[raw.microbatches[k]]
        base_rows.append(int(lengths.sum()))
        base_chain.append(trajectory_chunk_steps(lengths, chunk_size))
    return {"baseline": (base_rows, base_chain), "harts": (harts_rows, harts_chain)}


def _side(d: dict[str, Any], chain: list[int]) -> BenchSide:
    names = {f.name for f in fields(BenchSide)}
    return BenchSide(**{**{k: v for k, v in d.items() if k in names}, "microbatch_chain": chain})


def fit_result(result: dict[str, Any], workload: str, *, seed: int = 0, chunk_size: int | None = None) -> list[dict]:
    """``recurrence_fit`` of every step in a ``harts bench --json`` result (one dict per step,
    with "step" and "fit"). Raises ``ValueError`` naming the step and side whose replanned rows
    differ from the timed ones (another workload, seed, or planner than the run's)."""
    from harts.models.config import HybridConfig
    from harts.tree.workloads import generate

    if chunk_size is None:
        try:
            chunk_size = HybridConfig.preset(result["model"]).chunk_size
        except ValueError as e:
            raise ValueError(f"model {result['model']!r} is not a preset: give --chunk-size ({e})") from None
    out = []
    for st in result["steps"]:
        batch = generate(workload, step=st["step"], seed=seed)
        counted = chains_of_step(
            batch, capacity=result["capacity"], dp=st["dp"], replica=st["replica"], chunk_size=chunk_size
        )
        sides = {}
        for name, (rows, chain) in counted.items():
            timed = st[name]["microbatch_rows"]
            if rows != timed:
                raise ValueError(
                    f"step {st['step']}, {name}: replanned microbatch rows {rows[:4]}... differ from the timed "
                    f"{timed[:4]}... ({len(rows)} vs {len(timed)} microbatches): not this run's workload or seed"
                )
            sides[name] = _side(st[name], chain)
        bench = StepBench(
            step=st["step"],
            paths=st["paths"],
            raw_tokens=st["raw_tokens"],
            baseline=sides["baseline"],
            harts=sides["harts"],
        )
        out.append({"step": st["step"], "fit": bench.recurrence_fit()})
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("result", help="a `harts bench --json` file")
    p.add_argument("--workload", required=True, help="the run's built-in workload preset")
    p.add_argument("--seed", type=int, default=0, help="the run's --seed (default: 0)")
    p.add_argument("--chunk-size", type=int, default=None, help="default: the JSON's model preset's")
    add_json_argument(p)
    args = parse(p, argv)
    try:
        with open(args.result) as f:
            result = json.load(f)
        fits = fit_result(result, args.workload, seed=args.seed, chunk_size=args.chunk_size)
    except (OSError, ValueError, KeyError) as e:
        p.error(f"{args.result}: {e}")
    for r in fits:
        print(
            f"step {r['step']}: "
            + (
                "no fit (too few microbatches, or rows and chains do not separate)"
                if r["fit"] is None
                else recurrence_words(r["fit"])
            )
        )
    write_json(args, fits, indent=1, quiet=True)  # one fit per step, in the result's order
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
