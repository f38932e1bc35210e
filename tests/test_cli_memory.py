"""Every command that builds a model checks its memory estimate first: one ``harts: error:``
line naming the estimate, what is available, the largest term and the knob, exit 2, before the
model is built; ``--force`` goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import harts.commands._memory as memory
from harts.cli import main
from harts.tree.batch import RolloutBatch

GIB = 2**30


def run(capsys, *argv) -> tuple[int, str, str]:  # noqa: ANN001
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("harts: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def little_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU has 2 GiB free, whatever this machine has."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2 * GIB)


@pytest.fixture
def huge_token_file(tmp_path) -> str:  # noqa: ANN001
    """A batch file without a vocabulary header whose largest token id is 10,000,000."""
    rng = np.random.default_rng(0)
    trajs = [list(rng.integers(0, 500, 60)) for _ in range(4)]
    trajs[2][30] = 10_000_000
    path = tmp_path / "f.jsonl"
    RolloutBatch.from_trajectories(trajs, advantages=rng.normal(size=4)).save(str(path))
    return str(path)


@pytest.mark.parametrize(
    "argv, knob",
    [
        (["bench", "--workload", "small", "--steps", "1", "--capacity", "4096", "--model", "ling3_tiny"], "--layers"),
        (["bench", "--workload", "small", "--steps", "1", "--capacity", "2000000"], "--capacity"),
        (["fidelity", "--workload", "small", "--capacity", "2000000"], "--capacity"),
        (["train", "--workload", "tiny", "--steps", "1", "--capacity", "2000000"], "--capacity"),
    ],
    ids=["bench-ling3-tiny", "bench-capacity", "fidelity-capacity", "train-capacity"],
)
def test_too_big_stops_with_one_line(capsys, little_memory, argv, knob) -> None:  # noqa: ANN001
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    line = one_error_line(err)
    assert "not enough memory on cpu" in line and "2.0 GiB available" in line
    assert "the largest term is" in line and knob in line and "--force" in line
    assert "step 0:" not in out


def test_huge_token_id_stops_compare_and_train(capsys, little_memory, huge_token_file) -> None:  # noqa: ANN001
    for argv in (["compare", "--workload", huge_token_file], ["train", "--workload", huge_token_file]):
        code, out, err = run(capsys, *argv)
        assert code == 2, (argv, out, err)
        line = one_error_line(err)
        assert "fewer than 10,000,001 token ids" in line, line


def test_force_runs_anyway(capsys, little_memory) -> None:  # noqa: ANN001
    code, out, err = run(capsys, "train", "--workload", "tiny", "--steps", "1", "--capacity", "2000000", "--force")
    assert code == 0, err


def test_fitting_runs_are_not_refused(capsys) -> None:  # noqa: ANN001
    code, out, err = run(capsys, "train", "--workload", "tiny", "--steps", "1")
    assert code == 0, err


def test_available_bytes_is_what_the_machine_reports() -> None:
    have = memory.available_bytes("cpu")
    assert have is None or have > 0
    assert memory.available_bytes("meta") is None


def test_a_too_big_model_stops_within_seconds_in_a_subprocess() -> None:
    """The whole command, cold: ling3_tiny's 7.8 B float32 parameters alone exceed any CPU here."""
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "harts.cli", "bench", "--workload", "small", "--steps", "1", "--model", "ling3_tiny"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode == 0:  # pragma: no cover - a machine with terabytes of memory
        pytest.skip("this machine fits the whole ling3_tiny on the CPU")
    assert out.returncode == 2, out.stderr
    assert one_error_line(out.stderr).startswith("harts: error: not enough memory on cpu")
    assert time.perf_counter() - started < 120


