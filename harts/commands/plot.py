"""``harts plot RUN_DIR [RUN_DIR ...]``: the per-step curves of online and training runs, as PNG.

Reads every run's ``metrics.jsonl`` and draws its panels side by side. An online run (``harts
demo``) gets the paper's Figure 5: the reward per step (faint) with its moving average
(``--window`` steps, solid), the KL to the reference policy, and the step time. A training run
(``harts train --run-dir``; its records carry the learning rate) gets the loss the same way
(faint, with its moving average), the gradient norm, the compression and the step time, and the
reward first where every step's batch carried rewards. Several runs of one kind are overlaid,
one colour each, labelled by their directory. The plotted numbers go to a JSON file next to the
PNG (``--json`` moves it). Needs matplotlib (``pip install harts[plot]``).
"""

from __future__ import annotations

import argparse
from typing import Any

from harts.commands._inputs import add_output_arguments, positive_int

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "Plot the per-step curves (reward or loss with moving average, ...) of one or more runs as PNG."

#: an online run's panels (key, title); the first is drawn with its moving average
PANELS = (("reward", "reward"), ("kl", "KL to reference"), ("step_seconds", "step time (s)"))
#: a training run's panels; "reward" goes first where every record has one
TRAIN_PANELS = (
    ("loss", "loss"),
    ("grad_norm", "gradient norm"),
    ("compression", "compression (raw / computed tokens)"),
    ("step_seconds", "step time (s)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="output image, .png, .pdf or .svg (default: RUN_DIR/curves.png); a device or pipe "
        "(/dev/stdout) gets a PNG",
    )
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


def run_panels(records: dict[str, list[dict[str, Any]]]) -> tuple[tuple[str, str], ...]:
    """The panels of ``records`` (run directory -> its metrics records): a training run's (its
    records have "lr") or an online run's; UserError for runs of both kinds or a missing field."""
    from harts.errors import UserError

    kinds = {d: "train" if "lr" in recs[0] else "online" for d, recs in records.items()}
    if len(set(kinds.values())) > 1:
        train = next(d for d, k in kinds.items() if k == "train")
        online = next(d for d, k in kinds.items() if k == "online")
        raise UserError(f"{train} is a training run and {online} an online run: plot them separately")
    panels: tuple[tuple[str, str], ...] = PANELS
    if "train" in kinds.values():
        with_reward = all(r.get("reward") is not None for recs in records.values() for r in recs)
        panels = ((("reward", "reward"),) if with_reward else ()) + TRAIN_PANELS
    for d, recs in records.items():
        for i, r in enumerate(recs):
            missing = [key for key, _ in panels if key not in r]
            if missing:
                kind = "a training" if kinds[d] == "train" else "an online"
                raise UserError(f"{d}: metrics.jsonl record {i} has no {', '.join(missing)} (not {kind} run?)")
    return panels


def run(args: argparse.Namespace) -> int:
    import os

    from harts.errors import UserError
    from harts.outputs import PLOT_FORMATS, check_output_file, save_figure, special_file, write_json
    from harts.rl.metrics import read_metrics

    out = args.out or os.path.join(args.run_dirs[0], "curves.png")
    check_output_file(out, "--out", args.overwrite, formats=PLOT_FORMATS)
    # beside a figure written to a device or pipe (/dev/stdout) there is no place for the JSON
    json_out = args.json_out or (None if special_file(out) else os.path.splitext(out)[0] + ".json")
    check_output_file(json_out, "--json", args.overwrite)
    records = {os.path.normpath(d): read_metrics(d) for d in args.run_dirs}
    panels = run_panels(records)
    first = panels[0][0]
    runs = {}
    for d, recs in records.items():
        series = {key: [float(r[key]) for r in recs] for key, _ in panels}
        series["step"] = [int(r["step"]) for r in recs]
        series[f"{first}_moving_average"] = moving_average(series[first], args.window)
        runs[d] = series
    try:
        import matplotlib
    except ImportError:
        raise UserError("harts plot needs matplotlib: pip install 'harts[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for i, (label, s) in enumerate(runs.items()):
        color = f"C{i}"
        axes[0].plot(s["step"], s[first], color=color, alpha=0.3, linewidth=1)
        axes[0].plot(s["step"], s[f"{first}_moving_average"], color=color, linewidth=2, label=label)
        for ax, (key, _) in zip(axes[1:], panels[1:]):
            ax.plot(s["step"], s[key], color=color, label=label)
    for ax, (_, title) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{panels[0][1]} ({args.window}-step moving average)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    try:
        save_figure(fig, out, option="--out", dpi=110)
    finally:
        plt.close(fig)
    if json_out:
        write_json(json_out, {"window": args.window, "runs": runs})
    if not special_file(out):  # a figure on stdout gets no text after it
        print(f"wrote {out}" + (f" and {json_out}" if json_out else ""))
    return 0
