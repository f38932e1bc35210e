"""The step benchmark covers the whole step on both sides and reports consistent counts."""

from __future__ import annotations

import pytest
import torch

import harts
from harts.experiments.step_bench import bench_step
from harts.tree.compact import compact
from harts.tree.workloads import generate


def test_bench_step_counts():
    torch.manual_seed(0)
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern="KM"))
    batch = generate("tiny", step=1)
    r = bench_step(model, batch, capacity=100_000, warmup=False)
    cb = compact(batch)
    assert r.baseline.rows == batch.num_tokens
    assert r.harts.microbatches == 1 and r.harts.rows == cb.num_compact_tokens
    assert abs(r.compression - cb.compression) < 1e-12
    assert r.harts.calls >= 1 and r.baseline.train_seconds > 0
    assert set(r.to_dict()) >= {"fbg_speedup", "core_speedup", "compression"}
    # the benchmark leaves no gradients behind
    assert all(p.grad is None for p in model.parameters())
    # per microbatch: seconds and rows, adding up to the side's
    small = bench_step(model, batch, capacity=400, warmup=False)
    for side in (small.baseline, small.harts):
        assert len(side.microbatch_seconds) == len(side.microbatch_rows) == side.microbatches
        assert sum(side.microbatch_rows) == side.rows
        assert sum(side.microbatch_pairs) == side.attention_pairs
        assert 0 < sum(side.microbatch_seconds) <= side.train_seconds + 1e-3  # train_seconds: 4 decimals
    assert small.baseline.microbatches >= 3


def test_microbatch_fit_recovers_fixed_and_per_row_cost() -> None:
    from harts.experiments.bench_result import BenchSide

    side = BenchSide(
        microbatches=4, rows=0, calls=0, replay_rows=0, plan_seconds=0, train_seconds=1, peak_memory_gb=None
    )
    side.microbatch_rows = [1000, 2000, 4000, 3000]
    side.microbatch_seconds = [0.05 + 2e-5 * r for r in side.microbatch_rows]
    fit = side.microbatch_fit()
    assert fit == {"fixed_seconds": pytest.approx(0.05), "seconds_per_1k_rows": pytest.approx(0.02)}
    side.microbatch_rows = [1000] * 4
    assert side.microbatch_fit() is None  # one size: no slope


def test_bench_profile_writes_trace_and_operator_table(tmp_path) -> None:
    from harts.cli import main

    prof = tmp_path / "prof"
    assert main(["bench", "--workload", "tiny", "--model", "tiny", "--steps", "1", "--profile", str(prof)]) == 0
    for side in ("baseline", "harts"):
        assert (prof / "step0" / f"{side}.json").stat().st_size > 0
        table = (prof / "step0" / f"{side}.txt").read_text()
        assert "Self CPU" in table and "aten::" in table
        assert table.startswith("microbatch wall ") and "device busy 0.0 ms" in table  # CPU: no kernels


def test_bench_profile_only_profiles_without_timing(tmp_path, capsys) -> None:
    from harts.cli import main

    prof = tmp_path / "prof"
    args = ["bench", "--workload", "tiny", "--model", "tiny", "--steps", "1", "--dp", "2", "--replica", "1"]
    assert main([*args, "--profile", str(prof), "--profile-only"]) == 0
    out = capsys.readouterr().out
    for side in ("baseline", "harts"):
        assert (prof / "step0" / f"{side}.txt").read_text().startswith("microbatch wall ")
        assert f"step 0, {side} (" in out
    assert "F/B/Grad" not in out  # nothing timed
    assert main([*args, "--profile-only"]) == 2  # needs --profile: a clear error, no traceback
    assert "--profile-only needs --profile" in capsys.readouterr().err
    for extra in (["--json", str(tmp_path / "b.json")], ["--optimizer"]):
        assert main([*args, "--profile", str(tmp_path / "p2"), "--profile-only", *extra]) == 2
        assert f"{extra[0]} has nothing to act on" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_device_busy_seconds_is_the_union_of_device_spans() -> None:
    """Overlapping and nested kernels count once, gaps not at all, host events never."""
    from harts.models.region_trace import device_busy_seconds

    events = [
        {"cat": "kernel", "ts": 0, "dur": 10},
        {"cat": "kernel", "ts": 5, "dur": 10},  # overlaps: busy to 15
        {"cat": "gpu_memcpy", "ts": 6, "dur": 2},  # nested
        {"cat": "cpu_op", "ts": 15, "dur": 100},  # host: ignored
        {"cat": "gpu_memset", "ts": 30, "dur": 5},  # after a gap
        {"ph": "M", "name": "process_name"},  # metadata without ts
    ]
    busy, n = device_busy_seconds(events)
    assert n == 4
    assert abs(busy - 20e-6) < 1e-12


