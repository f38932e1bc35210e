import json

from harts.bench.op_count import main


def test_op_count_attributes_operators_to_each_modes_attention(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert main(["--workload", "tiny", "--pattern", "KM", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    traj, comp = data["sites"]["trajectory"], data["sites"]["compact"]
    assert data["totals"]["trajectory"] == sum(traj.values()) > 0
    assert data["totals"]["compact"] == sum(comp.values()) > 0
    # each mode runs its own attention op: the attribution tells them apart
    assert traj.get("ops/attention/varlen.py:varlen_causal_attention", 0) > 0
    assert "ops/attention/varlen.py:varlen_causal_attention" not in comp
    assert comp.get("ops/attention/ancestor_view.py:ancestor_view_attention", 0) > 0
    assert "compact / trajectory" in capsys.readouterr().out
