"""Qwen3.5 beyond the shared HF tests: compact == trajectory-wise in float64 with every gradient,
the VL checkpoints (language model taken, vision tower left out of the model and written back on
export, Hub layout with fused experts and an MTP head), text positions under mrope, the text-only
export, and bad checkpoints as one-line errors.

Parity with transformers' forward for the text and VL model types is in ``test_hf_logits``; the
state-dict round trip and ``save_pretrained`` checkpoints of the text types in ``test_hf_checkpoints``.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from harts.cli import main  # noqa: E402
from harts.errors import UserError  # noqa: E402
from harts.integrations.hf import (  # noqa: E402
    UnsupportedConfigError,
    adapter_for,
    from_hf,
    from_pretrained,
    inspect_checkpoint,
    pretrained_config,
    save_hf_checkpoint,
)
from harts.integrations.hf.checkpoint import write_safetensors  # noqa: E402
from harts.tree.batch import RolloutBatch  # noqa: E402
from tests.integrations._hf import (  # noqa: E402
    CONFIGS,
    VOCAB,
    hf_logits,
    make_hf_model,
    max_rel_logit_diff,
    trajectories,
)

B = 8


def _tree_batch() -> RolloutBatch:
    """Forks at B-1, B and B+1 off one base, plus a nested handoff; random advantages."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, VOCAB, 3 * B + 2).tolist()
    trajs = [base] + [base[:p] + rng.integers(0, VOCAB, n).tolist() for p, n in [(B - 1, 4), (B, B + 2), (B + 1, 3)]]
    trajs.append(trajs[2][: B + 3] + rng.integers(0, VOCAB, 5).tolist())
    return RolloutBatch.from_trajectories(trajs, advantages=rng.normal(size=len(trajs)))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_compact_equals_trajectory_float64_every_gradient(model_type):
    model = from_hf(make_hf_model(model_type, seed=21), chunk_size=B, dtype="float64")
    assert model.config.dtype == "float64"
    batch = _tree_batch()
    outs, grads = [], []
    for mode in ("trajectory", "compact"):
        model.zero_grad()
        lp = model(batch, mode=mode).logprobs
        (lp * torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype)).sum().backward()
        outs.append(lp.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-10)
    assert grads[0].keys() == grads[1].keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for n, g in grads[0].items():
        assert torch.allclose(g, grads[1][n], rtol=1e-9, atol=1e-11), n


