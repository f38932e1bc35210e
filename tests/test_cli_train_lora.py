"""``harts train --lora RANK``: only the adapters train (every base tensor and buffer is the fresh
model's, bit for bit, after training), ``--save`` writes the adapters alone and they load back
(harts' own loader; PEFT's on the transformers model, where ``--export-hf`` writes the merged
weights), the compact run equals the trajectory-wise one on adversarial trees in float64, a
resumed run equals the uninterrupted one bit for bit, and a bad value or a flag LoRA does not
run with is one line naming the flag, before any work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from harts.cli import main
from harts.models.hybrid_lm import HybridLM
from harts.trainer.build import ModelSpec, build_model
from harts.trainer.lora import LoraConfig, adapter_module, lora_config_of
from harts.trainer.weights import ADAPTER_FORMAT, load_adapter

TRAIN = ["train", "--workload", "tiny", "--lr", "1e-2", "--lora", "8"]

#: float64 rounding, summed over a few thousand terms and a few layers: far above it (1e-16 x 1e4)
#: and far below a wrong gradient (which is off by percents)
TOL = 1e-10


def _train(monkeypatch: pytest.MonkeyPatch, *argv: str) -> HybridLM:
    """Run ``harts train argv`` (which must ``--save``); the trained model, as ``--save`` gets it."""
    import harts.trainer.weights as weights

    got: dict[str, HybridLM] = {}
    real = weights.save_adapter

    def spy(model: HybridLM, out: str) -> str:
        got["model"] = model
        return real(model, out)

    monkeypatch.setattr(weights, "save_adapter", spy)
    assert main([*argv]) == 0
    return got["model"]


def _base(model: HybridLM) -> dict[str, torch.Tensor]:
    """The base tensors of an adapted model under the plain model's names, and every buffer."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            continue
        module, sep, rest = name.partition(".parametrizations.")
        out[f"{module}.{rest.split('.')[0]}" if sep else name] = t
    out.update({f"buffer {n}": b for n, b in model.named_buffers()})
    return out


