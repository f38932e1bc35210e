"""LoRA (harts.trainer.lora): compact == trajectory-wise with adapters on, every loss, float64 CPU;
frozen base, fresh adapters change nothing, merged weights, state round trip, HF and PEFT export."""

from __future__ import annotations

import pytest
import torch

from harts.errors import UserError
from harts.models import HybridConfig, HybridLM
from harts.rl.grpo import grpo_loss
from harts.rl.losses import LOSSES, check_loss, tinker_loss
from harts.trainer.lora import LoraConfig, apply_lora, lora_config_of, merged_model, save_peft_adapter
from tests.models._trees import mixed_batch

B = 8
TOL = 1e-10
LOSS_NAMES = [*sorted(LOSSES), "grpo"]


def make_model(**overrides) -> HybridLM:
    torch.manual_seed(0)
    cfg = HybridConfig.tiny(**{"dtype": "float64", "chunk_size": B, **overrides})
    model = HybridLM(cfg)
    for layer in model.layers:  # routing biases so expert choice differs from score order
        if layer.is_moe:
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.05)
    return model


def randomize_b(model: HybridLM, std: float = 0.3, seed: int = 1) -> None:
    """Non-zero B in every adapter, so that every adapter changes its weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(std * torch.randn(p.shape, generator=g, dtype=p.dtype))


def adapted(lora: LoraConfig | None = None, **overrides) -> tuple[HybridLM, list[torch.nn.Parameter]]:
    model = make_model(**overrides)
    params = apply_lora(model, lora or LoraConfig(rank=4, alpha=8.0))
    randomize_b(model)
    return model, params


def loss_of(name: str, logprobs: torch.Tensor, batch) -> torch.Tensor:
    if name == "grpo":
        return grpo_loss(logprobs, batch, kl_coef=0.1).loss
    return tinker_loss(logprobs, batch, name, check_loss(name, None))[0]


def step(model: HybridLM, inputs, loss: str, **fields) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs and the gradient of every parameter that requires grad, after one backward."""
    model.zero_grad(set_to_none=True)
    out = model(inputs, **fields)
    total = loss_of(loss, out.logprobs, inputs.batch)
    total = total + out.moe_objective(model.config.router_z_loss_coef, model.config.router_aux_loss_coef)
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return out.logprobs.detach(), grads


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-300) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / max(float(b.abs().max()), floor))


def check_compact_equals_trajectory(model: HybridLM, loss: str, **fields) -> None:
    inputs = model.prepare_compact(mixed_batch(B))
    lp_ref, g_ref = step(model, inputs, loss, mode="trajectory", **fields)
    lp, g = step(model, inputs, loss, mode="compact", **fields)
    assert rel(lp, lp_ref) <= TOL
    # each gradient against its own scale, floored at 1e-3 of the largest (as harts.rl.verify)
    floor = 1e-3 * max(float(x.abs().max()) for x in g_ref.values())
    worst = {n: rel(g[n], g_ref[n], floor) for n in g_ref}
    assert max(worst.values()) <= TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert all(float(x.abs().max()) > 0 for x in g_ref.values()), "every adapter must get a gradient"


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_compact_equals_trajectory_every_loss(loss: str) -> None:
    model, params = adapted()
    check_compact_equals_trajectory(model, loss)


@pytest.mark.parametrize(
    "flags",
    [
        dict(train_mlp=False, train_unembed=False),
        dict(train_attn=False, train_unembed=False),
        dict(train_attn=False, train_mlp=False),
    ],
    ids=["attn", "mlp", "unembed"],
)
def test_compact_equals_trajectory_each_flag(flags: dict) -> None:
    model, _ = adapted(LoraConfig(rank=3, alpha=5.0, **flags), layer_pattern="GAKM")
    check_compact_equals_trajectory(model, "ppo")


def test_compact_equals_trajectory_recompute_tied_qwen_style() -> None:
    """Checkpoint's recomputation (the adapted weights recomputed in the backward), tied
    embeddings with an adapted head, shared-expert gate and an MLA without q LoRA."""
    overrides = dict(
        layer_pattern="MGAK", tie_word_embeddings=True, shared_expert_gate=True, q_lora_rank=None, mla_output_gate=True
    )
    model, _ = adapted(LoraConfig(rank=2, alpha=2.0), **overrides)
    check_compact_equals_trajectory(model, "cispo", recompute=True)


