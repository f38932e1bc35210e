"""Running a Triton kernel check on CUDA, or on a CPU machine through Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def check_here_or_interpreted(check: Callable[[], None], code: str) -> None:
    """``check()`` in this process on CUDA (or where this process already interprets Triton);
    otherwise ``code`` (Python that runs the same check) in a fresh interpreter with
    ``TRITON_INTERPRET=1``: Triton reads it when first imported, and other tests of this process
    may have imported it already. Skips without Triton."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        check()
        return
    run = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