def test_bench_reports_compilations_inside_the_timed_step(tmp_path, capsys, monkeypatch) -> None:
    """Graphs Dynamo builds between the timed step's start and end are counted per side, written
    to the JSON and named in a note (the CPU runs the glue eagerly: none there, and no note)."""
    import itertools
    import json

    import harts.experiments.probes as SB
    from harts.cli import main

    out = tmp_path / "b.json"
    argv = ["bench", "--workload", "tiny", "--model", "tiny", "--pattern", "KM", "--steps", "1", "--no-warmup"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "inside" not in capsys.readouterr().out
    steps = json.loads(out.read_text())["steps"][0]
    assert steps["baseline"]["compiles_in_timed_step"] == steps["harts"]["compiles_in_timed_step"] == 0
    # every read of the counter finds one more graph: one compilation inside each timed step
    counter = itertools.count()
    monkeypatch.setattr(SB, "compiled_graphs", lambda: next(counter))
    assert main([*argv, "--json", str(out), "--overwrite"]) == 0
    text = capsys.readouterr().out
    assert "built 1 graph(s) inside baseline's timed step" in text and "inside harts's timed step" in text
    steps = json.loads(out.read_text())["steps"][0]
    assert steps["baseline"]["compiles_in_timed_step"] == steps["harts"]["compiles_in_timed_step"] == 1
    assert steps["baseline"]["allocator_syncs"] == steps["harts"]["allocator_syncs"] == 0  # CPU: no allocator
    assert "caching allocator" not in text
    # the allocator's synchronizing events are counted per run the same way, and named in a note
    syncs = itertools.count()
    monkeypatch.setattr(SB, "allocator_syncs", lambda device: next(syncs))
    assert main([*argv, "--json", str(out), "--overwrite"]) == 0
    text = capsys.readouterr().out
    for run in ("baseline's timed step", "harts' timed step", "harts' Core run"):
        assert f"synchronized the device 1 time(s) in {run}" in text
    steps = json.loads(out.read_text())["steps"][0]
    assert steps["harts"]["allocator_syncs"] == steps["harts"]["allocator_syncs_in_core_run"] == 1


def test_bench_first_step_times_a_later_step_alone(tmp_path, capsys) -> None:
    """``--first-step K --steps 1`` times step K of a preset (its own batch, labelled K); a step the
    preset does not have is a clear error, no traceback."""
    import json

    from harts.cli import main
    from harts.tree.workloads import generate

    out = tmp_path / "b.json"
    argv = ["bench", "--workload", "tiny", "--model", "tiny", "--pattern", "KM", "--no-warmup"]
    assert main([*argv, "--first-step", "1", "--steps", "1", "--json", str(out)]) == 0
    steps = json.loads(out.read_text())["steps"]
    assert [s["step"] for s in steps] == [1]
    assert steps[0]["raw_tokens"] == generate("tiny", step=1).num_tokens != generate("tiny", step=0).num_tokens
    assert steps[0]["ideal"]["fbg_speedup"] > 0 and set(steps[0]["ideal"]["ratio"]) == {
        "linear_attention",
        "attention",
        "moe",
        "lm_head",
        "other",
    }
    assert "at the baseline's time per unit of work" in capsys.readouterr().out
    assert main([*argv, "--first-step", "2"]) == 2
    err = capsys.readouterr().err
    assert "--first-step 2: workload 'tiny' has 2 step(s) here (0 .. 1)" in err and "Traceback" not in err


def test_bench_reports_the_cold_start(tmp_path, capsys) -> None:
    """Seconds from the command's start to each side's first timed microbatch: printed once and in
    the JSON; harts' side starts after the baseline's whole timed step."""
    import json

    from harts.cli import main

    out = tmp_path / "b.json"
    argv = ["bench", "--workload", "tiny", "--model", "tiny", "--pattern", "KM", "--steps", "2", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.count("cold start: the first timed microbatch began") == 1
    assert "imports" in text and "the baseline's untimed warm-up" in text
    report = json.loads(out.read_text())
    first, second = report["steps"]
    base, harts = first["baseline"], first["harts"]
    assert 0 < base["seconds_to_timed"] < harts["seconds_to_timed"]
    # the cold start's phases add up to the baseline's seconds to its first timed microbatch
    phases = report["cold_start"]
    assert list(phases) == ["imports", "inputs", "model", "step", "planning", "warmup"]
    # the model phase's two halves ran side by side: each fits inside it
    beside = report["cold_start_model_beside_attention"]
    assert set(beside) == {"model", "attention_probe"}
    assert 0 < beside["model"] <= phases["model"] + 0.02 and 0 <= beside["attention_probe"] <= phases["model"] + 0.02
    assert "building the model beside choosing the FlexAttention backend" in text and "(the model " in text
    assert all(v >= 0 for v in phases.values()) and phases["warmup"] == pytest.approx(base["warmup_seconds"], abs=0.01)
    assert sum(phases.values()) == pytest.approx(base["seconds_to_timed"], abs=0.05)
    assert harts["seconds_to_timed"] - base["seconds_to_timed"] >= base["train_seconds"]
    assert second["baseline"]["seconds_to_timed"] > harts["seconds_to_timed"]


def test_device_idle_gaps_charge_the_work_that_ends_each_gap() -> None:
    """Synthetic trace: three kernels with two gaps (one below the threshold), a synchronizing
    copy inside aten::item and a stream sync inside aten::nonzero."""
    from harts.models.region_trace import OUTSIDE_REGIONS, device_idle_gaps, idle_table

    def ev(cat: str, name: str, tid: int, ts: float, dur: float, corr: int | None = None) -> dict:
        e = {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    events = [
        ev("user_annotation", "harts/moe/forward", 1, 0, 5000),
        ev("cpu_op", "aten::mm", 1, 10, 20),
        ev("cuda_runtime", "cudaLaunchKernel", 1, 12, 2, corr=1),
        ev("cpu_op", "aten::item", 1, 100, 900),
        ev("cuda_runtime", "cudaMemcpy", 1, 110, 800),
        ev("cpu_op", "aten::add", 1, 1500, 20),
        ev("cuda_runtime", "cudaLaunchKernel", 1, 1505, 2, corr=2),
        ev("cpu_op", "aten::nonzero", 1, 6000, 300),
        ev("cuda_runtime", "cudaStreamSynchronize", 1, 6100, 150),
        ev("cuda_runtime", "cudaLaunchKernel", 1, 6200, 2, corr=3),
        ev("kernel", "gemm", 7, 20, 980, corr=1),  # ends at 1000
        ev("kernel", "add", 7, 1520, 400, corr=2),  # gap 520 us, launched in moe/forward by aten::add
        ev("kernel", "copy", 7, 1970, 30, corr=3),  # gap 50 us: below 0.1 ms, not counted
    ]
    idle = device_idle_gaps(events)
    assert idle["gaps"] == 1 and idle["gap_seconds"] == pytest.approx(520e-6)
    assert idle["by_region"] == {"moe/forward": pytest.approx(520e-6)}
    assert idle["largest"] == [(pytest.approx(520e-6), "moe/forward", "aten::add", "add")]
    assert idle["syncs"] == 2 and idle["sync_seconds"] == pytest.approx(950e-6)
    assert list(idle["sync_by_op"]) == ["aten::item", "aten::nonzero"]
    text = idle_table(idle)
    assert "1, 0.52 ms in all" in text and "aten::item" in text and "host calls that waited for the device: 2" in text
    # a gap before a launch outside every region, and a trace without device work
    events.append(ev("cuda_runtime", "cudaLaunchKernel", 1, 9000, 2, corr=4))
    events.append(ev("kernel", "late", 7, 9010, 10, corr=4))
    assert device_idle_gaps(events)["by_region"][OUTSIDE_REGIONS] == pytest.approx((9010 - 2000) * 1e-6)
    assert idle_table(device_idle_gaps([])) == ""


def test_operators_by_region_names_the_call_and_shapes_behind_kernels() -> None:
    from harts.models.region_trace import OUTSIDE_REGIONS, operators_by_region

    def ev(cat: str, name: str, tid: int, ts: float, dur: float, **args) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args}

    events = [
        ev("user_annotation", "harts/moe/forward", 1, 0, 100),
        ev("cpu_op", "aten::mm", 1, 10, 10, **{"Input Dims": [[64, 8], [8, 16], []]}),
        ev("cuda_runtime", "cudaLaunchKernel", 1, 12, 1, correlation=1),
        ev("cpu_op", "aten::mm", 1, 200, 10, **{"Input Dims": [[64, 8], [8, 32]]}),
        ev("cuda_runtime", "cudaLaunchKernel", 1, 202, 1, correlation=2),
        ev("cpu_op", "aten::mm", 1, 300, 10, **{"Input Dims": [[64, 8], [8, 32]]}),
        ev("cuda_runtime", "cudaLaunchKernel", 1, 302, 1, correlation=3),
        ev("cuda_runtime", "cudaLaunchKernel", 1, 400, 1, correlation=4),  # outside any operator
        ev("kernel", "gemm", 7, 1000, 50, correlation=1),
        ev("kernel", "gemm", 7, 1100, 30, correlation=2),
        ev("kernel", "gemm", 7, 1200, 30, correlation=3),
        ev("kernel", "fill", 7, 1300, 5, correlation=4),
    ]
    ops = operators_by_region(events)
    assert ops["moe/forward"] == [("aten::mm [64,8] [8,16]", pytest.approx(50e-6), 1)]
    assert ops[OUTSIDE_REGIONS] == [("aten::mm [64,8] [8,32]", pytest.approx(60e-6), 2), ("?", pytest.approx(5e-6), 1)]


def test_device_time_by_region_attributes_each_kernel_to_its_launching_range() -> None:
    """Synthetic trace: two threads (forward and autograd), nested ranges, a kernel launched
    outside every range, one whose launch is unknown; idle time counts nowhere."""
    from harts.models.region_trace import OUTSIDE_REGIONS, device_time_by_region, kernels_by_region, region_table

    def span(tid: int, ts: float, dur: float, name: str) -> dict:
        return {"ph": "X", "cat": "user_annotation", "name": f"harts/{name}", "tid": tid, "ts": ts, "dur": dur}

    def launch(tid: int, ts: float, corr: int, cat: str = "cuda_runtime") -> dict:
        return {
            "ph": "X",
            "cat": cat,
            "name": "cudaLaunchKernel",
            "tid": tid,
            "ts": ts,
            "dur": 1,
            "args": {"correlation": corr},
        }

    def kernel(corr: int, name: str, dur: float, cat: str = "kernel") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "tid": 7, "ts": 1e6, "dur": dur, "args": {"correlation": corr}}

    events = [
        span(1, 100, 100, "moe/forward"),
        span(1, 120, 20, "attention/forward"),  # nested (not a real model shape, but allowed)
        span(2, 500, 100, "moe/backward"),
        span(2, 550, 10, "linear_attention/recompute"),
        launch(1, 110, 1),  # moe forward
        launch(1, 130, 2),  # attention inside moe: the innermost wins
        launch(1, 150, 3, "cuda_driver"),  # moe again (Triton launches through the driver API)
        launch(1, 300, 4),  # outside
        launch(2, 555, 5),  # recompute inside a backward
        launch(2, 590, 6),  # backward, after the nested range closed
        launch(1, 125, 99),  # a launch whose kernel is not in the trace
        kernel(1, "gemm", 1000),
        kernel(2, "flash", 2000),
        kernel(3, "triton_moe", 500),
        kernel(4, "elementwise", 250),
        kernel(4, "elementwise", 250),
        kernel(5, "chunk_kda", 4000),
        kernel(6, "memcpy", 100, "gpu_memcpy"),
        kernel(77, "orphan", 50),  # no launch recorded
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 110, "dur": 5, "args": {"correlation": 1}},
    ]
    by_region, outside = device_time_by_region(events)
    assert by_region == pytest.approx(
        {
            "moe/forward": 1.5e-3,
            "attention/forward": 2e-3,
            "linear_attention/recompute": 4e-3,
            "moe/backward": 1e-4,
            OUTSIDE_REGIONS: 5.5e-4,
        }
    )
    assert outside == [("elementwise", pytest.approx(5e-4), 2), ("orphan", pytest.approx(5e-5), 1)]
    assert device_time_by_region([span(1, 0, 1, "moe/forward")]) == ({}, [])
    text = region_table(by_region, outside, wall=0.01, busy=0.0077)
    assert text.index("linear_attention/recompute") < text.index("moe/forward") < text.index(OUTSIDE_REGIONS)
    assert "idle (wall - busy)                         2.30 ms" in text and "0.50      2  elementwise" in text
    assert region_table({}, [], 1.0, 0.0) == ""
    per = kernels_by_region(events)
    assert per["moe/forward"] == [("gemm", pytest.approx(1e-3), 1), ("triton_moe", pytest.approx(5e-4), 1)]
    assert per[OUTSIDE_REGIONS] == outside
    text = region_table(by_region, outside, wall=0.01, busy=0.0077, per_region=per)
    assert "top kernels of linear_attention/recompute (4.00 ms; ms, launches):\n       4.00      1  chunk_kda" in text
    assert "top kernels of moe/backward" not in text  # 1.2% of the device time: below 2%


