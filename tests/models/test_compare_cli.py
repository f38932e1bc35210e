from __future__ import annotations

import json

from harts.cli import main
from tests.models._trees import batch_of, tree_cases


def test_compare_cli_agrees_on_a_batch_file(tmp_path, capfd) -> None:
    out, path = tmp_path / "cmp.json", tmp_path / "batch.jsonl"
    batch_of(tree_cases(8)["several_forks_in_one_chunk"]).save(str(path))
    assert main(["compare", "--workload", str(path), "--pattern", "KGMA", "--recompute", "--json", str(out)]) == 0
    text, err = capfd.readouterr()  # file-descriptor level: the profiler's C++ log lines would land here
    assert "compression" in text and "speedup" in text
    assert "USDT" not in err and "profiler_start" not in err and "USDT" not in text
    rec = json.loads(out.read_text())
    assert rec["C"] < rec["S"] and rec["modes"]["compact"]["calls"] >= 1
    assert max(rec["max_rel_diff"].values()) <= 1e-9, rec["max_rel_diff"]
    assert rec["modes"]["trajectory"]["peak_bytes"] > 0


def test_compare_cli_rejects_unknown_workload(capsys) -> None:
    assert main(["compare", "--workload", "nope"]) == 2
    assert "neither a preset" in capsys.readouterr().err
