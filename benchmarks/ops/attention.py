"""Full attention of one training microbatch: FlexAttention tile options against each other.

    python -m benchmarks.ops.attention --workload medium --capacity 65536 --json out.json \
        --variant harts --variant torch --variant "bwd=64,64,64,64,3,4"

Takes the largest microbatch of each side of ``--workload``'s step ``--step`` at capacity T
(``harts bench``'s plans): the baseline's raw microbatch under its document-causal mask, and
harts' compact microbatch under its tree mask (the ``tree_pre`` / ``tree_end`` the model
passes). On random q, k, v of the model's MLA shapes (H heads, qk dim ``nope + rope``, v dim
``v_head_dim``) it times FlexAttention's forward and forward + backward (CUDA events, median of
``--repeat`` after one untimed call that compiles), once per ``--variant``:

* ``harts``: harts' ``flex_kernel_options`` (what the model runs);
* ``torch``: no kernel options (torch's own tiles);
* ``bwd=M1,N1,M2,N2,stages,warps``: those backward tiles (``bwd_BLOCK_M1`` ...) over torch's;
* ``fwd=M,N,stages,warps``: those forward tiles;
* several, joined by ``+`` and applied left to right (``harts+bwd=...``), plus the flags
  ``safe`` (``ROWS_GUARANTEED_SAFE``: every row sees itself), ``tma`` (``USE_TMA``: Hopper's
  bulk tensor copies), ``prescale`` (``PRESCALE_QK``: q scaled once, not every score) and
  ``nodq`` (``WRITE_DQ=False``: dq written in the dk/dv loop) and ``flash`` (``BACKEND="FLASH"``:
  torch's flash-attention backend on the CuTe DSL, where ``flash-attn-4`` is installed; use it
  alone, ``--variant flash``, since the Triton tile options do not apply to it);
* ``kv=N``: the tree's BlockMask built with KV blocks of N columns (``tree_block_mask(...,
  kv_block=N)``, BLOCK_SIZE=(128, N)) instead of 128 x 128: flash-attn-4's Hopper backward for d_qk 192 / d_v 128 runs 64 x 96 tiles and takes
  a block mask only at a KV block of 96 (``flash+kv=96``).

A variant that does not compile or run is reported as failed and the others go on.

With ``--varlen`` the baseline's mask is also run through torch's flash-attention varlen kernel
(``torch.nn.attention.varlen``, v zero-padded to the qk dim) where this torch has it: what a
dense causal kernel reaches on the same rows. Printed per mask and variant: milliseconds and
TFLOP/s over the visible pairs (forward 2 x H x (d_qk + d_v) per pair, backward 2.5x that).
The largest difference of each variant's output and gradients from the first variant's checks
that the tiles change only speed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks._runner import (
    add_dtype_argument,
    add_json_argument,
    cuda_device,
    dtype_of,
    median_seconds,
    parse,
    parser,
    run,
    write_json,
)

__all__ = ["KV_BLOCK_KEY", "parse_variant", "masks_of_step", "main"]

#: the key ``parse_variant`` sets for ``kv=N``: the BlockMask's KV block size
KV_BLOCK_KEY = "kv_block"

#: the flag tokens of a variant and the FlexAttention kernel options each sets
_FLAGS: dict[str, dict[str, Any]] = {
    "safe": {"ROWS_GUARANTEED_SAFE": True},
    "tma": {"USE_TMA": True},
    "prescale": {"PRESCALE_QK": True},
    "nodq": {"WRITE_DQ": False},
    # torch's CuTe-DSL flash-attention backend (needs flash-attn-4 and nvidia-cutlass-dsl)
    "flash": {"BACKEND": "FLASH"},
}


def _bad_part(spec: str, part: str) -> ValueError:
    return ValueError(
        f"variant {spec!r}: {part!r} must be harts, torch, {', '.join(_FLAGS)}, bwd=M1,N1,M2,N2,stages,warps, "
        "fwd=M,N,stages,warps or kv=N"
    )


def parse_variant(spec: str, harts_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``"bwd=64,64,64,64,3,4+safe"`` -> FlexAttention kernel options; ``harts`` adds
    ``harts_options`` (the model's), ``torch`` adds nothing; ``kv=N`` sets the key
    ``KV_BLOCK_KEY`` (the block mask's KV block size, not a kernel option)."""
    opts: dict[str, Any] = {}
    for part in spec.split("+"):
        part = part.strip()
        if part in ("", "torch"):
            continue
        if part == "harts":
            opts.update(harts_options or {})
            continue
        if part in _FLAGS:
            opts.update(_FLAGS[part])
            continue
        key, eq, vals = part.partition("=")
        if not eq or key not in ("bwd", "fwd", "kv"):
            raise _bad_part(spec, part)
        try:
            nums = [int(x) for x in vals.split(",")]
        except ValueError:
            raise ValueError(f"variant {spec!r}: {part!r} needs integers after '='") from None
        names: tuple[str, ...]
        if key == "kv":
            if len(nums) != 1 or nums[0] < 16 or nums[0] % 16:
                raise ValueError(f"variant {spec!r}: {part!r} needs one multiple of 16 (kv=96)")
            opts[KV_BLOCK_KEY] = nums[0]
            continue
        if key == "bwd" and len(nums) == 6:
            names = ("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_stages", "bwd_num_warps")
        elif key == "fwd" and len(nums) == 4:
            names = ("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_stages", "fwd_num_warps")
        else:
            raise _bad_part(spec, part)
        opts.update(zip(names, nums))
    return opts


