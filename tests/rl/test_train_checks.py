"""The training loop's checks and hooks: capacity of every step before step 0, microbatch progress,
and the point after which a step is no longer abandoned (``on_update``)."""

from __future__ import annotations

import pytest
import torch

from harts import CapacityError, HybridConfig, HybridLM
from harts.trainer.loop import train
from harts.trainer.step import TrainConfig, train_step
from harts.trainer.weights import load_state
from harts.tree.workloads import generate


def _model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(HybridConfig.tiny(dtype="float64", vocab_size=256, num_experts=0, layer_pattern="KM"))


def test_train_checks_every_step_before_the_first():
    short = generate("tiny", step=1, seed=0)
    long = generate("tiny", step=0, seed=0)
    assert int(long.lengths.max()) > int(short.lengths.max())
    capacity = int(short.lengths.max())
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(
        CapacityError, match=rf"step 1: trajectory \d+ has .* fits this batch is capacity={int(long.lengths.max())}$"
    ):
        train(model, [short, long], TrainConfig(capacity=capacity))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # step 0 never ran


def test_train_step_reports_microbatches_then_update():
    batch = generate("tiny", step=0, seed=2)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    events: list = []
    log = train_step(
        model,
        opt,
        batch,
        TrainConfig(capacity=300),
        progress=lambda d, t: events.append((d, t)),
        on_update=lambda: events.append("update"),
    )
    total = log.rank_microbatches
    assert total > 2
    assert events == [(d, total) for d in range(total + 1)] + ["update"]


def test_cli_keeps_completed_steps_when_a_later_step_fails(tmp_path, monkeypatch, capsys):
    """A step that fails before touching the weights (here: a simulated out-of-memory) costs only
    that step: the table, --save and --json hold the completed ones, then the error propagates."""
    import json

    import harts.trainer.run as rl_train
    from harts.cli import main

    real = rl_train.train_step
    seen = []

    def flaky(model, optimizer, batch, cfg, *, step, **kw):  # noqa: ANN001
        if step == 2:
            raise RuntimeError("simulated out of memory")
        log = real(model, optimizer, batch, cfg, step=step, **kw)
        seen.append({n: p.detach().clone() for n, p in model.state_dict().items()})
        return log

    monkeypatch.setattr(rl_train, "train_step", flaky)
    save, log = tmp_path / "ckpt", tmp_path / "log.json"
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        main(
            ["train", "--workload", "tiny", "--steps", "4", "--pattern", "KM", "--save", str(save), "--json", str(log)]
        )
    out, err = capsys.readouterr()
    assert "harts: step 2 failed (RuntimeError); keeping the 2 completed step(s)" in err
    record = json.loads(log.read_text())
    assert [s["step"] for s in record["steps"]] == [0, 1]
    assert record["failed"]["step"] == 2 and "simulated out of memory" in record["failed"]["error"]
    saved = load_state(str(save))
    assert all(torch.equal(saved[n], v) for n, v in seen[-1].items())
