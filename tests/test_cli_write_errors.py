"""A write that fails on the way -- a full disk, a file-size limit, a read-only file system -- is one
line naming the output (``harts: error: <path>: cannot write: <why> (errno N)``), exit status 2,
no traceback; the previous checkpoint stays whole and no half-written file is left under a final
name (``harts.outputs.writing``).

The failures are real ones of the kernel, also as root (which permissions do not stop): a
file-size limit (``RLIMIT_FSIZE``: EFBIG at the limit, in this process around one call or in a
child for the whole command) and, where unprivileged namespaces are allowed, a small tmpfs mounted
for the command alone (ENOSPC) or remounted read-only (EROFS).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harts.errors import OutputPathError, UserError
from harts.outputs import os_error_of, write_failed, writing

BASE = ["train", "--workload", "tiny", "--dtype", "float64", "--threads", "1"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", HARTS_DEBUG="")
#: a file-size cap below the tiny model's weights (~480 KB) and checkpoint shards (~1.9 MB),
#: above every small file (metrics, JSON, RNG states)
CAP = 256 * 1024
TOO_LARGE = f"cannot write: File too large (errno {errno.EFBIG})"


@contextlib.contextmanager
def file_size_cap(limit: int) -> Iterator[None]:
    """Writes past ``limit`` bytes of a file fail with EFBIG (Python ignores SIGXFSZ) until exit."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)


def _capped(limit: int):  # noqa: ANN202
    """A ``preexec_fn``: the child's files are capped at ``limit`` bytes."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def harts(*args: str, limit: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harts.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        preexec_fn=None if limit is None else _capped(limit),
    )


def _exactly(text: str) -> str:
    return f"^{re.escape(text)}$"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line(r: subprocess.CompletedProcess) -> str:
    """The command's only error line (exit status 2, no traceback)."""
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("harts:")]
    assert len(lines) == 1 and lines[0].startswith("harts: error: "), r.stderr[-3000:]
    return lines[0]


# ---------------------------------------------------------------------------- the one line
def test_the_os_error_is_found_behind_a_writer_s_own_exception():
    from safetensors import SafetensorError

    quoted = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    found = os_error_of(quoted)
    assert found is not None and found.errno == errno.ENOSPC
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as err:
            raise RuntimeError("unexpected pos 704 vs 598") from err
    except RuntimeError as chained:
        assert os_error_of(chained).errno == errno.EROFS  # type: ignore[union-attr]
    assert os_error_of(RuntimeError("a bug")) is None
    assert os_error_of(UserError("a bad file")) is None
    line = write_failed("out/step-3", OSError(errno.ENOSPC, "No space left on device"))
    assert str(line) == "out/step-3: cannot write: No space left on device (errno 28)"
    # nested: the outer path, the one the caller named, not a temporary file inside it
    with pytest.raises(OutputPathError, match=r"^--save out: cannot write: No space left on device \(errno 28\)$"):
        with writing("out", "--save"), writing("out/.tmp/model.safetensors"):
            raise quoted
    with pytest.raises(ValueError, match="not a write"), writing("out"):
        raise ValueError("not a write")


# ---------------------------------------------------------------------------- in this process
def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from harts.integrations.loading import load_model

    model = load_model("tiny", vocab_size=256, dtype="float64", seed=1)
    return model, torch.optim.AdamW(model.parameters())


def test_a_checkpoint_that_cannot_be_written_leaves_the_previous_one(tmp_path):
    from harts.parallel.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    model, opt = _model_and_optimizer()
    first = save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, data_state={"next_step": 1})
    before = _files(tmp_path)
    with file_size_cap(CAP), pytest.raises(OutputPathError) as got:
        save_checkpoint(tmp_path, step=2, model=model, optimizer=opt, data_state={"next_step": 2})
    assert str(got.value) == (
        f"checkpoint {tmp_path}/checkpoints/step-00000002: {TOO_LARGE}; the previous checkpoint {first} is whole"
    )
    assert _files(tmp_path) == before  # nothing of step 2 is left, step 1 is untouched
    assert latest_checkpoint(tmp_path) == first
    assert load_checkpoint(tmp_path, model=model, optimizer=opt).step == 1


def test_a_trainer_state_that_cannot_be_written_leaves_the_previous_one(tmp_path):
    from harts.trainer.state import read_state, write_state

    model, opt = _model_and_optimizer()
    write_state(tmp_path / "state", model, opt, {"step": 1})
    before = _files(tmp_path)
    with file_size_cap(CAP), pytest.raises(OutputPathError, match=_exactly(f"{tmp_path}/state: {TOO_LARGE}")):
        write_state(tmp_path / "state", model, opt, {"step": 2})
    assert _files(tmp_path) == before
    assert read_state(tmp_path / "state")[0]["step"] == 1


