"""``--model NAME --layers N`` on every command that takes a model: the preset names, the cut, and
one clear error (exit 2, before any work) for an unknown name, a depth out of range, or
``--layers`` with a checkpoint directory."""

from __future__ import annotations

import argparse

import pytest

from harts.cli import build_parser, main
from harts.commands._inputs import MODEL_PRESETS
from harts.errors import UserError
from harts.models.config import PRESET_NAMES


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse errors
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def _commands_with_model() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: p for name, p in sub.choices.items() if any("--model" in a.option_strings for a in p._actions)}


#: commands with --model and no --layers yet
NOT_YET: set[str] = set()


def test_every_command_with_model_takes_layers() -> None:
    commands = _commands_with_model()
    assert {"bench", "compare", "fidelity", "train"} <= set(commands)
    missing = {name for name, p in commands.items() if not any("--layers" in a.option_strings for a in p._actions)}
    assert missing == NOT_YET & set(commands), missing
    for name in set(commands) - NOT_YET:
        text = commands[name].format_help().replace("\n", " ")
        assert all(preset in text for preset in ("qwen3_next_80b_a3b", "tiny")), name


def test_help_names_every_preset() -> None:
    assert MODEL_PRESETS == PRESET_NAMES


@pytest.mark.parametrize(
    "argv,match",
    [
        (
            ["compare", "--model", "qwen3_5_9b", "--layers", "33"],
            "--layers 33: --model qwen3_5_9b has 32 decoder layers",
        ),
        (["train", "--model", "kimi-linear-48b-a3b", "--layers", "28", "--steps", "1"], "use 1 .. 27"),
        (["fidelity", "--model", "tiny", "--pattern", "KM", "--layers", "3"], "--model tiny has 2 decoder layers"),
        (["compare", "--model", "qwen9"], "unknown model preset 'qwen9'; known: tiny, ling3_tiny, qwen3_5_9b"),
    ],
)
def test_bad_preset_or_layers(capsys: pytest.CaptureFixture[str], argv: list[str], match: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and match in err, err
    assert "step 0:" not in out


def test_layers_is_for_presets_only(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from harts.integrations.loading import load_model

    code, _, err = _run(capsys, "compare", "--model", tmp_path, "--layers", "2")
    assert code == 2 and "--layers 2: for model presets only" in err, err
    with pytest.raises(UserError, match="for presets only"):
        load_model(str(tmp_path), layers=2)
    code, _, err = _run(capsys, "compare", "--layers", "0")
    assert code == 2 and "argument --layers" in err


def test_layers_cut_the_preset(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "compare", "--model", "tiny", "--layers", "2")
    assert code == 0, err
    assert "model tiny (KG," in out
