"""Progress bars for long commands: tqdm on stderr, so stdout keeps only tables and results.

On a terminal the bars redraw in place (rate and ETA). When stderr is not a terminal (a log
file, CI, a pipe) the same bars are written as plain lines, at most one every ``LINE_INTERVAL``
seconds once a bar has run that long, and a last one when it ends -- so a log still shows how
far a long run got, without carriage-return noise (and a quick command prints no bar at all). ``TQDM_DISABLE=1`` turns every bar off.
"""

from __future__ import annotations

import re
import sys
from typing import Any

__all__ = ["progress", "LINE_INTERVAL"]

#: seconds between progress lines when stderr is not a terminal
LINE_INTERVAL = 15.0

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _LineWriter:
    """A file for tqdm that turns its in-place redraws into whole lines."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, s: str) -> int:
        for part in re.split(r"[\r\n]", _ANSI.sub("", s)):
            if part.strip():
                self.stream.write(part.rstrip() + "\n")
        return len(s)

    def flush(self) -> None:
        self.stream.flush()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def progress(
    total: int | None, desc: str, unit: str, *, leave: bool = True, position: int | None = None, disable: bool = False
) -> Any:
    """A tqdm bar on stderr (see the module docstring); ``disable`` for non-zero ranks."""
    from tqdm import tqdm

    err = sys.stderr
    if _isatty(err):
        return tqdm(
            total=total,
            desc=desc,
            unit=unit,
            leave=leave,
            position=position,
            file=err,
            dynamic_ncols=True,
            disable=disable,
        )
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        leave=leave,
        file=_LineWriter(err),
        ascii=True,
        ncols=100,
        mininterval=LINE_INTERVAL,
        maxinterval=LINE_INTERVAL * 4,
        delay=LINE_INTERVAL,
        disable=disable,
    )