def test_ideal_takes_each_component_at_the_baseline_s_cost_per_unit() -> None:
    """Rows for LA / MoE / other, LM-head rows for the head, pairs for attention."""
    from harts.experiments.bench_result import BenchSide, StepBench

    def side(rows, logit_rows, pairs, raw, times):  # noqa: ANN001, ANN202
        names = ("linear_attention", "attention", "moe", "lm_head", "other")
        breakdown = {n: {"total": t} for n, t in zip(names, times)}
        return BenchSide(
            microbatches=1,
            rows=rows,
            calls=1,
            replay_rows=0,
            plan_seconds=0.5,
            train_seconds=sum(times),
            peak_memory_gb=None,
            raw_tokens=raw,
            logit_rows=logit_rows,
            attention_pairs=pairs,
            breakdown=breakdown,
        )

    base = side(1000, 1000, 10_000, 1000, (10.0, 20.0, 30.0, 5.0, 15.0))  # 80 s
    harts = side(200, 100, 4_000, 1000, (3.0, 8.0, 6.0, 0.5, 6.0))  # rows 5x, head 10x, pairs 2.5x
    r = StepBench(step=0, paths=1, raw_tokens=1000, baseline=base, harts=harts)
    ideal = r.ideal()
    assert ideal is not None
    assert ideal["seconds"] == pytest.approx(
        {"linear_attention": 2.0, "attention": 8.0, "moe": 6.0, "lm_head": 0.5, "other": 3.0}
    )
    assert ideal["ratio"] == pytest.approx(
        {"linear_attention": 1.5, "attention": 1.0, "moe": 1.0, "lm_head": 1.0, "other": 2.0}
    )
    assert ideal["total_seconds"] == pytest.approx(19.5)
    assert ideal["fbg_speedup"] == pytest.approx(80 / 19.5, rel=1e-4)
    assert ideal["of_compression"] == pytest.approx(80 / 19.5 / 5, rel=1e-4)
    assert r.to_dict()["ideal"] == ideal
    no_breakdown = StepBench(step=0, paths=1, raw_tokens=1000, baseline=side(1, 1, 1, 1, (1, 1, 1, 1, 1)), harts=harts)
    no_breakdown.baseline.breakdown = {}
    assert no_breakdown.ideal() is None


