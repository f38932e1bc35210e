"""The ``harts`` command line.

Each subcommand lives in ``harts/commands/<name>.py`` and exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Command modules import only the
standard library at module level, so building the parser (and ``harts --help``) is
instant; heavy imports happen inside ``run`` after the arguments are parsed.

Entry points: the ``harts`` script, and ``python -m harts.cli`` (the same ``main``), which is the
form for several ranks -- ``torchrun --nproc-per-node N -m harts.cli train ...`` -- because it
works from any install (``torchrun $(which harts)`` fails where ``harts`` is a shell shim).

Errors: every user error is a ``harts.errors.UserError``; ``main`` prints it as
``harts: error: <message>`` on stderr and returns 2, without a traceback unless the environment
sets ``HARTS_DEBUG=1``; under torchrun, an error every rank raised alike (``UserError.every_rank``:
the ranks agreed on it) is printed by rank 0 alone. A bad option, value or command is one line
naming it (exit 2; ``harts COMMAND --help`` has the usage). Without torch installed, a command that
needs it says how to install it, in one line. Ctrl-C returns 130 (``harts train`` saves what it
finished first, see ``harts.commands.train``). Any other exception is a bug: it keeps its
traceback (exit status 1).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import os
import pkgutil
import sys
import traceback
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

import harts
import harts.commands
from harts.errors import UserError


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default, unless its help already mentions one or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" in text
            or "default" in text.lower()
            or not action.option_strings
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line naming the option, value or command
    (argparse prints its whole usage block above the error, which buries the line that matters),
    and whose unknown options are reported by the subcommand they were given to."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = _chosen_subparser(self, parsed) or self
            command.error(_unknown_arguments(command, unknown))
        return parsed


def _chosen_subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser | None:
    """The subcommand's parser ``args`` were parsed by (None before a command was named)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            return action.choices.get(name) if name else None
    return None


