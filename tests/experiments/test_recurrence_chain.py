"""``harts bench``'s linear-attention chain: the sequential chunk steps of a microbatch's state
recurrence (trajectory-wise: its longest trajectory; compact: each call's longest sequence,
summed over the calls), and the fit over both sides' microbatches that prices them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import harts
from harts.experiments.bench_result import BenchSide, StepBench
from harts.experiments.counts import recurrence_chunk_steps
from harts.experiments.step_bench import bench_step
from harts.tree.batch import RolloutBatch
from harts.tree.workloads import generate


def _model(pattern: str = "KM", chunk: int = 16) -> harts.HybridLM:
    torch.manual_seed(0)
    return harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern=pattern, chunk_size=chunk))


def _trunk_and_two_leaves() -> RolloutBatch:
    # a 64-token trunk (4 chunks of 16) and two leaves of 32 and 48 tokens
    rng = np.random.default_rng(0)
    trunk = rng.integers(1, 60, 64).tolist()
    return RolloutBatch.from_trajectories([trunk + [1] * 32, trunk + [2] * 48])


def test_trajectory_mode_counts_the_longest_trajectory() -> None:
    batch = _trunk_and_two_leaves()  # 96 and 112 tokens
    assert recurrence_chunk_steps(batch, None, "trajectory", 16) == 7
    assert recurrence_chunk_steps(batch, None, "trajectory", 64) == 2
    assert recurrence_chunk_steps(RolloutBatch.from_trajectories([[1] * 17]), None, "trajectory", 16) == 2


def test_compact_mode_sums_each_calls_longest_sequence() -> None:
    model = _model()
    batch = _trunk_and_two_leaves()
    inputs = model.prepare_compact(batch)
    assert len(inputs.layout.rounds) == 2
    # the trunk crosses a chunk boundary, so the side leaf waits one call for the state at 64:
    # call 0 runs the trunk and its continuing leaf, call 1 the other leaf from the anchor 64;
    # 4 trunk chunks + 2 or 3 chunks of leaf in call 0, 3 or 2 in call 1: 9 either way
    assert recurrence_chunk_steps(batch, inputs, "compact", 16) == 9
    with pytest.raises(ValueError, match="chunk_size"):
        recurrence_chunk_steps(batch, inputs, "compact", 0)


def test_compact_chain_never_beats_the_longest_path_and_a_chain_equals_it() -> None:
    model = _model()
    for step in range(3):
        batch = generate("tiny", step=step)
        inputs = model.prepare_compact(batch)
        longest = recurrence_chunk_steps(batch, None, "trajectory", 16)
        assert recurrence_chunk_steps(batch, inputs, "compact", 16) >= longest
    single = RolloutBatch.from_trajectories([list(range(1, 50))])
    assert recurrence_chunk_steps(single, model.prepare_compact(single), "compact", 16) == 4


def _side(rows: list[int], chain: list[int], seconds: list[float], pairs: list[int] | None = None) -> BenchSide:
    return BenchSide(
        microbatches=len(rows),
        rows=sum(rows),
        calls=len(rows),
        replay_rows=0,
        plan_seconds=0.0,
        train_seconds=sum(seconds),
        peak_memory_gb=None,
        raw_tokens=sum(rows),
        microbatch_seconds=seconds,
        microbatch_rows=rows,
        microbatch_pairs=[r * 1000 for r in rows] if pairs is None else pairs,
        microbatch_chain=chain,
    )


def test_fit_recovers_the_cost_of_a_step_and_prices_harts_chain() -> None:
    fixed, per_k, per_g, per_step = 0.02, 0.006, 0.3, 0.0002
    rng = np.random.default_rng(1)

    def side(n: int, rows_hi: int, steps_per_k: float) -> BenchSide:
        rows = rng.integers(20_000, rows_hi, n).tolist()
        chain = [int(r / 1e3 * steps_per_k * rng.uniform(0.6, 1.4)) for r in rows]
        # long sequences bring pairs too: pairs grow with the chain, plus noise
        pairs = [int(c * 64 * r * rng.uniform(0.2, 0.5)) for r, c in zip(rows, chain)]
        sec = [fixed + per_k * r / 1e3 + per_g * p / 1e9 + per_step * c for r, p, c in zip(rows, pairs, chain)]
        return _side(rows, chain, sec, pairs)

    base, harts_side = side(20, 65_000, 4.0), side(8, 60_000, 8.0)
    fit = StepBench(step=0, paths=1, raw_tokens=1, baseline=base, harts=harts_side).recurrence_fit()
    assert fit is not None
    assert fit["fixed_seconds"] == pytest.approx(fixed, abs=1e-5)
    assert fit["seconds_per_1k_rows"] == pytest.approx(per_k, rel=1e-3)
    assert fit["seconds_per_g_pairs"] == pytest.approx(per_g, rel=1e-3)
    assert fit["seconds_per_step"] == pytest.approx(per_step, rel=1e-3)
    assert fit["rms_seconds"] < 1e-6 < fit["rms_seconds_without_steps"]
    steps = sum(harts_side.microbatch_chain)
    assert fit["harts_chain_seconds"] == pytest.approx(per_step * steps, rel=1e-3)
    # at the baseline's steps per row, harts saves exactly its extra steps' price
    extra = steps - fit["steps_per_1k_rows"]["baseline"] * harts_side.rows / 1e3
    assert fit["harts_at_baseline_steps_seconds"] == pytest.approx(
        harts_side.train_seconds - per_step * extra, abs=1e-3
    )
    assert fit["steps_per_1k_rows"]["harts"] > fit["steps_per_1k_rows"]["baseline"]


def test_fit_refuses_what_it_cannot_separate() -> None:
    flat = _side([1000, 2000, 3000], [1, 2, 3], [0.1, 0.2, 0.3])  # chain and pairs proportional to rows
    assert StepBench(step=0, paths=1, raw_tokens=1, baseline=flat, harts=flat).recurrence_fit() is None
    few = _side([1000], [5], [0.1])
    assert StepBench(step=0, paths=1, raw_tokens=1, baseline=few, harts=few).recurrence_fit() is None
    no_chain = _side([1000, 2000, 3000], [], [0.1, 0.2, 0.3])
    assert StepBench(step=0, paths=1, raw_tokens=1, baseline=no_chain, harts=no_chain).recurrence_fit() is None


def test_bench_step_records_each_microbatch_chain() -> None:
    model = _model()
    batch = generate("tiny", step=1)
    r = bench_step(model, batch, capacity=300, warmup=False)
    for side in (r.baseline, r.harts):
        assert len(side.microbatch_chain) == side.microbatches and min(side.microbatch_chain) >= 1
    assert "recurrence_fit" in r.to_dict()
    # a model without linear attention has no chain to count
    r = bench_step(_model("MA"), batch, capacity=300, warmup=False)
    assert r.harts.microbatch_chain == [] and r.recurrence_fit() is None
