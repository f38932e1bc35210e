"""``benchmarks.step.gpu_runs``: every row's command parses on the CPU (a flag typo fails here, not
on a GPU machine), the runner refuses unknown names before running anything, runs a row for real
(log, JSON, status line), goes on after a row that fails or times out, and the long-context batch
files have the shapes their rows are sized for. ``scripts/gpu_bench_runs.sh`` stays a short,
valid wrapper of the runner."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import subprocess

import pytest

from benchmarks.step import gpu_runs
from benchmarks.step.gpu_runs import BY_NAME, RUNS, Run, commands, main
from harts.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Parsed(Exception):
    """Raised in place of a benchmark script's work, once its arguments have parsed."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = args


def _parse_script(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Run ``module``'s ``main(argv)`` up to its arguments' parse (``benchmarks._runner.parse``)."""
    mod = importlib.import_module(module)

    def parse_only(p: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
        raise _Parsed(p.parse_args(args))

    monkeypatch.setattr(mod, "parse", parse_only)
    with pytest.raises(_Parsed) as got:
        mod.main(argv)
    return got.value.namespace


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_every_row_parses(run: Run, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argvs, env = commands(run, str(tmp_path), ("--repeats", "3"))
    assert run.purpose and "\n" not in run.purpose and run.card in (None, "h200") and 0 < run.timeout_s <= 580
    assert all("{" not in v for v in env.values())
    for argv in argvs:
        assert all("{" not in w for w in argv), argv
        if argv[0] == "harts.cli":
            args = build_parser().parse_args(argv[1:])  # argparse exits (status 2) on a bad flag
            assert args.command in ("bench", "compare", "plan")
            if args.command == "bench":
                assert args.repeats == 3 and (args.json_out or args.profile_only)
        elif argv[0] == "pytest":
            files = [w.split("::")[0] for w in argv[1:] if w.startswith("tests/")]
            assert files or "-n" in argv
            assert all((ROOT / f).is_file() for f in files), files
        else:
            _parse_script(argv[0], argv[1:], monkeypatch)


def test_the_rows_the_results_cite_and_the_new_ones_are_there() -> None:
    cited = "gpu_suite compare compare_moe_kept medium medium_moe_kept swe5 swe0 swe5_layers20 swe5_keep20 swe0_keep20"
    cited += " medium_layers0 medium_layers2 medium_keep3 medium_full_keep20 silu_conv_keep20 silu_split_keep20"
    cited += " fla_gate0_keep20 fla_gate1_keep20 plan_swe profile profile_swe profile_la_tree profile_la_linked tune"
    cited += " medium_tuned qkv_norm_test qkv_norm sweep kernel_tests q35_L8 q35_L8_profile q9_L8 q35_L8_gdn_kda"
    new = " q35_L8_gdn_native qnext_L8 q35_lora_full q9_lora_full q9_full_ft q9_long_131k q9_long_131k_tree gpu_tests"
    new += " layer_memory_q9 layer_memory_q35 mamba2_la nemotron_L8"
    assert set((cited + new + " cpu_smoke").split()) == set(BY_NAME) and len(BY_NAME) == len(RUNS)
    assert all(n in (gpu_runs.__doc__ or "") for n in cited.split())
    full = {n: commands(BY_NAME[n], "o")[0][-1] for n in ("q35_lora_full", "q9_lora_full", "q9_full_ft")}
    for name, argv in full.items():  # every layer, 1/8 of `medium` step 3, the preset's own vocabulary
        args = build_parser().parse_args(argv[1:])
        assert args.layers is None and (args.dp, args.replica, args.first_step, args.steps) == (8, 0, 3, 1)
        assert (args.dtype, args.attention, args.la_backend, args.recompute, args.capacity) == (
            "bfloat16",
            "auto",
            "auto",
            True,
            65536,
        )
    assert BY_NAME["q9_full_ft"].card == "h200" and "--optimizer" in full["q9_full_ft"]
    long = build_parser().parse_args(commands(BY_NAME["q9_long_131k_tree"], "o")[0][-1][1:])
    assert long.capacity == 131072 and long.workload.endswith("tree_131072.jsonl")


def test_dry_run_prints_every_command_and_runs_nothing(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    assert main([*BY_NAME, "--dry-run", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == list(BY_NAME)
    assert all("python3 -m " in line for line in lines) and not out.exists()
    assert "HARTS_GDN_NATIVE=1 python3 -m harts.cli bench" in next(s for s in lines if "q35_L8_gdn_native" in s)
    assert "python3 -m benchmarks.step.long_batches --out /tmp/harts_batches && " in lines[-1]


def test_bench_flags_take_a_value_that_starts_with_dashes(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture
) -> None:
    """``--bench-flags "--no-core-run --force"`` (a value argparse alone takes for an option)."""
    for given in (["--bench-flags", "--no-core-run --force"], ["--bench-flags=--no-core-run --force"]):
        assert main(["cpu_smoke", "--dry-run", "--out", str(tmp_path), *given]) == 0
        assert capsys.readouterr().out.rstrip().endswith("--no-core-run --force")


def test_unknown_names_are_refused_before_anything_runs(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    assert main(["medium", "nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_runs: unknown run(s) nope; runs: cpu_smoke, ") and err.count("\n") == 1
    assert main(["--out", str(out)]) == 2 and "name at least one run" in capsys.readouterr().err
    assert not out.exists()
    assert main(["--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(RUNS)


def test_a_cpu_row_runs_for_real(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["cpu_smoke", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1].startswith("cpu_smoke: ok (")
    assert "\n  step  paths  raw tok  compress" in printed and "\n  cold start: " in printed
    assert "step 0: baseline " in (tmp_path / "cpu_smoke.log").read_text()
    assert json.loads((tmp_path / "cpu_smoke.json").read_text())["steps"][0]["step"] == 0


def test_a_failing_and_a_timed_out_row_do_not_stop_the_rest(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    rows = {
        "bad": Run("bad", "a flag harts refuses", ("harts.cli", "bench", "--model", "tiny", "--capacity", "0")),
        "slow": Run("slow", "sleeps past its limit", ("timeit", "-n1", "-r1", "import time; time.sleep(60)"), 1),
        "fine": Run("fine", "runs", ("timeit", "-n1", "-r1", "pass"), 30),
    }
    monkeypatch.setattr(gpu_runs, "BY_NAME", rows)
    assert main(["bad", "slow", "fine", "--out", str(tmp_path)]) == 1
    status = capsys.readouterr().out.splitlines()[-3:]
    assert status[0].startswith("bad: failed rc 2 (") and status[1] == "slow: timed out after 1 s"
    assert status[2].startswith("fine: ok (")
    assert "error: argument --capacity" in (tmp_path / "bad.log").read_text()
    assert "KeyboardInterrupt" in (tmp_path / "slow.log").read_text()  # SIGINT first


def test_long_batches_have_the_shapes_their_rows_are_sized_for(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.step.long_batches import write_batches
    from harts.tree.batch import RolloutBatch
    from harts.tree.compact import compact

    setup = commands(BY_NAME["q9_long_131k"], "o")[0][0]
    args = _parse_script(setup[0], setup[1:], monkeypatch)
    assert args.tokens == 131072 and args.out == gpu_runs.LONG
    tokens = 8192
    single, tree = (RolloutBatch.load(p) for p in write_batches(str(tmp_path), tokens))
    assert sorted(os.listdir(tmp_path)) == [f"trajectory_{tokens}.jsonl", f"tree_{tokens}.jsonl"]
    assert single.lengths.tolist() == [tokens]
    short = tokens // 2 + tokens // 8 - 256
    assert tree.lengths.tolist() == [tokens] + [short] * 4
    # the prompt once, then every completion: two microbatches of --capacity tokens hold it
    assert compact(tree).num_compact_tokens == tokens + 4 * (tokens // 8 - 256)
    assert tokens // 2 + 4 * (tokens // 8 - 256) <= tokens


def test_the_shell_wrapper_is_short_valid_bash_around_the_runner() -> None:
    script = ROOT / "scripts" / "gpu_bench_runs.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert len(text.splitlines()) <= 25 and 'python3 -m benchmarks.step.gpu_runs "$@" --out' in text
