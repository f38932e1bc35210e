"""hf_anchor: transformers' BailingHybrid on the baseline's packed rows equals harts' trajectory mode,
and keeps the trajectories of a row apart (CPU, float32: transformers computes its norms, router
and KDA core in float32, so float64 would only measure those casts)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402

from benchmarks.modules.hf_anchor import (  # noqa: E402
    bailing_hybrid_pair,
    build_anchor_models,
    hf_packed_logprobs,
    main,
    packed_kernels,
)
from harts.models.config import HybridConfig  # noqa: E402
from harts.models.execution.config import ExecutionConfig  # noqa: E402
from harts.ops.logprob import mapped_logprobs  # noqa: E402
from harts.tree.batch import RolloutBatch  # noqa: E402

TOL = 1e-4  # relative to the log-prob scale, as tests/integrations/test_hf_logits.py


@pytest.fixture(scope="module")
def models():
    preset = HybridConfig.preset("tiny", layer_pattern="KKMKM", vocab_size=64, dtype="float32")
    harts, hf, info = build_anchor_models(preset, device="cpu", seed=3)
    return harts.eval(), hf.eval(), info


def _batch(lengths: tuple[int, ...] = (9, 1, 3, 17, 2, 12)) -> RolloutBatch:
    # lengths 1-3 are shorter than the conv window (4), 9 and 17 cross the chunk size (8)
    g = torch.Generator().manual_seed(0)
    trajs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths]
    return RolloutBatch.from_trajectories(trajs, advantages=[0.0] * len(trajs))


def _alone_and_leaky(hf, sub: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers unmodified: each trajectory in its own forward (nothing to leak from), and
    the packed row with nothing marking the trajectories (what a leak looks like)."""
    alone = []
    for j in range(sub.num_trajectories):
        t = torch.as_tensor(sub.trajectory(j), device=hf.device)[None]
        h = hf.model(input_ids=t, use_cache=False).last_hidden_state[0]
        alone.append(mapped_logprobs(h, hf.lm_head.weight, torch.arange(t.shape[1] - 1), t[0, 1:].cpu()))
    ids = torch.as_tensor(sub.tokens, device=hf.device)[None]
    plain = hf.model(input_ids=ids, use_cache=False).last_hidden_state[0]
    rows, targets = torch.as_tensor(sub.predicting_positions()), torch.as_tensor(sub.next_token_targets())
    return torch.cat(alone).double(), mapped_logprobs(plain, hf.lm_head.weight, rows, targets).double()


def test_packed_row_matches_harts_and_each_trajectory_alone(models):
    harts, hf, _ = models
    sub = _batch()
    with torch.no_grad():
        with packed_kernels(torch.device("cpu")):
            packed = hf_packed_logprobs(hf, sub).double()
        ours = harts(sub, ExecutionConfig(mode="trajectory")).logprobs.double()
        alone, leaky = _alone_and_leaky(hf, sub)
    scale = max(1.0, float(alone.abs().max()))
    assert packed.shape == ours.shape == alone.shape == (sub.num_logprobs,)
    assert float((packed - alone).abs().max()) <= TOL * scale
    assert float((packed - ours).abs().max()) <= TOL * scale
    assert float((leaky - alone).abs().max()) > 100 * TOL * scale


