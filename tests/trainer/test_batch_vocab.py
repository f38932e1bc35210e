"""The vocabulary a model is built with for a batch: a published model's preset keeps its own
(its LM head is part of the shape being trained and measured) unless the batch needs more,
which one line says; the small presets and checkpoints keep their rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from harts.commands._inputs import batch_vocab
from harts.models.config import HybridConfig
from harts.trainer.checks import StepSummary, needed_vocab, published_vocab, vocab_note


def _summary(max_token: int, declared: int | None) -> StepSummary:
    return StepSummary(
        step=3,
        label="medium",
        trajectories=2,
        tokens=10,
        longest=0,
        longest_len=6,
        max_token=max_token,
        max_token_at=(1, 4),
        vocab_size=declared,
    )


LING = 157_184  # the built-in workloads' declared vocabulary (ling3_tiny's)


def test_a_published_preset_keeps_its_vocabulary_when_the_batch_fits() -> None:
    steps = [_summary(9_000, LING)]
    assert HybridConfig.preset("qwen3_5_9b").vocab_size == 248_320
    for name in ("qwen3_5_9b", "Qwen3.5-35B-A3B", "kimi_linear_48b_a3b"):
        own = HybridConfig.preset(name).vocab_size
        assert own > LING and needed_vocab(steps, name)[0] == own
        assert vocab_note(name, own) is None
    # without a model (and before this rule): the batch's own
    assert needed_vocab(steps)[0] == LING


def test_a_published_preset_grows_to_the_batch_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    steps = [_summary(9_000, LING)]
    assert HybridConfig.preset("qwen3_next_80b_a3b").vocab_size == 151_936
    vocab, where = batch_vocab(steps, "qwen3_next_80b_a3b")
    assert vocab == LING and where == "token id 9,000 (step 3 (medium), trajectory 1, position 4)"
    err = capsys.readouterr().err
    assert err == (
        "harts: note: --model qwen3_next_80b_a3b: its vocabulary of 151,936 grown to 157,184 to fit the batch's tokens\n"
    )
    batch_vocab(steps, "qwen3_next_80b_a3b", quiet=True)
    assert capsys.readouterr().err == ""
    # a token id past the declared vocabulary decides it
    assert needed_vocab([_summary(200_000, LING)], "qwen3_next_80b_a3b")[0] == 200_001


def test_small_presets_checkpoints_and_unknown_names_take_the_batch_vocabulary(tmp_path: Path) -> None:
    steps = [_summary(60, 100)]
    for model in ("tiny", "ling3_tiny", str(tmp_path), "no_such_model"):
        assert published_vocab(model) is None
        assert needed_vocab(steps, model)[0] == 100
        assert vocab_note(model, 100) is None


def test_a_published_vocabulary_that_does_not_fit_names_the_preset_not_the_batch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from harts import cli
    from harts.trainer import build

    monkeypatch.setattr(build, "_memory_bytes", lambda device: 2**30)
    assert cli.main(["compare", "--model", "qwen3_5_9b", "--layers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "harts: error: --model qwen3_5_9b: the preset's embedding and output layers (vocabulary 248,320, hidden 4,096)"
    ), err
    assert "batch needs" not in err and err.count("\n") == 1
    # a --layers error comes before it
    assert cli.main(["compare", "--model", "qwen3_5_9b", "--layers", "33"]) == 2
    assert "--layers 33: --model qwen3_5_9b has 32 decoder layers" in capsys.readouterr().err
