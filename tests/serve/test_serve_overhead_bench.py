"""``benchmarks.step.serve_overhead --sides server`` on the CPU: the server alone, its log kept,
the JSON's headline from the server's own engine time; a bad ``--server-log`` is refused first."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("tinker")
pytest.importorskip("uvicorn")

from benchmarks.step import serve_overhead  # noqa: E402
from harts.errors import UserError  # noqa: E402

ARGS = ["--model", "tiny", "--tokens", "96", "--repeats", "1", "--warmup", "0", "--threads", "1"]


def test_server_side_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, log = tmp_path / "o.json", tmp_path / "logs" / "server.log"
    assert serve_overhead.main([*ARGS, "--sides", "server", "--server-log", str(log), "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["in_process_s"] is None and "in_process_engine_s" not in got["median"]
    med = got["median"]
    assert med["server_engine_s"] > 0 and math.isfinite(med["overhead_fraction"])
    assert med["overhead_s"] == pytest.approx(med["client_wall_s"] - med["server_engine_s"])
    assert "harts serve: serving 'tiny'" in log.read_text()
    err = capsys.readouterr().err
    assert "server: up after" in err and "server: call 1 of 1" in err and "in process" not in err


def test_a_directory_as_server_log_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--server-log .*is a directory"):
        serve_overhead.parse_args([*ARGS, "--server-log", str(tmp_path)])