@pytest.mark.gpu
def test_packed_row_on_cuda_with_fla_matches_each_trajectory_alone():
    """The H200 path: fla-core's chunk_kda (through transformers) and varlen conv; float32 with
    head dims fla's kernels take. Log-probs and every weight gradient against transformers'
    per-trajectory forward."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla")
    import transformers

    if not hasattr(transformers, "BailingHybridForCausalLM"):
        # the GPU machine's own transformers (5.17) predates it: carry the 5.24 wheel (module docstring)
        pytest.skip(f"transformers {transformers.__version__} has no BailingHybridForCausalLM")
    preset = HybridConfig.preset(
        "tiny",
        layer_pattern="KKMKM",
        vocab_size=64,
        dtype="float32",
        num_attention_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        chunk_size=64,
    )
    _, hf, _ = build_anchor_models(preset, device="cuda", seed=3)
    sub = _batch(lengths=(9, 1, 3, 130, 2, 64, 65))
    with packed_kernels(torch.device("cuda")) as used:
        assert "fla-core" in used["kda_core"] and "fla-core" in used["conv"]
        packed = hf_packed_logprobs(hf, sub)
        packed.sum().backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)
    alone, leaky = _alone_and_leaky(hf, sub)
    alone.sum().backward()
    scale = max(1.0, float(alone.abs().max()))
    assert float((packed.double() - alone).abs().max()) <= TOL * scale
    assert float((leaky - alone).abs().max()) > 100 * TOL * scale
    for n, p in hf.named_parameters():
        if p.grad is not None:
            assert float((grads[n] - p.grad).abs().max()) <= 1e-3 * max(float(p.grad.abs().max()), 1e-6), n


def test_packed_kernels_restore_transformers_functions():
    import transformers.models.bailing_hybrid.modeling_bailing_hybrid as mod

    before = (mod.chunk_kimi_delta_attention, mod.causal_conv1d_fn)
    with packed_kernels(torch.device("cpu")) as used:
        assert (mod.chunk_kimi_delta_attention, mod.causal_conv1d_fn) != before
        assert "once per trajectory" in used["kda_core"] and "once per trajectory" in used["conv"]
    assert (mod.chunk_kimi_delta_attention, mod.causal_conv1d_fn) == before


def test_ling3_tiny_differs_from_bailing_hybrid_in_semantics_only():
    """The ling3_tiny preset is not BailingHybrid: the anchor's harts side changes these (and no size)."""
    preset = HybridConfig.preset("ling3_tiny", layer_pattern="KKKM")
    hf_cfg, cfg = bailing_hybrid_pair(preset)
    assert hf_cfg.linear_num_heads == 16 and hf_cfg.linear_head_dim == 128 and hf_cfg.head_dim == 64
    changed = {k for k, v in preset.to_dict().items() if getattr(cfg, k) != v}
    # head_dim: gated-GQA (A) layers only, of which there are none
    assert changed == {
        "head_dim",
        "kda_low_rank_gates",
        "kda_safe_gate",
        "rope_interleave",
        "mla_head_gate",
        "mla_norm_eps",
    }


def test_main_cpu_writes_both_sides(tmp_path):
    out = tmp_path / "anchor.json"
    argv = ["--model", "tiny", "--workload", "tiny", "--capacity", "1024", "--microbatches", "2"]
    argv += ["--device", "cpu", "--dtype", "float32", "--repeat", "1", "--json", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["microbatches"] == 2 and r["raw_tokens"] > 0
    for side in ("harts", "transformers"):
        assert r[side]["best_seconds"] > 0 and r[side]["tokens_per_second"] > 0
    assert r["parameters"]["harts"] == r["parameters"]["transformers"]
    assert r["experts_implementation"] in ("grouped_mm", "batched_mm", "eager")
    assert r["warmup_max_abs_logprob_diff"] < 1e-3
    top = r["warmup_max_abs_logprob_diff"]
    assert 0 <= r["warmup_mean_abs_logprob_diff"] <= top and 0 <= r["warmup_p999_abs_logprob_diff"] <= top
    assert main(argv) == 2  # the JSON exists and --overwrite is not given


def test_main_refuses_layers_bailing_hybrid_lacks(capsys):
    assert main(["--model", "tiny", "--pattern", "KGMA", "--workload", "tiny", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("harts: error:") and "KGMA" in err and "Traceback" not in err


def test_main_says_when_transformers_lacks_bailing_hybrid(monkeypatch, capsys):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="5.17.0"))
    assert main(["--model", "tiny", "--workload", "tiny", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "transformers 5.17.0 has no BailingHybridForCausalLM" in err and "5.24.0" in err
