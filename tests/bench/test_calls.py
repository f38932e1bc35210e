"""``python -m benchmarks.step.calls --sweep``: one row per shape and size with each path's time and the path
``plan_calls`` picks (timings are not checked, only what the rows say)."""

from __future__ import annotations

import json

import pytest

from benchmarks.step import calls
from harts.plan.calls import LEAN_BASE, LEAN_MAX_SEGMENTS, LEAN_PER_GENERAL_FORK


def test_sweep_rows(tmp_path):
    out = tmp_path / "sweep.json"
    assert calls.main(["--sweep", "--sweep-sizes", "16,600", "--repeat", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["sweep"]
    assert [(r["shape"], r["segments"]) for r in rows] == [("random", 16), ("random", 600), ("deep", 15), ("deep", 599)]
    for r in rows:
        v, g = r["segments"], r["general_forks"]
        lean = v <= LEAN_BASE or (v <= LEAN_MAX_SEGMENTS and v <= LEAN_BASE + LEAN_PER_GENERAL_FORK * g)
        assert r["auto_path"] == ("lean" if lean else "units")
        assert {"lean_ms", "units_ms", "auto_ms"} <= r.keys()
    assert rows[3]["general_forks"] == 0 and rows[3]["auto_path"] == "units"  # a caterpillar past LEAN_BASE


@pytest.mark.parametrize("bad", ["16,x", "1", ""])
def test_sweep_sizes_rejected(bad, capsys):
    with pytest.raises(SystemExit) as e:
        calls.main(["--sweep", "--sweep-sizes", bad])
    assert e.value.code == 2
    assert "--sweep-sizes" in capsys.readouterr().err
