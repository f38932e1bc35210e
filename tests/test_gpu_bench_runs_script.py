"""``scripts/gpu_bench_runs.sh``: valid bash, and a bad part is refused before anything is
installed or run (the parts themselves need a GPU)."""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_bench_runs.sh")


def test_script_parses_and_refuses_a_bad_part(tmp_path) -> None:  # noqa: ANN001
    assert subprocess.run(["bash", "-n", SCRIPT], capture_output=True).returncode == 0
    for argv, message in [
        (["nope"], "unknown part 'nope'"),
        (["layers", "x"], "layers needs a layer count"),
        (["moe_keep"], "moe_keep needs a layer count"),
        (["medium_full", "x"], "medium_full needs a layer count"),
        (["silu_ab"], "silu_ab needs a layer count"),
        (["qwen"], "qwen needs a preset name"),
        (["qwen_profile", "Bad Name"], "qwen_profile needs a preset name"),
        (["gpu_tests"], "gpu_tests needs test paths"),
        (["gpu_tests", "tests/nope.py"], "gpu_tests: no test file 'tests/nope.py'"),
    ]:
        r = subprocess.run(["bash", SCRIPT, *argv], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert not (tmp_path / "gpu_bench_out").exists()  # nothing ran