def test_warmup_covers_the_first_the_smallest_and_both_divisibility_classes() -> None:
    from harts.experiments.counts import warmup_microbatches

    # executed rows 101 (not a multiple of 16), ..., 160 (a multiple): index 3 joins
    assert warmup_microbatches([101, 99, 90, 160, 32], [100, 98, 80, 150, 30]) == [0, 4, 3]
    assert warmup_microbatches([160, 99, 96], [150, 98, 90]) == [0, 2, 1]
    assert warmup_microbatches([100, 200], [100, 200]) == [0]  # no multiple of 16: one class
    assert warmup_microbatches([], []) == []


def test_bench_recomputes_the_first_layers_only_on_request(tmp_path, capsys) -> None:
    """``--recompute --recompute-layers 1``: both sides run with one checkpointed layer; the header
    and the JSON say so."""
    import json

    from harts.cli import main

    out = tmp_path / "b.json"
    argv = ["bench", "--workload", "tiny", "--model", "tiny", "--pattern", "KM", "--no-warmup", "--steps", "1"]
    assert main([*argv, "--recompute", "--recompute-layers", "1", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["recompute"] is True and rec["recompute_layers"] == 1
    assert "recompute on (first 1 layers only)" in capsys.readouterr().out


def test_core_run_prepares_each_microbatch_one_ahead(monkeypatch) -> None:
    """Core times harts as ``harts train`` runs a step: microbatch k + 1 is prepared (on a host
    thread) while k runs, never further ahead, and each is prepared before it runs."""
    torch.manual_seed(0)
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern="KM"))
    batch = generate("tiny", step=1)
    events: list[str] = []
    prepare, forward = model.prepare_compact, model.forward

    def logged_prepare(*a, **k):  # noqa: ANN002, ANN003, ANN202
        events.append("prepare")
        return prepare(*a, **k)

    def logged_forward(inputs, config=None, **k):  # noqa: ANN001, ANN003, ANN202
        events.append(f"run {type(inputs).__name__}")
        return forward(inputs, config, **k)

    monkeypatch.setattr(model, "prepare_compact", logged_prepare)
    monkeypatch.setattr(model, "forward", logged_forward)
    r = bench_step(model, batch, capacity=400, warmup=False)
    n = r.harts.microbatches
    assert n >= 2
    # the timed harts run prepares everything ahead; the Core run interleaves
    harts_events = events[r.baseline.microbatches :]
    assert harts_events[: 2 * n] == ["prepare"] * n + ["run CompactInputs"] * n
    core = harts_events[2 * n :]
    assert core.count("prepare") == core.count("run CompactInputs") == n
    for i, at in enumerate(j for j, e in enumerate(core) if e.startswith("run")):
        # before run i: microbatches 0 .. i prepared, and at most i + 1 (the one ahead)
        assert i + 1 <= core[:at].count("prepare") <= i + 2
    assert r.harts.core_seconds is not None and r.harts.core_seconds > 0
    assert r.step_plan_seconds is not None and 0 < r.step_plan_seconds < r.harts.core_seconds
    assert r.harts.compiles_in_core_run == 0  # nothing is compiled on CPU
    assert r.core_speedup == pytest.approx(
        r.harts.raw_tokens / r.harts.core_seconds / r.baseline.raw_tokens * r.baseline.train_seconds, rel=1e-9
    )
    assert r.to_dict()["critical_plan_seconds"] == pytest.approx(r.harts.core_seconds - r.harts.train_seconds, abs=1e-4)
    assert all(p.grad is None for p in model.parameters())

    events.clear()
    ahead = bench_step(model, batch, capacity=400, warmup=False, core_run=False)
    assert ahead.harts.core_seconds is None
    assert events.count("prepare") == n
    assert ahead.harts.core_time == ahead.harts.plan_seconds + ahead.harts.train_seconds


