"""Each shared flag is made from the schema (``harts.trainer.options.OPTIONS``) by one function
(``harts.commands._inputs.add_option``), so its spelling, check, default and help are written
once; a switch a ``--config`` file turns on is turned off by its ``--no-X`` flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from harts.cli import build_parser
from harts.commands._config import apply_config
from harts.commands._inputs import Switch, add_option
from harts.trainer.options import OPTIONS, execution_config, option_of


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_train_states_each_shared_flag_as_the_schema_has_it() -> None:
    """harts train (the reference command) overrides nothing of the schema but --workload's default
    (none: --data may name the batches instead) and the note on it."""
    actions = {a.dest: a for a in commands()["train"]._actions}
    for option in OPTIONS:
        action = actions[option.dest]
        assert action.option_strings[0] == option.option, option.dest
        assert action.type is option.type and action.metavar == option.metavar, option.dest
        assert (tuple(action.choices) if action.choices else None) == option.allowed(), option.dest
        assert action.default == option.default, option.dest
        assert option.help and action.help is not None and action.help.startswith(option.help), option.dest
        if option.dest != "workload":
            assert action.help == option.help, option.dest
        assert isinstance(action, Switch) == option.switch, option.dest


def test_every_switch_has_its_opposite() -> None:
    seen = 0
    for name, parser in commands().items():
        for action in parser._actions:
            if isinstance(action, Switch):
                on, off = action.option_strings
                assert off == ("--" + on[5:] if on.startswith("--no-") else "--no-" + on[2:]), (name, on)
                seen += 1
    assert seen >= 7  # recompute, the step's two, the mesh's two, overwrite, tensorboard


def test_no_flag_turns_off_a_switch_the_file_turned_on(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        "[execution]\nrecompute = true\n[step]\nno_prepare_ahead = true\n[parallel]\nmeta_init = true\n"
        "[outputs]\noverwrite = true\n"
    )
    parser = build_parser()
    argv = ["train", "--config", str(path), "--no-recompute", "--prepare-ahead"]
    args = apply_config(parser, parser.parse_args(argv), argv)
    assert (args.recompute, args.no_prepare_ahead, args.meta_init, args.overwrite) == (False, False, True, True)
    assert not execution_config(args).recompute
    assert sorted(args._config_sources) == ["meta_init", "overwrite"]  # the flags' values name the flags
    # without the file the pair works the same, the later flag winning
    plain = parser.parse_args(["train", "--recompute", "--no-recompute", "--no-prepare-ahead"])
    assert (plain.recompute, plain.no_prepare_ahead) == (False, True)


def test_a_command_overrides_only_what_differs() -> None:
    p = argparse.ArgumentParser()
    add_option(p, "capacity", default=8192, help="microbatch capacity T (compact tokens)")
    add_option(p, "lora", more=". what it means here")
    args = p.parse_args(["--lora", "4"])
    assert (args.capacity, args.lora) == (8192, 4)
    lora = option_of("lora")
    assert lora is not None
    assert next(a for a in p._actions if a.dest == "lora").help == lora.help + ". what it means here"
    with pytest.raises(KeyError, match="no option of harts.trainer.options.OPTIONS"):
        add_option(p, "port")
