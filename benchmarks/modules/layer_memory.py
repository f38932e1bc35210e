"""Bytes per row each decoder layer keeps for its backward, measured, beside ``harts.models.memory``'s count.

    python -m benchmarks.modules.layer_memory --model qwen3_5_9b --device cuda --rows 16384 [--lora 32] [--json FILE]

For every distinct layer kind of a preset (its mixer letter, with a dense, an MoE or no FFN), a one-layer model of
the preset's shapes (vocabulary cut to ``--vocab``: the head is not what is measured) runs one forward over
``--rows`` tokens (one trajectory, trajectory mode, no recomputation) under
``torch.autograd.graph.saved_tensors_hooks``. Each saved tensor is attributed to the decoder layer whose forward is
running (module hooks) and counted once per storage, if it is still held when the backward starts; the layer's bytes
/ rows is what it keeps per row, the figure ``estimate_memory``'s ``activations`` and ``backward`` terms are built
from (``layer_row_bytes``: the same count, estimated). ``--lora RANK`` freezes the base and adapts every projection
the Engine covers, as ``harts bench --lora`` runs: frozen weights need no saved input, the adapters keep theirs.

The measured and estimated bytes print side by side with their ratio, per layer kind, and go to ``--json``. On the
CPU it measures the reference kernels (the counts the estimate was written from); on CUDA fla-core's and
FlashAttention's, where the estimate is known to overcount.
"""

from __future__ import annotations

from typing import Any

from benchmarks._runner import add_device_argument, add_json_argument, device_of, parse, parser, run, write_json
from harts.errors import UserError


def _ffn_letter(config: Any, i: int) -> str:  # noqa: ANN401
    """Layer ``i``'s FFN block as an ``ffn_pattern`` letter: ``E`` MoE, ``D`` dense, ``-`` none."""
    return "E" if config.is_moe_layer(i) else "D" if config.has_ffn(i) else "-"


def _kinds(config: Any) -> list[tuple[str, str, int]]:  # noqa: ANN401
    """(mixer letter, FFN letter, first layer index) of each distinct layer kind, in layer order."""
    seen: dict[tuple[str, str], int] = {}
    for i, letter in enumerate(config.layer_pattern):
        seen.setdefault((letter, _ffn_letter(config, i)), i)
    return [(letter, ffn, i) for (letter, ffn), i in seen.items()]


def one_layer(config: Any, letter: str, ffn: str) -> Any:  # noqa: ANN401
    """A one-layer ``HybridConfig`` of ``config``'s shapes: mixer ``letter`` with FFN ``ffn``."""
    return config.replace(
        layer_pattern=letter,
        ffn_pattern=ffn if config.ffn_pattern else "",
        first_k_dense_replace=0,
        num_experts=config.num_experts if ffn == "E" else 0,
    )


def saved_bytes(config: Any, rows: int, device: Any, lora: int) -> int:  # noqa: ANN401
    """Bytes of the distinct storages the one decoder layer of ``config`` (a one-layer
    ``HybridConfig``) saves for its backward over one trajectory of ``rows`` tokens, its
    parameters left out (module docstring)."""
    import weakref

    import numpy as np
    import torch

    from harts.models.execution.config import ExecutionConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.trainer.lora import LoraConfig, apply_lora
    from harts.tree.batch import RolloutBatch

    torch.manual_seed(0)
    with torch.device(device):
        model = HybridLM(config, seed=0)
    model.to(getattr(torch, config.dtype))
    if lora:
        apply_lora(model, LoraConfig(rank=lora))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, rows).tolist()
    batch = RolloutBatch.from_trajectories([tokens], advantages=np.ones(1))
    execution = ExecutionConfig(mode="trajectory", fused_logprobs=True, recompute=False)
    layer = model.layers[0]
    inside: list[bool] = [False]
    # (storage pointer, bytes, the saved tensor held weakly): a tensor saved by an op whose output
    # is dropped before the backward (a branch the layer computes but never uses) dies with that
    # output's graph, and is not kept memory
    saved: list[tuple[int, int, weakref.ref[torch.Tensor]]] = []
    # a weight saved for the input gradient is counted under ``parameters``, not per row
    weights = {q.untyped_storage().data_ptr() for q in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] and t.device.type == device.type:
            s = t.untyped_storage()
            if s.data_ptr() not in weights:
                saved.append((s.data_ptr(), s.nbytes(), weakref.ref(t)))
        return t

    def enter(*_: Any) -> None:  # noqa: ANN401
        inside[0] = True

    def leave(*_: Any) -> None:  # noqa: ANN401
        inside[0] = False

    hooks = [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(batch, execution)
        loss = out.logprobs.sum()
        storages = {ptr: nbytes for ptr, nbytes, ref in saved if ref() is not None}
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    del model, out, loss
    return sum(storages.values())


def measure_layer(config: Any, rows: int, device: Any, lora: int) -> dict[str, Any]:  # noqa: ANN401
    """One layer kind's saved bytes per row: measured as the slope between ``rows`` and half as
    many (what does not grow with the rows, such as routing tables per expert, drops out), and
    ``estimate_memory``'s count for the same config and device."""
    from harts.models.execution.config import ExecutionConfig
    from harts.models.memory import estimate_memory

    half = rows // 2
    measured = (saved_bytes(config, rows, device, lora) - saved_bytes(config, half, device, lora)) / (rows - half)
    est = estimate_memory(
        config,
        ExecutionConfig(mode="trajectory", fused_logprobs=True, recompute=False),
        capacity=rows,
        device_type=device.type,
        dtype=config.dtype,
        optimizer=False,
        frozen_base=bool(lora),
    )
    estimated = est.layer_row_bytes[0]
    return {
        "measured_bytes_per_row": measured,
        "estimated_bytes_per_row": estimated,
        "ratio": estimated / measured if measured else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--model", default="qwen3_5_9b", help="a preset name (harts.models.config.PRESET_NAMES)")
    p.add_argument("--rows", type=int, default=16384, help="tokens of the one trajectory (default 16384)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary of the measured model (default 4096)")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on a frozen base (default 0: full training)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float64"))
    add_device_argument(p)
    add_json_argument(p)
    args = parse(p, argv)
    if args.rows < 2 or args.vocab < 2 or args.lora < 0:
        raise UserError(f"--rows {args.rows} / --vocab {args.vocab} / --lora {args.lora}: need >= 2 / >= 2 / >= 0")
    from harts.models.config import HybridConfig

    device = device_of(args.device)
    full = HybridConfig.preset(args.model, dtype=args.dtype, vocab_size=args.vocab)
    rows = []
    print(f"{args.model}: saved bytes per row of one decoder layer, {args.rows:,} rows, {args.dtype} on {device}"
          f"{f', LoRA rank {args.lora} on a frozen base' if args.lora else ''}")  # fmt: skip
    print(f"{'layer':<10} {'measured B/row':>15} {'estimated B/row':>16} {'est/meas':>9}")
    for letter, ffn, index in _kinds(full):
        r = measure_layer(one_layer(full, letter, ffn), args.rows, device, args.lora)
        name = "+".join(part for part in (letter.strip("-"), {"E": "moe", "D": "mlp", "-": ""}[ffn]) if part)
        r.update(layer=name, first_index=index)
        rows.append(r)
        print(f"{name:<10} {r['measured_bytes_per_row']:>15,.0f} {r['estimated_bytes_per_row']:>16,.0f} "
              f"{r['ratio']:>9.2f}")  # fmt: skip
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
    write_json(args, {"model": args.model, "rows": args.rows, "dtype": args.dtype, "device": str(device),
                      "lora": args.lora, "layers": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
