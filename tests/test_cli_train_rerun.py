"""``harts train``'s final table shows what moves beside the loss (kl-sampler, entropy), and a
second run into the same ``--run-dir`` is refused with the ``--resume auto`` command that
continues it -- which then does."""

from __future__ import annotations

from harts.cli import main

TINY = ["--workload", "tiny", "--pattern", "KM", "--layers", "2"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["train", *TINY, *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_second_train_suggests_resume_auto_which_continues_it(capsys, tmp_path):
    run_dir = tmp_path / "run dir"
    code, out, err = run(capsys, "--steps", "1", "--run-dir", run_dir)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.lstrip().startswith("step") and "loss" in line)
    assert "kl-sampler" in header.split() and "entropy" in header.split(), header

    code, out, err = run(capsys, "--steps", "2", "--run-dir", run_dir)
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert f"continue it with: harts train --resume auto --run-dir {run_dir} --steps N" in err
    assert "or pass --overwrite to start a new run there" in err

    code, out, err = run(capsys, "--steps", "2", "--resume", "auto", "--run-dir", run_dir)
    assert code == 0, err
    assert f"resumed {run_dir} after step 0" in out
