"""An adapted ``nn.Linear`` runs in activation form: its backward forms no [out, in] weight gradient
of the frozen base (the GEMMs a frozen base exists to skip), no merged weight is made for it, and
its outputs and adapter gradients equal the merged form's (float64)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from harts.trainer.lora import LoraConfig, LoraDelta, _adapted_linear_forward, adapted_view, apply_lora
from tests.models._trees import mixed_batch
from tests.trainer.test_lora import B, make_model, randomize_b

T, IN, OUT, R = 64, 48, 40, 4


def _flops(fn) -> int:  # noqa: ANN001
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_adapted_linear_backward_counts_no_base_weight_gradient() -> None:
    """FLOPs of one adapted linear's forward + backward are exactly the frozen-base count: forward
    2 T in out, input gradient 2 T in out, and the rank-r adapter three times 2 T r (in + out)
    (``FlopModel.formula``'s LoRA terms); the merged form adds the base's 2 T in out weight gradient."""
    lin = nn.Linear(IN, OUT, bias=True, dtype=torch.float64)
    lin.weight.requires_grad_(False)
    lin.bias.requires_grad_(False)
    delta = LoraDelta(torch.randn(R, IN, dtype=torch.float64), torch.randn(OUT, R, dtype=torch.float64), 0.5)
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", delta)
    x = torch.randn(T, IN, dtype=torch.float64, requires_grad=True)

    def merged() -> None:
        torch.nn.functional.linear(x, lin.weight, lin.bias).sum().backward()

    lin.forward = _adapted_linear_forward.__get__(lin)  # type: ignore[method-assign]

    def activation() -> None:
        lin(x).sum().backward()

    need = 2 * T * IN * OUT * 2 + 3 * 2 * T * R * (IN + OUT)
    assert _flops(activation) == need
    # the merged form: the base's forward, input and full weight gradient, and the merge B A
    # (2 out r in) with its two gradients, dA = B^T dW and dB = dW A^T
    assert _flops(merged) == 2 * T * IN * OUT * 3 + 3 * 2 * OUT * R * IN


def test_model_linears_make_no_merged_weight_and_equal_the_merged_form() -> None:
    """In a GQA + dense MLP model every adapted ``nn.Linear`` is called as a module: no adapter's
    merge runs in its forward or backward (the LM head, read as a weight, still merges). Its
    log-probs and every adapter gradient equal those of the same model run in merged form."""
    model = make_model(layer_pattern="AA", num_experts=0)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    randomize_b(model)
    merges: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, LoraDelta):
            m.register_forward_hook(lambda mod, a, o, name=name: merges.append(name))
    batch = mixed_batch(B)
    out = model(batch, mode="compact", recompute=True)
    out.logprobs.sum().backward()
    assert merges and all(n.startswith("lm_head") for n in merges), sorted(set(merges))[:3]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    # the merged form of the same model: drop the instance forwards (nn.Linear reads the merged weight)
    merged = copy.deepcopy(model)
    for m in merged.modules():
        if isinstance(m, nn.Linear) and "forward" in m.__dict__:
            del m.forward
    merged.zero_grad(set_to_none=True)
    ref = merged(batch, mode="compact", recompute=True)
    ref.logprobs.sum().backward()
    scale = float(out.logprobs.detach().abs().max())
    assert float((out.logprobs - ref.logprobs).detach().abs().max()) <= 1e-12 * scale
    for n, p in merged.named_parameters():
        if p.requires_grad:
            g = grads[n]
            assert float((g - p.grad).abs().max()) <= 1e-10 * max(1.0, float(g.abs().max())), n


def test_adapted_view_rebinds_the_activation_form_to_its_own_modules() -> None:
    """``adapted_view`` deep-copies the structure: each copy's linears compute with the copy's own
    adapters (a gradient lands on the view's adapters, none on the base's)."""
    base = make_model(layer_pattern="A", num_experts=0)
    view = adapted_view(base, LoraConfig(rank=2))
    randomize_b(view)
    view(mixed_batch(B), mode="compact").logprobs.sum().backward()
    lin = view.layers[0].self_attn.q_proj
    assert lin.forward.__self__ is lin
    assert lin.parametrizations["weight"][0].lora_B.grad is not None
    assert all(p.grad is None for p in base.parameters())


def _grouped_outputs(monkeypatch) -> list[tuple[int, ...]]:  # noqa: ANN001
    """Shapes of every ``torch._grouped_mm`` result from here on."""
    shapes: list[tuple[int, ...]] = []
    real = torch._grouped_mm

    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "_grouped_mm", recorded)
    return shapes


def test_grouped_experts_adapted_in_activation_form(monkeypatch) -> None:  # noqa: ANN001
    """Routed experts on the grouped path (float32 on the CPU) with rank-8 adapters: no
    [E, out, in] weight gradient of the frozen stacks is formed, and the log-probs and every
    adapter gradient equal the merged form's (the loop over experts reading merged weights)."""
    model = make_model(dtype="float32", layer_pattern="AA", first_k_dense_replace=1)
    apply_lora(model, LoraConfig(rank=8, alpha=8.0, train_attn=False, train_unembed=False))
    randomize_b(model, std=0.05)
    experts = model.layers[1].mlp.experts
    assert experts.uses_grouped(torch.zeros(1, dtype=torch.float32))
    stacks = {tuple(getattr(experts, n).shape) for n in experts.weight_names}
    batch = mixed_batch(B)
    shapes = _grouped_outputs(monkeypatch)
    out = model(batch, mode="compact")
    out.logprobs.sum().backward()
    assert shapes and not stacks & set(shapes), stacks & set(shapes)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    experts.impl = "loop"  # the reference: per-expert GEMMs on the merged weights
    ref = model(batch, mode="compact")
    ref.logprobs.sum().backward()
    eps = torch.finfo(torch.float32).eps
    scale = float(ref.logprobs.detach().abs().max())
    assert float((out.logprobs - ref.logprobs).detach().abs().max()) <= 64 * eps * scale
    for n, p in model.named_parameters():
        if p.requires_grad:
            g = grads[n]
            assert float((g - p.grad).abs().max()) <= 1e-4 * max(1e-6, float(p.grad.abs().max())), n
