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
* ``write_json`` and ``save_figure`` are the two writers on top of it;
* ``replace_dir`` puts a finished directory (a checkpoint, a trainer state) in place of an older
  one so that a process killed at any point leaves one of them whole, and ``restore_dir`` repairs
  what such a kill left (every saver of directories uses the pair);
* ``writing(path)`` turns a write that fails on the way (a disk that fills, a directory made
  read-only, a quota) into ``write_failed``'s one line, ``<path>: cannot write: No space left on
  device (errno 28)``: every writer of a command's outputs (checkpoints, saved weights, metrics,
  JSON) runs inside it, so that the CLI prints that line instead of a traceback. ``os_error_of``
  finds the operating system's error also where a writer reports it as its own exception
  (safetensors' ``SafetensorError`` carries it only in its text).

Every problem is an ``OutputPathError`` (a ``UserError``) naming the option and the path. At the
bottom of the package beside ``harts.errors``: only the standard library and ``harts.errors`` are
imported (matplotlib by the figure's own ``savefig``), so every layer can write its outputs here.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harts.errors import HartsError, OutputPathError

__all__ = [
    "PLOT_FORMATS",
    "check_output_dir",
    "check_output_file",
    "moved_aside",
    "remove_path",
    "replace_dir",
    "restore_dir",
    "save_figure",
    "os_error_of",
    "special_file",
    "write_atomic",
    "write_failed",
    "write_json",
    "writing",
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


def moved_aside(path: Path) -> Path:
    """Where ``replace_dir`` keeps the directory it replaces until the new one is in place."""
    return path.with_name(f".{path.name}.old")


def replace_dir(tmp: Path, path: Path, aside: Path | None = None) -> None:
    """Rename the finished directory ``tmp`` to ``path``. One already at ``path`` is renamed to
    ``aside`` (``moved_aside(path)`` unless given) first and removed once the new one is in place,
    so a process killed at any point leaves one whole copy: under ``path`` (old or new) or, between
    the two renames, under ``aside``, which ``restore_dir`` puts back."""
    aside = moved_aside(path) if aside is None else aside
    if os.path.lexists(path):
        remove_path(aside)  # stale: ``path`` is whole
        os.replace(path, aside)
    os.replace(tmp, path)
    remove_path(aside)


def restore_dir(path: Path, aside: Path | None = None) -> str | None:
    """Repair what a killed ``replace_dir`` left of ``path``: with nothing at ``path``, the copy
    moved aside goes back ("restored"); beside a ``path`` it is stale and goes ("removed"); None
    when there is no such copy."""
    aside = moved_aside(path) if aside is None else aside
    if not os.path.lexists(aside):
        return None
    if os.path.lexists(path):
        remove_path(aside)
        return "removed"
    os.replace(aside, path)
    return "restored"


def remove_path(path: Path) -> None:
    """Remove ``path`` whatever it is (a directory tree, a file, a symlink: the link, never its
    target); nothing there, or a part that cannot be removed, is no error."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        with contextlib.suppress(OSError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


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

    with writing(path, option):
        write_atomic(path, write, option=option)


def save_figure(fig: Any, path: str | Path, *, option: str, dpi: int = 110) -> None:  # noqa: ANN401
    """``fig.savefig`` into ``path`` (atomically; its format from the suffix, one of
    ``PLOT_FORMATS``), every failure an ``OutputPathError`` naming ``option``."""
    p = Path(path)
    if not _written_in_place(p):
        _check_format(p, option, PLOT_FORMATS)
    fmt = p.suffix.lower().lstrip(".") or "png"  # /dev/stdout has no suffix
    with writing(p, option):
        write_atomic(p, lambda target: fig.savefig(str(target), format=fmt, dpi=dpi), option=option)


#: how Rust's ``std::io::Error`` ends its text (safetensors' ``SafetensorError`` quotes it)
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_of(err: BaseException) -> OSError | None:
    """The operating system's error behind ``err``: ``err`` itself, one it was raised from (or
    while handling), or one a writer quotes in its text, as safetensors does (its I/O failures are
    a ``SafetensorError`` whose text ends in ``(os error 28)``); None for any other failure. Of a
    harts error, only ``write_failed``'s has one (its cause): a ``writing`` block around another
    names its own path, the one its caller was asked to write, not a temporary one inside it."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, HartsError):
            cause = cur.__cause__
            return cause if isinstance(cur, OutputPathError) and isinstance(cause, OSError) else None
        if isinstance(cur, OSError):
            return cur
        quoted = _RUST_OS_ERROR.search(str(cur)) if type(cur).__name__ == "SafetensorError" else None
        if quoted is not None:
            code = int(quoted[1])
            return OSError(code, os.strerror(code))
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return None


def write_failed(path: str | Path, err: OSError, option: str | None = None) -> OutputPathError:
    """The one line for output ``path`` (given by ``option``, if any) that could not be written:
    ``[option ]path: cannot write: <the system's words> (errno N)``."""
    why = err.strerror or str(err) or type(err).__name__
    code = f" (errno {err.errno})" if err.errno is not None and err.errno in errno_mod.errorcode else ""
    return OutputPathError(f"{option + ' ' if option else ''}{path}: cannot write: {why}{code}")


@contextlib.contextmanager
def writing(path: str | Path, option: str | None = None) -> Iterator[None]:
    """Writes into output ``path``: a failure of the operating system's (``os_error_of``) inside
    becomes ``write_failed``'s ``OutputPathError``; any other exception passes unchanged. Nested,
    the outermost names the path (the one the caller was asked for, not a temporary one inside)."""
    try:
        yield
    except Exception as err:
        found = os_error_of(err)
        if found is None:
            raise
        raise write_failed(path, found, option) from found
