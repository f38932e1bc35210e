"""The ``harts`` command line.

Each subcommand lives in ``harts/commands/<name>.py`` and exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Command modules import only the
standard library at module level, so building the parser (and ``harts --help``) is
instant; heavy imports happen inside ``run`` after the arguments are parsed.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import harts.commands


def _command_modules() -> dict[str, object]:
    mods = {}
    for info in sorted(pkgutil.iter_modules(harts.commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mods[info.name] = importlib.import_module(f"harts.commands.{info.name}")
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harts",
        description="Train hybrid-attention LMs on agentic RL rollout trees with prefix sharing.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in _command_modules().items():
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        # user-facing errors (bad files, bad options) are one clear line, not a traceback
        print(f"harts {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # output piped into `head` and closed early: not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
