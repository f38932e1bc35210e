"""``harts train`` with checkpoints and several ranks: resume equals the uninterrupted run,
``torchrun -m harts.cli`` launches, and a mesh that does not fit the launch is a clear error."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from harts.errors import UserError
from harts.parallel.mesh import ParallelConfig
from harts.trainer.weights import load_state
from tests.parallel._dist import free_port

BASE = ["train", "--workload", "tiny", "--dtype", "float64", "--threads", "1"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", HARTS_DEBUG="")


def harts(*args: str, ranks: int = 1, timeout: int = 240) -> subprocess.CompletedProcess:
    if ranks == 1:
        cmd = [sys.executable, "-m", "harts.cli", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        cmd += ["--master-port", str(free_port()), "-m", "harts.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def _weights(path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return load_state(str(path))


def test_resume_equals_the_uninterrupted_run(tmp_path):
    run, straight, resumed = tmp_path / "run", tmp_path / "straight", tmp_path / "resumed"
    r = harts(*BASE, "--steps", "5", "--run-dir", str(run), "--save-every", "3", "--save", str(straight))
    assert r.returncode == 0, r.stderr
    done = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert done == ["step-00000003", "step-00000005"]
    assert {p.name for p in (run / "checkpoints" / "step-00000003").iterdir()} == {
        "data.safetensors",
        "dcp",
        "meta.json",
        "rng",
    }
    shutil.rmtree(run / "checkpoints" / "step-00000005")  # as if the run had stopped after step 3

    r = harts(*BASE, "--steps", "5", "--resume", str(run), "--save", str(resumed))
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stdout and "step 3:" in r.stdout and "step 2:" not in r.stdout
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # an existing run directory is not overwritten; a resume must match the run
    r = harts(*BASE, "--steps", "5", "--run-dir", str(run))
    assert r.returncode == 2 and "--overwrite" in r.stderr
    r = harts(*BASE, "--steps", "5", "--resume", str(run), "--seed", "7")
    assert r.returncode == 2 and "--seed 0" in r.stderr


@pytest.mark.slow
def test_torchrun_two_ranks_and_resume_on_one(tmp_path):
    """2 ranks (ep 2) for 3 steps, resumed on one process with the same 2-replica plan, equals
    2 ranks for 5 steps."""
    run, two, one = tmp_path / "run", tmp_path / "two", tmp_path / "one"
    common = [*BASE, "--capacity", "600", "--replicas", "2"]
    r = harts(
        *common, "--steps", "5", "--ep", "2", "--run-dir", str(run), "--save-every", "3", "--save", str(two), ranks=2
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 ranks (dp 1 x ep 2)" in r.stdout
    shutil.rmtree(run / "checkpoints" / "step-00000005")
    r = harts(*common, "--steps", "5", "--resume", str(run), "--save", str(one))
    assert r.returncode == 0, r.stderr
    a, b = _weights(two), _weights(one)
    for k in a:
        scale = max(float(a[k].abs().max()), 1e-30)
        assert float((a[k] - b[k]).abs().max()) / scale <= 1e-9, k


@pytest.mark.slow
def test_torchrun_context_parallel_and_resume_on_one(tmp_path):
    """2 ranks of one context-parallel group (cp 2) for 3 steps equal 2 steps there and the
    third resumed on one process (the same 1-replica plan): a checkpoint moves between layouts."""
    run, two, one = tmp_path / "run", tmp_path / "two", tmp_path / "one"
    common = [*BASE, "--capacity", "600"]
    r = harts(
        *common, "--steps", "3", "--cp", "2", "--run-dir", str(run), "--save-every", "2", "--save", str(two), ranks=2
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 ranks (dp 1 x ep 1 x cp 2)" in r.stdout
    shutil.rmtree(run / "checkpoints" / "step-00000003")
    r = harts(*common, "--steps", "3", "--resume", str(run), "--save", str(one))
    assert r.returncode == 0, r.stderr
    assert "step 2:" in r.stdout and "step 1:" not in r.stdout
    a, b = _weights(two), _weights(one)
    for k in a:
        scale = max(float(a[k].abs().max()), 1e-30)
        assert float((a[k] - b[k]).abs().max()) / scale <= 1e-10, k


def test_torchrun_cp2_tp2_and_resume_at_tp2(tmp_path):
    """4 ranks (cp 2 x tp 2) for 3 steps equal 2 steps there and the third resumed on 2 ranks at
    tp 2. The tiny preset's GDN has one key head, which tp 2 cannot split: attention layers only."""
    run, four, two = tmp_path / "run", tmp_path / "four", tmp_path / "two"
    common = [*BASE, "--capacity", "600", "--pattern", "MAMA", "--steps", "3"]
    r = harts(
        *common, "--cp", "2", "--tp", "2", "--run-dir", str(run), "--save-every", "2", "--save", str(four), ranks=4
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 ranks (dp 1 x ep 1 x cp 2 x tp 2)" in r.stdout
    shutil.rmtree(run / "checkpoints" / "step-00000003")
    r = harts(*common, "--tp", "2", "--resume", str(run), "--save", str(two), ranks=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 2:" in r.stdout and "step 1:" not in r.stdout
    a, b = _weights(four), _weights(two)
    for k in a:
        scale = max(float(a[k].abs().max()), 1e-30)
        assert float((a[k] - b[k]).abs().max()) / scale <= 1e-10, k


def test_mesh_errors():
    with pytest.raises(UserError, match=r"--dp 3 x --ep 1 = 3 ranks, but the launch has 2"):
        ParallelConfig(dp=3).check(2, 4)
    with pytest.raises(UserError, match=r"--ep 3 does not divide the model's 4 experts"):
        ParallelConfig(ep=3).check(3, 4)
    with pytest.raises(UserError, match=r"no MoE layers"):
        ParallelConfig(ep=2).check(2, 0)
    with pytest.raises(UserError, match=r"--dp 1 x --ep 1 x --cp 2 x --tp 2 = 4 ranks, but the launch has 2"):
        ParallelConfig(cp=2, tp=2).check(2, 0)
    with pytest.raises(UserError, match=r"--tp must be a positive integer"):
        ParallelConfig(tp=0).check(1, 0)


def test_wrong_world_size_on_the_command_line():
    r = harts(*BASE, "--steps", "1", "--dp", "2")
    assert r.returncode == 2 and "--dp 2 x --ep 1 = 2 ranks, but the launch has 1" in r.stderr
    r = harts(*BASE, "--steps", "1", "--ep", "2")
    assert r.returncode == 2 and "--ep 2 does not divide the 1 rank(s)" in r.stderr
    r = harts(*BASE, "--steps", "1", "--cp", "2")
    assert r.returncode == 2 and "--cp 2 does not divide the 1 rank(s)" in r.stderr
    r = harts(*BASE, "--steps", "1", "--tp", "2")
    assert r.returncode == 2 and "--tp 2 does not divide the 1 rank(s)" in r.stderr
    r = harts(*BASE, "--steps", "1", "--cpu-offload")
    assert r.returncode == 2 and "--cpu-offload" in r.stderr and "--device cuda" in r.stderr


def test_capacity_error_names_the_way_through():
    r = harts(*BASE, "--steps", "1", "--capacity", "50")
    assert r.returncode == 2, r.stderr
    assert "--capacity 50" in r.stderr and "--recompute" in r.stderr and "--ep" in r.stderr


@pytest.mark.slow
def test_ranks_stop_together_on_a_signal_and_checkpoint(tmp_path):
    """SIGINT to torchrun: both ranks finish the same step, save one checkpoint, write the log."""
    import json
    import signal

    from harts.parallel.checkpoint import latest_checkpoint
    from tests.rl.test_train_signals import interrupt

    run, log = tmp_path / "run", tmp_path / "log.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += ["-m", "harts.cli", *BASE, "--steps", "500", "--ep", "2", "--run-dir", str(run), "--json", str(log)]
    _, _, err = interrupt(cmd, signal.SIGINT, ENV)
    record = json.loads(log.read_text())
    done = record["interrupted"]["completed_steps"]
    assert record["interrupted"]["signal"] == "SIGINT" and 2 <= done < 500
    assert f"harts: interrupted by SIGINT after step {done - 1}" in err
    assert latest_checkpoint(run).name == f"step-{done:08d}"
    assert len(list((latest_checkpoint(run) / "rng").iterdir())) == 2


def _save_tiny(tmp_path) -> str:  # noqa: ANN001
    """A model saved by ``harts train --save`` (harts' own weights directory); attention layers
    only, so that --tp 2 can split it (the tiny preset's GDN has one key head)."""
    saved = tmp_path / "saved"
    r = harts(*BASE, "--pattern", "MAMA", "--steps", "1", "--save", str(saved))
    assert r.returncode == 0, r.stderr
    return str(saved)


def _first_loss(tmp_path, name: str, *extra: str, ranks: int = 1) -> float:  # noqa: ANN001
    """``harts train --model ... --steps 1``'s loss, read from its --json."""
    import json

    log = tmp_path / f"{name}.json"
    r = harts(*BASE, "--capacity", "600", "--steps", "1", "--json", str(log), *extra, ranks=ranks)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(log.read_text())["steps"][0]["loss"]


def test_a_saved_model_trains_with_meta_init_as_on_one_process(tmp_path):
    """--meta-init builds the saved model on the meta device and reads its weights after: the same
    values, so the same run bit for bit."""
    saved = _save_tiny(tmp_path)
    for name, extra in (("default", []), ("meta", ["--meta-init"])):
        r = harts(*BASE, "--model", saved, "--steps", "2", "--save", str(tmp_path / name), *extra)
        assert r.returncode == 0, r.stderr
    a, b = _weights(tmp_path / "default"), _weights(tmp_path / "meta")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["--dp", "2"], ["--tp", "2"], ["--cp", "2"]], ids=["DP2", "TP2", "CP2"])
