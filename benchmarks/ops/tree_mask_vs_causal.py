"""Tree-mask attention against causal attention over the same tokens, per head dim (CUDA).

The compact side of a step runs full attention over P compact rows under the tree mask; this
times that call (``tree_mask_attention(impl="flex")`` with host-built BlockMasks: the kernel,
tiles and masks the model runs) forward and forward + backward, beside causal attention over
the same P tokens, on random bf16 q, k, v of 16 query heads over 2 KV heads (Qwen3-Next's GQA
layers at head dim 256):

* ``fan``: a 2,048-token prompt shared by 16 rollouts of 1,920 tokens (rows in preorder);
* ``nested``: a 1,024-token trunk, 4 branches of 1,024, each forked again into 4 of 1,728;
* ``causal``: one sequence of P tokens through the same kernel (a chain is a tree);
* ``doc_causal``: P tokens packed as sequences of the fan's root-to-leaf length (3,968), what
  the trajectory-wise side runs on the same number of tokens;
* ``sdpa_causal``: ``scaled_dot_product_attention(is_causal=True)`` on its flash backend, KV
  heads expanded: a dense causal kernel on one sequence of P tokens.

Each of the four masks is also timed as ``MASK/varlen``: the same attention as ancestor views
(``ancestor_view_attention``: every segment's ancestors' and own K/V rows gathered, one
FlashAttention-2 varlen call, bottom-right causal), the path ``attention="gather"`` runs on CUDA
where FlashAttention-2 takes the heads; ``attention="auto"`` chooses between the two paths by
what this benchmark measured (``harts.models.execution.config``).

Printed per head dim and mask: milliseconds, visible pairs, TFLOP/s over them (forward 4 x H x
D per pair, backward 2.5x that) and the ratio of time to ``causal``'s and ``sdpa_causal``'s.
``--alt-bwd M1,N1,M2,N2,stages,warps`` also times ``fan`` with that backward tile over harts'
forward tile at head dims above 128 (tile choice). JSON rows are rewritten after every
measurement, so a run stopped at its limit keeps what it finished.

    python -m benchmarks.ops.tree_mask_vs_causal --head-dims 128,256 --json out.json
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks._runner import add_json_argument, cuda_device, median_seconds, parse, parser, run, write_json
from harts.ops.attention.host_block_mask import host_block_mask
from harts.ops.attention.tree_mask import _compiled_flex, flex_kernel_options, tree_mask_attention, tree_mask_mod

Segments = list[tuple[int, int]]


def laid_out_tree(segments: Segments) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tree_pre, tree_end, depth) int64 [P] of a tree of segments given in preorder as (parent
    segment or -1, length), rows laid out in that order (pre = row)."""
    starts = np.cumsum([0] + [n for _, n in segments])
    sub_end = starts[1:].copy()
    depth0 = np.zeros(len(segments), dtype=np.int64)
    for s, (parent, _) in enumerate(segments):
        if parent >= 0:
            depth0[s] = depth0[parent] + segments[parent][1]
    for s in range(len(segments) - 1, -1, -1):  # children come after their parent in preorder
        parent = segments[s][0]
        if parent >= 0:
            sub_end[parent] = max(sub_end[parent], sub_end[s])
    lens = [n for _, n in segments]
    pre = np.arange(starts[-1], dtype=np.int64)
    end = np.repeat(sub_end, lens).astype(np.int64)
    depth = np.concatenate([d + np.arange(n) for d, n in zip(depth0, lens)]).astype(np.int64)
    return pre, end, depth


def ancestor_views(segments: Segments) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(q_rows, cu_q, kv_rows, cu_kv) int64 of ``laid_out_tree``'s tree: one branch per segment,
    its own rows as queries over its ancestors' rows (root first) and then its own."""
    starts = np.cumsum([0] + [n for _, n in segments])
    q_rows, kv_rows, cu_q, cu_kv = [], [], [0], [0]
    for s, (parent, n) in enumerate(segments):
        chain = [s]
        while segments[chain[-1]][0] >= 0:
            chain.append(segments[chain[-1]][0])
        own = np.arange(starts[s], starts[s] + n)
        q_rows.append(own)
        kv_rows += [np.arange(starts[a], starts[a] + segments[a][1]) for a in reversed(chain)]
        cu_q.append(cu_q[-1] + n)
        cu_kv.append(cu_kv[-1] + sum(segments[a][1] for a in chain))
    return np.concatenate(q_rows), np.asarray(cu_q), np.concatenate(kv_rows), np.asarray(cu_kv)