def masks_of_step(workload: str, step: int, capacity: int, chunk_size: int) -> dict[str, dict[str, np.ndarray]]:
    """The largest microbatch of each side: {"baseline" | "harts": {pre, end, position}} (int64 [P])."""
    from harts.plan.baselines.trajectory_plan import plan_trajectory_step
    from harts.plan.layout import build_layout
    from harts.plan.step import plan_step
    from harts.tree.workloads import workload_steps

    steps = workload_steps(workload, step + 1)
    batch = steps[step][1]()
    raw = plan_trajectory_step(batch.lengths, dp=1, capacity=capacity)
    lengths = np.asarray(batch.lengths)
    big = max(raw.microbatches, key=lambda mb: int(lengths[mb].sum()))
    lens = lengths[big]
    ends = np.cumsum(lens)
    base = {
        "pre": np.arange(int(ends[-1]), dtype=np.int64),
        "end": np.repeat(ends, lens).astype(np.int64),
        "position": np.concatenate([np.arange(n) for n in lens]).astype(np.int64),
    }
    plan = plan_step(batch, dp=1, capacity=capacity)
    best = None
    for cb, call_plan in plan.prepare_replica(0, chunk_size):
        layout = build_layout(cb, call_plan)
        if best is None or layout.num_rows > best.num_rows:
            best = layout
    assert best is not None
    tree = {
        "pre": np.asarray(best.tree_pre, dtype=np.int64),
        "end": np.asarray(best.tree_end, dtype=np.int64),
        "position": np.asarray(best.position, dtype=np.int64),
    }
    return {"baseline": base, "harts": tree}


