"""A SIGKILL in the middle of a save never loses the previous checkpoint.

A child process (forked, so that it starts without importing torch again) saves over and over
(new steps; the same step again; a trainer state in place) and is killed at random points, and
between the two renames that replace a checkpoint; afterwards the newest checkpoint (or state)
on disk loads, whole, and is at least the last one the child reported as saved.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from harts.parallel.checkpoint import checkpoint_path, checkpoints, load_checkpoint, save_checkpoint
from harts.trainer.state import read_state, write_state
from tests.parallel.test_checkpoint_safety import make


def _save(mode: str, where: Path, k: int) -> None:
    net, opt = make(k)
    if mode == "state":
        write_state(where, net, opt, {"k": k})
    else:
        step = k if mode == "steps" else 1
        save_checkpoint(where, step=step, model=net, optimizer=opt, data_state={"k": k})


def _saver(mode: str, where: Path, report: int, die_after_move: bool) -> None:
    """The child's life: save k = 1, 2, ... forever, writing each finished k to fd ``report``;
    ``die_after_move``: SIGKILL itself right after the rename that moves the old copy aside."""
    t0 = time.perf_counter()
    _save(mode, where, 1)
    os.write(report, f"1 {time.perf_counter() - t0:.4f}\n".encode())
    if die_after_move:
        moved = os.path.abspath(checkpoint_path(where, 1) if mode == "same" else where)
        replace = os.replace

        def dying_replace(src, dst) -> None:  # noqa: ANN001
            replace(src, dst)
            if os.path.abspath(src) == moved:
                os.kill(os.getpid(), signal.SIGKILL)

        os.replace = dying_replace
    k = 1
    while True:
        k += 1
        _save(mode, where, k)
        os.write(report, f"{k}\n".encode())


def _start(mode: str, where: Path, die_after_move: bool = False) -> tuple[int, int]:
    """Fork a saving child (it shares this process's imports, so it starts at once); (pid, fd)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        os.close(read)
        try:
            _saver(mode, where, write, die_after_move)
        finally:
            os._exit(1)
    os.close(write)
    return pid, read


def _finish(pid: int, read: int) -> tuple[int, list[str]]:
    """Wait for the child; (its wait status, the lines it reported)."""
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as fh:
        return status, fh.read().split("\n")


def _kill_at_random(mode: str, where: Path, rnd: random.Random) -> int:
    """Start a child, kill it at a random point of its saves; the last k it reported saved."""
    pid, read = _start(mode, where)
    first = b""
    while not first.endswith(b"\n"):
        first += os.read(read, 1) or b"?\n"
    k, seconds = first.decode().split()
    time.sleep(rnd.uniform(0.0, 4.0 * float(seconds)))  # within the next few saves
    os.kill(pid, signal.SIGKILL)
    status, lines = _finish(pid, read)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    done = [int(x) for x in [k, *lines] if x.strip()]
    return done[-1]


def _loaded_value(where: Path, mode: str) -> int:
    """The k of the newest save on disk (its weights must all equal k)."""
    if mode == "state":
        fields, model, _, _ = read_state(where)
        k = fields["k"]
        assert all(torch.equal(t, torch.full_like(t, k)) for t in model.values())
        return k
    net, opt = make(-1)
    got = load_checkpoint(where, model=net, optimizer=opt)
    k = got.data_state["k"]
    assert all(torch.equal(t, torch.full_like(t, k)) for t in [*net.parameters(), *net.buffers()])
    return k


@pytest.mark.parametrize("mode", ["steps", "same", "state"])
def test_sigkill_at_random_points_keeps_the_previous_save(tmp_path, mode):
    rnd = random.Random(f"harts-{mode}")
    for i in range(8):
        where = tmp_path / f"run{i}"
        reported = _kill_at_random(mode, where, rnd)
        assert _loaded_value(where, mode) >= reported
        if mode != "state":
            assert not list((where / "checkpoints").glob("step-*/dcp/.*.tmp"))
            # the next save clears what the killed one left
            _save(mode, where, 1000)
            left = [p.name for p in (where / "checkpoints").iterdir() if p.name.startswith(".")]
            assert not left and _loaded_value(where, mode) == 1000


@pytest.mark.parametrize("mode", ["same", "state"])
def test_sigkill_between_the_two_renames_of_a_replacement(tmp_path, mode):
    where = tmp_path / "run"
    pid, read = _start(mode, where, die_after_move=True)
    status, lines = _finish(pid, read)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert [x.split()[0] for x in lines if x] == ["1"]  # the second save died halfway
    assert _loaded_value(where, mode) == 1
    if mode == "same":
        assert [p.name for p in checkpoints(where)] == [".old-step-00000001"]
    # the next save puts things right
    _save(mode, where, 3)
    assert _loaded_value(where, mode) == 3
    if mode == "same":
        assert [p.name for p in checkpoints(where)] == ["step-00000001"]
