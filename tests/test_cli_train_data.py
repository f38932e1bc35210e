"""``harts train --data PATH... --epochs N``: the steps it makes, metrics.jsonl every step (and
after a resume, the same records as the uninterrupted run), ``harts plot`` of a training run, and
the loggers' checks before any work."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from harts.cli import main
from harts.tree.batch import RolloutBatch

TRAIN = ["train", "--pattern", "KM", "--capacity", "256", "--dtype", "float64"]


def _dataset(root: Path, names: tuple[str, ...] = ("a.jsonl", "b.jsonl", "sub/c.jsonl")) -> Path:
    rng = np.random.default_rng(0)
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        trajs = [rng.integers(0, 60, size=n) for n in rng.integers(5, 14, size=4)]
        RolloutBatch.from_trajectories(trajs, advantages=[1.0, -1.0, 0.5, -0.5], rewards=[1, 0, 1, 0]).save(path)
    return root


def _train(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([*TRAIN, *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_data_epochs_and_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _dataset(tmp_path / "data")
    extra = _dataset(tmp_path / "more", ("x.jsonl",)) / "x.jsonl"
    run = tmp_path / "run"
    code, out, _ = _train(capsys, "--data", data, extra, "--epochs", "2", "--run-dir", run)
    assert code == 0
    assert "data: 4 batch files x 2 epochs = 8 steps" in out
    records = _records(run)
    assert [r["step"] for r in records] == list(range(8))
    assert [r["epoch"] for r in records] == [0] * 4 + [1] * 4
    names = [Path(r["batch"]).name for r in records]
    assert names == ["a.jsonl", "b.jsonl", "c.jsonl", "x.jsonl"] * 2
    for r in records:
        assert r["lr"] == 1e-4 and r["reward"] == 0.5
        assert r["tokens"] >= r["compact_tokens"] > 0 and r["compression"] == r["tokens"] / r["compact_tokens"]
        assert r["step_seconds"] > 0 and np.isfinite(r["loss"]) and r["grad_norm"] > 0
    # the same file trains the same way in both epochs up to the weights it meets
    assert records[0]["tokens"] == records[4]["tokens"]


def test_steps_cut_the_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _dataset(tmp_path / "data")
    code, out, _ = _train(capsys, "--data", f"{data}/*.jsonl", "--epochs", "3", "--steps", "5")
    assert code == 0 and "2 batch files x 3 epochs = 6 steps, the first 5" in out and "step 4:" in out


def test_resume_rewrites_metrics_as_the_uninterrupted_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _dataset(tmp_path / "data")
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _train(capsys, "--data", data, "--epochs", "2", "--run-dir", full)[0] == 0
    assert _train(capsys, "--data", data, "--epochs", "2", "--run-dir", cut, "--save-every", "2")[0] == 0
    # as if the run had died after step 3's records were written but before step 4's checkpoint
    for name in sorted((cut / "checkpoints").iterdir())[1:]:
        shutil.rmtree(name)
    code, out, _ = _train(capsys, "--data", data, "--epochs", "2", "--resume", cut)
    assert code == 0 and "resumed" in out
    want, got = _records(full), _records(cut)
    assert [r["step"] for r in got] == list(range(6))
    for a, b in zip(want, got):
        assert (a["loss"], a["grad_norm"], a["batch"]) == (b["loss"], b["grad_norm"], b["batch"])
    # the run's data is part of its identity
    code, _, err = _train(capsys, "--data", data, "--epochs", "3", "--resume", cut)
    assert code == 2 and "--epochs" in err


def test_plot_draws_a_training_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    data = _dataset(tmp_path / "data", ("a.jsonl", "b.jsonl"))
    run = tmp_path / "run"
    assert _train(capsys, "--data", data, "--run-dir", run)[0] == 0
    assert main(["plot", str(run)]) == 0
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    series = json.loads((run / "curves.json").read_text())["runs"][str(run)]
    assert list(series)[:5] == ["reward", "loss", "grad_norm", "compression", "step_seconds"]
    assert len(series["loss"]) == len(series["reward_moving_average"]) == 2
    online = tmp_path / "online"
    online.mkdir()
    (online / "metrics.jsonl").write_text('{"step": 0, "reward": 1.0, "kl": 0.0, "step_seconds": 1.0}\n')
    capsys.readouterr()
    assert main(["plot", str(run), str(online), "--out", str(tmp_path / "x.png")]) == 2
    assert "a training run" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--data", "DATA", "--workload", "tiny"], "--data and --workload both name"),
        (["--data", "DATA/nothing*.jsonl"], "matches no batch file"),
        (["--data", "DATA", "--steps", "4"], "--steps 4: the data gives 3 steps"),
        (["--wandb", "proj"], "--wandb logs beside RUN_DIR/metrics.jsonl"),
        (["--tensorboard"], "--tensorboard logs beside"),
    ],
)
def test_errors_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], match: str
) -> None:
    data = _dataset(tmp_path / "data")
    code, out, err = _train(capsys, *(a.replace("DATA", str(data)) for a in argv))
    assert code == 2 and match in err and "step 0" not in out


def test_wandb_gets_every_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    logged: list[tuple[int, dict]] = []
    calls: dict[str, object] = {}

    class Run:
        def log(self, values: dict, step: int) -> None:
            logged.append((step, values))

        def finish(self) -> None:
            calls["finished"] = True

    def init(**kwargs: object) -> Run:
        calls.update(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    data = _dataset(tmp_path / "data", ("a.jsonl", "b.jsonl"))
    code, _, _ = _train(capsys, "--data", data, "--run-dir", tmp_path / "run", "--wandb", "harts-test")
    assert code == 0 and calls["project"] == "harts-test" and calls["finished"]
    assert [s for s, _ in logged] == [0, 1] and "loss" in logged[0][1] and "batch" not in logged[0][1]
