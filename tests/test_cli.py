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