def test_bench_cli_reports_the_core_run_and_can_skip_it(tmp_path, capsys, monkeypatch) -> None:
    import json

    from harts.cli import main

    out = tmp_path / "b.json"
    argv = ["bench", "--workload", "tiny", "--model", "tiny", "--pattern", "KM", "--steps", "1", "--no-warmup"]
    argv += ["--planner-workers", "0"]  # the last --planner-workers given counts
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "harts as `harts train` runs it" in text and "the step planner" in text and "crit. plan s" in text
    assert "harts' Core run against its F/B/Grad run, ms per microbatch: min " in text
    assert "waited" in text and "for preparations in all" in text
    step = json.loads(out.read_text())["steps"][0]
    assert step["harts"]["core_seconds"] > 0 and step["step_plan_seconds"] > 0
    assert main([*argv, "--no-core-run", "--json", str(out), "--overwrite"]) == 0
    assert "harts as `harts train` runs it" not in capsys.readouterr().out
    step = json.loads(out.read_text())["steps"][0]
    assert step["harts"]["core_seconds"] is None
    h = step["harts"]
    assert step["critical_plan_seconds"] == pytest.approx(h["plan_seconds"], abs=1e-3)
    # planner workers: the step planner's time with them and alone, and the same plan
    assert step["planner_workers"] == 0 and step["step_plan_seconds_serial"] is None
    import harts.plan.step.workers as planner_workers

    monkeypatch.setattr(planner_workers, "MIN_PATHS", 0)  # this step is small: plan it with them anyway
    assert main([*argv, "--planner-workers", "2", "--json", str(out), "--overwrite"]) == 0
    assert "step planner with 2 worker processes" in capsys.readouterr().out
    step = json.loads(out.read_text())["steps"][0]
    assert step["planner_workers"] == 2 and step["planner_workers_same_plan"] is True
    assert step["step_plan_seconds_serial"] > 0


