"""``harts plot RUN_DIR [RUN_DIR ...]``: reward, KL and step time of online runs, as PNG.

Reads every run's ``metrics.jsonl`` (``harts demo`` writes one per step) and draws three panels
side by side, like the paper's Figure 5: the reward per step (faint) with its moving average
(``--window`` steps, solid), the KL to the reference policy, and the step time. Several runs
are overlaid, one colour each, labelled by their directory. The plotted numbers go to a JSON
file next to the PNG (``--json`` moves it). Needs matplotlib (``pip install harts[plot]``).
"""

from __future__ import annotations

import argparse

from harts.commands._inputs import add_output_arguments, positive_int

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "Plot reward (with moving average), KL and step time of one or more runs as PNG."

PANELS = (("reward", "reward"), ("kl", "KL to reference"), ("step_seconds", "step time (s)"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument("--out", default=None, metavar="PNG", help="output image (default: RUN_DIR/curves.png)")
    p.add_argument("--window", type=positive_int, default=5, help="moving-average window for the reward")
    add_output_arguments(p, what="the plotted series (default: next to the PNG)")


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over at most ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def run(args: argparse.Namespace) -> int:
    import os

    from harts.commands._inputs import check_output_file, write_json
    from harts.errors import UserError
    from harts.rl.metrics import read_metrics

    out = args.out or os.path.join(args.run_dirs[0], "curves.png")
    json_out = args.json_out or os.path.splitext(out)[0] + ".json"
    check_output_file(out, "--out", args.overwrite)
    check_output_file(json_out, "--json", args.overwrite)
    runs = {}
    for d in args.run_dirs:
        records = read_metrics(d)
        missing = [key for key, _ in PANELS if key not in records[0]]
        if missing:
            raise UserError(f"{d}: metrics.jsonl has no {', '.join(missing)} (not an online run?)")
        series = {key: [float(r[key]) for r in records] for key, _ in PANELS}
        series["step"] = [int(r["step"]) for r in records]
        series["reward_moving_average"] = moving_average(series["reward"], args.window)
        runs[os.path.normpath(d)] = series
    try:
        import matplotlib
    except ImportError:
        raise UserError("harts plot needs matplotlib: pip install 'harts[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for i, (label, s) in enumerate(runs.items()):
        color = f"C{i}"
        axes[0].plot(s["step"], s["reward"], color=color, alpha=0.3, linewidth=1)
        axes[0].plot(s["step"], s["reward_moving_average"], color=color, linewidth=2, label=label)
        axes[1].plot(s["step"], s["kl"], color=color, label=label)
        axes[2].plot(s["step"], s["step_seconds"], color=color, label=label)
    for ax, (_, title) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_title(f"reward ({args.window}-step moving average)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    write_json(json_out, {"window": args.window, "runs": runs})
    print(f"wrote {out} and {json_out}")
    return 0
