"""A run from a transformers checkpoint: every resumable checkpoint carries an ``hf/`` directory
that transformers loads (gathered from the shards on several ranks)."""

from __future__ import annotations

import pytest
import torch

from harts.parallel.checkpoint import latest_checkpoint
from tests.parallel.test_train_cli import harts

pytest.importorskip("transformers")


@pytest.fixture
def checkpoint(tmp_path):
    from tests.integrations._hf import make_hf_model

    path = tmp_path / "kimi"
    make_hf_model("kimi_linear", vocab_size=256).save_pretrained(path)
    return path


def _check(run, original) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    ckpt = latest_checkpoint(run)
    assert ckpt is not None and (ckpt / "hf" / "config.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    first = AutoModelForCausalLM.from_pretrained(original)
    assert reloaded.state_dict().keys() == first.state_dict().keys()
    assert any(not torch.equal(p, first.state_dict()[n]) for n, p in reloaded.named_parameters())


def test_checkpoint_holds_a_transformers_model(checkpoint, tmp_path):
    run = tmp_path / "run"
    args = ["train", "--model", str(checkpoint), "--workload", "tiny", "--steps", "1", "--lr", "1e-2"]
    r = harts(*args, "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    _check(run, checkpoint)


@pytest.mark.slow
def test_checkpoint_holds_a_transformers_model_gathered_from_two_ranks(checkpoint, tmp_path):
    run = tmp_path / "run"
    args = ["train", "--model", str(checkpoint), "--workload", "tiny", "--steps", "1", "--lr", "1e-2"]
    r = harts(*args, "--run-dir", str(run), "--ep", "2", ranks=2)
    assert r.returncode == 0, r.stderr[-3000:]
    _check(run, checkpoint)