def segments_of(rows: int) -> dict[str, Segments]:
    """The trees of the module docstring over ``rows`` (a multiple of 32,768), as segments."""
    k = rows // 32768
    fan: Segments = [(-1, 2048 * k)] + [(0, 1920 * k)] * 16
    nested: Segments = [(-1, 1024 * k)]
    for _ in range(4):
        nested.append((0, 1024 * k))
        mid = len(nested) - 1
        nested += [(mid, 1728 * k)] * 4
    path = (2048 + 1920) * k
    docs = [path] * (rows // path) + ([rows % path] if rows % path else [])
    return {"fan": fan, "nested": nested, "causal": [(-1, rows)], "doc_causal": [(-1, n) for n in docs]}


def masks(rows: int) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(tree_pre, tree_end, depth) of each tree of ``segments_of`` (a document list is a forest
    of one-segment trees: each row's subtree ends at its document's end)."""
    return {name: laid_out_tree(segs) for name, segs in segments_of(rows).items()}


def _measure(call: Callable[[], torch.Tensor], leaves: list[torch.Tensor], go: torch.Tensor, repeat: int):  # noqa: ANN202
    def fb() -> None:
        for t in leaves:
            t.grad = None
        call().backward(go)

    device = go.device
    return median_seconds(call, device, repeat, events=True), median_seconds(fb, device, repeat, events=True)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--head-dims", default="128,256")
    p.add_argument("--rows", type=int, default=32768, help="P, a multiple of 32768")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--alt-bwd", default=None, help="M1,N1,M2,N2,stages,warps: another backward tile on 'fan'")
    p.add_argument("--deadline", type=float, default=1e9, help="seconds after which --alt-bwd is skipped")
    add_json_argument(p)
    args = parse(p, argv)
    if args.rows % 32768:
        p.error("--rows must be a multiple of 32768")
    dev = cuda_device("FlexAttention's Triton kernels")
    began = time.perf_counter()
    H, G, P = args.heads, args.kv_heads, args.rows
    info = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": P,
        "heads": H,
        "kv_heads": G,
        "dtype": "bfloat16",
    }
    rows: list[dict[str, Any]] = []

    def save() -> None:
        write_json(args, {**info, "results": rows}, indent=1, quiet=True)

    the_masks = masks(P)
    the_views = {name: ancestor_views(segs) for name, segs in segments_of(P).items()}
    print(f"{info['device']} torch {info['torch']}: P={P} H={H} G={G} bf16, median of {args.repeat}")
    head = " ".join(f"{'/' + ref[:7]:>7}" for ref in _REFS)
    print(f"{'D':>4} {'mask':12} {'pairs':>9} {'fwd ms':>8} {'f+b ms':>8} {'f+b TF/s':>8} {head}")
    for D in [int(d) for d in args.head_dims.split(",")]:
        gen = torch.Generator(device=dev).manual_seed(D)
        q = torch.randn(P, H, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
        k, v = (torch.randn(P, G, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in "kv")
        go = torch.randn(P, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
        tiles = flex_kernel_options(dev, torch.bfloat16, D, D)
        print(f"D={D}: harts' tiles {tiles or 'torch defaults'}")
        for name, (pre, end, depth) in the_masks.items():
            pre_d, end_d = torch.as_tensor(pre, device=dev), torch.as_tensor(end, device=dev)
            cache: dict = {}

            def call(pre=pre, end=end, pre_d=pre_d, end_d=end_d, cache=cache) -> torch.Tensor:  # noqa: ANN001
                return tree_mask_attention(
                    q, k, v, tree_pre=pre_d, tree_end=end_d, scale=D**-0.5, impl="flex",
                    mask_cache=cache, tree_pre_host=pre, tree_end_host=end,
                )  # fmt: skip

            pairs = int((depth + 1).sum())
            views = _views_call(q, k, v, the_views[name], D**-0.5)
            _guarded(
                rows, save, D, f"{name}/varlen", lambda: _measure(views, [q, k, v], go, args.repeat), pairs, H, None
            )
            if not _guarded(rows, save, D, name, lambda: _measure(call, [q, k, v], go, args.repeat), pairs, H, tiles):
                break  # one kernel serves every mask of this head dim: the others would fail alike
        _guarded(rows, save, D, "sdpa_causal", lambda: _sdpa(q, k, v, go, args.repeat), P * (P + 1) // 2, H, None)
        _ratios([r for r in rows if r["head_dim"] == D])
        save()
        if args.alt_bwd and tiles and time.perf_counter() - began < args.deadline:
            _alt_bwd(rows, save, args.alt_bwd, tiles, the_masks["fan"], q, k, v, go, args.repeat, D, H)
    save()
    return 0


def _guarded(rows, save, D, name, measure, pairs, H, tiles) -> bool:  # noqa: ANN001
    """``measure()`` into a row; a kernel that fails to compile or run is a row with its error."""
    try:
        t_f, t_fb = measure()
    except Exception as exc:  # noqa: BLE001 - report it and keep the other measurements
        rows.append({"head_dim": D, "mask": name, "error": f"{type(exc).__name__}: {exc}"[:600]})
        print(f"{D:4d} {name:12} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        save()
        return False
    _record(rows, save, D, name, pairs, H, tiles, t_f, t_fb)
    return True


def _ratios(of_d: list[dict[str, Any]]) -> None:
    """Each row's forward + backward time over causal's, the trajectory-wise packing's and SDPA's
    (rows of one head dim), printed as the table's lines."""
    base = {r["mask"]: r["forward_backward_s"] for r in of_d if "forward_backward_s" in r}
    for r in of_d:
        if "forward_backward_s" not in r:
            continue
        for ref in ("causal", "doc_causal", "sdpa_causal"):
            if ref in base:
                r[f"vs_{ref}"] = r["forward_backward_s"] / base[ref]
        cols = " ".join(f"{r[f'vs_{ref}']:7.2f}" if f"vs_{ref}" in r else f"{'-':>7}" for ref in _REFS)
        print(
            f"{r['head_dim']:4d} {r['mask']:12} {r['pairs']:9.3g} {r['forward_s'] * 1e3:8.2f} "
            f"{r['forward_backward_s'] * 1e3:8.2f} {r['forward_backward_tflops']:8.1f} {cols}",
            flush=True,
        )


_REFS = ("causal", "doc_causal", "sdpa_causal")


def _record(rows, save, D, name, pairs, H, tiles, t_f, t_fb) -> float:  # noqa: ANN001
    rows.append(
        {
            "head_dim": D,
            "mask": name,
            "pairs": pairs,
            "forward_s": t_f,
            "forward_backward_s": t_fb,
            "forward_backward_tflops": 3.5 * 4.0 * H * D * pairs / t_fb / 1e12,
            "kernel_options": tiles,
        }
    )
    save()
    return t_fb


def _views_call(q, k, v, views, scale: float) -> Callable[[], torch.Tensor]:  # noqa: ANN001
    """The ancestor-view path on ``views`` (``ancestor_views``' arrays), as the compact executor calls it."""
    from harts.ops.attention import ancestor_view_attention

    q_rows, cu_q, kv_rows, cu_kv = views
    dev = [torch.as_tensor(a, device=q.device) for a in views]

    def call() -> torch.Tensor:
        return ancestor_view_attention(
            q, k, v, q_rows=dev[0], cu_q=dev[1], kv_rows=dev[2], cu_kv=dev[3], scale=scale,
            cu_q_host=cu_q, cu_kv_host=cu_kv, q_rows_host=q_rows,
        )  # fmt: skip

    return call


def _sdpa(q, k, v, go, repeat: int) -> tuple[float, float]:  # noqa: ANN001
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q.shape[1] // k.shape[1]

    def call() -> torch.Tensor:
        qq = q.transpose(0, 1)[None]
        kk, vv = (t.repeat_interleave(rep, dim=1).transpose(0, 1)[None] for t in (k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        return o[0].transpose(0, 1)

    return _measure(call, [q, k, v], go, repeat)


def _alt_bwd(rows, save, spec: str, tiles: dict, fan, q, k, v, go, repeat: int, D: int, H: int) -> None:  # noqa: ANN001
    names = ("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_stages", "bwd_num_warps")
    opts = {**tiles, **dict(zip(names, (int(x) for x in spec.split(","))))}
    pre, end, depth = fan
    mask = host_block_mask(
        pre, end, tree_mask_mod(*(torch.as_tensor(a, device=q.device) for a in (pre, end))), q.device
    )
    flex = _compiled_flex()

    def call() -> torch.Tensor:
        o = flex(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            block_mask=mask, scale=D**-0.5, enable_gqa=True, kernel_options=dict(opts),
        )  # fmt: skip
        return o[0].transpose(0, 1)

    try:
        t_f, t_fb = _measure(call, [q, k, v], go, repeat)
    except Exception as exc:  # noqa: BLE001 - a tile that does not compile: say so, keep the rest
        rows.append({"head_dim": D, "mask": f"fan bwd={spec}", "error": f"{type(exc).__name__}: {exc}"[:600]})
        print(f"{D:4d} fan bwd={spec}: failed: {type(exc).__name__}: {str(exc)[:300]}")
        save()
        return
    _record(rows, save, D, f"fan bwd={spec}", int((depth + 1).sum()), H, opts, t_f, t_fb)
    print(f"{D:4d} fan bwd={spec}: fwd {t_f * 1e3:.2f} ms, f+b {t_fb * 1e3:.2f} ms")


if __name__ == "__main__":
    raise SystemExit(run(main))