def test_saved_weights_that_cannot_be_written_leave_no_file(tmp_path):
    from harts.integrations.native import save_native
    from harts.trainer.weights import save_weights

    model, _ = _model_and_optimizer()
    for save, out in ((save_weights, tmp_path / "save"), (save_native, tmp_path / "native")):
        with file_size_cap(CAP), pytest.raises(OutputPathError, match=_exactly(f"{out}: {TOO_LARGE}")):
            save(model, str(out))
        assert list(out.iterdir()) == []  # no part under a final name, no temporary file


def test_metrics_that_cannot_be_written_are_one_error_and_close_quietly(tmp_path):
    from harts.rl.metrics import MetricsWriter

    writer = MetricsWriter(str(tmp_path))
    writer.write({"step": 0, "loss": 1.0})
    with file_size_cap(4096), pytest.raises(OutputPathError, match=_exactly(f"{tmp_path}/metrics.jsonl: {TOO_LARGE}")):
        writer.write({"step": 1, "note": "x" * 8192})
    writer.close()  # the failed write's buffer is not reported a second time


# ---------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def run_of_two_steps(tmp_path_factory) -> Path:
    """A run directory with a checkpoint after step 2 (of 4)."""
    run = tmp_path_factory.mktemp("run") / "run"
    r = harts(*BASE, "--steps", "2", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    return run


def test_train_stops_with_one_line_when_its_checkpoint_cannot_be_written(tmp_path, run_of_two_steps):
    run = tmp_path / "run"
    shutil.copytree(run_of_two_steps, run)
    before = _files(run / "checkpoints")
    r = harts(
        *BASE, "--steps", "4", "--resume", str(run), "--save-every", "1", "--save", str(tmp_path / "w"), limit=CAP
    )
    step2, step3 = run / "checkpoints" / "step-00000002", run / "checkpoints" / "step-00000003"
    assert _one_line(r) == f"harts: error: checkpoint {step3}: {TOO_LARGE}; the previous checkpoint {step2} is whole"
    assert _files(run / "checkpoints") == before  # step 2 whole, nothing of step 3
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())


def test_train_stops_with_one_line_when_its_saved_weights_cannot_be_written(tmp_path):
    out, log = tmp_path / "w", tmp_path / "log.json"
    r = harts(*BASE, "--steps", "1", "--save", str(out), "--json", str(log), limit=CAP)
    assert _one_line(r) == f"harts: error: --save {out}: {TOO_LARGE}"
    assert list(out.iterdir()) == []
    assert log.is_file()  # the step logs do not depend on the weights


def _namespace_works() -> bool:
    """Whether this machine lets a process mount a tmpfs in a user and mount namespace of its own."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


#: the namespace's script: a tmpfs of $SIZE at $1 holding a copy of the run $2, filled up to
#: $ROOM KiB free (or remounted read-only: $ROOM=ro); then the command (the rest of the
#: arguments, its stderr to $HARTS_STDERR), and the run copied out to $OUT
_SCRIPT = r"""
set -e
disk="$1"
mount -t tmpfs -o size=$SIZE tmpfs "$disk"
cp -r "$2" "$disk/run"
if [ "$ROOM" = ro ]; then
    mount -o remount,ro "$disk"
else
    dd if=/dev/zero of="$disk/filler" bs=1k count=$(( $(df -k --output=avail "$disk" | tail -1) - ROOM )) 2>/dev/null
fi
shift 2
set +e
"$@" 2>"$HARTS_STDERR"
code=$?
cp -r "$disk/run" "$OUT"
exit $code
"""


@pytest.mark.skipif(not _namespace_works(), reason="needs unprivileged user and mount namespaces (unshare)")
@pytest.mark.parametrize("room", ["40", "ro"], ids=["full", "read-only"])
def test_train_on_a_full_or_read_only_disk(tmp_path, run_of_two_steps, room):
    mnt, after, stderr = tmp_path / "mnt", tmp_path / "after", tmp_path / "stderr"
    mnt.mkdir()
    env = dict(ENV, SIZE="8m", ROOM=room, OUT=str(after), HARTS_STDERR=str(stderr))
    cmd = [sys.executable, "-m", "harts.cli", *BASE, "--steps", "4", "--resume", str(mnt / "run")]
    r = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _SCRIPT, "sh", mnt, run_of_two_steps, *cmd],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    r.stderr = stderr.read_text()
    line = _one_line(r)
    if room == "ro":  # the first write of a resumed run is its metrics file
        assert line == f"harts: error: {mnt}/run/metrics.jsonl: cannot write: Read-only file system (errno 30)"
    else:
        step2, step4 = mnt / "run" / "checkpoints" / "step-00000002", mnt / "run" / "checkpoints" / "step-00000004"
        why = f"cannot write: No space left on device (errno {errno.ENOSPC})"
        assert line == f"harts: error: checkpoint {step4}: {why}; the previous checkpoint {step2} is whole"
    assert _files(after / "checkpoints") == _files(run_of_two_steps / "checkpoints")
