"""Weights both ways: from_hf -> to_hf_state_dict -> transformers, checkpoints on disk, errors, CLI."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402

from harts.cli import main  # noqa: E402
from harts.integrations.hf import (  # noqa: E402
    UnsupportedConfigError,
    from_hf,
    from_pretrained,
    inspect_checkpoint,
    save_hf_checkpoint,
    to_hf_state_dict,
)
from tests.integrations._hf import (  # noqa: E402
    CONFIGS,
    batch_of,
    harts_trajectory_logits,
    hf_logits,
    make_hf_model,
    max_rel_logit_diff,
    trajectories,
)

ARCHS = ["bailing_hybrid", "qwen3_next", "kimi_linear", "qwen3_5_text", "qwen3_5_moe_text"]


@pytest.mark.parametrize("model_type", ARCHS)
def test_round_trip_state_dict_reloads_identically(model_type):
    from transformers import AutoModelForCausalLM

    hf = make_hf_model(model_type, seed=11)
    model = from_hf(hf, chunk_size=8)
    sd = to_hf_state_dict(model)
    ref = hf.state_dict()
    assert set(sd) == set(ref)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    fresh = AutoModelForCausalLM.from_config(hf.config).eval()
    fresh.load_state_dict(sd, strict=True)
    t = trajectories([13], seed=2)[0]
    assert torch.equal(hf_logits(fresh, t), hf_logits(hf, t))


@pytest.mark.parametrize("model_type", ARCHS)
def test_from_pretrained_reads_save_pretrained_shards(model_type, tmp_path, capsys):
    hf = make_hf_model(model_type, seed=13)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")  # transformers writes the Hub layout
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = from_pretrained(str(tmp_path), chunk_size=8)
    direct = from_hf(hf, chunk_size=8)
    a, b = model.state_dict(), direct.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    trajs = trajectories([9, 17], seed=4)
    assert max_rel_logit_diff(hf, model, trajs) <= 1e-4

    rep = inspect_checkpoint(str(tmp_path))
    assert rep.all_mapped and rep.layer_pattern == model.config.layer_pattern
    assert rep.num_parameters == model.num_parameters()
    assert main(["convert", str(tmp_path), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert rep.architecture in out and model.config.layer_pattern in out and f"{rep.num_parameters:,}" in out
    assert "all mapped     yes" in out
    assert json.loads((tmp_path / "r.json").read_text())["all_mapped"] is True


@pytest.mark.parametrize("model_type", ARCHS)
def test_trained_model_saves_back_as_transformers_checkpoint(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = make_hf_model(model_type, seed=17)
    model = from_hf(hf, chunk_size=8)
    trajs = trajectories([10, 19], seed=6)
    batch = batch_of(trajs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss = -model(batch, mode="trajectory").logprobs.sum()
    loss.backward()
    opt.step()
    save_hf_checkpoint(model, str(tmp_path), max_shard_size=30_000)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    loaded.config._attn_implementation = "eager"
    sd, ref = to_hf_state_dict(model), loaded.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    assert not torch.equal(ref["model.embed_tokens.weight"], hf.state_dict()["model.embed_tokens.weight"])
    ours = harts_trajectory_logits(model, batch)
    theirs = hf_logits(loaded, trajs[1])
    off = batch.offsets
    assert float((ours[off[1] : off[2]] - theirs).abs().max() / theirs.abs().max()) <= 1e-4


def test_unsupported_options_are_all_named():
    hf_cfg = CONFIGS["qwen3_next"](attention_bias=True, decoder_sparse_step=2, hidden_act="gelu")
    from harts.integrations.hf import adapter_for

    with pytest.raises(UnsupportedConfigError) as e:
        adapter_for("qwen3_next").config_from_hf(hf_cfg)
    msg = str(e.value)
    assert "attention_bias=True" in msg and "decoder_sparse_step" in msg and "hidden_act='gelu'" in msg
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(UnsupportedConfigError, match="rope_type"):
        adapter_for("bailing_hybrid").config_from_hf(CONFIGS["bailing_hybrid"](rope_parameters=yarn))
    with pytest.raises(UnsupportedConfigError, match="mlp_layer_types"):
        adapter_for("kimi_linear").config_from_hf(
            CONFIGS["kimi_linear"](mlp_layer_types=["dense", "sparse", "dense", "sparse"])
        )
    with pytest.raises(ValueError, match="cannot override"):
        adapter_for("kimi_linear").config_from_hf(CONFIGS["kimi_linear"](), hidden_size=64)


def test_convert_reports_unmapped_and_missing_tensors(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    hf = make_hf_model("kimi_linear", seed=19)
    hf.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    del tensors["model.norm.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    rep = inspect_checkpoint(str(tmp_path))
    assert not rep.all_mapped
    assert rep.unmapped == ["model.layers.0.self_attn.mystery.weight"] and rep.missing == ["model.norm.weight"]
    assert main(["convert", str(tmp_path)]) == 1
    assert "all mapped     NO" in capsys.readouterr().out
    with pytest.raises(ValueError, match="mystery"):
        from_pretrained(str(tmp_path))
