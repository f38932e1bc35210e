"""``harts train --save DIR`` writes weights every ``--model DIR`` loads: harts' own directory for a
preset (config.json + model.safetensors), a transformers checkpoint for one; ``--export-hf DIR``
adds a transformers checkpoint where the model has a transformers class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harts.cli import main
from harts.integrations.loading import load_model
from harts.trainer.engine import Engine

TRAIN = ["train", "--workload", "tiny", "--steps", "1", "--pattern", "KM", "--lr", "1e-2"]


def test_preset_weights_reload_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trained"
    assert main([*TRAIN, "--save", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["model_type"] == "harts"
    trained = load_model(str(out))
    initial = load_model("tiny", layer_pattern="KM", vocab_size=trained.config.vocab_size)
    assert trained.state_dict().keys() == initial.state_dict().keys()
    assert any(not torch.equal(v, initial.state_dict()[k]) for k, v in trained.state_dict().items())
    engine = Engine.from_spec(str(out))
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in engine.model.state_dict().items())
    capsys.readouterr()
    # --model DIR: training goes on from the saved weights, and the other commands take them
    again = tmp_path / "again"
    assert main(["train", "--model", str(out), "--workload", "tiny", "--steps", "1", "--save", str(again)]) == 0
    assert "model " + str(out) in capsys.readouterr().out
    assert load_model(str(again)).config == trained.config
    assert main(["compare", "--model", str(out), "--workload", "tiny", "--dtype", "float64"]) == 0
    assert "gradients" in capsys.readouterr().out


def test_saved_directory_keeps_the_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trained"
    assert main([*TRAIN, "--save", str(out)]) == 0
    capsys.readouterr()
    assert main(["train", "--model", str(out), "--pattern", "KKM", "--workload", "tiny", "--steps", "1"]) == 2
    assert str(out) in capsys.readouterr().err


def test_export_hf_needs_a_transformers_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TRAIN, "--export-hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "--export-hf" in err and "preset" in err and not (tmp_path / "hf").exists()


def test_export_hf_of_a_transformers_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from tests.integrations._hf import make_hf_model

    source = tmp_path / "kimi"
    make_hf_model("kimi_linear", vocab_size=256).save_pretrained(source)
    save, hf = tmp_path / "save", tmp_path / "hf"
    argv = ["train", "--model", str(source), "--workload", "tiny", "--steps", "1", "--capacity", "400"]
    assert main([*argv, "--save", str(save), "--export-hf", str(hf)]) == 0
    a = AutoModelForCausalLM.from_pretrained(save).state_dict()
    b = AutoModelForCausalLM.from_pretrained(hf).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
