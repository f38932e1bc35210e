"""Draw a segment tree with its call plan, in the style of the paper's Figures 6-8.

Each circle is a segment labelled with its name, token count and call number (colour =
call). Thick solid edges are direct continuations (one input sequence); dashed edges start
an independent sequence and carry its replay length r = e_v mod B. matplotlib is imported
inside ``plot_plan`` so that planning never needs it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harts.errors import UserError
from harts.outputs import save_figure
from harts.plan.calls import CallPlan

__all__ = ["plot_plan", "tree_coordinates"]

#: drawing more segments than this gives an unreadable figure
MAX_SEGMENTS = 400


def tree_coordinates(plan: CallPlan) -> tuple[np.ndarray, np.ndarray]:
    """float64 [V] x and y: leaves on consecutive columns in preorder, parents centred above."""
    f = plan.forest
    v = f.num_segments
    x = np.zeros(v)
    y = np.zeros(v)
    col = 0.0
    for t in range(f.num_trees):
        for u in f.tree_segments(t):  # preorder: parents first
            p = f.parent[u]
            y[u] = 0.0 if p < 0 else y[p] - 1.0
            if f.num_children[u] == 0:
                x[u] = col
                col += 1.0
        col += 0.5  # gap between trees
    for u in range(v - 1, -1, -1):  # children before parents
        ch = f.children(u)
        if ch.size:
            x[u] = 0.5 * (x[ch[0]] + x[ch[-1]])
    return x, y


def plot_plan(plan: CallPlan, out: str | Path, *, title: str | None = None, option: str = "--plot") -> None:
    """Write a figure of the segment tree and its plan to ``out`` (PNG, PDF or SVG, by suffix;
    atomically; ``option`` names it in an ``OutputPathError``)."""
    f = plan.forest
    if f.num_segments > MAX_SEGMENTS:
        raise UserError(f"{option} draws at most {MAX_SEGMENTS} segments; this plan has {f.num_segments}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, y = tree_coordinates(plan)
    width = max(6.0, 1.3 * (x.max() - x.min() + 1)) if x.size else 6.0
    height = max(3.0, 1.5 * (y.max() - y.min() + 1)) if y.size else 3.0
    fig, ax = plt.subplots(figsize=(min(width, 60.0), min(height, 40.0)))
    cmap = plt.get_cmap("tab10")
    rnd = plan.seg_round
    seg_seq = plan.seg_seq
    b = plan.chunk_size
    for u in range(f.num_segments):
        p = int(f.parent[u])
        if p < 0:
            continue
        direct = seg_seq[u] == seg_seq[p]
        ax.plot(
            [x[p], x[u]],
            [y[p], y[u]],
            color="black",
            linewidth=2.6 if direct else 1.0,
            linestyle="-" if direct else "--",
            zorder=1,
        )
        if not direct:
            ax.text(
                0.5 * (x[p] + x[u]),
                0.5 * (y[p] + y[u]),
                f"r={int(f.end[p] % b)}",
                fontsize=7,
                ha="center",
                va="center",
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"},
                zorder=2,
            )
    for u in range(f.num_segments):
        # opaque pastel fill so edges do not run through the labels
        fill = 0.35 * np.asarray(cmap(int(rnd[u]) % 10)[:3]) + 0.65
        ax.scatter([x[u]], [y[u]], s=1500, color=[fill], edgecolors="black", zorder=3)
        label = f"{f.name(u)}\n{int(f.end[u] - f.start[u])} tok\nCall {int(rnd[u]) + 1}"
        ax.text(x[u], y[u], label, fontsize=7, ha="center", va="center", zorder=4)
    ax.set_title(
        title
        or f"chunk_size={b}: {plan.num_calls} calls, R={plan.total_replay}\n"
        f"thick: direct continuation; dashed: new sequence, r = replay",
        fontsize=9,
    )
    ax.margins(0.08)
    ax.set_axis_off()
    fig.tight_layout()
    try:
        save_figure(fig, out, option=option, dpi=110)
    finally:
        plt.close(fig)