def test_compact_equals_trajectory_without_lora_every_tinker_loss() -> None:
    model = make_model(layer_pattern="KGMA")
    for loss in sorted(LOSSES):
        check_compact_equals_trajectory(model, loss)


def test_fast_paths_read_the_adapted_weights() -> None:
    """KDA's stacked q / k / v and gate GEMMs and the grouped MoE experts, lean under
    recomputation, read module weights outside ``nn.Linear`` calls (float32: ``torch._grouped_mm``
    takes no float64): they give the merged model's log-probs, and every adapter a gradient."""
    model, params = adapted(dtype="float32", layer_pattern="KM")
    assert all(layer.mlp.experts.uses_grouped(torch.zeros(1, dtype=torch.float32)) for layer in model.layers[1:])
    merged = merged_model(model)
    inputs = model.prepare_compact(mixed_batch(B))
    stacked = tuple(sorted(model.backends().fast_paths | {"stacked_qkv", "stacked_gates"}))
    fields = dict(recompute=True, recompute_skip=("moe",), fast_paths=stacked)
    for mode in ("compact", "trajectory"):
        out = model(inputs, mode=mode, **fields)
        assert rel(out.logprobs, merged(inputs, mode=mode, **fields).logprobs) <= 1e-5
        model.zero_grad(set_to_none=True)
        out.logprobs.sum().backward()
        assert all(p.grad is not None and float(p.grad.abs().max()) > 0 for p in params)


def adapted_weight_names(model: HybridLM) -> set[str]:
    """The plain names of the weights that carry an adapter, from the state dict's names."""
    out = set()
    for name in model.state_dict():
        if name.endswith(".lora_A"):
            module, _, rest = name.partition(".parametrizations.")
            out.add(f"{module}.{rest.split('.')[0]}" if rest else "lm_head.weight")
    return out


def test_only_adapters_require_grad_and_targets() -> None:
    model = make_model(layer_pattern="KGMA", shared_expert_gate=True)
    base = {n for n, _ in model.named_parameters()}
    params = apply_lora(model, LoraConfig(rank=4))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in params} and len(params) == len(trainable)
    # every projection, the stacked experts and the head; not the router, shared-expert gate, convs
    want = {n for n in base if n.endswith(("_proj", "lm_head.weight")) or "_proj" in n.split(".")[-2]}
    assert adapted_weight_names(model) == want
    assert not any(n.endswith(("gate.weight", "conv1d.weight", "norm.weight")) for n in want)
    experts = model.layers[1].mlp.experts.parametrizations.gate_up_proj[0]
    assert experts.lora_A.shape == (4, 4, 32) and experts.lora_B.shape == (4, 32, 4)  # [E, r, D], [E, 2I, r]
    assert lora_config_of(model) == LoraConfig(rank=4) and lora_config_of(make_model()) is None
    only_attn = make_model(layer_pattern="KGMA")
    apply_lora(only_attn, LoraConfig(train_mlp=False, train_unembed=False))
    assert adapted_weight_names(only_attn) == {n for n in want if ".mlp." not in n and n != "lm_head.weight"}


def test_fresh_adapter_changes_nothing_and_lora_b_matters() -> None:
    model = make_model()
    batch = mixed_batch(B)
    before = {m: model(batch, mode=m).logprobs.detach() for m in ("compact", "trajectory")}
    apply_lora(model, LoraConfig(rank=4, seed=3))
    for mode, lp in before.items():
        assert torch.equal(model(batch, mode=mode).logprobs, lp)
    randomize_b(model)
    assert rel(model(batch, mode="compact").logprobs, before["compact"]) > 1e-3