def test_a_saved_model_trains_under_torchrun(tmp_path, mesh):
    """Two ranks read the saved model (rank 0 reads, every rank keeps its shard): the first step's
    loss, a float64 sum over the step's tokens, is the one process's up to the order of that sum
    (a relative 1e-10 is hundreds of times the rounding of ~2,000 terms; a model that is not the
    saved one is off by percents)."""
    saved = _save_tiny(tmp_path)
    one = _first_loss(tmp_path, "one", "--model", saved)
    two = _first_loss(tmp_path, "two", "--model", saved, *mesh, ranks=2)
    assert abs(two - one) <= 1e-10 * abs(one), (one, two)


@pytest.mark.parametrize("damage", ["weights", "config"])
def test_a_saved_model_that_does_not_load_is_one_line_under_torchrun(tmp_path, damage):
    """A saved model that does not load stops every rank at the same point, and rank 0 alone
    prints the one line, no rank a traceback: damaged weights (rank 0 reads them; no rank waits
    for the broadcast) or a bad config (every rank reads it)."""
    saved = _save_tiny(tmp_path)
    if damage == "weights":
        file = os.path.join(saved, "model.safetensors")
        os.truncate(file, 1000)
        why = "not readable (Error while deserializing header: invalid header length)"
    else:
        file = os.path.join(saved, "config.json")
        with open(file, "w") as fh:
            fh.write('{"model_type": "harts", "harts_config": {"hidden_size": -3}}')
        why = "HybridConfig.hidden_size must be a positive integer, got -3"
    r = harts(*BASE, "--capacity", "600", "--steps", "1", "--model", saved, ranks=2)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.startswith("harts: error:")]
    assert lines == [f"harts: error: {file}: {why}"], r.stderr
    assert "harts/cli.py" not in r.stderr, r.stderr
