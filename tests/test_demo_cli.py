"""``harts demo`` and ``harts plot`` from the command line: run directory rules, the per-step
table and metrics file, compact vs trajectory side by side, and the PNG with its JSON."""

from __future__ import annotations

import json

import pytest

from harts.cli import main

SMALL = ["demo", "--steps", "2", "--tasks", "2", "--group-size", "2", "--updates", "1"]


def _run(capsys, *argv) -> tuple[int, str, str]:  # noqa: ANN001
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_demo_refuses_a_non_empty_run_dir(tmp_path, capsys) -> None:  # noqa: ANN001
    (tmp_path / "keep.txt").write_text("mine")
    code, out, err = _run(capsys, *SMALL, "--run-dir", tmp_path)
    assert code == 2 and "--run-dir" in err and "--overwrite" in err and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    code, _, _ = _run(capsys, *SMALL, "--run-dir", tmp_path, "--overwrite")
    assert code == 0 and (tmp_path / "metrics.jsonl").exists()


def test_demo_writes_table_metrics_and_summary(tmp_path, capsys) -> None:  # noqa: ANN001
    run_dir = tmp_path / "run"
    code, out, _ = _run(capsys, *SMALL, "--run-dir", run_dir)
    assert code == 0
    for header in ("reward", "kl", "clip", "entropy", "compress", "mismatch", "step_s", "tok/s"):
        assert header in out
    assert "chance" in out and "-> " in out
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["rewards"]) == 2


def test_demo_both_modes_agree_in_float64_and_plot_overlays(tmp_path, capsys) -> None:  # noqa: ANN001
    run_dir = tmp_path / "both"
    code, out, _ = _run(capsys, *SMALL, "--mode", "both", "--dtype", "float64", "--run-dir", run_dir)
    assert code == 0 and "compact vs trajectory" in out
    diff = json.loads((run_dir / "summary.json").read_text())["compact_vs_trajectory"]
    assert diff["steps_with_equal_rewards"] == 2 and diff["max_abs_reward_diff"] == 0.0
    assert diff["max_abs_loss_diff"] < 1e-12 and "the same rewards for 2 of 2 steps" in out
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    code, _, _ = _run(capsys, "plot", run_dir / "compact", run_dir / "trajectory", "--out", png)
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    series = json.loads((tmp_path / "curves.json").read_text())["runs"]
    assert len(series) == 2
    for s in series.values():
        assert len(s["reward"]) == len(s["reward_moving_average"]) == len(s["kl"]) == 2


def test_plot_errors_name_the_run_dir(tmp_path, capsys) -> None:  # noqa: ANN001
    code, _, err = _run(capsys, "plot", tmp_path / "nothing")
    assert code == 2 and "nothing" in err and "metrics.jsonl" in err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    code, _, err = _run(capsys, "plot", tmp_path / "bad", "--out", tmp_path / "x.png")
    assert code == 2 and "line 2" in err


def test_moving_average() -> None:
    from harts.commands.plot import moving_average

    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_tensorboard_when_installed_else_one_warning(tmp_path, capsys) -> None:  # noqa: ANN001
    from harts.rl.metrics import tensorboard_available

    code, _, err = _run(capsys, *SMALL, "--run-dir", tmp_path / "tb", "--tensorboard")
    assert code == 0 and (tmp_path / "tb" / "metrics.jsonl").exists()
    if tensorboard_available():
        assert any((tmp_path / "tb" / "tensorboard").iterdir()) and "--tensorboard" not in err
    else:
        assert err.count("--tensorboard") == 1