def _unknown_arguments(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """``unrecognized arguments: --stpes`` with the closest option the parser has, if one is close."""
    text = f"unrecognized arguments: {' '.join(unknown)}"
    options = [s for a in parser._actions for s in a.option_strings]
    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
    close = difflib.get_close_matches(flags[0], options, n=1) if flags else []
    return text + (f" (did you mean {close[0]}?)" if close else "")


def debug_enabled() -> bool:
    """``HARTS_DEBUG=1``: user errors show their traceback too."""
    return os.environ.get("HARTS_DEBUG", "").strip() not in ("", "0", "false", "no")


def _command_modules() -> dict[str, ModuleType]:
    mods: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules(harts.commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mods[info.name] = importlib.import_module(f"harts.commands.{info.name}")
    return mods


def build_parser() -> Parser:
    parser = Parser(
        prog="harts",
        description="Train hybrid-attention LMs on agentic RL rollout trees with prefix sharing.",
        epilog="Errors print 'harts: error: ...' and exit 2 (HARTS_DEBUG=1 shows the traceback).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"harts {harts.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in _command_modules().items():
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, formatter_class=HelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _typed_errors=getattr(mod, "TYPED_ERRORS", False))
    return parser


def _prepare_json_output(args: argparse.Namespace) -> None:
    """Before any command runs: ``--json FILE`` must be writable (and, for commands with
    ``--overwrite``, not an existing file without it); its missing directories are created."""
    path = getattr(args, "json_out", None)
    if not path or path == "-":
        return
    from harts.commands._inputs import check_output_file

    check_output_file(path, "--json", getattr(args, "overwrite", True))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def _check_environment() -> None:
    """Settings read from the environment deep inside a step, checked before any work (by the
    modules that read them, which need torch: without it no step runs, and ``harts stats`` /
    ``harts plan`` still do)."""
    if importlib.util.find_spec("torch") is None:
        return
    from harts.errors import UserError
    from harts.ops.attention.tree_mask import flex_backend_setting
    from harts.ops.compiled import dynamic_setting
    from harts.ops.linear_attn.fla_configs import fla_autotune_asked
    from harts.ops.linear_attn.tree_kernel import gdn_native_asked

    try:
        flex_backend_setting()
        dynamic_setting()
        gdn_native_asked()
        fla_autotune_asked()
    except ValueError as err:
        raise UserError(str(err)) from None


#: the CUDA caching allocator's setting every command runs with unless the environment sets
#: ``PYTORCH_CUDA_ALLOC_CONF`` itself (``default_allocator_settings``)
ALLOCATOR_DEFAULT = "expandable_segments:True"


def default_allocator_settings() -> None:
    """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set the variable.

    Microbatches of a tree step differ in rows from one to the next, so the cached blocks of one
    rarely fit the next; near the memory limit the allocator then frees its cache to the driver
    and retries, and each ``cudaFree`` waits for the device, stalling the host's launches (and
    the preparation of the next microbatch behind them). Expandable segments grow and shrink
    mapped memory instead of caching fixed blocks (torch's advice for changing shapes). Read by
    torch at its first CUDA allocation, so it is set before any command runs; ``harts bench``
    reports the allocator's synchronizing events it still sees."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_DEFAULT)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    default_allocator_settings()
    _one_line_warnings()
    try:
        if getattr(args, "config", None):  # --config FILE: its options under the flags given
            from harts.commands._config import apply_config

            args = apply_config(parser, args, argv)
        _prepare_json_output(args)
        _check_environment()
        return int(args._run(args) or 0)
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] != "torch" or importlib.util.find_spec("torch") is not None:
            raise
        if debug_enabled():
            traceback.print_exc()
        print(f"harts: error: {torch_missing_line(args.command)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # output piped into `head` and closed early: not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        if debug_enabled():
            traceback.print_exc()
        print(f"harts: {args.command} interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if _is_out_of_memory(err):
            if debug_enabled():
                traceback.print_exc()
            line = out_of_memory_line(args.command, err, _command_options(parser, args.command))
            print(f"harts: error: {line}", file=sys.stderr)
            return 2
        if not _is_user_error(err, args):
            raise  # a bug of ours: keep the traceback (exit status 1)
        # user-facing errors (bad files, bad options) are one clear line, not a traceback
        if debug_enabled():
            traceback.print_exc()
        if not (getattr(err, "every_rank", False) and _rank() > 0):
            print(f"harts: error: {err}", file=sys.stderr)
        return 2


def _one_line_warnings() -> None:
    """harts' own warning categories (e.g. ``harts.tree.io.BatchFormatWarning``) print as one
    ``harts: warning: ...`` line, not as Python's file, line and source line; others as before."""
    shown = warnings.showwarning
    if getattr(shown, "harts_one_line", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if category.__module__.partition(".")[0] != "harts":
            return shown(message, category, filename, lineno, file, line)
        print(f"harts: warning: {message}", file=sys.stderr if file is None else file, flush=True)

    show.harts_one_line = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def torch_missing_line(command: str) -> str:
    """One line for a command that needs torch where it is not installed (harts' own requirements
    are numpy and tqdm; torch is the ``torch`` extra, installed as the machine needs it)."""
    return (
        f"harts {command} needs PyTorch, which is not installed: pip install torch (or pip install -e '.[torch]'), "
        "adding --index-url https://download.pytorch.org/whl/cpu on a CPU-only Linux machine (README: Install)"
    )


def _rank() -> int:
    """This process's rank under torchrun (0 without it)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _is_out_of_memory(err: Exception) -> bool:
    """torch's device out-of-memory error (torch imported by the command that raised it)."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(err, oom)


def out_of_memory_line(command: str, err: Exception, options: frozenset[str] = frozenset()) -> str:
    """One line for a device that ran out of memory mid-run: torch's first three sentences (what
    it tried to allocate; the device's capacity and what was free) and what to change, naming
    only the flags ``command`` has (``options``: its option strings). The commands that can size
    a run estimate its memory before any work and refuse one that does not fit, so this is a run
    whose estimate was overridden (``--force``) or fell short."""
    sentences = [p.strip() for p in str(err).split(". ") if p.strip()]
    said = ". ".join(sentences[:3]).rstrip(".")
    changes = [
        text
        for flag, text in (
            ("--capacity", "lower --capacity"),
            ("--layers", "use fewer --layers"),
            ("--recompute", "recompute more (--recompute)"),
        )
        if flag in options
    ]
    advice = "the run does not fit" + (f"; {', or '.join(changes)}" if changes else " on this device")
    if "--force" in options:
        advice += "; without --force the memory check refuses runs it estimates over the device"
    return f"{command}: the device ran out of memory ({said}): {advice} (HARTS_DEBUG=1 shows where it ran out)"


def _command_options(parser: argparse.ArgumentParser, command: str) -> frozenset[str]:
    """The option strings of subcommand ``command`` (empty for an unknown one)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return frozenset(s for a in action.choices[command]._actions for s in a.option_strings)
    return frozenset()


def _is_user_error(err: Exception, args: argparse.Namespace) -> bool:
    """A ``UserError``; for commands that predate ``harts.errors`` (no ``TYPED_ERRORS = True``
    in their module, e.g. ``bench``), also any ``ValueError`` / ``FileNotFoundError``, as before."""
    if isinstance(err, UserError):
        return True
    return not args._typed_errors and isinstance(err, (ValueError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())
