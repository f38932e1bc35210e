"""The trainer engine on a mesh equals the one-process engine: 2 gloo processes (FSDP2, CP2, TP2;
EP2 marked slow), float64, the adversarial flat trajectories of ``tests/trainer/test_engine``
(forks at, next to and inside linear-attention chunks, duplicates, a one-token trajectory).
Every rank gets the whole call's per-trajectory log-probs in the caller's order and the same
loss; two accumulated calls (a built-in loss, then a callable one) and one clipped ``optim_step``
leave the weights and the expert bias of the one-process engine (1e-10 relative). The mesh's
state, saved sharded, loads in one process to the same weights and step; the sampler export
holds the gathered weights. Bad layouts and LoRA on a mesh are one-line UserErrors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harts import HybridConfig, HybridLM, UserError
from harts.parallel.mesh import ParallelConfig
from harts.trainer.engine import Engine
from tests.parallel._dist import assert_close, spawn
from tests.trainer.test_engine import _custom, _flat

CAPACITY = 48  # several microbatches per replica
TOL = 1e-10
OPTIONS: dict[str, Any] = {"capacity": CAPACITY, "grad_clip": 0.5, "lr": 1e-2, "expert_bias_rate": 0.05}


def _tp_model() -> HybridLM:
    """The tiny preset with linear-attention heads that two tensor-parallel shards can split."""
    return HybridLM(HybridConfig.tiny(dtype="float64", linear_num_value_heads=4, linear_num_key_heads=2), seed=3)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer at its full shape (collective on a mesh)."""
    from torch.distributed.tensor import DTensor

    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in tensors.items()}


def _calls(engine: Engine, tmp: str | None) -> dict[str, Any]:
    """What the test compares: two accumulated calls, a step, a forward (and the saves)."""
    trajs = _flat()
    fb = engine.forward_backward(trajs, "ppo")
    custom = engine.forward_backward(trajs[3:], _custom)
    step = engine.optim_step()
    after = engine.forward(trajs)
    got = {
        "fb": fb,
        "custom": custom,
        "grad_norm": step.grad_norm,
        "after": after,
        "state": _full_state(engine.model),
    }
    if tmp is not None:
        engine.save_state(f"{tmp}/state")
        engine.save_weights_for_sampler(f"{tmp}/sampler")
    return got


def _engine(layout: str, parallel: ParallelConfig | None) -> Engine:
    if layout == "tp":
        if parallel is None:
            return Engine(_tp_model(), **OPTIONS)
        from harts.parallel.mesh import init_parallel
        from harts.parallel.parallelize import parallelize

        state = init_parallel(parallel, "cpu", 4)
        return Engine(parallelize(_tp_model(), state), parallel=state, **OPTIONS)
    return Engine.from_spec("tiny", dtype="float64", parallel=parallel, **OPTIONS)


def _on_mesh(layout: str, dp: int, ep: int, cp: int, tp: int, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    engine = _engine(layout, ParallelConfig(dp=dp, ep=ep, cp=cp, tp=tp))
    got = _calls(engine, tmp)
    # every rank returns the same log-probs, loss and metrics
    mine = (got["fb"], got["custom"], got["grad_norm"], got["after"])
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    got["same_on_every_rank"] = all(_same(e, every[0]) for e in every)
    if layout == "fsdp":
        got["errors"] = [_error(p) for p in (ParallelConfig(dp=2, cp=2), ParallelConfig(tp=2))]
    return got


def _error(parallel: ParallelConfig) -> str:
    try:
        Engine.from_spec("tiny", dtype="float64", parallel=parallel)
    except UserError as err:
        return str(err)
    return "no error"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b, equal_nan=True)
    if hasattr(a, "__dataclass_fields__"):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(abs(b), 1.0)