def _adapters(model: HybridLM) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in adapter_module(model).state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two steps of rank-8 LoRA on the tiny preset (MoE layers with routed experts), saved."""
    mp, out = pytest.MonkeyPatch(), tmp_path_factory.mktemp("lora") / "adapter"
    log = out.parent / "log.json"
    try:
        model = _train(mp, *TRAIN, "--steps", "2", "--save", str(out), "--json", str(log))
    finally:
        mp.undo()
    return {"model": model, "out": out, "log": json.loads(log.read_text())}


def test_only_the_adapters_train(trained: dict[str, Any]) -> None:
    model: HybridLM = trained["model"]
    fresh = build_model(ModelSpec(), model.config.vocab_size)
    assert _equal(_base(model), _base(fresh)), "a base tensor or buffer changed"
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".lora_" in n)
    adapters = _adapters(model)
    # B starts at zero: every B moved; the routed experts' stacked adapters among them
    assert all(float(v.abs().max()) > 0 for k, v in adapters.items() if k.endswith("lora_B"))
    assert any(".experts.parametrizations.gate_up_proj." in k for k in adapters)
    lora = trained["log"]["lora"]
    trainable = sum(v.numel() for v in adapters.values())
    assert lora == {"rank": 8, "alpha": 32.0, "targets": ["attn", "mlp", "unembed"], "trainable_parameters": trainable}
    assert lora_config_of(model) == LoraConfig(rank=8)


def test_saved_adapter_loads_back(trained: dict[str, Any]) -> None:
    out: Path = trained["out"]
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["format"] == ADAPTER_FORMAT and config["lora"]["rank"] == 8
    model = trained["model"]
    assert _equal(load_file(str(out / "adapter_model.safetensors")), _adapters(model))
    fresh = build_model(ModelSpec(), model.config.vocab_size)
    load_adapter(fresh, str(out))
    assert _equal(_adapters(fresh), _adapters(model)) and lora_config_of(fresh) == lora_config_of(model)
    # harts' adapter layout names the model it was trained for
    other = build_model(ModelSpec(pattern="KM"), model.config.vocab_size)
    with pytest.raises(Exception, match="saved for another model .layer_pattern"):
        load_adapter(other, str(out))


def test_transformers_model_saves_a_peft_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--save`` of a transformers ``--model``: PEFT's layout, which PEFT loads onto the
    transformers model to the log-probs of ``--export-hf``'s merged checkpoint, and which harts
    loads back bit for bit."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from harts.integrations.hf import from_pretrained
    from tests.integrations._hf import hf_logprobs, make_hf_model, trajectories

    source, save, merged = tmp_path / "qwen3_next", tmp_path / "adapter", tmp_path / "merged"
    make_hf_model("qwen3_next", vocab_size=256).save_pretrained(source)
    argv = ["train", "--model", str(source), "--workload", "tiny", "--steps", "2", "--capacity", "400"]
    model = _train(monkeypatch, *argv, "--lr", "1e-2", "--lora", "4", "--save", str(save))
    assert {p.name for p in save.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}  # + README.md
    assert json.loads((save / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert main([*argv, "--lr", "1e-2", "--lora", "4", "--export-hf", str(merged)]) == 0
    capsys.readouterr()

    def load(path: Path) -> Any:  # noqa: ANN401
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()

    trajs = trajectories([11, 18], seed=3)
    with torch.no_grad():
        peft = hf_logprobs(PeftModel.from_pretrained(load(source), str(save)).eval(), trajs)
        theirs, base = hf_logprobs(load(merged), trajs), hf_logprobs(load(source), trajs)
    scale = float(theirs.abs().max())
    assert float((peft - theirs).abs().max()) <= 1e-4 * scale  # float32, two ways of adding B A
    assert float((base - theirs).abs().max()) > 1e-3 * scale  # the adapters reached both
    again = from_pretrained(str(source))
    load_adapter(again, str(save))
    assert _equal(_adapters(again), _adapters(model))


def test_compact_equals_trajectory_on_adversarial_trees(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One float64 LoRA step on the adversarial trees (forks at chunk B - 1, B, B + 1, nested,
    one-token segments, duplicates), several microbatches, adapters on the routed experts: the
    loss, the gradient norm and every adapter after the update equal the trajectory-wise step's."""
    from tests.models._trees import mixed_batch

    data = tmp_path / "trees.jsonl"
    mixed_batch(8).save(str(data))
    got = {}
    for mode in ("compact", "trajectory"):
        out, log = tmp_path / mode, tmp_path / f"{mode}.json"
        argv = ["train", "--workload", str(data), "--dtype", "float64", "--lora", "4", "--lr", "1e-2"]
        argv += ["--mode", mode, "--capacity", "128", "--moe-stats", "step", "--save", str(out), "--json", str(log)]
        assert main(argv) == 0
        step = json.loads(log.read_text())["steps"][0]
        assert step["microbatches"] > 1
        got[mode] = (step, load_file(str(out / "adapter_model.safetensors")))
    capsys.readouterr()
    (compact, a), (trajectory, b) = got["compact"], got["trajectory"]
    for key in ("loss", "grad_norm"):
        assert abs(compact[key] - trajectory[key]) <= TOL * abs(trajectory[key]), key
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    for k in a:
        assert float((a[k] - b[k]).abs().max()) <= TOL * max(float(b[k].abs().max()), 1e-300), k


