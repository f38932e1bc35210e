"""benchmarks.decode.serve_batching runs end to end on the CPU: every row (batched, one by one,
the reference) times the same requests, and the JSON records the command and the speedup."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.decode.serve_batching import MODES, main


def test_serve_batching_bench_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "serve batching.json"
    argv = ["--requests", "3", "--samples", "2", "--prompt", "5", "--new", "3", "--repeats", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m benchmarks.decode.serve_batching --requests 3")
    assert set(record["rows"]) == set(MODES) and record["settings"]["tokens"] == 3 * 2 * 3
    assert all(row["seconds"] > 0 and row["tokens_per_s"] > 0 for row in record["rows"].values())
    assert record["batched_speedup"] > 0
