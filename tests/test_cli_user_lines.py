"""What a user sees when a command cannot start: one line naming what to change, never a usage
block or a traceback -- a bad option value or an unknown option (named by its subcommand), a
missing torch, a ``--model`` that is a Hub id or a missing directory, a second ``harts demo``
into the same run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harts.cli import main
from harts.errors import UserError
from harts.trainer.build import ModelSpec, check_model


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse's errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["train", "--lr", "abc"],
            "harts train: error: argument --lr: expected a number, got 'abc'; see 'harts train --help'",
        ),
        (
            ["demo", "--stpes", "3"],
            "harts demo: error: unrecognized arguments: --stpes 3 (did you mean --steps?); see 'harts demo --help'",
        ),
        (["stats", "--chunk-size"], "harts stats: error: argument --chunk-size: expected one argument"),
        (["bogus"], "harts: error: argument COMMAND: invalid choice: 'bogus'"),
        (["--bogus"], "harts: error: unrecognized arguments: --bogus; see 'harts --help'"),
    ],
)
def test_usage_errors_are_one_line_naming_the_option(capsys, argv, line):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith(line), err
    assert "usage:" not in err


#: runs ``harts`` as an install without torch: ``import torch`` raises ModuleNotFoundError
_NO_TORCH = "import sys; sys.modules['torch'] = None; from harts.cli import main; sys.exit(main(sys.argv[1:]))"


def _harts_without_torch(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("HARTS_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def test_without_torch_a_command_says_how_to_install_it(tmp_path):
    done = _harts_without_torch("demo", "--steps", "1", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("harts: error: harts demo needs PyTorch, which is not installed: pip install torch")
    assert "https://download.pytorch.org/whl/cpu" in done.stderr


def test_without_torch_the_torch_free_commands_run(tmp_path):
    done = _harts_without_torch("stats", "--workload", "tiny", "--steps", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "tiny[0]" in done.stdout


@pytest.mark.parametrize(
    "model, line",
    [
        (
            "Qwen/Qwen3.5-9B",
            "--model Qwen/Qwen3.5-9B: no such directory, and harts does not download from the Hugging Face Hub: "
            f"download it first (hf download Qwen/Qwen3.5-9B --local-dir {os.path.join('checkpoints', 'Qwen3.5-9B')}), "
            f"then pass --model {os.path.join('checkpoints', 'Qwen3.5-9B')}; --model qwen3_5_9b is its preset",
        ),
        ("some-org/some-model", "download it first (hf download some-org/some-model --local-dir"),
        ("./no-such-checkpoint", "--model ./no-such-checkpoint: no such directory: give a transformers checkpoint"),
    ],
)
def test_model_that_is_a_hub_id_or_missing_directory_says_what_to_download(model, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        check_model(ModelSpec(model=model))
    assert line in str(err.value) and str(err.value).startswith(f"--model {model}"), err.value
    assert "unknown model preset" not in str(err.value)


def test_model_that_is_a_file_is_named_as_one(tmp_path):
    afile = tmp_path / "weights.safetensors"
    afile.write_bytes(b"")
    with pytest.raises(UserError, match=f"--model {afile}: is a file, not a transformers checkpoint directory"):
        check_model(ModelSpec(model=str(afile)))


def test_second_demo_into_a_run_suggests_resume_auto(capsys, tmp_path):
    run_dir = tmp_path / "run dir"
    step = run_dir / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    code, out, err = run(capsys, "demo", "--steps", "3", "--run-dir", run_dir)
    assert code == 2, err
    assert f"continue it with: harts demo --resume auto --run-dir {run_dir} --steps N" in err
    assert "or pass --overwrite to start a new run there" in err
    assert "step 0" not in out  # refused before any work


def test_older_batch_file_form_is_one_warning_line(capsys, tmp_path):
    path = tmp_path / "old form.jsonl"
    path.write_text('{"tokens": [1, 2, 3], "advantages": [0, 1, 1], "old_logprobs": [0, -1, -1]}\n')
    code, out, err = run(capsys, "stats", path)
    assert code == 0, err
    assert err.startswith(f"harts: warning: {path}: the older batch-file form ('old_logprobs' for 'logprobs'")
    assert len(err.splitlines()) == 1, err


def test_demo_prints_and_logs_what_moves_beside_the_loss(capsys, tmp_path):
    from harts.commands.demo import FLAT_LOSS_NOTE

    run_dir = tmp_path / "run"
    argv = ["demo", "--steps", "2", "--tasks", "2", "--group-size", "2", "--updates", "2", "--run-dir", run_dir]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert out.count("harts: note:") == 1 and FLAT_LOSS_NOTE in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("step"))
    assert all(name in header.split() for name in ("reward", "kl-sampler", "entropy", "clip", "loss", "grad-norm"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the second update of a step starts from moved weights: the sampler's log-probs are behind it
    assert all(r["kl_sampler"] > 0 and r["grad_norm"] > 0 for r in records)