def test_adapter_init_is_seeded_per_weight() -> None:
    a, b, c = make_model(), make_model(), make_model()
    pa, pb, pc = apply_lora(a, LoraConfig(seed=5)), apply_lora(b, LoraConfig(seed=5)), apply_lora(c, LoraConfig(seed=6))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert not torch.equal(pa[0], pc[0]) and all(float(p.detach().abs().max()) == 0 for p in pa[1::2])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_merged_model_equals_adapted(tied: bool) -> None:
    model, _ = adapted(tie_word_embeddings=tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_model(model)
    batch = mixed_batch(B)
    for mode in ("compact", "trajectory"):
        assert rel(merged(batch, mode=mode).logprobs, model(batch, mode=mode).logprobs) <= 1e-13
    plain = HybridLM(merged.config.replace(), seed=0)
    assert list(merged.state_dict()) == list(plain.state_dict())
    assert merged.config.tie_word_embeddings is False and lora_config_of(merged) is None
    assert all(p.requires_grad for p in merged.parameters())
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    if tied:  # the input embedding stays the base one, the head is adapted
        assert torch.equal(merged.embed_tokens.weight, model.embed_tokens.weight)
        assert not torch.equal(merged.lm_head.weight, merged.embed_tokens.weight)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_state_dict_round_trips_through_safetensors(tied: bool, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model, _ = adapted(tie_word_embeddings=tied)
    save_file(model.state_dict(), str(tmp_path / "s.safetensors"))
    other = HybridLM(model.config, seed=123)
    apply_lora(other, LoraConfig(rank=4, alpha=8.0, seed=9))
    other.load_state_dict(load_file(str(tmp_path / "s.safetensors")), strict=True)
    for name, buf in model.named_buffers():
        dict(other.named_buffers())[name].copy_(buf)  # the routing bias is not persistent in tiny()
    batch = mixed_batch(B)
    assert torch.equal(other(batch, mode="compact").logprobs, model(batch, mode="compact").logprobs)


def test_user_errors() -> None:
    model = make_model()
    for bad in (dict(rank=0), dict(rank=2.0), dict(alpha=0.0), dict(alpha=float("nan"))):
        with pytest.raises(UserError, match="LoRA"):
            apply_lora(model, LoraConfig(**bad))
    with pytest.raises(UserError, match="at least one"):
        apply_lora(model, LoraConfig(train_attn=False, train_mlp=False, train_unembed=False))
    assert all(p.requires_grad for p in model.parameters()), "a refused apply_lora changes nothing"
    with pytest.raises(UserError, match="no LoRA adapters"):
        merged_model(model)
    apply_lora(model, LoraConfig(rank=2))
    with pytest.raises(UserError, match="already has LoRA"):
        apply_lora(model, LoraConfig(rank=2))
    with pytest.raises(UserError, match="no HF source"):
        save_peft_adapter(model, "unused")


# ---------------------------------------------------------------------------- transformers / PEFT


def _hf_case(seed: int = 21):
    pytest.importorskip("transformers")
    from harts.integrations.hf import from_hf
    from tests.integrations._hf import batch_of, make_hf_model, trajectories

    hf = make_hf_model("qwen3_next", seed=seed)
    model = from_hf(hf, chunk_size=8)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    randomize_b(model, std=0.2)
    trajs = trajectories([11, 18], seed=3)
    with torch.no_grad():
        ours = model(batch_of(trajs), mode="trajectory").logprobs.double()
    return hf, model, trajs, ours


def test_merged_export_loads_in_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from harts.integrations.hf import save_hf_checkpoint
    from tests.integrations._hf import hf_logprobs

    hf, model, trajs, ours = _hf_case()
    save_hf_checkpoint(merged_model(model), str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    loaded.config._attn_implementation = "eager"
    theirs = hf_logprobs(loaded, trajs)
    assert rel(ours, theirs) <= 1e-4
    assert rel(hf_logprobs(hf, trajs), theirs) > 1e-3  # the adapters reached the checkpoint


def test_peft_adapter_loads_in_peft(tmp_path) -> None:
    pytest.importorskip("peft")
    from peft import PeftModel

    from tests.integrations._hf import hf_logprobs, make_hf_model

    hf, model, trajs, ours = _hf_case()
    save_peft_adapter(model, str(tmp_path))
    assert (tmp_path / "adapter_config.json").exists() and (tmp_path / "adapter_model.safetensors").exists()
    peft_model = PeftModel.from_pretrained(make_hf_model("qwen3_next", seed=21), str(tmp_path)).eval()
    theirs = hf_logprobs(peft_model, trajs)
    assert rel(ours, theirs) <= 1e-4
    assert rel(hf_logprobs(hf, trajs), theirs) > 1e-3


@pytest.mark.parametrize("flags", [{}, {"train_mlp": False}, {"train_unembed": True}])
def test_adapter_parameters_counts_what_apply_lora_adds(flags: dict) -> None:
    from harts.trainer.lora import adapter_parameters

    cfg = LoraConfig(rank=3, **flags)
    model = make_model()
    with torch.device("meta"):
        meta = HybridLM(model.config, seed=0)
    counted = adapter_parameters(meta, cfg)
    assert counted == sum(p.numel() for p in apply_lora(model, cfg)) > 0