def test_resume_equals_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run, straight, resumed = tmp_path / "run", tmp_path / "straight", tmp_path / "resumed"
    argv = [*TRAIN, "--steps", "3", "--run-dir", str(run), "--save-every", "1", "--save", str(straight)]
    assert main(argv) == 0
    last = run / "checkpoints" / "step-00000003"
    # the checkpoints hold the adapters and their AdamW state, not the base
    names = json.loads((last / "dcp" / "metadata.json").read_text())["tensors"]
    assert names and all(".lora_" in n for n in names)
    for p in sorted(last.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    last.rmdir()
    capsys.readouterr()
    argv = [*TRAIN, "--steps", "3", "--run-dir", str(run), "--resume", "auto", "--save", str(resumed)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "resumed" in out and "step 2:" in out and "step 1:" not in out
    a, b = (load_file(str(p / "adapter_model.safetensors")) for p in (straight, resumed))
    assert _equal(a, b)
    # another adapter, or none, is refused by name
    for change, match in (
        (["--lora", "4"], "the run used --lora 8, this command --lora 4"),
        (["--lora", "8", "--lora-alpha", "16"], "the run used --lora-alpha 32.0, this command --lora-alpha 16.0"),
        (["--lora", "8", "--lora-targets", "mlp"], "--lora-targets attn,mlp,unembed, this command --lora-targets mlp"),
    ):
        argv = ["train", "--workload", "tiny", "--lr", "1e-2", "--steps", "4", "--resume", str(run), *change]
        assert main(argv) == 2
        assert match in capsys.readouterr().err
    assert main(["train", "--workload", "tiny", "--lr", "1e-2", "--steps", "4", "--resume", str(run)]) == 2
    assert "the run trained LoRA adapters (--lora 8); pass --lora 8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--lora", "0"], "argument --lora: must be a positive integer (>= 1), got '0'"),
        (["--lora", "-2"], "argument --lora: must be a positive integer (>= 1), got '-2'"),
        (["--lora", "2.5"], "argument --lora: expected an integer, got '2.5'"),
        (["--lora", "8", "--lora-alpha", "0"], "argument --lora-alpha: must be a finite number > 0"),
        (["--lora", "8", "--lora-alpha", "nan"], "argument --lora-alpha: must be a finite number > 0"),
        (["--lora", "8", "--lora-targets", "attn,ffn"], "argument --lora-targets: unknown target 'ffn'"),
        (["--lora", "8", "--lora-targets", ","], "argument --lora-targets: no target"),
        (["--lora-alpha", "16"], "--lora-alpha sets up LoRA adapters, which --lora RANK turns on"),
        (["--lora-targets", "mlp"], "--lora-targets sets up LoRA adapters, which --lora RANK turns on"),
        (["--lora", "8", "--ep", "2"], "--ep 2 with --lora: LoRA adapters train on one process"),
        (["--lora", "8", "--tp", "2"], "--tp 2 with --lora: LoRA adapters train on one process"),
        (["--lora", "8", "--cpu-offload"], "--cpu-offload with --lora: it is FSDP's"),
    ],
)
def test_bad_lora_flags_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], match: str) -> None:
    try:
        code = main(["train", "--workload", "tiny", *argv])
    except SystemExit as exit_:  # argparse's
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2 and match in err and "Traceback" not in err, err
    assert [line for line in err.splitlines() if "error:" in line] == [err.splitlines()[-1]]
    assert "step 0:" not in out


def test_lora_under_torchrun_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--workload", "tiny", "--lora", "8"]) == 2
    assert "--lora under torchrun (2 ranks)" in capsys.readouterr().err


def test_lora_option_names_match_the_config() -> None:
    from harts.commands import _inputs
    from harts.trainer import lora

    assert _inputs.LORA_TARGETS == lora.LORA_TARGETS
    parser = __import__("argparse").ArgumentParser()
    _inputs.add_lora_arguments(parser)
    parser.add_argument("--seed", type=int, default=3)
    assert _inputs.lora_config(parser.parse_args([])) is None
    assert _inputs.lora_config(parser.parse_args(["--lora", "8"])) == LoraConfig(rank=8, seed=3)
    got = _inputs.lora_config(parser.parse_args(["--lora", "2", "--lora-alpha", "4", "--lora-targets", "unembed,attn"]))
    assert got == LoraConfig(rank=2, alpha=4.0, train_mlp=False, seed=3) and got.targets == ("attn", "unembed")
