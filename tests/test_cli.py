"""The ``harts`` console script: instant help, stats on workloads and files, clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harts.cli import main


def test_help_lists_commands_without_heavy_imports():
    code = "import sys; from harts.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_stats_workload_and_json(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["stats", "--workload", "tiny", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tiny[0]" in text and "compress" in text
    data = json.loads(out.read_text())
    assert data["batches"][0]["paths"] > 1


def test_stats_on_file_and_errors(tmp_path, capsys):
    import harts

    path = tmp_path / "b.jsonl"
    harts.workloads.generate("tiny").save(path)
    assert main(["stats", str(path)]) == 0
    assert str(path) in capsys.readouterr().out
    assert main(["stats", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such batch file" in capsys.readouterr().err
    assert main(["stats", "--workload", "nope"]) == 2


def test_commands_default_the_cuda_allocator_to_expandable_segments(monkeypatch, capsys):
    """Every command runs with expandable segments unless the user set PYTORCH_CUDA_ALLOC_CONF."""
    from harts.cli import ALLOCATOR_DEFAULT

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert main(["stats", "--workload", "tiny"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOCATOR_DEFAULT == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert main(["stats", "--workload", "tiny"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"  # the user's stays
    capsys.readouterr()


def test_version(capsys):
    import harts

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"harts {harts.__version__}"


@pytest.mark.parametrize(
    "name, value",
    [
        ("HARTS_GDN_NATIVE", "true"),
        ("HARTS_FLA_AUTOTUNE", "yes"),
        ("HARTS_FLEX_BACKEND", "cutlass"),
        ("HARTS_COMPILE_DYNAMIC", "some"),
    ],
)
def test_a_misspelt_setting_is_one_line_before_any_work(monkeypatch, capsys, tmp_path, name, value):
    """A checked ``HARTS_*`` setting with a value it does not take is refused by name before the
    command does anything (no output file written), never read as its default."""
    monkeypatch.setenv(name, value)
    out = tmp_path / "s.json"
    assert main(["stats", "--workload", "tiny", "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harts: error:") and name in err[0] and repr(value) in err[0]
    assert not out.exists()


@pytest.mark.parametrize("value, on", [("", False), ("0", False), (" 1 ", True), ("1", True)])
def test_opt_in_switches_read_0_1_or_unset(monkeypatch, value, on):
    from harts.ops.linear_attn.fla_configs import fla_autotune_asked
    from harts.ops.linear_attn.tree_kernel import gdn_native_asked

    for name in ("HARTS_GDN_NATIVE", "HARTS_FLA_AUTOTUNE"):
        monkeypatch.delenv(name, raising=False)
    assert gdn_native_asked() is False and fla_autotune_asked() is False
    monkeypatch.setenv("HARTS_GDN_NATIVE", value)
    monkeypatch.setenv("HARTS_FLA_AUTOTUNE", value)
    assert gdn_native_asked() is on and fla_autotune_asked() is on
