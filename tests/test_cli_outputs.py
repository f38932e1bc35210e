"""Every output is checked before any work: a place that refuses new files, a format its writer
does not have, a directory where a file is wanted -- one ``harts: error:`` line, exit 2, nothing
run or written. Devices and FIFOs are written in place, never replaced by a regular file; sockets
are refused; regular files are still replaced atomically."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import tempfile
import threading
from pathlib import Path

import pytest

from harts.cli import main
from harts.errors import OutputPathError
from harts.outputs import check_output_dir, check_output_file, write_json

TRAIN = ["train", "--workload", "tiny", "--steps", "2", "--pattern", "KM", "--threads", "1"]
DEMO = ["demo", "--steps", "1", "--tasks", "2", "--group-size", "2", "--updates", "1"]
TREE = {
    "chunk_size": 4,
    "segments": [{"id": "R", "tokens": 5, "parent": None}, {"id": "A", "tokens": 3, "parent": "R"}],
}


def _refuses_new_files(directory: str) -> bool:
    """Whether ``directory`` exists and a new file cannot be made there (``/sys``, even for root)."""
    if not os.path.isdir(directory):
        return False
    try:
        fd, name = tempfile.mkstemp(dir=directory)
    except OSError:
        return True
    os.close(fd)
    os.unlink(name)
    return False


needs_sys = pytest.mark.skipif(not _refuses_new_files("/sys"), reason="needs an unwritable /sys (Linux)")


def run(capsys, *argv) -> tuple[int, str, str]:  # noqa: ANN001
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def assert_refused(capsys, *argv, match: str) -> str:  # noqa: ANN001
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("harts: error: ") and match in err, err
    assert "step 0" not in out and "step  " not in out  # nothing ran
    return err


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    path = tmp_path / "TREE.json"
    path.write_text(json.dumps(TREE))
    return path


@pytest.fixture
def metrics_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": i, "reward": 0.1 * i, "kl": 0.0, "step_seconds": 1.0} for i in range(3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


# --------------------------------------------------------------- places that refuse files
@needs_sys
def test_train_run_dir_that_refuses_files_stops_before_step_0(capsys):
    assert_refused(capsys, *TRAIN, "--run-dir", "/sys/run", match="--run-dir /sys/run: cannot be written, /sys")


@needs_sys
def test_demo_run_dir_that_refuses_files_is_one_line(capsys):
    assert_refused(capsys, *DEMO, "--run-dir", "/sys/demo", match="--run-dir /sys/demo: cannot be written")


@needs_sys
@pytest.mark.parametrize("command", ["plot", "calls", "plan", "fidelity"])
def test_figures_into_a_place_that_refuses_files(capsys, command, tree, metrics_run):
    argv = {
        "plot": ["plot", metrics_run, "--out", "/sys/x.png"],
        "calls": ["calls", tree, "--plot", "/sys/x.png"],
        "plan": ["plan", "--workload", "tiny", "--plot", "/sys/x.png"],
        "fidelity": ["fidelity", "--plot", "/sys/x.png"],
    }[command]
    opt = "--out" if command == "plot" else "--plot"
    assert_refused(capsys, *argv, match=f"{opt} /sys/x.png: cannot be written")


@needs_sys
def test_json_and_save_into_a_place_that_refuses_files(capsys):
    assert_refused(capsys, *TRAIN, "--json", "/sys/a/log.json", match="--json /sys/a/log.json: cannot be written")
    assert_refused(capsys, *TRAIN, "--save", "/sys/w", match="--save /sys/w: cannot be written")


def test_a_file_where_a_directory_would_be_made(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_refused(
        capsys, "stats", "--workload", "tiny", "--json", afile / "x.json", match="is a file, not a directory"
    )
    assert afile.read_text() == "x"


# ------------------------------------------------------------------------------ formats
@pytest.mark.parametrize("command", ["plot", "calls", "plan", "fidelity"])
def test_figure_format_is_checked_first(capsys, command, tree, metrics_run, tmp_path):
    out = tmp_path / "x.txt"
    argv = {
        "plot": ["plot", metrics_run, "--out", out],
        "calls": ["calls", tree, "--plot", out],
        "plan": ["plan", "--workload", "tiny", "--plot", out],
        "fidelity": ["fidelity", "--plot", out],
    }[command]
    assert_refused(capsys, *argv, match="'.txt' is not a format it writes; use .png, .pdf or .svg")
    assert not out.exists()


@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg"])
def test_plot_writes_each_format(capsys, metrics_run, tmp_path, suffix):
    out = tmp_path / f"curves{suffix}"
    code, _, err = run(capsys, "plot", metrics_run, "--out", out)
    assert code == 0, err
    assert out.stat().st_size > 0 and (tmp_path / "curves.json").is_file()
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_directory_where_a_file_is_wanted(capsys, tmp_path, metrics_run):
    (tmp_path / "d").mkdir()
    assert_refused(capsys, "plot", metrics_run, "--out", tmp_path / "d", match="is a directory; give a file name")
    assert_refused(capsys, "stats", "--workload", "tiny", "--json", f"{tmp_path}/new/", match="is a directory")


# ------------------------------------------------------------------------ special files
def test_a_device_is_written_in_place_never_replaced(capsys, tree):
    code, out, err = run(capsys, "calls", tree, "--json", "/dev/null")
    assert code == 0, err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_device_is_one_line_and_stays_a_device(capsys, tree):
    code, _, err = run(capsys, "calls", tree, "--json", "/dev/full", "--overwrite")
    assert code == 2 and err.count("\n") == 1
    assert "--json /dev/full: cannot write: No space left on device (errno 28)" in err
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_fifo_gets_the_json(capsys, tree, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    try:
        code, _, err = run(capsys, "calls", tree, "--json", fifo)
    finally:
        # A failed run never opened the FIFO, and the reader still waits in open(): open and
        # close the write end so that it ends. After a good run the reader may already have
        # closed its end (ENXIO: no reader) before it appended what it read.
        if reader.is_alive():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as error:
                if error.errno != errno.ENXIO:
                    raise
        reader.join(timeout=60)
    assert code == 0, err
    assert json.loads(got[0])["calls"] >= 1
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_socket_is_refused(capsys, tree, tmp_path):
    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        assert_refused(capsys, "calls", tree, "--json", path, match="is a socket")


def test_a_figure_to_a_device(capsys, metrics_run):
    code, out, err = run(capsys, "plot", metrics_run, "--out", "/dev/null")
    assert code == 0, err
    assert not (Path("/dev") / "null.json").exists()


# ------------------------------------------------------------------------ the helpers
def test_helpers_name_the_option(tmp_path):
    target = tmp_path / "x.json"
    target.write_text("old")
    with pytest.raises(OutputPathError, match="--json .*exists; pass --overwrite"):
        check_output_file(str(target), "--json", False)
    check_output_file(str(target), "--json", True)
    write_json(str(target), {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1} and not list(tmp_path.glob(".*.tmp"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "f").write_text("")
    with pytest.raises(OutputPathError, match="--run-dir .*not empty"):
        check_output_dir(str(tmp_path / "run"), "--run-dir", False)
    check_output_dir(str(tmp_path / "run"), "--run-dir", True)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["f"]  # the probe left nothing
