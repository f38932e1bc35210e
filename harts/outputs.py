"""Output paths: checked before any work, written atomically, special files written in place.

Every file a command writes (``--json``, ``--out`` / ``--plot`` figures, a run directory, saves
and exports) goes through here:

* ``check_output_file`` / ``check_output_dir`` run before the first step: the path is not a
  directory where a file is wanted (nor a file where a directory is), has a format its writer
  supports (figures: ``PLOT_FORMATS``), does not exist without ``overwrite``, and can really be
  created -- a file is made and removed in the directory that will hold it, since
  ``os.access`` says yes to root on a read-only file system or in ``/sys``;
* ``write_atomic`` writes a regular file aside and renames it into place, so an interrupted write
  never leaves half a file. A character device or FIFO (``/dev/stdout``, ``/dev/null``, a pipe)
  is written in place instead: renaming onto it would replace the device node with a regular
  file. Sockets and block devices are refused;
* ``write_json`` and ``save_figure`` are the two writers on top of it.

Every problem is an ``OutputPathError`` (a ``UserError``) naming the option and the path. At the
bottom of the package beside ``harts.errors``: only the standard library and ``harts.errors`` are
imported (matplotlib by the figure's own ``savefig``), so every layer can write its outputs here.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harts.errors import OutputPathError

__all__ = [
    "PLOT_FORMATS",
    "check_output_dir",
    "check_output_file",
    "save_figure",
    "special_file",
    "write_atomic",
    "write_json",
]

#: the figure formats every command that draws accepts (matplotlib's own writers, no PIL)
PLOT_FORMATS = (".png", ".pdf", ".svg")

#: where paths name the process's own streams and devices, never files to replace
_IN_PLACE_ROOTS = ("/dev/", "/proc/")


def special_file(path: str | Path) -> str | None:
    """What kind of special file ``path`` is ("character device", "FIFO", "socket", "block
    device"), following symlinks; None for a regular file, a directory or nothing there."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, kind in (
        (stat.S_ISCHR, "character device"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return kind
    return None


def _written_in_place(p: Path) -> bool:
    """A character device or FIFO, or anything below /dev or /proc (``/dev/stdout`` is a link
    to ``/proc/self/fd/1``, which may be a regular file the shell holds open)."""
    if special_file(p) in ("character device", "FIFO"):
        return True
    return p.exists() and any(str(p.absolute()).startswith(root) for root in _IN_PLACE_ROOTS)


def _refused_special(p: Path, option: str) -> None:
    kind = special_file(p)
    if kind in ("socket", "block device"):
        raise OutputPathError(f"{option} {p}: is a {kind}; give a regular file (or a character device, or a FIFO)")


def _nearest_existing(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe(directory: Path, option: str, target: Path, *, is_dir: bool) -> None:
    """Make and remove a file (or directory) in ``directory``: the only sure test of writing there."""
    try:
        if is_dir:
            os.rmdir(tempfile.mkdtemp(prefix=".harts-probe-", dir=directory))
        else:
            fd, name = tempfile.mkstemp(prefix=".harts-probe-", dir=directory)
            os.close(fd)
            os.unlink(name)
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise OutputPathError(f"{option} {target}: cannot be written, {directory} refuses new files ({why})") from None


def _check_creatable(p: Path, option: str, *, is_dir: bool = False) -> None:
    parent = p.absolute().parent
    anc = _nearest_existing(parent)
    if not anc.is_dir():
        raise OutputPathError(f"{option} {p}: cannot be created, {anc} is a file, not a directory")
    # a missing parent directory is created on writing: probe that, else the file itself
    _probe(anc, option, p, is_dir=is_dir or anc != parent)


def _check_format(p: Path, option: str, formats: tuple[str, ...] | None) -> None:
    if formats is None or p.suffix.lower() in formats:
        return
    found = f"'{p.suffix}'" if p.suffix else "no suffix"
    names = ", ".join(formats[:-1]) + f" or {formats[-1]}" if len(formats) > 1 else formats[0]
    raise OutputPathError(f"{option} {p}: {found} is not a format it writes; use {names}")


def check_output_file(
    path: str | None, option: str, overwrite: bool, *, formats: tuple[str, ...] | None = None
) -> None:
    """``path`` can be written as a file (missing parent directories are created when writing);
    ``formats``: the suffixes its writer supports (e.g. ``PLOT_FORMATS``). A character device or
    FIFO is written in place and needs no ``overwrite``."""
    if not path or path == "-":
        return
    p = Path(path)
    if path.endswith(os.sep) or p.is_dir():
        raise OutputPathError(f"{option} {path}: is a directory; give a file name")
    _refused_special(p, option)
    if _written_in_place(p):
        if not os.access(p, os.W_OK):
            raise OutputPathError(f"{option} {p}: is not writable")
        return
    _check_format(p, option, formats)
    if p.exists():
        if not overwrite:
            raise OutputPathError(f"{option} {p}: exists; pass --overwrite to replace it, or choose another name")
        if not os.access(p, os.W_OK):
            raise OutputPathError(f"{option} {p}: exists and is not writable")
        _probe(p.absolute().parent, option, p, is_dir=False)  # the new file is renamed into its place
        return
    _check_creatable(p, option)


def check_output_dir(path: str | None, option: str, overwrite: bool) -> None:
    """``path`` can be written as a directory: missing, or empty, or ``overwrite``."""
    if not path:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputPathError(f"{option} {p}: exists and is not a directory; give a directory name")
    if p.is_dir():
        if any(p.iterdir()) and not overwrite:
            raise OutputPathError(f"{option} {p}: exists and is not empty; pass --overwrite to write into it")
        _probe(p, option, p, is_dir=True)
        return
    _check_creatable(p, option, is_dir=True)


def write_atomic(path: str | Path, write: Callable[[Path], None], *, option: str = "output") -> None:
    """``write(tmp)`` then rename onto ``path``: an interrupted write never leaves half a file. A
    character device or FIFO gets ``write(path)`` itself (module docstring)."""
    p = Path(path)
    _refused_special(p, option)
    if _written_in_place(p):
        write(p)
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.parent / f".{p.name}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(
    path: str,
    obj: Any,  # noqa: ANN401
    *,
    indent: int | None = 2,
    default: Callable[[Any], Any] | None = None,
    option: str = "--json",
) -> None:
    """Write ``obj`` as JSON to ``path`` (atomically; ``-`` = stdout); ``option`` names it in errors."""
    if path == "-":
        print(json.dumps(obj, indent=indent, default=default))
        return

    def write(tmp: Path) -> None:
        with tmp.open("w") as fh:
            json.dump(obj, fh, indent=indent, default=default)

    try:
        write_atomic(path, write, option=option)
    except OSError as err:
        raise OutputPathError(f"{option} {path}: cannot write ({err.strerror or err})") from None


def save_figure(fig: Any, path: str | Path, *, option: str, dpi: int = 110) -> None:  # noqa: ANN401
    """``fig.savefig`` into ``path`` (atomically; its format from the suffix, one of
    ``PLOT_FORMATS``), every failure an ``OutputPathError`` naming ``option``."""
    p = Path(path)
    if not _written_in_place(p):
        _check_format(p, option, PLOT_FORMATS)
    fmt = p.suffix.lower().lstrip(".") or "png"  # /dev/stdout has no suffix
    try:
        write_atomic(p, lambda target: fig.savefig(str(target), format=fmt, dpi=dpi), option=option)
    except OSError as err:
        raise OutputPathError(f"{option} {p}: cannot write ({err.strerror or err})") from None