@pytest.mark.parametrize("model_type,tied", [("qwen3_5", True), ("qwen3_5_moe", False)])
def test_vl_model_gives_its_language_model_and_exports_text_only(model_type, tied, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    hf = make_hf_model(model_type, seed=23, tie_word_embeddings=tied)
    model = from_hf(hf, chunk_size=B)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vision tower" in err[0] and "left out" in err[0]
    assert model.config.tie_word_embeddings is tied
    text_type = adapter_for(model_type).text_model_type
    assert model.hf_source["model_type"] == text_type
    trajs = trajectories([6, 2 * B + 1], seed=3)
    assert max_rel_logit_diff(hf, model, trajs) <= 1e-4

    save_hf_checkpoint(model, str(tmp_path), hf_config=model.hf_source["config"])  # the language model alone
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == text_type and written["tie_word_embeddings"] is tied
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    loaded.config._attn_implementation = "eager"
    assert type(loaded).__name__ == adapter_for(text_type).architecture
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tied
    for t in trajs:
        ours, theirs = hf_logits(loaded, t), hf_logits(hf, t)
        assert float((ours - theirs).abs().max() / theirs.abs().max()) <= 1e-5


def _hub_layout(hf, path) -> None:
    """The published VL layout: transformers' module names (``model.language_model.*``, fused experts
    ``[E, 2I, D]``, ``model.visual.*``), an MTP head, sharded with an index."""
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    d = hf.config.text_config.hidden_size
    tensors["mtp.fc.weight"] = torch.randn(d, 2 * d)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(d)
    write_safetensors(tensors, str(path), max_shard_bytes=40_000)
    (path / "config.json").write_text(json.dumps(hf.config.to_dict(), default=str))


@pytest.mark.parametrize("layout", ["hub", "save_pretrained"])
def test_vl_checkpoint_loads_and_converts(layout, tmp_path, capsys):
    hf = make_hf_model("qwen3_5_moe", seed=29)
    if layout == "hub":
        _hub_layout(hf, tmp_path)
    else:
        hf.save_pretrained(tmp_path)  # per-expert tensors under model.language_model.
    capsys.readouterr()
    model = from_pretrained(str(tmp_path), chunk_size=B)
    assert "vision tower" in capsys.readouterr().err
    direct = from_hf(hf, chunk_size=B)
    a, b = model.state_dict(), direct.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the same source, but where the vision tower is kept: the directory, or the model's tensors
    vision, direct_vision = model.hf_source.pop("vision"), direct.hf_source.pop("vision")
    assert model.hf_source == direct.hf_source
    assert vision["checkpoint"] == str(tmp_path) and vision["config"] == direct_vision["config"]
    assert sorted(direct_vision["tensors"]) == sorted(k for k in hf.state_dict() if k.startswith("model.visual."))

    rep = inspect_checkpoint(str(tmp_path))
    assert rep.all_mapped and rep.model_type == "qwen3_5_moe" and rep.layer_pattern == "GAGA"
    assert rep.num_parameters == model.num_parameters()
    assert any(n.startswith("model.visual.") for n in rep.ignored)
    assert (layout == "hub") == any(n.startswith("mtp.") for n in rep.ignored)
    assert main(["convert", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Qwen3_5MoeForConditionalGeneration" in out and "all mapped     yes" in out
    assert "MoE 4 experts top-2" in out and f"{rep.num_parameters:,}" in out


def _vl_export_matches(hf, out, trajs) -> None:
    """``out`` is a VL checkpoint transformers loads: the vision tower bit for bit ``hf``'s, and the
    language model's logits ``hf``'s (harts' weights were not trained)."""
    from transformers import AutoModelForImageTextToText

    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    assert written["architectures"] == [type(hf).__name__]
    loaded = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
    loaded.config._attn_implementation = loaded.config.text_config._attn_implementation = "eager"
    assert type(loaded) is type(hf)
    theirs, ours = hf.state_dict(), loaded.state_dict()
    visual = [k for k in theirs if k.startswith("model.visual.")]
    assert visual and all(torch.equal(ours[k], theirs[k]) for k in visual)
    for t in trajs:
        a, b = hf_logits(loaded, t), hf_logits(hf, t)
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-5


@pytest.mark.parametrize("model_type,tied", [("qwen3_5", True), ("qwen3_5_moe", False)])
def test_vl_model_saves_with_its_vision_tower(model_type, tied, tmp_path):
    hf = make_hf_model(model_type, seed=31, tie_word_embeddings=tied)
    model = from_hf(hf, chunk_size=B)
    save_hf_checkpoint(model, str(tmp_path / "out"))
    _vl_export_matches(hf, tmp_path / "out", trajectories([6, 2 * B + 1], seed=5))


def test_vl_checkpoint_saves_with_its_vision_tower_read_back_from_disk(tmp_path, capsys):
    import shutil

    hf = make_hf_model("qwen3_5", seed=37)
    hf.save_pretrained(tmp_path / "src")
    model = from_pretrained(str(tmp_path / "src"), chunk_size=B)
    save_hf_checkpoint(model, str(tmp_path / "out"))
    _vl_export_matches(hf, tmp_path / "out", trajectories([7], seed=6))
    again = from_pretrained(str(tmp_path / "out"), chunk_size=B).state_dict()
    assert all(torch.equal(t, again[k]) for k, t in model.state_dict().items())
    # the tower is read from the source at save time: gone, the save refuses in one line
    shutil.rmtree(tmp_path / "src")
    with pytest.raises(UserError, match=r"cannot save the vision tower \(it is read from .*src, the checkpoint"):
        save_hf_checkpoint(model, str(tmp_path / "again"))
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize(
    "section", [[2, 1, 1], [0, 0, 4], [1, 3, 0], [11, 11, 10]], ids=lambda s: "-".join(map(str, s))
)
def test_text_positions_are_1d_under_any_mrope_section(section):
    """transformers gives a text token T = H = W = its 1-D position, so the interleaved sections
    pick equal positions and harts' 1-D RoPE is exact."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": section}
    hf = make_hf_model("qwen3_5", seed=31, rope_parameters=rope)
    ids = torch.tensor(trajectories([2 * B + 3, 2 * B + 3], seed=5))
    pos, _ = hf.model.get_rope_index(ids, mm_token_type_ids=torch.zeros_like(ids))
    assert pos.shape == (3, 2, ids.shape[1])
    assert all(torch.equal(pos[a, j], torch.arange(ids.shape[1])) for a in range(3) for j in range(2))
    model = from_hf(hf, chunk_size=B)
    assert max_rel_logit_diff(hf, model, trajectories([1, B + 1, 3 * B], seed=6)) <= 1e-4


def test_unsupported_options_are_all_named():
    cfg = CONFIGS["qwen3_5_moe_text"](hidden_act="gelu", attention_bias=True, shared_expert_intermediate_size=0)
    with pytest.raises(UnsupportedConfigError) as e:
        adapter_for("qwen3_5_moe_text").config_from_hf(cfg)
    msg = str(e.value)
    assert isinstance(e.value, UserError)
    assert "hidden_act='gelu'" in msg and "attention_bias=True" in msg and "shared_expert_intermediate_size=0" in msg
    with pytest.raises(UnsupportedConfigError, match="linear_num_value_heads=3"):
        adapter_for("qwen3_5_text").config_from_hf(CONFIGS["qwen3_5_text"](linear_num_value_heads=3))


def _checkpoint(tmp_path, model_type="qwen3_5"):
    path = tmp_path / model_type
    make_hf_model(model_type, seed=37).save_pretrained(path)
    return path


def _edit_config(path, edit) -> None:
    f = path / "config.json"
    cfg = json.loads(f.read_text())
    edit(cfg)
    f.write_text(json.dumps(cfg))


def _one_line_error(argv, capsys) -> str:
    capsys.readouterr()  # what writing the checkpoint printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


def test_unsupported_model_type_names_the_supported_ones(tmp_path, capsys):
    path = _checkpoint(tmp_path)
    _edit_config(path, lambda c: c.update(model_type="llama"))
    err = _one_line_error(["convert", str(path)], capsys)
    assert "unsupported model_type 'llama'" in err and "qwen3_5_moe_text" in err and "kimi_linear" in err
    with pytest.raises(UserError, match="llama"):
        from_pretrained(str(path))


def test_missing_config_field_names_the_field_and_the_file(tmp_path, capsys):
    path = _checkpoint(tmp_path)
    _edit_config(path, lambda c: c["text_config"].pop("hidden_size"))
    err = _one_line_error(["convert", str(path)], capsys)
    assert "text_config.hidden_size" in err and str(path / "config.json") in err
    for load in (from_pretrained, pretrained_config):
        with pytest.raises(UserError, match=r"text_config\.hidden_size"):
            load(str(path))
    _edit_config(path, lambda c: c.pop("text_config"))
    assert "text_config" in _one_line_error(["convert", str(path)], capsys)


def test_bad_config_values_are_one_line_errors(tmp_path, capsys):
    path = _checkpoint(tmp_path, "qwen3_5_text")
    _edit_config(path, lambda c: c.update(hidden_size="wide"))
    err = _one_line_error(["convert", str(path)], capsys)
    assert "hidden_size" in err and str(path / "config.json") in err
    (path / "config.json").write_text("{ not json")
    assert "not JSON" in _one_line_error(["convert", str(path)], capsys)


def test_weights_disagreeing_with_the_config_name_the_tensor(tmp_path, capsys):
    path = _checkpoint(tmp_path, "qwen3_5_moe")
    _edit_config(path, lambda c: c["text_config"].update(moe_intermediate_size=12))
    for load in (from_pretrained, pretrained_config):
        with pytest.raises(UserError, match=r"model\.language_model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight"):
            load(str(path))
    assert main(["convert", str(path)]) == 1
    out = capsys.readouterr().out
    assert "mismatch  model.layers.0.mlp.experts.gate_up_proj [4, 32, 32] as assembled from" in out
    assert "all mapped     NO" in out
    _edit_config(path, lambda c: c["text_config"].update(moe_intermediate_size=16, linear_num_value_heads=2))
    with pytest.raises(UserError, match=r"model\.language_model\.layers\.0\.linear_attn\.in_proj_qkv\.weight"):
        from_pretrained(str(path))
    assert main(["train", "--model", str(path), "--workload", "tiny", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "in_proj_qkv" in err and "Traceback" not in err
