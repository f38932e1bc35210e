"""The reference decoder on the Mamba-2 hybrids (float64): Nemotron-H's layout (Mamba-2 'S',
attention-only, MLP-only and relu2-MoE-only layers, no RoPE) and Granite 4.0-H's scalings
(embedding, residual, attention and logits multipliers). The sampler's log-probs of a tree
whose paths cross several SSD chunks and fork inside one equal the training forward's (both
modes) to 1e-9: the SSD recurrence per token with its conv state, D skip and gated norm, the
empty mixer slots and the multipliers are the training forward's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.models.config import HybridConfig
from harts.models.hybrid_lm import HybridLM
from harts.rl.grpo import per_logprob
from harts.rollout.decode import extend, new_branch
from harts.tree.batch import RolloutBatch
from tests.rollout.test_sampler import sampled_tree

HYBRID = dict(
    dtype="float64",
    vocab_size=32,
    chunk_size=8,
    num_experts=4,
    attn_qk_norm=False,
    partial_rotary_factor=0.0,
    attn_output_gate=False,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=8,
    mamba_n_groups=2,
)
MODELS = {
    "nemotron_h": dict(layer_pattern="S-S-A-S", ffn_pattern="-E-D-D-", hidden_act="relu2"),
    "granite_4_0_h": dict(
        layer_pattern="SAS",
        embedding_multiplier=3.0,
        residual_multiplier=0.4,
        attn_scale=0.3,
        logits_scaling=2.5,
        first_k_dense_replace=0,
    ),
}


def _model(name: str) -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.tiny(**HYBRID, **MODELS[name]))
    with torch.no_grad():  # decays in the trained range, non-trivial skips and conv biases
        for layer in model.layers:
            if layer.letter == "S":
                layer.mamba.A_log.uniform_(0.0, 1.5)
                layer.mamba.D.normal_()
                layer.mamba.conv1d.bias.normal_(std=0.3)
    return model


def _gap(model: HybridLM, batch: RolloutBatch, mode: str) -> float:
    """Largest |training log-prob - sampler log-prob| over the action tokens."""
    with torch.no_grad():
        lp = model(batch, mode=mode).logprobs.double().numpy()
    act = per_logprob(batch, batch.action_mask)
    return float(np.abs(lp[act] - per_logprob(batch, batch.old_logprobs)[act]).max())


@pytest.mark.parametrize("name", list(MODELS))
def test_sampled_logprobs_equal_the_training_forward(name: str) -> None:
    model = _model(name)
    assert "S" in model.config.layer_pattern
    batch = sampled_tree(model)
    assert batch.num_trajectories == 6 and batch.lengths.max() > 3 * model.config.chunk_size
    for mode in ("compact", "trajectory"):
        assert _gap(model, batch, mode) < 1e-9, mode


def test_the_check_sees_a_wrong_ssd_skip() -> None:
    """The same check fails once the decoder and the forward differ (the D skip changed after
    sampling), so the equality above is not vacuous."""
    model = _model("nemotron_h")
    batch = sampled_tree(model)
    with torch.no_grad():
        model.layers[0].mamba.D.add_(1e-3)
    assert _gap(model, batch, "compact") > 1e-7


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-steps"])
@pytest.mark.parametrize("name", list(MODELS))
def test_batched_decoder_equals_the_reference(name: str, static: bool) -> None:
    """``harts.rollout.fast`` (CUDA's decoder, here on the CPU, eager or through the bucketed
    static steps CUDA graphs capture) gives the reference's logits on these models: a prompt,
    two forks, then one token per fork and step."""
    from harts.rollout.fast import FastDecoder

    model = _model(name)
    prompt, steps = list(range(1, 20)), [[3, 7], [9, 9], [30, 2], [4, 5]]
    (root,) = extend(model, [new_branch(model)], [prompt])
    dec = FastDecoder(model)
    dec.static_steps = static
    (seq,) = dec.open()
    dec.extend([seq], [prompt])
    torch.testing.assert_close(dec.logits[seq], root.logits, rtol=0, atol=1e-12)
    branches, ids = root.fork(2), dec.fork(seq, 2)
    for tokens in steps:
        branches = extend(model, branches, [[t] for t in tokens])
        dec.extend(ids, [[t] for t in tokens])
        for n, b in zip(ids, branches):
            torch.testing.assert_close(dec.logits[n], b.logits, rtol=0, atol=1e-12)
    assert (dec._static is not None) == static