def test_compilations_inside_the_core_run_are_counted_and_reported(monkeypatch, capsys) -> None:
    import itertools

    import harts.experiments.probes as probes
    from harts.cli import main

    ticks = itertools.count()
    # every read of Dynamo's counter sees one more graph: each counted run built one
    monkeypatch.setattr(probes, "compiled_graphs", lambda: next(ticks))
    argv = ["bench", "--workload", "tiny", "--model", "tiny", "--pattern", "KM", "--steps", "1", "--no-warmup"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "torch.compile built 1 graph(s) inside harts' Core run; Core includes them" in out
    assert "inside baseline's timed step" in out and "inside harts's timed step" in out


def test_triton_variants_are_counted_through_the_jit_hook(monkeypatch) -> None:
    """The counting hook (Triton's ``jit_post_compile_hook``) records each new kernel
    specialization's name and still calls a hook that was there before it."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from triton import knobs

    import harts.experiments.probes as sb

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["fn"].name))
    monkeypatch.setattr(sb, "TRITON_VARIANTS", [])
    monkeypatch.setattr(sb, "TRITON_HOOKED", [False])
    before = sb.triton_variants()
    for name in ("_tree_scan_fwd_kernel", "_tree_scan_bwd_kernel", "_tree_scan_fwd_kernel"):
        knobs.runtime.jit_post_compile_hook(key=None, fn=SimpleNamespace(name=name))
    assert sb.triton_variants() - before == 3 == len(seen)
    assert sb.TRITON_VARIANTS[before:] == ["_tree_scan_fwd_kernel", "_tree_scan_bwd_kernel", "_tree_scan_fwd_kernel"]
    from harts.commands.bench import _variant_words

    assert _variant_words(sb.TRITON_VARIANTS) == "_tree_scan_fwd_kernel x2, _tree_scan_bwd_kernel"


def test_repeats_report_the_median_run_and_keep_every_run(tmp_path, capsys) -> None:
    """``--repeats 3``: each side's step and the Core run timed three times; the median run is the
    one reported (its microbatches and components with it), every run's seconds in the JSON and a
    printed line; a count below 1 is refused."""
    import json

    from harts.cli import main

    torch.manual_seed(0)
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern="KM"))
    r = bench_step(model, generate("tiny", step=1), capacity=400, warmup=False, repeats=3)
    for side in (r.baseline, r.harts):
        assert len(side.train_seconds_runs) == 3
        assert side.train_seconds == sorted(side.train_seconds_runs)[1]
        assert 0 < sum(side.microbatch_seconds) <= side.train_seconds + 1e-3
    assert len(r.harts.core_seconds_runs) == 3 and r.harts.core_seconds == sorted(r.harts.core_seconds_runs)[1]
    assert len(r.harts.core_microbatch_seconds) == r.harts.microbatches
    assert 0 < sum(r.harts.core_microbatch_seconds) <= r.harts.core_seconds
    assert (
        r.harts.core_prepare_wait_seconds is not None and 0 <= r.harts.core_prepare_wait_seconds < r.harts.core_seconds
    )
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="repeats must be at least 1; got 0"):
        bench_step(model, generate("tiny", step=1), capacity=400, warmup=False, repeats=0)

    out = tmp_path / "b.json"
    argv = ["bench", "--workload", "tiny", "--model", "tiny", "--pattern", "KM", "--steps", "1", "--no-warmup"]
    assert main([*argv, "--repeats", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 timed runs each, in order (the median reported): baseline " in text and "harts' Core " in text
    step = json.loads(out.read_text())["steps"][0]
    assert len(step["baseline"]["train_seconds_runs"]) == len(step["harts"]["core_seconds_runs"]) == 2
    with pytest.raises(SystemExit) as exited:  # argparse's usage error, no traceback
        main([*argv, "--repeats", "0"])
    assert exited.value.code == 2 and "argument --repeats: must be a positive integer" in capsys.readouterr().err