def _check(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["same_on_every_rank"]
    for key in ("fb", "custom"):
        g, r = got[key], ref[key]
        assert _close(g.loss, r.loss), (key, g.loss, r.loss)
        assert len(g.logprobs) == len(r.logprobs)
        for x, y in zip(g.logprobs, r.logprobs):
            np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL)
        for name in ("target_tokens:sum", "weight:sum", "clip_fraction:mean", "custom"):
            if name in r.metrics:
                assert _close(g.metrics[name], r.metrics[name]), name
    assert _close(got["grad_norm"], ref["grad_norm"])
    for x, y in zip(got["after"], ref["after"]):
        np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL)
    assert_close(got["state"], ref["state"], tol=TOL)


def _run(layout: str, dp: int, ep: int, cp: int, tp: int, tmp_path: Path) -> dict[str, Any]:
    got = spawn(dp * ep * cp * tp, _on_mesh, layout, dp, ep, cp, tp, str(tmp_path), tmp=str(tmp_path))
    ref = _calls(_engine(layout, None), None)
    _check(got, ref)
    return got


def test_fsdp2_engine_equals_one_process_and_its_state_loads_in_one(tmp_path: Path) -> None:
    got = _run("fsdp", 2, 1, 1, 1, tmp_path)
    assert got["errors"][0].startswith("--dp 2 x --ep 1 x --cp 2 = 4 ranks, but the launch has 2")
    assert got["errors"][1] == "--tp 2 does not divide the model's 1 linear-attention key heads (linear_num_key_heads)"
    # the sharded state, in one process: the same weights, buffers and step
    one = Engine.from_spec("tiny", dtype="float64", **OPTIONS)
    one.load_state(tmp_path / "state")
    assert one.step == 1
    assert_close(_full_state(one.model), got["state"], tol=0.0)
    # the sampler's weights are the gathered ones
    from harts.integrations.loading import load_model

    sampler = load_model(str(tmp_path / "sampler"), dtype="float64")
    params = {n: p.detach() for n, p in sampler.named_parameters()}
    assert_close(params, {n: got["state"][n] for n in params}, tol=0.0)


@pytest.mark.parametrize("layout, cp, tp", [("cp", 2, 1), ("tp", 1, 2)], ids=["CP2", "TP2"])
def test_row_split_engine_equals_one_process(tmp_path: Path, layout: str, cp: int, tp: int) -> None:
    _run(layout, 1, 1, cp, tp, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, dp, ep, tp",
    [("ep", 1, 2, 1), ("ep", 2, 2, 1), ("tp", 2, 1, 2)],
    ids=["EP2", "FSDP2xEP2", "FSDP2xTP2"],
)
def test_more_engine_layouts_equal_one_process(tmp_path: Path, layout: str, dp: int, ep: int, tp: int) -> None:
    """With replicas of the expert blocks or tensor-parallel shards (4 ranks), whose gradients
    the engine sums per call: a second call before ``optim_step`` must not sum the first again."""
    _run(layout, dp, ep, 1, tp, tmp_path)


def test_bad_layouts_and_lora_on_a_mesh_are_one_line_user_errors() -> None:
    with pytest.raises(UserError, match=r"^--cp 2 does not divide the 1 rank\(s\) of this launch$"):
        Engine.from_spec("tiny", parallel=ParallelConfig(cp=2))
    with pytest.raises(UserError, match=r"^--ep 3 does not divide the 1 rank\(s\)"):
        Engine.from_spec("tiny", parallel=ParallelConfig(ep=3))
    from harts.trainer.lora import LoraConfig

    with pytest.raises(UserError, match=r"^LoRA adapters cannot be trained on a mesh"):
        Engine.from_spec("tiny", lora=LoraConfig(rank=4), parallel=ParallelConfig())
    # one process through the mesh path: the engine of the plain path
    a = Engine.from_spec("tiny", dtype="float64", parallel=ParallelConfig(), capacity=CAPACITY)
    b = Engine.from_spec("tiny", dtype="float64", capacity=CAPACITY)
    assert_close(_full_state(a.model), _full_state(b.model), tol=0.0)
