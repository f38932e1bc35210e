"""What every benchmark script shares: its parser, device and dtype, timing, and the JSON it writes.

A script is run from the repository root as a module, ``python -m benchmarks.ops.la ...``, and
defines ``main(argv: list[str] | None = None) -> int``; its last lines are::

    if __name__ == "__main__":
        raise SystemExit(run(main))

* ``parser(__doc__, __file__)``: the script's parser, its ``prog`` the command that runs it and
  its description the docstring's first paragraph; ``add_device_argument``,
  ``add_dtype_argument`` and ``add_json_argument`` add the options most scripts take;
* ``parse(p, argv)``: the arguments, with ``args.command_line`` (the command as a user would
  type it) and the ``--json`` path checked before any work;
* ``device_of`` / ``dtype_of``: ``--device`` checked (an unusable device is a ``UserError``)
  and ``--dtype`` as a torch dtype; ``cuda_device`` for the scripts that run only on CUDA;
* ``sync`` / ``median_seconds``: wall time with the device synchronized around each run, or
  CUDA events around it (``events=True``: the device's time only);
* ``write_json(args, record)``: the record with its command line first, written atomically;
* ``run(main)``: a ``UserError`` printed as one line (``harts: error: ...``, exit status 2).

Torch is imported only by the helpers that need it, so planning-only scripts run without it.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harts.commands._inputs import check_device, check_output_file
from harts.commands._inputs import write_json as _write_json
from harts.errors import UserError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ROOT",
    "add_device_argument",
    "add_dtype_argument",
    "add_json_argument",
    "cuda_device",
    "device_of",
    "dtype_of",
    "median_seconds",
    "module_of",
    "parse",
    "parser",
    "run",
    "sync",
    "write_json",
]

#: the repository root: the directory that holds ``benchmarks/``
ROOT = Path(__file__).resolve().parent.parent


def module_of(file: str) -> str:
    """The module name of a script in ``benchmarks/``: ``benchmarks/ops/la.py`` -> ``benchmarks.ops.la``."""
    return ".".join(Path(file).resolve().relative_to(ROOT).with_suffix("").parts)


def parser(doc: str | None, file: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of the script at ``file``: ``prog`` is ``python -m <its module>`` and the
    description the first paragraph of ``doc`` (the script's docstring)."""
    description = (doc or "").split("\n\n")[0]
    return argparse.ArgumentParser(prog=f"python -m {module_of(file)}", description=description, **kwargs)


def add_device_argument(p: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--device`` (default: ``default``, else cuda where a CUDA device is visible, else cpu)."""
    if default is None:
        import torch

        default = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default, help=f"torch device (default {default})")


def add_dtype_argument(p: argparse.ArgumentParser, choices: Sequence[str], default: str) -> None:
    """``--dtype``, one of ``choices`` (torch dtype names)."""
    p.add_argument(
        "--dtype", choices=list(choices), default=default, help=f"parameter / input dtype (default {default})"
    )


def add_json_argument(p: argparse.ArgumentParser, *, overwrite: bool = False) -> None:
    """``--json FILE`` (``args.json_out``); with ``overwrite`` also ``--overwrite``, without which an
    existing file is refused (otherwise it is replaced)."""
    p.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="write the results here as JSON")
    if overwrite:
        p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``p.parse_args(argv)`` plus ``args.command_line`` (``prog`` and the arguments, shell-quoted:
    what ``write_json`` records); a ``--json`` path that cannot be written is a ``UserError`` now,
    before any work."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.command_line = " ".join([p.prog, *(shlex.quote(a) for a in argv)])
    json_out = getattr(args, "json_out", None)
    if json_out:
        check_output_file(json_out, "--json", overwrite=getattr(args, "overwrite", True))
    return args


def device_of(spec: str) -> torch.device:
    """``--device``'s value as a torch device; one this machine cannot use is a ``UserError``."""
    import torch

    check_device(spec)
    return torch.device(spec)


def cuda_device(why: str) -> torch.device:
    """The current CUDA device, for a script that runs only there; none visible is a ``UserError``
    that says ``why`` the script needs one."""
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"needs a CUDA device ({why}); none is visible here")
    return torch.device("cuda")


def dtype_of(name: str) -> torch.dtype:
    """A dtype name (``bfloat16``, ``float32``, ...) as the torch dtype."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"--dtype {name!r} is not a torch dtype")
    return dtype


def sync(device: torch.device | None) -> None:
    """Wait for the device's queued work (a no-op on the CPU and for None: host-only work)."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], object], device: torch.device | None, repeat: int, *, warmup: bool = True, events: bool = False
) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, after one untimed run (``warmup``: compile,
    autotune, allocator). Wall time between device synchronizations, or with ``events`` on CUDA
    the time between two CUDA events recorded around the call (the device's time, without the
    host's synchronization). ``device`` None: host-only work, nothing to synchronize."""
    if warmup:
        fn()
        sync(device)
    times = []
    for _ in range(repeat):
        if events and device is not None and device.type == "cuda":
            import torch

            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
            continue
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_json(
    args: argparse.Namespace, record: dict[str, Any] | list[Any], *, indent: int | None = 2, quiet: bool = False
) -> None:
    """Write ``record`` to ``args.json_out`` (nothing without ``--json``), atomically. A dict gets
    the command line that made it (``parse``) as its first key, ``command``; a list (a script
    whose readers index its rows) is written as it is. Says so on stdout unless ``quiet`` (a
    script that rewrites the file after every measurement, or whose stdout is its result)."""
    if not getattr(args, "json_out", None):
        return
    if isinstance(record, dict):
        record = {"command": args.command_line, **record}
    _write_json(args.json_out, record, indent=indent)
    if not quiet:
        print(f"wrote {args.json_out}")


def run(main: Callable[[], int | None]) -> int:
    """``main()``'s exit status; a ``UserError`` prints ``harts: error: <message>`` on stderr (the
    line the ``harts`` command prints for it) and exits 2, without a traceback."""
    try:
        return main() or 0
    except UserError as err:
        print(f"harts: error: {err}", file=sys.stderr)
        return 2
