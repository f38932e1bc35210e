"""``harts demo``: online GRPO on the built-in tool task, a tiny hybrid model learning on a CPU.

A tiny hybrid LM (KDA + GDN + MLA + gated attention, MoE FFNs) samples rollout trees on
``ToolLookup`` (call the tool with the key asked for, read its output, answer from it; forks
at turn boundaries, retries after tool errors), then trains on them with GRPO in compact mode.
Every step prints reward, success, KL to the initial weights, KL from the sampler's log-probs,
clip fraction, entropy, compression (raw / compact tokens), the sampler-vs-trainer log-prob gap,
the loss (with a note, once, on why it stays near 0), the gradient norm, step time and tokens/s;
``RUN_DIR/metrics.jsonl`` gets the same per step (TensorBoard too with ``--tensorboard``). The
closing note compares the first and last steps' rewards with chance.

``--mode both`` runs the same seed compactly and trajectory-wise (``RUN_DIR/compact`` and
``RUN_DIR/trajectory``) and prints how far their losses and rewards differ: sampling depends
only on the seed and the weights, so the two runs see the same trees; in ``--dtype float64``
they agree to rounding. ``harts plot RUN_DIR/*`` draws the curves.

Checkpoints (``harts.parallel.checkpoint``, in ``RUN_DIR/checkpoints``, per mode with ``--mode
both``): one at the end of the run, one when SIGINT (Ctrl-C) or SIGTERM stops it (after the last
completed step; exit status 130 / 143), one when a step fails (then the error is reported), and
one every ``--save-every N`` steps if asked (default: none in between -- the three cases above
keep every completed step, only a SIGKILL or a power cut would lose them; a checkpoint of the
tiny model takes ~80 ms, a default step ~0.5 s, both on one CPU thread). Each holds the model, the
optimizer, the step, the RNG states and the online state (task and sampler generators,
per-step history, the reference weights), in JSON and tensor files (no pickle: a checkpoint from
elsewhere cannot run code when loaded), written aside and renamed. The demo's model is the
built-in tiny preset, which has no transformers architecture, so a checkpoint has no ``hf/``
part. A step that is interrupted or fails halfway (after some of its ``--updates``) is undone
first: each step starts from an in-memory copy of the tiny model and optimizer (~6 ms).

``--resume RUN_DIR`` continues such a run up to ``--steps`` (which may be more than before):
the flags that shape the run (seed, tasks, sampling, updates, lr, KL, dtype, mode) must be
those it was started with -- the error names the flag that differs -- and ``metrics.jsonl``
continues after the checkpoint's step (rows of steps after it, from a run that died after
saving, are dropped and computed again). The resumed run equals the uninterrupted one (the
same per-step records and final weights; bitwise on the CPU). The summary covers every step;
its ``seconds`` are this command's. A damaged checkpoint file is an error naming it and the
checkpoint before it; ``--resume auto`` continues ``--run-dir`` (default ``runs/demo``) from its
newest checkpoint that loads, or starts the run there when it has none
(``harts.commands._resume``).

An existing non-empty RUN_DIR is an error unless ``--overwrite`` (a new run there also drops the
old run's checkpoints).

``--config FILE`` reads the flags from a TOML file (``harts.commands._config``): the schema's
sections for the options every command shares (``[execution] mode``, ``[optimizer] lr``,
``[outputs] run_dir``...) and ``[demo]`` for the demo's own (``tasks = 8``); each step's
``ExecutionConfig`` is the schema's (``harts.trainer.options.execution_config``).
"""

from __future__ import annotations

import argparse
from typing import Any

from harts.commands._config import add_config_argument
from harts.commands._inputs import (
    add_option,
    add_output_arguments,
    positive_float,
    positive_int,
)
from harts.commands._memory import add_force_argument
from harts.commands._runs import Interrupted, Signals, check_run_dir

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

DEFAULT_RUN_DIR = "runs/demo"

HELP = "Online GRPO on a built-in tool-use task: a tiny hybrid model learns on the CPU in minutes."

