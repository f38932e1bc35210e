"""``--config FILE``: a TOML file's options as a command's defaults, under its flags.

The file's tables are the schema's sections (``harts.trainer.options.OPTIONS``: ``[model]``,
``[lora]``, ``[execution]``, ``[step]``, ``[parallel]``, ``[optimizer]``, ``[data]``,
``[outputs]``) plus the command's own (``[serve]``, ``[bench]``, ``[train]``: its other flags by
name, ``max_models = 4`` for ``--max-models 4``). Every value goes through its flag's own check,
so a bad one is the same error a flag gets, naming ``FILE: section.key``; so is an unknown
section, an unknown key, or an option this command does not have. Precedence: the command's
defaults < the file < flags given on the command line::

    # run.toml
    [model]
    model = "ling3_tiny"
    [execution]
    recompute = true
    recompute_skip = ["moe"]
    [step]
    capacity = 16384

    harts train --config run.toml --capacity 8192    # capacity 8192, the rest from the file
"""

from __future__ import annotations

import argparse

from harts.errors import UserError
from harts.trainer.options import Option, option_of, read_toml, sections_of, table_values

__all__ = ["add_config_argument", "apply_config", "command_options"]


def add_config_argument(p: argparse.ArgumentParser) -> None:
    """``--config FILE``, for the commands that take a file (train, bench, compare, serve, demo),
    added after every other flag of ``p``: its help names the tables of those flags, the ones a
    file for this command may hold (a table of another command's flags is an error)."""
    tables = ", ".join(f"[{s}]" for s in sections_of(command_options(p, p.prog.split()[-1])))
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help=f"read options from a TOML file: tables {tables}, keys named as the flags (--la-backend: "
        "la_backend); flags given here override the file (docs/CONFIG.md)",
    )


def command_options(parser: argparse.ArgumentParser, command: str) -> dict[tuple[str, str], Option]:
    """(section, key) -> option for every flag of ``command``'s ``parser`` a file may set: the
    schema's section and key for a shared option, ``[command]`` and its destination otherwise; the
    check is the flag's own (type, choices)."""
    options: dict[tuple[str, str], Option] = {}
    for action in parser._actions:
        # --recompute and its --no-recompute (argparse.BooleanOptionalAction), or a plain store_true
        switch = isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction))
        if not action.option_strings or action.dest == "config":
            continue
        if not (switch or type(action) is argparse._StoreAction):
            continue  # --help, --version and the like: flags only
        shared = option_of(action.dest)
        section, key = (shared.section, shared.key) if shared is not None else (command, action.dest)
        options[(section, key)] = Option(
            section,
            key,
            action.dest,
            type=action.type if callable(action.type) else None,
            choices=tuple(action.choices) if action.choices is not None else None,  # type: ignore[arg-type]
            switch=switch,
            many=action.nargs in ("+", "*"),
            default=action.default,
            flag=action.option_strings[0] if switch else max(action.option_strings, key=len),
        )
    return options


def apply_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None
) -> argparse.Namespace:
    """``args`` parsed again with ``--config``'s values as the subcommand's defaults (the flags
    given still win); ``_config_sources`` records which destination came from which
    ``FILE: section.key``, for the errors that name it later."""
    path = args.config
    sub = _subparser(parser, args.command)
    data = read_toml(path)
    values, sources = table_values(data, path, command_options(sub, args.command), f"harts {args.command}")
    sub.set_defaults(**values)
    again = parser.parse_args(argv)
    # a flag given on the command line overrides the file: only the values still the file's keep its name
    again._config_sources = {d: s for d, s in sources.items() if getattr(again, d, None) is values[d]}
    return again


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    raise UserError(f"--config: unknown command {command!r}")