def test_serve_counts_the_served_weights_once(capsys, monkeypatch) -> None:  # noqa: ANN001
    """LoRA runs share the served weights, so the check at start counts them once beside the
    sampling engines, whatever --max-models is: a device with room for that serves 8 runs, and
    one without it is refused by the parameters term."""
    from harts.models.config import HybridConfig
    from harts.models.execution.config import ExecutionConfig
    from harts.models.memory import estimate_memory
    from harts.serve.sampling import SAMPLER_ENGINES

    config = HybridConfig.preset("ling3_tiny").first_layers(1)
    head = ExecutionConfig(fused_logprobs=True)
    kw = dict(capacity=1024, dtype="float32", optimizer=False, frozen_base=True)
    held = estimate_memory(config, head, models=1 + SAMPLER_ENGINES, **kw)
    one = estimate_memory(config, head, **kw)
    assert held.terms["parameters"] == (1 + SAMPLER_ENGINES) * one.terms["parameters"]
    started: list[object] = []
    monkeypatch.setattr("harts.serve.server.serve", lambda config, **kw: started.append(config))
    argv = ["serve", "--model", "ling3_tiny", "--layers", "1", "--capacity", "1024", "--port", "1"]
    argv += ["--api-key", "tml-test-0123456789abcdef", "--max-models", "8"]
    monkeypatch.setattr(memory, "available_bytes", lambda device: held.total)
    assert run(capsys, *argv)[0] == 0 and len(started) == 1
    monkeypatch.setattr(memory, "available_bytes", lambda device: held.total - one.terms["parameters"])
    code, _, err = run(capsys, *argv)
    line = one_error_line(err)
    assert code == 2 and "not enough memory on cpu" in line and "parameters" in line, line
    assert "--max-models" not in line


def test_serve_checks_its_engines_execution(capsys, monkeypatch) -> None:  # noqa: ANN001
    """The serve check sizes activations as its engines run them: ``--recompute`` keeps one
    layer's at a time, so a device that cannot hold the stored activations of every layer
    serves with it (and is refused without it)."""
    from harts.models.config import HybridConfig
    from harts.models.execution.config import ExecutionConfig
    from harts.models.memory import estimate_memory
    from harts.serve.sampling import SAMPLER_ENGINES

    config = HybridConfig.preset("ling3_tiny").first_layers(4)
    kw = dict(capacity=4096, dtype="float32", optimizer=False, frozen_base=True, models=1 + SAMPLER_ENGINES)
    stored = estimate_memory(config, ExecutionConfig(fused_logprobs=True), **kw).total
    recomputed = estimate_memory(config, ExecutionConfig(fused_logprobs=True, recompute=True), **kw).total
    assert recomputed < stored
    have = (recomputed + stored) // 2
    monkeypatch.setattr(memory, "available_bytes", lambda device: have)
    started: list[object] = []
    monkeypatch.setattr("harts.serve.server.serve", lambda config, **kw: started.append(config))
    argv = ["serve", "--model", "ling3_tiny", "--layers", "4", "--capacity", "4096", "--max-models", "1", "--port", "1"]
    argv += ["--api-key", "tml-test-0123456789abcdef"]
    code, _, err = run(capsys, *argv)
    line = one_error_line(err)
    assert code == 2 and "not enough memory on cpu" in line and "activations" in line, line
    assert run(capsys, *argv, "--recompute")[0] == 0 and len(started) == 1


