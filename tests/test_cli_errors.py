"""Every command survives bad input: one clear ``harts: error:`` line and exit 2, checked before any
work starts, never a traceback; unexpected exceptions keep theirs (exit 1)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import harts
from harts.cli import build_parser, main
from harts.errors import UserError
from harts.integrations.loading import load_model
from harts.tree.workloads import generate

TRAIN_FAST = ["train", "--workload", "tiny", "--steps", "1", "--pattern", "KM"]


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def assert_user_error(capsys, *argv, match: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    assert match in err, err
    assert "step 0:" not in out  # nothing ran
    return err


# ---------------------------------------------------------------- option values
@pytest.mark.parametrize(
    "argv, match",
    [
        (["train", "--steps", "0"], "argument --steps: must be a positive integer"),
        (["train", "--seed", "-1"], "argument --seed: must be a non-negative integer"),
        (["train", "--capacity", "0"], "argument --capacity: must be a positive integer"),
        (["train", "--lr", "nan"], "argument --lr: nan is outside (0, 1]"),
        (["train", "--lr", "1e30"], "argument --lr: 1e+30 is outside (0, 1]"),
        (["train", "--lr", "0"], "argument --lr: 0.0 is outside (0, 1]"),
        (["stats", "--workload", "tiny", "--chunk-size", "-4"], "argument --chunk-size: must be a positive integer"),
        (["stats", "--workload", "tiny", "--chunk-size", "0"], "argument --chunk-size: must be a positive integer"),
        (["plan", "--workload", "tiny", "--dp", "0"], "argument --dp: must be a positive integer"),
        (["compare", "--threads", "-2"], "argument --threads: must be a non-negative integer"),
        (["compare", "--recompute", "--recompute-skip", "mlp"], "--recompute-skip: recompute_skip: unknown core 'mlp'"),
        (["bench", "--recompute-skip", "attention"], "needs recompute=True"),
        ([*TRAIN_FAST, "--recompute", "--recompute-skip", "attention,attention"], "names a core twice"),
        (["bench", "--recompute-layers", "2"], "--recompute-layers 2 needs --recompute"),
        (["bench", "--recompute", "--recompute-layers", "-1"], "argument --recompute-layers: must be a non-negative"),
        (
            [*TRAIN_FAST, "--recompute", "--recompute-layers", "3"],
            "--recompute-layers 3: the model has 2 decoder layers",
        ),
        (
            ["compare", "--workload", "tiny", "--pattern", "KM", "--recompute", "--recompute-layers", "9"],
            "the model has 2 decoder layers",
        ),
        (
            ["bench", "--recompute", "--moe-keep-gate-up", "2"],
            "--moe-keep-gate-up 2 needs --recompute --recompute-skip",
        ),
        (["bench", "--moe-keep-gate-up", "-1"], "argument --moe-keep-gate-up: must be a non-negative"),
        (
            [*TRAIN_FAST, "--recompute", "--recompute-skip", "moe", "--moe-keep-gate-up", "3"],
            "--moe-keep-gate-up 3: the model has 1 MoE layer (use 0 .. 1)",
        ),
    ],
)
def test_bad_option_values_name_the_option(capsys, argv, match):
    assert_user_error(capsys, *argv, match=match)


def test_every_command_takes_json_file_and_help_shows_defaults(capsys):
    parser = build_parser()
    positional = {"calls": ["t.json"], "convert": ["ckpt"], "plot": ["run"]}
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) >= {"stats", "calls", "plan", "compare", "bench", "train", "convert"}
    for name in commands:
        args = parser.parse_args([name, *positional.get(name, []), "--json", "out.json"])
        assert args.json_out == "out.json", name
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 65536)" in text and "(default: tiny)" in text and "(default: cpu)" in text


# ------------------------------------------------------------ checks before work
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bad_flex_backend_setting_is_refused_before_any_work(capsys, monkeypatch):
    monkeypatch.setenv("HARTS_FLEX_BACKEND", "cuDNN")
    assert_user_error(capsys, *TRAIN_FAST, match="HARTS_FLEX_BACKEND must be one of auto, triton, flash; got 'cudnn'")


def test_unavailable_device(capsys):
    assert_user_error(capsys, *TRAIN_FAST, "--device", "cuda", match="--device cuda: ")
    assert_user_error(capsys, "compare", "--device", "cuda:3", match="--device cuda:3: ")
    assert_user_error(capsys, *TRAIN_FAST, "--device", "potato", match="'potato' is not a device name")
    assert_user_error(capsys, *TRAIN_FAST, "--la-backend", "fla", match="--la-backend fla on --device cpu: ")
    assert_user_error(capsys, *TRAIN_FAST, "--pattern", "XYZ", match="layer_pattern 'XYZ'")


def test_save_paths_are_checked_before_training(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_user_error(capsys, *TRAIN_FAST, "--save", afile, match="exists and is not a directory")
    assert_user_error(capsys, *TRAIN_FAST, "--save", afile / "sub", match=f"{afile} is a file, not a directory")
    full = tmp_path / "full"
    full.mkdir()
    (full / "harts.pt").write_text("old")
    assert_user_error(capsys, *TRAIN_FAST, "--save", full, match="pass --overwrite")
    assert_user_error(capsys, *TRAIN_FAST, "--json", afile, match="exists; pass --overwrite")
    assert_user_error(capsys, "stats", "--workload", "tiny", "--json", tmp_path, match="is a directory")
    assert (full / "harts.pt").read_text() == "old" and afile.read_text() == "x"


def test_json_output_is_checked_before_any_command_runs(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    # bench predates the typed errors; the --json check still runs before it does any work
    assert_user_error(capsys, "bench", "--workload", "tiny", "--json", tmp_path, match="is a directory")
    assert_user_error(capsys, "convert", tmp_path, "--json", afile / "r.json", match="is a file, not a directory")
    assert_user_error(capsys, "plan", "--workload", "tiny", "--json", afile, match="exists; pass --overwrite")


def test_json_into_missing_directory_keeps_the_checkpoint(tmp_path, capsys):
    ckpt, log = tmp_path / "ckpt", tmp_path / "new" / "dir" / "log.json"
    code, out, _ = run(capsys, *TRAIN_FAST, "--save", ckpt, "--json", log)
    assert code == 0
    assert json.loads(log.read_text())["steps"][0]["step"] == 0
    assert load_model(str(ckpt)).config.layer_pattern == "KM"  # reloadable as --model DIR
    # --overwrite replaces both
    code, _, _ = run(capsys, *TRAIN_FAST, "--save", ckpt, "--json", log, "--overwrite")
    assert code == 0


def test_huge_token_id_is_refused_before_allocating(tmp_path, capsys):
    path = tmp_path / "b.jsonl"
    path.write_text(
        json.dumps({"tokens": [1, 2_000_000_000], "advantages": 1.0})
        + "\n"
        + json.dumps({"tokens": [1, 2], "advantages": -1.0})
        + "\n"
    )
    err = assert_user_error(capsys, "train", "--workload", path, match="needs vocab_size >= 2,000,000,001")
    assert "token id 2,000,000,000" in err and "trajectory 0, position 1" in err and "GiB" in err
    assert_user_error(capsys, "compare", "--workload", path, match="needs vocab_size >= 2,000,000,001")


def _seed_where_step1_is_longer() -> tuple[int, int, int]:
    for seed in range(50):
        a, b = (int(generate("tiny", step=s, seed=seed).lengths.max()) for s in (0, 1))
        if b > a:
            return seed, a, b
    pytest.skip("no seed with a longer step 1")


def test_capacity_of_every_step_is_checked_before_step_0(capsys):
    seed, first, second = _seed_where_step1_is_longer()
    err = assert_user_error(
        capsys, "train", "--workload", "tiny", "--seed", seed, "--capacity", first, match="step 1 (tiny[1]): trajectory"
    )
    assert f"more than --capacity {first:,}" in err
    assert f"the smallest capacity that fits every step is --capacity {second}" in err
    # and that suggestion does fit
    code, out, _ = run(capsys, "train", "--workload", "tiny", "--seed", seed, "--capacity", second, "--pattern", "KM")
    assert code == 0 and "step 1:" in out


def test_plan_capacity_and_dp_are_checked(tmp_path, capsys):
    assert_user_error(capsys, "plan", "--workload", "tiny", "--capacity", "100", match="--capacity 222")
    assert_user_error(capsys, "plan", "--workload", "tiny", "--dp", "40", match="fewer than the 40 replicas of --dp")
    # 5 unshared trajectories of 100 tokens at T = 100 need 8 microbatches for D = 4, but only 4 can be filled
    path = tmp_path / "five.jsonl"
    harts.RolloutBatch.from_trajectories(
        [[j * 100 + i + 1 for i in range(100)] for j in range(5)], advantages=[1.0] * 5
    ).save(path)
    assert_user_error(
        capsys, "plan", path, "--dp", "4", "--capacity", "100", match=f"step 0 ({path}): capacity=100 is too small"
    )


def test_trajectory_baseline_plan_is_checked_before_step_0(capsys):
    # tiny step 0 at --capacity 230 packs into 12 raw-token microbatches; 9 replicas need 18, and
    # 17 trajectories cannot fill them (harts' compact plan fits: 9 microbatches)
    assert_user_error(
        capsys,
        *TRAIN_FAST,
        "--mode",
        "trajectory",
        "--replicas",
        "9",
        "--capacity",
        "230",
        match="step 0 (tiny[0]): trajectory-wise baseline: dp=9: the 17 trajectories need 17 microbatches",
    )
    code, _, err = run(capsys, *TRAIN_FAST, "--replicas", "9", "--capacity", "230")  # compact: fits
    assert code == 0, err


def test_calls_json_file(tmp_path, capsys):
    tree = tmp_path / "t.json"
    tree.write_text(
        json.dumps(
            {
                "segments": [
                    {"id": "R", "tokens": 70, "parent": None},
                    {"id": "a", "tokens": 2, "parent": "R"},
                    {"id": "b", "tokens": 2, "parent": "R"},
                ]
            }
        )
    )
    code, out, _ = run(capsys, "calls", tree, "--json", tmp_path / "plan.json")
    assert code == 0 and "calls: 2" in out
    assert json.loads((tmp_path / "plan.json").read_text())["calls"] == 2


def test_missing_inputs(tmp_path, capsys):
    assert_user_error(capsys, "stats", tmp_path / "nope.jsonl", match="no such batch file")
    assert_user_error(capsys, "calls", tmp_path / "nope.json", match="no such file")
    assert_user_error(capsys, "train", "--workload", tmp_path / "nope.parquet", match="no such batch file")
    assert_user_error(capsys, "convert", tmp_path / "nope", match="does not exist")
    assert_user_error(capsys, "train", "--model", "gigantic", "--steps", "1", match="--model 'gigantic'")
    assert_user_error(capsys, "stats", "--workload", "nope", match="not a preset")
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_text(
        json.dumps({"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]})
    )
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    assert_user_error(capsys, "convert", bad, match=f"{bad}: not a readable checkpoint")


# --------------------------------------------------------------- the error path
def test_user_error_one_line_debug_traceback_and_bugs_keep_theirs(tmp_path, monkeypatch, capsys):
    import harts.commands.stats as stats

    def boom(args):  # noqa: ANN001
        raise UserError("the item and the fix")

    monkeypatch.setattr(stats, "run", boom)
    monkeypatch.delenv("HARTS_DEBUG", raising=False)
    code = main(["stats"])
    err = capsys.readouterr().err
    assert code == 2 and err == "harts: error: the item and the fix\n"
    monkeypatch.setenv("HARTS_DEBUG", "1")
    assert main(["stats"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("harts: error: the item and the fix\n")

    def bug(args):  # noqa: ANN001
        raise KeyError("a bug of ours")

    monkeypatch.setattr(stats, "run", bug)
    with pytest.raises(KeyError):
        main(["stats"])


def test_device_out_of_memory_is_one_line(monkeypatch, capsys):
    """A run that ran out of device memory (its estimate overridden with --force, or short):
    torch's first three sentences and what to change, exit 2; the traceback only with HARTS_DEBUG."""
    import harts.commands.stats as stats

    def oom(args):  # noqa: ANN001
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 1.20 GiB. GPU 0 has a total capacity of 79.18 GiB of "
            "which 454.19 MiB is free. Including non-PyTorch memory, this process has 78.73 GiB in use."
        )

    monkeypatch.setattr(stats, "run", oom)
    monkeypatch.delenv("HARTS_DEBUG", raising=False)
    assert main(["stats"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        "harts: error: stats: the device ran out of memory (CUDA out of memory. Tried to allocate 1.20 GiB. "
        "GPU 0 has a total capacity of 79.18 GiB of which 454.19 MiB is free): "
    )
    # stats sizes nothing: no flag to change is named, only that it does not fit
    assert "the run does not fit on this device" in err
    assert not any(flag in err for flag in ("--capacity", "--layers", "--recompute", "--force"))
    monkeypatch.setenv("HARTS_DEBUG", "1")
    assert main(["stats"]) == 2
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, named, absent",
    [
        ("train", ["--capacity", "--layers", "--recompute", "--force"], []),
        ("compare", ["--layers", "--recompute", "--force"], ["--capacity"]),
        ("demo", ["--force"], ["--capacity", "--layers", "--recompute"]),
        ("plan", ["--capacity"], ["--layers", "--recompute", "--force"]),
    ],
)
def test_out_of_memory_advice_names_only_the_commands_own_flags(command, named, absent):
    from harts.cli import _command_options, build_parser, out_of_memory_line

    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.20 GiB.")
    line = out_of_memory_line(command, err, _command_options(build_parser(), command))
    assert line.startswith(f"{command}: the device ran out of memory (CUDA out of memory. Tried to allocate 1.20 GiB)")
    assert all(flag in line for flag in named), line
    assert not any(flag in line for flag in absent), line


def test_console_script_exit_codes(tmp_path):
    """Through the real entry point: exit 2 and one line for a user error."""
    code = "import sys; from harts.cli import main; sys.exit(main())"
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"tokens": [1, 2], "advantages": "high"}\n')
    out = subprocess.run([sys.executable, "-c", code, "stats", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr == (
        f"harts: error: {bad}: trajectory 0 (line 1): advantages must be a number or a list "
        "of numbers (one per predicted token), got string 'high'\n"
    )


def test_user_errors_are_value_errors():
    assert issubclass(harts.UserError, ValueError) and issubclass(harts.BatchValidationError, harts.UserError)
    assert issubclass(harts.CapacityError, harts.UserError) and issubclass(harts.TreeFileError, harts.UserError)


def test_bad_compile_dynamic_setting_is_refused_before_any_work(capsys, monkeypatch):
    monkeypatch.setenv("HARTS_COMPILE_DYNAMIC", "everything")
    assert_user_error(capsys, *TRAIN_FAST, match="HARTS_COMPILE_DYNAMIC must be 'rows' or 'all'; got 'everything'")