def _visible_pairs(mask: dict[str, np.ndarray]) -> int:
    """Visible (query, key) pairs: a row at trajectory position p sees p + 1 rows (padding: 1)."""
    pre = mask["pre"]
    return int(np.where(pre >= 0, mask["position"] + 1, 1).sum())


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--workload", default="medium")
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--capacity", type=int, default=65536)
    p.add_argument("--model", default="ling3_tiny", help="model preset whose MLA shapes are used")
    add_dtype_argument(p, ["bfloat16", "float32"], "bfloat16")
    p.add_argument("--variant", action="append", default=None, help="kernel options (module docstring); repeatable")
    p.add_argument("--sides", default="baseline,harts")
    p.add_argument("--varlen", action="store_true", help="also the flash-attention varlen kernel on the baseline")
    p.add_argument("--repeat", type=int, default=3)
    add_json_argument(p)
    args = parse(p, argv)
    try:
        specs = args.variant or ["harts"]
        for v in specs:
            parse_variant(v)  # checked before any CUDA work
    except ValueError as exc:
        p.error(str(exc))
    sides = args.sides.split(",")
    for s in sides:
        if s not in ("baseline", "harts"):
            p.error(f"--sides: unknown side {s!r} (baseline, harts)")
    dev = cuda_device("FlexAttention's Triton kernels")
    from harts.models.config import HybridConfig
    from harts.ops.attention.tree_mask import _compiled_flex, flex_kernel_options, tree_block_mask

    cfg = HybridConfig.preset(args.model)
    H, dqk, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    dtype = dtype_of(args.dtype)
    masks = masks_of_step(args.workload, args.step, args.capacity, cfg.chunk_size)
    harts_options = flex_kernel_options(dev, dtype, dqk, dv) or {}
    variants = [(v, parse_variant(v, harts_options)) for v in specs]
    flex = _compiled_flex()
    results: list[dict[str, Any]] = []
    print(
        f"{args.workload}[{args.step}] T={args.capacity} H={H} d_qk={dqk} d_v={dv} {args.dtype}; harts: {harts_options}"
    )
    print(
        f"{'side':9} {'rows':>7} {'pairs':>10} {'variant':34} {'fwd ms':>8} {'f+b ms':>8} {'bwd/fwd':>7} "
        f"{'fwd TF/s':>8} {'f+b TF/s':>8} {'max diff':>9}"
    )
    for side in sides:
        m = masks[side]
        P, pairs = len(m["pre"]), _visible_pairs(m)
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, H, P, dqk, device=dev, dtype=dtype, generator=gen).requires_grad_()
        k = torch.randn(1, H, P, dqk, device=dev, dtype=dtype, generator=gen).requires_grad_()
        v = torch.randn(1, H, P, dv, device=dev, dtype=dtype, generator=gen).requires_grad_()
        go = torch.randn(1, H, P, dv, device=dev, dtype=dtype, generator=gen)
        pre, end = torch.as_tensor(m["pre"], device=dev), torch.as_tensor(m["end"], device=dev)
        block_mask = tree_block_mask(pre, end)
        fwd_flops = 2.0 * H * (dqk + dv) * pairs
        ref = None
        runs: list[tuple[str, Callable[[], torch.Tensor]]] = []
        for name, opts in variants:
            # exactly the variant's options: ``torch`` and ``flash`` must not carry harts' tiles
            opts = dict(opts)
            kv_block = opts.pop(KV_BLOCK_KEY, None)
            mask = block_mask if kv_block is None else tree_block_mask(pre, end, kv_block=kv_block)
            runs.append((name, functools.partial(_flex_call, flex, q, k, v, mask, dqk**-0.5, opts or None)))
        if args.varlen and side == "baseline":
            varlen = _varlen_call(q, k, v, m, dqk, dv)
            if varlen is None:
                print("  (torch.nn.attention.varlen is not in this torch: varlen skipped)")
            else:
                runs.append(("flash varlen (v padded)", varlen))
        for name, call in runs:
            # every variant compiles afresh: in one H200 run a variant without kernel options
            # timed like the variant compiled before it, as if it had reused that kernel
            torch._dynamo.reset()
            try:
                t_f = median_seconds(call, dev, args.repeat, events=True)

                def fb(call: Callable[[], torch.Tensor] = call) -> None:
                    q.grad = k.grad = v.grad = None
                    call().backward(go)

                t_fb = median_seconds(fb, dev, args.repeat, events=True)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile: report, go on
                print(f"{side:9} {P:7d} {pairs:10.3g} {name:34} failed: {type(exc).__name__}: {str(exc)[:200]}")
                results.append({"side": side, "variant": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
                continue
            q.grad = k.grad = v.grad = None
            out = call()
            out.backward(go)
            assert q.grad is not None and k.grad is not None and v.grad is not None
            got = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
            if ref is None:
                ref, diff = got, 0.0
            else:
                diff = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(got, ref))
            row = {
                "side": side,
                "variant": name,
                "rows": P,
                "pairs": pairs,
                "forward_s": t_f,
                "forward_backward_s": t_fb,
                "forward_tflops": fwd_flops / t_f / 1e12,
                "forward_backward_tflops": 3.5 * fwd_flops / t_fb / 1e12,
                "max_rel_diff_vs_first": diff,
            }
            results.append(row)
            print(
                f"{side:9} {P:7d} {pairs:10.3g} {name:34} {t_f * 1e3:8.2f} {t_fb * 1e3:8.2f} "
                f"{(t_fb - t_f) / t_f:7.2f} {row['forward_tflops']:8.1f} {row['forward_backward_tflops']:8.1f} {diff:9.2e}",
                flush=True,
            )
    write_json(
        args, {"workload": args.workload, "step": args.step, "capacity": args.capacity, "results": results}, indent=1
    )
    return 0


def _flex_call(flex, q, k, v, block_mask, scale: float, kernel_options: dict | None) -> torch.Tensor:  # noqa: ANN001
    out = flex(q, k, v, block_mask=block_mask, scale=scale, kernel_options=kernel_options)
    assert isinstance(out, torch.Tensor)
    return out


def _varlen_call(q, k, v, mask, dqk: int, dv: int) -> Callable[[], torch.Tensor] | None:  # noqa: ANN001
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    end = mask["end"]
    starts = np.flatnonzero(mask["position"] == 0)
    cu = torch.as_tensor(np.append(starts, end[-1]), dtype=torch.int32, device=q.device)
    max_len = int(np.diff(cu.cpu().numpy()).max())
    import inspect

    # torch 2.10-2.11 spell causal ``is_causal=True``; later releases a (-1, 0) window
    causal: dict[str, Any] = (
        {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else {"window_size": (-1, 0)}
    )

    def call() -> torch.Tensor:
        qq, kk = q[0].transpose(0, 1), k[0].transpose(0, 1)
        vv = torch.nn.functional.pad(v[0].transpose(0, 1), (0, dqk - dv))
        o = varlen_attn(qq, kk, vv, cu, cu, max_len, max_len, scale=dqk**-0.5, **causal)
        assert isinstance(o, torch.Tensor)
        return o[..., :dv].transpose(0, 1)[None]

    return call


if __name__ == "__main__":
    raise SystemExit(run(main))
