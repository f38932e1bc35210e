"""``harts train`` / ``bench`` / ``compare`` take ``--model PATH`` (a transformers checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch

from harts.cli import main
from tests.integrations._hf import make_hf_model

pytest.importorskip("transformers")


@pytest.fixture
def checkpoint(tmp_path):
    hf = make_hf_model("kimi_linear", vocab_size=256)
    path = tmp_path / "kimi"
    hf.save_pretrained(path)
    return path


def test_train_bench_compare_accept_checkpoint(checkpoint, tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "trained"
    assert (
        main(
            [
                "train",
                "--model",
                str(checkpoint),
                "--workload",
                "tiny",
                "--steps",
                "1",
                "--capacity",
                "400",
                "--lr",
                "1e-2",
                "--save",
                str(out),
                "--json",
                str(tmp_path / "t.json"),
            ]
        )
        == 0
    )
    log = json.loads((tmp_path / "t.json").read_text())
    assert log["steps"][0]["microbatches"] >= 2
    # the trained weights come back as a transformers checkpoint that transformers loads
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(checkpoint)
    changed = [n for n, p in reloaded.named_parameters() if not torch.equal(p, original.state_dict()[n])]
    assert changed, "training changed no weight"

    assert main(["bench", "--model", str(checkpoint), "--workload", "tiny", "--steps", "1", "--no-warmup"]) == 0
    assert "F/B/Grad" in capsys.readouterr().out
    assert main(["compare", "--model", str(checkpoint), "--workload", "tiny", "--dtype", "float32"]) == 0
    assert "gradients" in capsys.readouterr().out


def test_checkpoint_vocab_too_small_is_an_error(tmp_path, capsys):
    hf = make_hf_model("kimi_linear", vocab_size=64)
    hf.save_pretrained(tmp_path / "small_vocab")
    assert main(["bench", "--model", str(tmp_path / "small_vocab"), "--workload", "tiny", "--steps", "1"]) == 2
    assert "needs vocab_size >= " in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "train"])
def test_checkpoint_with_unreadable_weights_is_an_error(checkpoint, command, capsys):
    """The configuration reads, so every check passes on the structure-only model; the weights are
    read on the helper thread of ``build_model_and_attention``, and their error still reaches the
    user as one line naming the checkpoint's file."""
    weights = next(checkpoint.glob("*.safetensors"))
    weights.write_bytes(b"not a safetensors file")
    assert main([command, "--model", str(checkpoint), "--workload", "tiny", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{weights}: not a readable safetensors file" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_model_built_beside_the_attention_probe_equals_build_model() -> None:
    """``build_model_and_attention`` makes the model on a helper thread: the same values as
    ``build_model``, and on the CPU no FlexAttention backend to choose."""
    import argparse

    from harts.commands._inputs import build_model, build_model_and_attention
    from harts.models.execution.config import ExecutionConfig

    args = argparse.Namespace(
        model="tiny", dtype="float32", pattern="KM", seed=3, device="cpu", threads=0, la_backend="reference"
    )
    built = build_model_and_attention(args, 256, ExecutionConfig())
    whole = build_model(args, 256)
    assert built.flex == {} and built.model_seconds > 0 and built.attention_seconds >= 0
    mine, theirs = built.model.state_dict(), whole.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all(t.device.type == "cpu" for t in mine.values())