def test_serve_checks_each_lora_run_by_its_adapters(monkeypatch) -> None:  # noqa: ANN001
    """A LoRA run needs its adapters with their gradients and AdamW state (4 float32 tensors of
    the adapters' size) beside one step: the check passes the rank that fits, refuses the next
    one naming the rank that fits, and a run without LoRA is the whole model's check."""
    import torch

    from harts.models.config import HybridConfig
    from harts.models.execution.config import ExecutionConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.models.memory import estimate_memory, gathered_view_rows
    from harts.trainer.build import ModelSpec
    from harts.trainer.lora import LoraConfig, adapter_parameters

    spec = ModelSpec(model="ling3_tiny", layers=2, dtype="bfloat16", device="cpu")
    execution = ExecutionConfig(fused_logprobs=True, recompute=True)
    config = HybridConfig.preset("ling3_tiny", layers=2)
    est = estimate_memory(
        config,
        execution,
        capacity=2048,
        dtype="bfloat16",
        optimizer=False,
        frozen_base=True,
        device_type="cpu",
        view_rows=gathered_view_rows(2048, 1.0),
    )
    step = est.total - est.terms["parameters"]
    with torch.device("meta"):
        per_rank = 16 * adapter_parameters(HybridLM(config, seed=0), LoraConfig(rank=1))
    monkeypatch.setattr(memory, "available_bytes", lambda device: step + 8 * per_rank)
    check = memory.run_memory_check(spec, capacity=2048, execution=execution, force=False)
    check(LoraConfig(rank=8))
    with pytest.raises(memory.UserError, match=r"rank-9 adapters: .*; rank 8 fits") as err:
        check(LoraConfig(rank=9))
    assert "\n" not in str(err.value)
    with pytest.raises(memory.UserError, match=r"one step is estimated at"):
        check(None)
    memory.run_memory_check(spec, capacity=2048, execution=execution, force=True)(LoraConfig(rank=512))


# ------------------------------------------------------------------ the address-space limit
@pytest.fixture
def address_space_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ulimit -v`` of 12 GiB on a process that maps 3 GiB already; 64 GiB free, no cgroup limit."""
    import resource

    real = resource.getrlimit
    monkeypatch.setattr(
        resource,
        "getrlimit",
        lambda which: (12 * GIB, resource.RLIM_INFINITY) if which == resource.RLIMIT_AS else real(which),
    )
    monkeypatch.setattr(memory, "_virtual_size", lambda: 3 * GIB)
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 64 * GIB)
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)


def test_the_address_space_limit_bounds_what_is_available(address_space_limit) -> None:  # noqa: ANN001
    have = memory.available_bytes("cpu")
    assert have == 9 * GIB  # the limit less what is mapped, not the limit
    assert have.limit == "the address-space limit, ulimit -v 12.0 GiB, less the 3.0 GiB this process maps already"


def test_no_address_space_limit_leaves_the_free_memory(monkeypatch) -> None:  # noqa: ANN001
    import resource

    monkeypatch.setattr(memory, "_meminfo_available", lambda: 64 * GIB)
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    have = memory.available_bytes("cpu")
    assert have == 64 * GIB and not getattr(have, "limit", "")


def test_the_check_names_the_address_space_limit(capsys, address_space_limit) -> None:  # noqa: ANN001
    code, _, err = run(capsys, "train", "--workload", "tiny", "--steps", "1", "--capacity", "2000000")
    line = one_error_line(err)
    assert code == 2 and line.startswith("harts: error: not enough memory on cpu"), line
    assert "9.0 GiB available (the address-space limit, ulimit -v 12.0 GiB, less the 3.0 GiB" in line


def _virtual_size_after_import() -> int:
    """A fresh interpreter's virtual size once torch and the trainer are imported."""
    code = "import os, torch, harts.trainer.run; print(int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout)


def test_a_run_over_the_address_space_limit_is_one_line_not_the_allocator_s_traceback() -> None:
    """The whole command under a real ``ulimit -v`` of 1 GiB more than it maps after its imports:
    one layer of ling3_tiny at --capacity 1024 is estimated at about 3 GiB, so the check refuses
    it, naming the limit; without the check the step died in torch's allocator ("can't allocate
    memory", a traceback)."""
    import resource

    if (memory._meminfo_available() or 0) < 6 * GIB:
        pytest.skip("needs 6 GiB free, so that the address-space limit is the one that binds")
    cap = _virtual_size_after_import() + GIB
    argv = ["train", "--workload", "tiny", "--steps", "1", "--model", "ling3_tiny", "--layers", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "harts.cli", *argv, "--capacity", "1024", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1])),
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = one_error_line(out.stderr)
    assert line.startswith("harts: error: not enough memory on cpu"), line
    assert "available (the address-space limit, ulimit -v" in line, line