#: the per-step table: (header, record key, format)
COLUMNS = (
    ("step", "step", "{:>4d}"),
    ("reward", "reward", "{:>6.3f}"),
    ("success", "success", "{:>7.3f}"),
    ("kl", "kl", "{:>6.3f}"),
    ("kl-sampler", "kl_sampler", "{:>10.4f}"),
    ("clip", "clip_frac", "{:>5.3f}"),
    ("entropy", "entropy", "{:>7.3f}"),
    ("compress", "compression", "{:>7.2f}x"),
    ("mismatch", "mismatch", "{:>8.1e}"),
    ("loss", "loss", "{:>7.4f}"),
    ("grad-norm", "grad_norm", "{:>9.4f}"),
    ("step_s", "step_seconds", "{:>6.2f}"),
    ("tok/s", "tokens_per_second", "{:>6.0f}"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_option(
        p, "run_dir", help=f"where metrics.jsonl, the checkpoints and the summary go (default {DEFAULT_RUN_DIR})"
    )
    add_option(p, "steps", default=60, help="online steps (sample, then train)")
    # both: not an execution mode, the demo's two runs side by side
    add_option(
        p,
        "mode",
        choices=("compact", "trajectory", "both"),
        help="compact (harts), trajectory (the baseline) or both, same seed, side by side",
    )
    add_option(p, "seed", help="model init, tasks and sampling")
    p.add_argument("--tasks", type=positive_int, default=32, help="episodes (rollout trees) per step")
    p.add_argument("--group-size", type=positive_int, default=4, help="first turns sampled per task")
    p.add_argument("--fork-width", type=positive_int, default=2, help="branches at each later turn boundary")
    p.add_argument("--max-leaves", type=positive_int, default=8, help="paths per task at most")
    p.add_argument("--updates", type=positive_int, default=2, help="optimizer updates per step")
    add_option(p, "lr", default=3e-3)
    add_option(p, "kl_coef", help="k3 KL penalty to the initial weights")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature")
    add_option(p, "dtype")
    add_option(p, "device", help="torch device (sampling and training)")
    # torch.set_num_threads directly: 0 (torch's choice) is not taken
    add_option(
        p,
        "threads",
        type=positive_int,
        help="CPU threads for torch (a tiny model gains nothing from more, and on a busy machine "
        "oversubscribed threads make every step many times slower)",
    )
    add_option(p, "tensorboard", help="also log to RUN_DIR/tensorboard (if installed)")
    add_option(
        p,
        "save_every",
        help="also checkpoint every N steps (always: at the end, on Ctrl-C / SIGTERM, when a step fails)",
    )
    add_option(
        p,
        "resume",
        help="continue the run in RUN_DIR from its latest checkpoint, up to --steps (same flags otherwise); "
        "auto: continue --run-dir from its newest checkpoint that loads (damaged newer ones are passed over), "
        "or start it there when it has none",
    )
    add_force_argument(p)
    add_output_arguments(p, what="the summary")
    add_config_argument(p)


def run(args: argparse.Namespace) -> int:
    signals = Signals()
    signals.install()
    try:
        return _run(args, signals)
    except Interrupted as err:
        import signal
        import sys

        if not getattr(err, "reported", False):
            name = signal.Signals(err.signum).name
            print(f"harts: interrupted by {name} before the first step completed", file=sys.stderr, flush=True)
        return 128 + err.signum
    finally:
        signals.restore()


def _run(args: argparse.Namespace, signals: Signals) -> int:
    import os

    from harts.commands._inputs import check_device, write_json
    from harts.commands._resume import resolve_resume
    from harts.errors import UserError

    if args.updates > args.tasks:
        raise UserError(f"--updates {args.updates}: at most --tasks ({args.tasks}) updates per step")
    subdirs = ("compact", "trajectory") if args.mode == "both" else ("",)
    resolve_resume(args, subdirs, DEFAULT_RUN_DIR)
    if args.run_dir is None and args.resume is None:
        args.run_dir = DEFAULT_RUN_DIR
    _refuse_second_run(args, subdirs)
    check_run_dir(args, subdirs)
    root = args.resume or args.run_dir
    check_device(args.device)
    if args.tensorboard:
        import sys

        from harts.rl.metrics import tensorboard_available

        if not tensorboard_available():
            print(
                "harts: warning: --tensorboard: torch.utils.tensorboard does not import here (pip install "
                "tensorboard); the metrics go to metrics.jsonl only",
                file=sys.stderr,
            )
    modes = ["compact", "trajectory"] if args.mode == "both" else [args.mode]
    summaries = {}
    for mode in modes:
        run_dir = os.path.join(root, mode) if args.mode == "both" else root
        summaries[mode] = _train(args, mode, run_dir, signals)
    summary: dict[str, Any] = summaries[modes[0]] if len(modes) == 1 else {"runs": summaries}
    if len(modes) == 2:
        diff = summary["compact_vs_trajectory"] = _compare(summaries["compact"], summaries["trajectory"])
        same = diff["steps_with_equal_rewards"]
        print(
            f"compact vs trajectory, seed {args.seed} ({args.dtype}): the same rewards for {same} of {args.steps} steps",
            end="",
        )
        if same:
            print(
                f"; loss difference {diff['loss_diff_step0']:.1e} at step 0, at most "
                f"{diff['max_loss_diff_while_equal']:.1e} over those steps (rounding, which training amplifies)",
                end="",
            )
        print()
    write_json(os.path.join(root, "summary.json"), summary)
    if args.json_out:
        write_json(args.json_out, summary)
    return 0


def _identity(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The flags a resumed run must share with the run it continues (keys are flag names)."""
    flags = ("seed", "tasks", "group_size", "fork_width", "max_leaves", "updates", "lr", "kl_coef", "temperature")
    return {"mode": mode, "dtype": args.dtype} | {f.replace("_", "-"): getattr(args, f) for f in flags}


def _train(args: argparse.Namespace, mode: str, run_dir: str, signals: Signals) -> dict[str, Any]:
    import sys
    import time

    with signals.window():
        from tqdm import tqdm

        from harts.commands._progress import progress
        from harts.envs import ToolLookup
        from harts.rl.metrics import MetricsWriter

        t_start = time.perf_counter()
        env = ToolLookup()
        model, trainer = _trainer(args, mode, env.vocab_size)
        identity = _identity(args, mode)
        found = _resume_or_start(args, run_dir, model, trainer, identity)
    start = trainer.state.step
    saved = {"step": start if found is not None else -1}

    def save() -> None:
        from harts.parallel.checkpoint import save_checkpoint

        done = trainer.state.step
        if done == saved["step"] or done == 0:
            return
        path = save_checkpoint(
            run_dir,
            step=done,
            model=model,
            optimizer=trainer.optimizer,
            data_state={"next_step": done, "online": trainer.state_dict()},
            extra={"command": "demo", **identity},
        )
        saved["step"] = done
        print(f"checkpoint {path}", file=sys.stderr, flush=True)

    print(
        f"harts demo ({mode}): {model.num_parameters():,}-parameter {model.config.layer_pattern} model "
        f"({args.dtype}, {args.device}), ToolLookup, {args.tasks} tasks x {args.group_size} samples per step, "
        f"chance reward {env.chance_reward():.3f}"
    )
    if found is not None:
        left = f"steps {start}..{args.steps - 1} to go" if start < args.steps else "no step left"
        print(f"resumed {run_dir} after step {start - 1}; {left}")
    if mode == modes_first(args):
        print(f"harts: note: {FLAT_LOSS_NOTE}", flush=True)
    header = "  ".join(f"{h:>{len(fmt.format(0))}}" for h, _, fmt in COLUMNS)
    print(header, flush=True)
    try:
        with MetricsWriter(run_dir, tensorboard=args.tensorboard) as writer:
            bar = progress(args.steps, f"demo {mode}", "step")
            with bar:
                bar.update(start)
                for _ in range(start, args.steps):
                    snap = trainer.snapshot()
                    try:
                        with signals.window():
                            record = trainer.step(progress=lambda phase: bar.set_postfix_str(phase, refresh=False))
                    except BaseException:
                        trainer.restore(snap)  # undo a step stopped halfway (after some updates)
                        raise
                    record["mode"] = mode
                    writer.write(record)
                    bar.update(1)
                    # tqdm.write keeps a terminal's bar below the table rows
                    tqdm.write("  ".join(fmt.format(record[key]) for _, key, fmt in COLUMNS), file=sys.stdout)
                    sys.stdout.flush()  # a row per step also through a pipe (tee, a log file)
                    if args.save_every and trainer.state.step % args.save_every == 0:
                        save()
                with signals.window():
                    pass  # a signal during the last step's bookkeeping
    except Interrupted as err:
        signals.restore()  # a second signal aborts at once
        _stopped(trainer.state.step, save, f"interrupted by {_signal_name(err.signum)}", args)
        err.reported = True  # type: ignore[attr-defined]
        raise
    except Exception as err:
        _stopped(trainer.state.step, save, f"step {trainer.state.step} failed ({type(err).__name__})", args)
        raise
    save()
    return _summary(args, mode, trainer, env, run_dir, time.perf_counter() - t_start)


#: why the demo's loss column hovers near 0 while the policy learns (printed once, above the table)
FLAT_LOSS_NOTE = (
    "the loss is GRPO's surrogate near the sampled weights, about -(mean advantage), which is 0 for "
    "group-normalized advantages: it does not track learning; reward, kl (to the initial weights), kl-sampler "
    "(from the sampler's log-probs, 0 at each step's first update), entropy and grad-norm do"
)


def modes_first(args: argparse.Namespace) -> str:
    """The first mode ``args`` runs (the flat-loss note is printed above its table only)."""
    return "compact" if args.mode == "both" else str(args.mode)


def _trainer(args: argparse.Namespace, mode: str, vocab_size: int) -> tuple[Any, Any]:
    """The tiny model (seeded) and its online trainer for ``mode``."""
    import torch

    from harts.commands._inputs import execution_config
    from harts.commands._memory import check_memory
    from harts.envs import ToolLookup
    from harts.models.config import HybridConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.rollout.collect import RolloutConfig
    from harts.trainer.build import ModelSpec
    from harts.trainer.online import OnlineConfig, OnlineTrainer
    from harts.trainer.step import TrainConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    spec = ModelSpec(model="tiny", dtype=args.dtype, device=args.device)
    check_memory(spec, vocab_size, capacity=TrainConfig.capacity, force=args.force)
    model = HybridLM(HybridConfig.tiny(vocab_size=vocab_size, dtype=args.dtype)).to(args.device)
    cfg = OnlineConfig(
        rollout=RolloutConfig(
            tasks=args.tasks,
            group_size=args.group_size,
            fork_width=args.fork_width,
            max_leaves=args.max_leaves,
            temperature=args.temperature,
        ),
        # one attention call per branch: the tiny model's head dims (8, 12) are below the
        # minimum (16) of FlexAttention, which the tree-mask path uses on CUDA
        train=TrainConfig(
            lr=args.lr, kl_coef=args.kl_coef, execution=execution_config(args, mode=mode, attention="gather")
        ),
        updates=args.updates,
        seed=args.seed,
    )
    return model, OnlineTrainer(model, ToolLookup, cfg)


def _refuse_second_run(args: argparse.Namespace, subdirs: tuple[str, ...]) -> None:
    """``refuse_second_run`` with the flags a demo run is continued with."""
    from harts.commands._resume import refuse_second_run

    where = "" if args.run_dir == DEFAULT_RUN_DIR else f" --run-dir {args.run_dir}"
    mode = f" --mode {args.mode}" if args.mode != "compact" else ""
    refuse_second_run(args, "demo", where + mode, subdirs)


def _resume_or_start(
    args: argparse.Namespace,
    run_dir: str,
    model: Any,
    trainer: Any,
    identity: dict[str, Any],  # noqa: ANN401
) -> Any:  # noqa: ANN401
    """Load the newest checkpoint of ``run_dir`` when resuming (returns it), else clear the
    run directory's metrics and checkpoints for a new run (returns None)."""
    import os
    import shutil
    import sys

    from harts.commands._resume import check_resumed_run
    from harts.errors import UserError
    from harts.parallel.checkpoint import latest_checkpoint, load_checkpoint
    from harts.rl.metrics import METRICS_FILE, truncate_metrics

    found = latest_checkpoint(run_dir) if args.resume else None
    if found is not None:
        # the flags are checked on meta.json before any weights are read: weights of another
        # dtype would not even load
        got = load_checkpoint(
            run_dir,
            model=model,
            optimizer=trainer.optimizer,
            fallback=args.resume_auto,
            check=lambda saved: check_resumed_run(args.resume, saved.path, saved.extra, "demo", identity),
        )
        for line in got.skipped:
            print(f"harts: warning: {line}", file=sys.stderr, flush=True)
        if got.step > args.steps:
            raise UserError(
                f"--resume {args.resume}: it completed {got.step} steps, more than the {args.steps} asked for"
            )
        trainer.load_state_dict(got.data_state["online"])
        truncate_metrics(run_dir, got.step)
    else:
        # a new run (--overwrite was checked for the whole run dir): start its metrics and
        # checkpoints afresh (an older run's later checkpoints would be resumed instead)
        if os.path.exists(os.path.join(run_dir, METRICS_FILE)):
            os.remove(os.path.join(run_dir, METRICS_FILE))
        shutil.rmtree(os.path.join(run_dir, "tensorboard"), ignore_errors=True)
        shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    return found


def _summary(
    args: argparse.Namespace,
    mode: str,
    trainer: Any,
    env: Any,
    run_dir: str,
    seconds: float,  # noqa: ANN401
) -> dict[str, Any]:
    """The run's summary record, and its closing line (reward first vs last steps, chance)."""
    import os

    from harts.rl.metrics import METRICS_FILE

    rewards = [r["reward"] for r in trainer.state.history]
    k = min(5, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    summary = {
        "mode": mode,
        "steps": args.steps,
        "seed": args.seed,
        "dtype": args.dtype,
        "reward_first5": first,
        "reward_last5": last,
        "success_last5": sum(r["success"] for r in trainer.state.history[-k:]) / k,
        "chance_reward": env.chance_reward(),
        "max_mismatch": max(r["mismatch"] for r in trainer.state.history),
        "seconds": seconds,
        "losses": [r["loss"] for r in trainer.state.history],
        "rewards": rewards,
        "run_dir": run_dir,
    }
    ratio = f"{last / first:.1f}x" if first > 0 else "from zero"
    print(
        f"\nreward {first:.3f} (mean of the first {k} steps) -> {last:.3f} (last {k}): {ratio}; "
        f"chance {env.chance_reward():.3f}, guessing a value without the tool {1 / env.num_values:.3f}; "
        f"success {summary['success_last5']:.0%} in the last {k} steps. Largest sampler/trainer log-prob gap "
        f"{summary['max_mismatch']:.1e}. {args.steps} steps in {seconds:.0f} s. "
        f"Metrics: {os.path.join(run_dir, METRICS_FILE)}; curves: harts plot {run_dir}\n",
        flush=True,
    )
    return summary


def _signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def _stopped(done: int, save: Any, why: str, args: argparse.Namespace) -> None:  # noqa: ANN401
    """Keep the ``done`` completed steps (checkpoint) before the run stops; a failing save is
    reported but does not hide why the run stopped."""
    import sys

    after = f"after step {done - 1}" if done else "before the first step completed"
    print(f"harts: {why} {after}; keeping the {done} completed step(s)", file=sys.stderr, flush=True)
    try:
        save()
    except Exception as err:  # noqa: BLE001 - the original error is the one to report
        print(f"harts: could not save them: {err}", file=sys.stderr, flush=True)
        return
    if done:
        mode = f" --mode {args.mode}" if args.mode != "compact" else ""
        print(
            f"harts: continue with: harts demo --resume {args.resume or args.run_dir}{mode} --steps {args.steps} "
            "(and the same flags)",
            file=sys.stderr,
            flush=True,
        )


def _compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """How two runs of one seed compare: for how many steps they sampled the same trees (the
    same rewards), and how far their losses differ over those steps."""
    same = 0
    while same < min(len(a["rewards"]), len(b["rewards"])) and a["rewards"][same] == b["rewards"][same]:
        same += 1
    diffs = [abs(x - y) for x, y in zip(a["losses"][:same], b["losses"][:same])]
    return {
        "steps_with_equal_rewards": same,
        "loss_diff_step0": diffs[0] if diffs else None,
        "max_loss_diff_while_equal": max(diffs) if diffs else None,
        "max_abs_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
        "max_abs_reward_diff": max(abs(x - y) for x, y in zip(a["rewards"], b["rewards"])),
    }
