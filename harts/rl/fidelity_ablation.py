"""Replay ablation by state-handoff depth (paper §5.4: Table 5, Figure 4).

The same weights and microbatches run through four paths, per recomputation setting:

    baseline_a   trajectory-wise (the common reference)
    baseline_b   trajectory-wise again: on a GPU its run-to-run variation is the noise floor
    replay       compact, as harts ships it (side branches replay from the chunk anchor)
    no_replay    compact with ``no_replay=True`` (side branches start from the fork's state)

Every path is compared with baseline_a of the same recomputation setting (the paper's
"matched baseline"): per token the full-vocabulary symmetric KL (Eq. 25), |delta NLL|
(Eq. 26) and logit cosine (Eq. 27), averaged per state-handoff depth d (``handoff_depth``,
buckets 0..max_depth-1 and max_depth+) and over all tokens (Table 5's MeanCos); the GRPO loss
difference and every parameter gradient's cosine. The same averages are also kept by
``imported_state_depth`` (sequences started from an exported state), the handoffs that
replay and no-replay execute differently.

The GRPO loss of every path takes Baseline A's own log-probs (one extra no-grad forward) as
its old log-probs (``on_policy``): the ratio exp(lp - lp_old) is then 1 for Baseline A, every
action token carries gradient (a synthetic batch's random old log-probs would clip nearly all
of them), and |loss_X - loss_A| measures the paths' log-prob deviation through the policy loss.

On one GPU a rerun can be bit-identical, leaving no noise to compare with; with a
``reference`` model (the same weights in float32 / float64) every path, Baseline A included,
is also compared with the reference's Baseline A, and Replay's error is judged against
Baseline A's own (``vs_reference``).

``choose_microbatches`` picks microbatches so that every depth bucket present in the step is
covered first; ``measure`` runs them; ``plot_depth`` draws Figure 4.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import HybridLM
from harts.plan.calls import CallPlan
from harts.plan.depth import handoff_depth, imported_state_depth
from harts.rl.fidelity import TOKEN_METRICS, PathRun, gradient_cosines, run_path, token_errors
from harts.rl.verify import compare_runs
from harts.tree.compact import CompactBatch

__all__ = ["PATHS", "choose_microbatches", "depth_buckets", "measure", "on_policy", "path_configs", "plot_depth"]

#: every path, the reference first
PATHS = ("baseline_a", "baseline_b", "replay", "no_replay")
#: the per-depth breakdowns: the paper's logical depth, and the handoffs the plan executes
AXES = ("handoff_depth", "imported_states")


def depth_buckets(depth: np.ndarray, max_depth: int) -> np.ndarray:
    """int64: ``depth`` with every value >= ``max_depth`` in one last bucket ``max_depth``."""
    return np.minimum(np.asarray(depth, dtype=np.int64), max_depth)


def bucket_labels(max_depth: int) -> list[str]:
    return [str(d) for d in range(max_depth)] + [f"{max_depth}+"]


def path_configs(base: ExecutionConfig, recompute: bool) -> dict[str, ExecutionConfig]:
    """The four paths of one recomputation setting; log-probs are chunked in every path (a
    trajectory-wise [S, V] logit block would not fit at a 157 k vocabulary)."""
    traj = replace(base, mode="trajectory", recompute=recompute, no_replay=False, fused_logprobs=True)
    return {
        "baseline_a": traj,
        "baseline_b": traj,
        "replay": replace(traj, mode="compact"),
        "no_replay": replace(traj, mode="compact", no_replay=True),
    }


def choose_microbatches(depths: Sequence[np.ndarray], limit: int | None, max_depth: int) -> list[int]:
    """Indices of the microbatches to run, at most ``limit`` (None: all).

    ``depths[k]`` is microbatch k's ``handoff_depth``. Deepest bucket first, each bucket that no
    chosen microbatch covers yet takes the unchosen microbatch with the most tokens in it; the
    rest follow in plan order.
    """
    hist = np.stack([np.bincount(depth_buckets(d, max_depth), minlength=max_depth + 1) for d in depths])
    chosen: list[int] = []
    for b in range(max_depth, -1, -1):
        if hist[:, b].max() == 0 or any(hist[k, b] for k in chosen):
            continue
        free = [k for k in range(len(depths)) if k not in chosen]
        chosen.append(max(free, key=lambda k: hist[k, b]))
    chosen += [k for k in range(len(depths)) if k not in chosen]
    return chosen if limit is None else chosen[:limit]


def on_policy(model: HybridLM, cb: CompactBatch, base: ExecutionConfig) -> CompactBatch:
    """``cb`` with its batch's old log-probs replaced by Baseline A's (trajectory-wise, no grad)."""
    batch = cb.batch
    with torch.no_grad():
        lp = model(
            batch, replace(base, mode="trajectory", recompute=False, no_replay=False, fused_logprobs=True)
        ).logprobs
    old = np.zeros(batch.num_tokens)
    old[batch.predicting_positions() + 1] = lp.double().cpu().numpy()  # entry 0 of a trajectory is unused
    return replace(cb, batch=replace(batch, old_logprobs=old))


def _param_group(name: str) -> str:
    """``layers.3.linear_attn.q_proj.weight`` -> ``linear_attn``; ``embed_tokens.weight`` -> ``embed_tokens``."""
    parts = name.split(".")
    return parts[2] if parts[0] == "layers" and len(parts) > 2 else parts[0]


class _Sums:
    """Per-bucket token counts and metric sums of the compared ``paths`` on one depth axis, and
    their ratios to the ``noise`` path."""

    def __init__(self, buckets: int, paths: Sequence[str] = PATHS[1:], noise: str = "baseline_b") -> None:
        self.noise = noise
        self.tokens = np.zeros(buckets, dtype=np.int64)
        self.sums = {p: {m: np.zeros(buckets) for m in TOKEN_METRICS} for p in paths}

    def add_tokens(self, bucket: np.ndarray) -> None:
        self.tokens += np.bincount(bucket, minlength=self.tokens.size)

    def add(self, path: str, bucket: np.ndarray, errors: dict[str, np.ndarray]) -> None:
        for m, v in errors.items():
            self.sums[path][m] += np.bincount(bucket, weights=v, minlength=self.tokens.size)

    def mean_cos(self) -> dict[str, float]:
        """Eq. 27 over every token of every bucket."""
        n = max(int(self.tokens.sum()), 1)
        return {p: float(ms["cos"].sum() / n) for p, ms in self.sums.items()}

    def record(self, labels: list[str]) -> dict[str, Any]:
        n = np.maximum(self.tokens, 1)
        means = {p: {m: (s / n).tolist() for m, s in ms.items()} for p, ms in self.sums.items()}
        b = self.sums[self.noise]
        # None where the noise path equals the reference exactly (Baseline B on a deterministic
        # device): no noise to compare with
        ratio = {
            p: {
                m: [float(x / y) if y > 0 else None for x, y in zip(self.sums[p][m], b[m])]
                for m in ("sym_kl", "abs_dnll")
            }
            for p in self.sums
            if p != self.noise
        }
        return {"buckets": labels, "tokens": self.tokens.tolist(), "mean": means, f"ratio_to_{self.noise}": ratio}


class _Setting:
    """Everything one recomputation setting accumulates over microbatches."""

    def __init__(self, buckets: int, reference: bool) -> None:
        self.axes = {a: _Sums(buckets) for a in AXES}
        #: every path (Baseline A too) against the higher-precision reference, if any
        self.hi = {a: _Sums(buckets, PATHS, noise="baseline_a") for a in AXES} if reference else None
        self.loss_a: list[float] = []
        self.loss_diff: dict[str, list[float]] = {p: [] for p in PATHS[1:]}
        self.grad_cos: dict[str, dict[str, list[float]]] = {p: {} for p in PATHS[1:]}
        self.rel: dict[str, dict[str, float]] = {p: {} for p in PATHS[1:]}

    def add(
        self, name: str, ref: PathRun, run: PathRun, buckets: dict[str, np.ndarray], errors: dict[str, np.ndarray]
    ) -> None:
        for a in AXES:
            self.axes[a].add(name, buckets[a], errors)
        self.loss_diff[name].append(abs(run.step.loss - ref.step.loss))
        for pname, c in gradient_cosines(ref.step.grads, run.step.grads).items():
            self.grad_cos[name].setdefault(pname, []).append(c)
        for key, v in compare_runs(ref.step, run.step).items():
            self.rel[name][key] = max(self.rel[name].get(key, 0.0), v)

    def _gradients(self, path: str) -> dict[str, Any]:
        per_param = self.grad_cos[path]
        groups: dict[str, list[float]] = {}
        for pname, cs in per_param.items():
            groups.setdefault(_param_group(pname), []).extend(cs)
        every = [c for cs in per_param.values() for c in cs]
        return {
            "min": float(np.min(every)) if every else float("nan"),
            "median": float(np.median(every)) if every else float("nan"),
            "groups": {g: {"min": float(np.min(v)), "median": float(np.median(v))} for g, v in sorted(groups.items())},
        }

    def record(self, labels: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.hi is not None:
            out["vs_reference"] = {
                **{a: s.record(labels) for a, s in self.hi.items()},
                "mean_cos": self.hi["handoff_depth"].mean_cos(),
            }
        return {
            **{a: s.record(labels) for a, s in self.axes.items()},
            "mean_cos": self.axes["handoff_depth"].mean_cos(),
            **out,
            "loss": {"baseline_a": self.loss_a, "abs_diff": self.loss_diff},
            "gradient_cos": {p: self._gradients(p) for p in PATHS[1:]},
            "max_rel_diff": self.rel,
        }


def measure(
    model: HybridLM,
    microbatches: Sequence[tuple[CompactBatch, CallPlan]],
    base: ExecutionConfig,
    *,
    recompute: Sequence[bool] = (False, True),
    max_depth: int = 6,
    chunk_rows: int = 1024,
    on_path: Callable[[str], None] | None = None,
    old_logprobs: str = "baseline",
    reference: HybridLM | None = None,
) -> dict[str, Any]:
    """Run every microbatch through the four paths of each ``recompute`` setting; a JSON record.

    ``base`` gives attention and the linear-attention backend (mode, recompute and no_replay
    are set per path). ``old_logprobs``: "baseline" (``on_policy``, module docstring) or "batch"
    (the batch's own). ``reference``: the same weights in a higher precision; its Baseline A
    becomes a second reference for every path (``vs_reference``: err(X, A_hi) and ratios to
    err(A, A_hi), the flash-attention way of judging a low-precision result when reruns are
    bit-identical). ``on_path(name)`` is called after each path's step. Record layout::

        microbatches: [{trajectories, S, C, calls, calls_no_replay, replay_rows, tokens_by_depth}]
        settings: {"recompute=False": {handoff_depth: {buckets, tokens, mean: {path: {metric:
                   [per bucket]}}, ratio_to_baseline_b}, imported_states: (same), mean_cos: {path},
                   loss: {baseline_a: [per mb], abs_diff: {path: [per mb]}}, gradient_cos:
                   {path: {min, median, groups: {group: {min, median}}}}, max_rel_diff: {path: {...}},
                   vs_reference (with ``reference``): {handoff_depth, imported_states (every path,
                   ratio_to_baseline_a), mean_cos}}}
    """
    labels = bucket_labels(max_depth)
    mb_info: list[dict[str, Any]] = []
    state = {r: _Setting(max_depth + 1, reference is not None) for r in recompute}
    head = model.lm_head_weight
    if old_logprobs not in ("baseline", "batch"):
        raise ValueError(f"old_logprobs must be 'baseline' or 'batch', got {old_logprobs!r}")
    for cb, plan in microbatches:
        if old_logprobs == "baseline":
            cb = on_policy(model, cb, base)
        inputs = {
            False: model.prepare_compact(cb, ExecutionConfig(no_replay=False), plan=plan),
            True: model.prepare_compact(cb, ExecutionConfig(no_replay=True), plan=plan),
        }
        pred = cb.batch.predicting_positions()
        targets = cb.batch.next_token_targets()
        buckets = {
            "handoff_depth": depth_buckets(handoff_depth(cb)[pred], max_depth),
            "imported_states": depth_buckets(imported_state_depth(cb, plan)[pred], max_depth),
        }
        info: dict[str, Any] = {
            "trajectories": cb.num_trajectories,
            "S": cb.num_semantic_tokens,
            "C": cb.num_compact_tokens,
            "tokens_by_depth": np.bincount(buckets["handoff_depth"], minlength=max_depth + 1).tolist(),
        }
        for r in recompute:
            st = state[r]
            configs = path_configs(base, r)
            for a in AXES:
                st.axes[a].add_tokens(buckets[a])
            hi: PathRun | None = None
            if reference is not None and st.hi is not None:
                hi = run_path(reference, inputs[False], configs["baseline_a"])
                for a in AXES:
                    st.hi[a].add_tokens(buckets[a])
            ref: PathRun | None = None
            for name, cfg in configs.items():
                run = run_path(model, inputs[cfg.no_replay], cfg)
                if hi is not None and st.hi is not None:
                    assert reference is not None
                    e = token_errors(
                        hi, run, head, targets, chunk_rows=chunk_rows, ref_head_VD=reference.lm_head_weight
                    )
                    for a in AXES:
                        st.hi[a].add(name, buckets[a], e)
                if name == "replay":
                    info.update(calls=run.step.info["calls"], replay_rows=run.step.info["replay_rows"])
                elif name == "no_replay":
                    info["calls_no_replay"] = run.step.info["calls"]
                if ref is None:
                    ref = run
                    st.loss_a.append(run.step.loss)
                else:
                    st.add(name, ref, run, buckets, token_errors(ref, run, head, targets, chunk_rows=chunk_rows))
                del run
                if on_path is not None:
                    on_path(name)
            del ref, hi
        mb_info.append(info)
    settings = {f"recompute={r}": st.record(labels) for r, st in state.items()}
    return {"buckets": labels, "microbatches": mb_info, "settings": settings}


def plot_depth(record: dict[str, Any], setting: str, path: str | Path) -> None:
    """Figure 4: mean symmetric KL and mean |delta NLL| by handoff depth, one line per path
    against baseline A (log scale), and token counts under the axis. The noise floor: Baseline B
    where a rerun differs (with No-replay's excess over B on the right axis, dashed); where B is
    bit-identical to A, Baseline A against the higher-precision reference (``--reference-dtype``,
    dotted) if the record has one. Written to ``path`` (PNG, PDF or SVG; atomically,
    ``harts.outputs.save_figure``)."""
    import matplotlib

    from harts.outputs import save_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = record["settings"][setting]["handoff_depth"]
    hi = record["settings"][setting].get("vs_reference", {}).get("handoff_depth")
    keep = [i for i, n in enumerate(rec["tokens"]) if n > 0]
    x = np.arange(len(keep))
    labels = [f"d={rec['buckets'][i]}\nn={rec['tokens'][i]:,}" for i in keep]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {
        "baseline_b": ("Baseline B vs A", "tab:blue"),
        "replay": ("Replay vs A", "tab:green"),
        "no_replay": ("No-replay vs A", "tab:red"),
    }
    for ax, metric, title in zip(
        axes, ("sym_kl", "abs_dnll"), ("(a) Full-token SymKL (Eq. 25)", "(b) Mean |ΔNLL| (Eq. 26)")
    ):
        b_is_a = not np.asarray(rec["mean"]["baseline_b"][metric])[keep].any()
        for p, (label, color) in styles.items():
            y = np.asarray(rec["mean"][p][metric])[keep]
            if p == "baseline_b" and b_is_a:
                label += " (bit-identical: 0)"
            ax.plot(x, np.where(y > 0, y, np.nan), marker="o", color=color, label=label)
        if b_is_a and hi is not None:
            y = np.asarray(hi["mean"]["baseline_a"][metric])[keep]
            ref = record.get("reference_dtype") or "reference"
            ax.plot(
                x, np.where(y > 0, y, np.nan), linestyle=":", marker=".", color="black", label=f"Baseline A vs {ref}"
            )
        if any(np.asarray(rec["mean"][p][metric])[keep].max() > 0 for p in styles):
            ax.set_yscale("log")
        handles, names = ax.get_legend_handles_labels()
        if not b_is_a:
            ratio = np.array([np.nan if r is None else r for r in rec["ratio_to_baseline_b"]["no_replay"][metric]])
            twin = ax.twinx()
            twin.plot(
                x, (ratio[keep] - 1.0) * 100.0, linestyle="--", color="tab:orange", label="No-replay excess over B"
            )
            twin.set_ylabel("No-replay vs B (%)")
            more = twin.get_legend_handles_labels()
            handles, names = handles + more[0], names + more[1]
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_xlabel("state-handoff depth d")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(handles, names, fontsize=8)
    fig.suptitle(f"Replay fidelity by state-handoff depth ({setting})")
    fig.tight_layout()
    try:
        save_figure(fig, path, option="--plot", dpi=120)
    finally:
        plt.close(fig)
