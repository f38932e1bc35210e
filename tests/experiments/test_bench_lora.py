"""``harts bench --lora RANK``: both sides train the same adapters over a frozen base, and MFU
counts only the work a frozen base needs (``harts.models.flops``)."""

from __future__ import annotations

import json

import pytest
import torch

import harts
from harts.experiments.step_bench import bench_step
from harts.models.flops import LORA_MFU_FORMULA, FlopModel
from harts.trainer.lora import LoraConfig, apply_lora
from harts.tree.workloads import generate


def test_bench_of_a_lora_model_counts_its_frozen_base_flops() -> None:
    torch.manual_seed(0)
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern="KM"))
    adapters = apply_lora(model, LoraConfig(rank=4))
    before = [p.detach().clone() for p in adapters]
    r = bench_step(model, generate("tiny", step=1), capacity=400, warmup=False, core_run=False)
    fm = FlopModel.from_model(model)
    assert fm.frozen_base
    for side in (r.baseline, r.harts):
        assert side.flops == fm.training_flops(side.rows, side.logit_rows, side.attention_pairs)
    # the base frozen, nothing trained, no gradient left behind
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    assert all(torch.equal(a, b) for a, b in zip(adapters, before))
    assert all(p.grad is None for p in model.parameters())


def test_bench_cli_lora_runs_and_reports(tmp_path, capsys) -> None:
    from harts.cli import main

    out = tmp_path / "b.json"
    argv = ["bench", "--workload", "tiny", "--model", "tiny", "--steps", "1", "--no-warmup", "--no-core-run"]
    assert main([*argv, "--lora", "4", "--lora-targets", "attn,mlp", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "LoRA rank 4, alpha 32 on attn, mlp (" in text and "F/B/Grad" in text
    record = json.loads(out.read_text())
    lora = record["lora"]
    assert (lora["rank"], lora["train_attn"], lora["train_mlp"], lora["train_unembed"]) == (4, True, True, False)
    assert lora["adapter_parameters"] > 0 and record["mfu_formula"] == LORA_MFU_FORMULA
    assert record["steps"][0]["harts"]["flops"] > 0
    # without --lora: no adapters, the full count
    assert main([*argv, "--json", str(out), "--overwrite"]) == 0
    record = json.loads(out.read_text())
    assert record["lora"] is None and "no weight gradient" not in record["mfu_formula"]


def test_bench_lora_flags_are_checked_and_the_formula_is_in_the_help(capsys) -> None:
    from harts.cli import main

    for bad, words in ((["--lora-targets", "attn,router"], "unknown target 'router'"), (["--lora", "0"], "--lora")):
        with pytest.raises(SystemExit) as exited:
            main(["bench", "--workload", "tiny", "--lora", "4", *bad])
        assert exited.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "2 m n k input gradient" in " ".join(capsys.readouterr().out.split())
