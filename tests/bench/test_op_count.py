import json
import os

from benchmarks.step import op_count
from benchmarks.step.op_count import PACKAGE_DIR, call_site, main


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


def test_call_site_is_the_package_directory_not_a_path_containing_harts(tmp_path):
    # a clone named "harts" with its venv inside: torch's frames lie under ".../harts/.venv/..."
    clone = tmp_path / "my clone" / "harts"
    torch_file = clone / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "_tensor.py"
    assert call_site(str(torch_file), "backward") is None
    assert call_site(str(clone / "harts" / "ops" / "x.py"), "f") is None  # another copy of harts
    own = os.path.join(PACKAGE_DIR, "ops", "attention", "varlen.py")
    assert call_site(own, "varlen_causal_attention") == "ops/attention/varlen.py:varlen_causal_attention"
    assert call_site(op_count.__file__, "count_ops") is None  # the benchmark itself, outside the package
