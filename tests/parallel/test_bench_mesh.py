"""``harts bench`` on a (dp, ep, cp, tp) mesh: ``torchrun -m harts.cli bench --cp/--tp`` on gloo
processes reports both sides' slowest-rank time and every rank's peak memory, harts' loss is the
one-process step's, and a layout that does not fit is one line before any model or rendezvous."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harts.cli import main
from tests.parallel._dist import free_port

SMALL = ["bench", "--model", "tiny", "--workload", "tiny", "--steps", "1", "--capacity", "400"]
FLAGS = [*SMALL, "--dtype", "float64", "--threads", "1"]
ENV = {"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HARTS_DEBUG": ""}


def _torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    import os

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    cmd += ["--master-port", str(free_port()), "-m", "harts.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ENV), timeout=300)


def _one_process_loss(pattern: str | None) -> float:
    """The step's loss on one process, as the bench's harts side runs it (compact, capacity 400,
    log-probs at every position, fused), on the model the bench builds (tiny, seed 0, float64)."""
    from harts.integrations.loading import load_model
    from harts.models.execution.config import ExecutionConfig
    from harts.trainer.step import TrainConfig, accumulate_step_gradients
    from harts.tree.workloads import workload_steps

    batch = workload_steps("tiny", 1, seed=0)[0][1]()
    vocab = int(batch.tokens.max()) + 1
    model = load_model("tiny", vocab_size=vocab, dtype="float64", layer_pattern=pattern, seed=0)
    execution = ExecutionConfig(mode="compact", fused_logprobs=True, logprob_positions="all")
    return accumulate_step_gradients(model, batch, TrainConfig(capacity=400, execution=execution)).loss


@pytest.mark.parametrize(
    "layout, pattern",
    [(["--cp", "2"], None), (["--tp", "2"], "MAMA")],  # the tiny GDN's one key head does not split 2 ways
    ids=["cp2", "tp2"],
)
def test_bench_on_two_gloo_ranks(tmp_path, layout, pattern) -> None:
    out = tmp_path / "bench.json"
    extra = ["--pattern", pattern] if pattern else []
    r = _torchrun(2, *FLAGS, *extra, *layout, "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "2 ranks (dp 1 x ep 1 x " in r.stdout and "peak memory per rank" in r.stdout
    record = json.loads(out.read_text())
    cp, tp = (2, 1) if layout[0] == "--cp" else (1, 2)
    assert record["mesh"] == {"world_size": 2, "dp": 1, "ep": 1, "cp": cp, "tp": tp, "replicas": 1}
    (step,) = record["steps"]
    for side in ("baseline", "harts"):
        s = step[side]
        assert s["step_seconds"] > 0 and s["microbatches"] >= 1
        assert len(s["peak_gib_per_rank"]) == 2  # one entry a rank (None off CUDA)
        assert len(s["replica_seconds_measured"]) == len(s["replica_seconds_predicted"]) == 1
    assert step["speedup"] == pytest.approx(step["baseline"]["step_seconds"] / step["harts"]["step_seconds"])
    # same weights on both sides, and the one-process step's loss
    loss = _one_process_loss(pattern)
    assert step["harts"]["loss"] == pytest.approx(loss, rel=1e-9, abs=1e-12)
    assert step["baseline"]["loss"] == pytest.approx(loss, rel=1e-9, abs=1e-12)


def _error(capsys, monkeypatch, world: int, *argv: str) -> str:
    """``harts bench argv`` as rank 0 of a ``world``-rank torchrun launch would run it, up to
    its first error (every check runs before the process group is joined)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    code = main([*SMALL, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and "step 0:" not in out, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "world, argv, match",
    [
        (1, ["--cp", "2"], "--cp 2 does not divide the 1 rank(s) of this launch"),
        (2, ["--cp", "3"], "--cp 3 does not divide the 2 rank(s) of this launch"),
        (4, ["--cp", "2", "--tp", "2", "--ep", "2"], "--ep 2 x --cp 2 x --tp 2 = 8 does not divide the 4 ranks"),
        (4, ["--cp", "2", "--dp", "1"], "--dp 1: under torchrun --dp is the mesh's data-parallel degree, 4 ranks"),
        (2, ["--cp", "2", "--capacity", "401"], "--cp 2 x --tp 1 = 2 does not divide --capacity 401"),
        (2, ["--tp", "2"], "--tp 2 does not divide the model's 1 linear-attention key heads"),
        (3, ["--ep", "3"], "--ep 3 does not divide the model's 4 experts"),
        (2, ["--cp", "2", "--replica", "1"], "--replica times one device"),
        (2, ["--profile", "prof"], "--profile times one device"),
        (2, ["--repeats", "3"], "--repeats times one device's step"),
        (2, ["--lora", "4"], "--lora is timed on one device"),
    ],
)
def test_a_layout_that_does_not_fit_is_one_line(capsys, monkeypatch, world, argv, match) -> None:
    assert match in _error(capsys, monkeypatch, world, *argv)


def test_one_process_keeps_dp_as_planned_replicas(capsys, monkeypatch) -> None:
    """Without torchrun ``--dp`` plans replicas and launches nothing (the one-device timing)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _error(capsys, monkeypatch, 1, "--dp", "2", "--replica", "2")
    assert "--replica must lie in [0, 2) for --dp 2; got 2" in err
