"""``--resume`` through the command line: a damaged checkpoint file of each kind is one
``harts: error:`` line naming the file and the previous checkpoint (exit 2, no traceback),
``--resume auto`` continues from that previous checkpoint, and a run directory of the other
command (train vs demo) is named as such."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from harts.cli import main
from harts.parallel.checkpoint import checkpoint_path, latest_checkpoint

DEMO = ["demo", "--tasks", "2", "--group-size", "2", "--updates", "1", "--dtype", "float64"]
TRAIN = ["train", "--workload", "tiny", "--pattern", "KM", "--threads", "1"]


def run(capsys, *argv) -> tuple[int, str, str]:  # noqa: ANN001
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:  # noqa: ANN001
    """Two demo steps, a checkpoint after each."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    assert main([*DEMO, "--steps", "2", "--save-every", "1", "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.fixture(scope="module")
def train_run(tmp_path_factory) -> Path:  # noqa: ANN001
    run_dir = tmp_path_factory.mktemp("train") / "run"
    assert main([*TRAIN, "--steps", "1", "--run-dir", str(run_dir)]) == 0
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize(
    "slot, damage",
    [
        ("meta.json", b"\x8f\x00 random bytes"),
        ("data.safetensors", b"\x01\x02"),
        ("rng/rank0.safetensors", b"garbage in rng"),
        ("dcp/metadata.json", b"{"),
        ("dcp/__0_0.distcp", None),  # truncated
    ],
)
def test_damaged_file_is_one_line_and_auto_resumes_from_the_previous(capsys, demo_run, tmp_path, slot, damage):
    run_dir = _copy(demo_run, tmp_path)
    file = checkpoint_path(run_dir, 2) / slot
    file.write_bytes(damage if damage is not None else file.read_bytes()[:100])
    code, out, err = run(capsys, *DEMO, "--steps", "3", "--resume", run_dir)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith(f"harts: error: {file}: "), err
    assert f"the previous one is {checkpoint_path(run_dir, 1)} (--resume auto picks it)" in err
    code, out, err = run(capsys, *DEMO, "--steps", "3", "--run-dir", run_dir, "--resume", "auto")
    assert code == 0, err
    assert f"harts: warning: step-00000002 skipped: {file}" in err
    assert f"resumed {run_dir} after step 0" in out
    assert latest_checkpoint(run_dir) == checkpoint_path(run_dir, 3)


def test_resume_auto_starts_a_new_run_and_then_continues_it(capsys, tmp_path):
    run_dir = tmp_path / "run"
    code, out, _ = run(capsys, *DEMO, "--steps", "1", "--run-dir", run_dir, "--resume", "auto")
    assert code == 0 and "resumed" not in out
    code, out, _ = run(capsys, *DEMO, "--steps", "2", "--run-dir", run_dir, "--resume", "auto")
    assert code == 0 and f"resumed {run_dir} after step 0" in out


def test_demo_resume_of_a_train_run_names_the_command(capsys, train_run):
    code, _, err = run(capsys, *DEMO, "--steps", "2", "--resume", train_run)
    assert code == 2 and err.count("\n") == 1
    assert "was written by harts train, not by harts demo" in err and "None" not in err


def test_train_resume_of_a_demo_run_is_one_line(capsys, demo_run):
    code, _, err = run(capsys, *TRAIN, "--steps", "3", "--resume", demo_run)
    assert code == 2 and err.count("\n") == 1, err
    assert "was written by harts demo, not by harts train" in err and "None" not in err


def test_resume_auto_needs_a_run_dir(capsys):
    code, _, err = run(capsys, *TRAIN, "--steps", "1", "--resume", "auto")
    assert code == 2 and "--resume auto needs --run-dir DIR" in err


def test_train_resume_auto_passes_over_a_damaged_checkpoint(capsys, tmp_path):
    run_dir = tmp_path / "run"
    assert run(capsys, *TRAIN, "--steps", "2", "--save-every", "1", "--run-dir", run_dir)[0] == 0
    meta = checkpoint_path(run_dir, 2) / "meta.json"
    meta.write_text("{")
    code, _, err = run(capsys, *TRAIN, "--steps", "3", "--resume", run_dir)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"harts: error: {meta}: not readable JSON")
    code, out, err = run(capsys, *TRAIN, "--steps", "3", "--run-dir", run_dir, "--resume", "auto")
    assert code == 0, err
    assert f"harts: warning: step-00000002 skipped: {meta}" in err and f"resumed {run_dir} after step 0" in out


def test_an_old_pickled_checkpoint_is_refused(capsys, demo_run, tmp_path):
    run_dir = _copy(demo_run, tmp_path)
    for step in (1, 2):
        (checkpoint_path(run_dir, step) / "meta.json").rename(checkpoint_path(run_dir, step) / "meta.pt")
    code, _, err = run(capsys, *DEMO, "--steps", "3", "--resume", run_dir)
    assert code == 2 and err.count("\n") == 1
    assert "no complete checkpoint" in err
