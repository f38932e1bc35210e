"""The step benchmark covers the whole step on both sides and reports consistent counts."""

from __future__ import annotations

import torch

import harts
from harts.bench.step_bench import bench_step
from harts.tree.workloads import generate


def test_bench_step_counts():
    torch.manual_seed(0)
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern="KM"))
    batch = generate("tiny", step=1)
    r = bench_step(model, batch, capacity=100_000, warmup=False)
    cb = harts.compact(batch)
    assert r.baseline.rows == batch.num_tokens
    assert r.harts.microbatches == 1 and r.harts.rows == cb.num_compact_tokens
    assert abs(r.compression - cb.compression) < 1e-12
    assert r.harts.calls >= 1 and r.baseline.train_seconds > 0
    assert set(r.to_dict()) >= {"fbg_speedup", "core_speedup", "compression"}
    # the benchmark leaves no gradients behind
    assert all(p.grad is None for p in model.parameters())


def test_bench_profile_writes_trace_and_operator_table(tmp_path) -> None:
    from harts.cli import main

    prof = tmp_path / "prof"
    assert main(["bench", "--workload", "tiny", "--model", "tiny", "--steps", "1", "--profile", str(prof)]) == 0
    for side in ("baseline", "harts"):
        assert (prof / "step0" / f"{side}.json").stat().st_size > 0
        table = (prof / "step0" / f"{side}.txt").read_text()
        assert "Self CPU" in table and "aten::" in table
        assert table.startswith("microbatch wall ") and "device busy 0.0 ms" in table  # CPU: no kernels


def test_device_busy_seconds_is_the_union_of_device_spans() -> None:
    """Overlapping and nested kernels count once, gaps not at all, host events never."""
    from harts.bench.step_bench import device_busy_seconds

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

    import harts.bench.step_bench as SB
    from harts.cli import main

    out = tmp_path / "b.json"
    argv = ["bench", "--workload", "tiny", "--model", "tiny", "--pattern", "KM", "--steps", "1", "--no-warmup"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "inside" not in capsys.readouterr().out
    steps = json.loads(out.read_text())["steps"][0]
    assert steps["baseline"]["compiles_in_timed_step"] == steps["harts"]["compiles_in_timed_step"] == 0
    # every read of the counter finds one more graph: one compilation inside each timed step
    counter = itertools.count()
    monkeypatch.setattr(SB, "_compiled_graphs", lambda: next(counter))
    assert main([*argv, "--json", str(out), "--overwrite"]) == 0
    text = capsys.readouterr().out
    assert "built 1 graph(s) inside baseline's timed step" in text and "inside harts's timed step" in text
    steps = json.loads(out.read_text())["steps"][0]
    assert steps["baseline"]["compiles_in_timed_step"] == steps["harts"]["compiles_in_timed_step"] == 1


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
    capsys.readouterr()
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
    assert capsys.readouterr().out.count("cold start: the first timed microbatch began") == 1
    first, second = json.loads(out.read_text())["steps"]
    base, harts = first["baseline"], first["harts"]
    assert 0 < base["seconds_to_timed"] < harts["seconds_to_timed"]
    assert harts["seconds_to_timed"] - base["seconds_to_timed"] >= base["train_seconds"]
    assert second["baseline"]["seconds_to_timed"] > harts["seconds_to_timed"]
