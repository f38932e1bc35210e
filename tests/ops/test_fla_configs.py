"""Pinned fla-core Triton configs: the shipped files are in fla's format, and pinning is opt-out."""

from __future__ import annotations

import json

import pytest

from harts.ops.linear_attn import fla_configs
from harts.ops.linear_attn.fla_configs import CONFIG_ROOT, configure_fla_cache, gpu_dir_name


def test_gpu_dir_name_matches_fla_sanitizer() -> None:
    assert gpu_dir_name("NVIDIA H200") == "NVIDIA_H200"
    assert gpu_dir_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert gpu_dir_name("  ") == "unknown_gpu"


def test_shipped_configs_are_fla_config_files() -> None:
    files = sorted(CONFIG_ROOT.glob("*/*.json"))
    assert files, "no pinned configs shipped"
    for f in files:
        data = json.loads(f.read_text())
        assert data["kernel_name"] == f.stem
        configs = [e["config"] for e in data["autotune_entries"].values()] + [data["default_config"]]
        for entry in data["autotune_entries"].values():
            assert isinstance(entry["autotune_key"], list)
        for c in configs:
            assert isinstance(c["kwargs"], dict)
            assert c["num_warps"] in (1, 2, 4, 8, 16, 32) and c["num_stages"] >= 1 and c["num_ctas"] >= 1


def test_configure_leaves_user_settings_and_cpu_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.setenv("HARTS_FLA_AUTOTUNE", "1")
    assert configure_fla_cache() is None
    monkeypatch.delenv("HARTS_FLA_AUTOTUNE")
    monkeypatch.setenv("FLA_CACHE_MODE", "strict")
    assert configure_fla_cache() is None
    monkeypatch.delenv("FLA_CACHE_MODE")

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    d = configure_fla_cache()
    assert d is not None and d.endswith("NVIDIA_H200")
    import os

    assert os.environ["FLA_CONFIG_DIR"] == d and os.environ["FLA_CACHE_MODE"] == "full"
    monkeypatch.delenv("FLA_CONFIG_DIR")
    monkeypatch.delenv("FLA_CACHE_MODE")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Some Other GPU")
    assert configure_fla_cache() is None and "FLA_CONFIG_DIR" not in os.environ
    assert fla_configs.CONFIG_ROOT.is_dir()


def test_tuning_lengths_fill_the_rows_after_the_chunk_edges() -> None:
    from benchmarks.ops.tune_fla import tuning_lengths

    assert tuning_lengths(5289) == [1, 63, 64, 65, 1000, 4096]
    lengths = tuning_lengths(65536)
    assert sum(lengths) == 65536 and lengths[:6] == [1, 63, 64, 65, 1000, 4096]
    assert max(lengths) == 8192 and lengths[-1] == 65536 - 5289 - 8192 * 7
    with pytest.raises(ValueError, match="at least 5,289 rows"):
        tuning_lengths(5288)


def test_config_changes_lists_each_differing_key(tmp_path) -> None:
    import json
    import shutil

    from harts.ops.linear_attn.fla_configs import config_changes

    old = fla_configs.CONFIG_ROOT / "NVIDIA_H200"
    new = tmp_path / "new"
    shutil.copytree(old, new)
    assert config_changes(old, new) == []
    f = new / "causal_conv1d_bwd_kernel.json"
    data = json.loads(f.read_text())
    entry = next(iter(data["autotune_entries"].values()))
    entry["config"]["kwargs"]["BD"] = 128
    entry["config"]["num_warps"] = 8
    f.write_text(json.dumps(data))
    (new / "chunk_gla_fwd_kernel_o.json").unlink()
    lines = config_changes(old, new)
    assert len([x for x in lines if x.startswith("causal_conv1d_bwd_kernel [")]) == 1
    assert any("BD=128 warps=8" in x and "-> BD=128" in x for x in lines)
    assert any(x.startswith("chunk_gla_fwd_kernel_o [default]") and x.endswith("-> none") for x in lines)


def test_config_diff_cli_names_a_broken_file(tmp_path, capsys) -> None:
    from harts.ops.linear_attn.fla_configs import _main

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (b / "k.json").write_text("{not json")
    with pytest.raises(SystemExit) as exit_:
        _main(["diff", str(a), str(b)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "k.json: not an fla config file" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        _main(["diff", str(a), str(tmp_path / "missing")])
    assert "not a directory" in capsys.readouterr().err
    assert _main(["diff", str(a), str(a)]) == 0
    assert capsys.readouterr().out.strip() == "no config differs"
