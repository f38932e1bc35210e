"""``harts train``: GRPO training on rollout trees, every microbatch executed compactly.

Single process by default; data parallel with ``torchrun --nproc-per-node D $(which harts) train``
(gloo on CPU, NCCL on CUDA). ``--mode trajectory`` runs the baseline on the same plan.

Before the first step, everything that could stop the run later is checked: the output paths
(``--save``, ``--json``: writable, not overwriting without ``--overwrite``), the device, every
step's batch (read once; each trajectory must fit ``--capacity``, and the error names the smallest
capacity that fits every step), and the vocabulary the batches need against the model. Progress
goes to stderr (steps, and microbatches within a step); stdout keeps the step lines and the table.

Interruptions: SIGINT (Ctrl-C) and SIGTERM stop the run after the last *completed* step. A step
interrupted while its gradients are being computed is discarded: only ``p.grad`` had changed, so
the weights and the optimizer state are those after the previous step. A signal arriving during
the update itself (clipping, optimizer step, expert-bias update; milliseconds) lets that step
finish first. Then the completed steps' table is printed, ``--save`` gets those weights (written
atomically, so a second Ctrl-C cannot leave half a checkpoint), ``--json`` gets the completed
steps' logs with an ``interrupted`` entry, and the exit status is 130 (SIGINT) or 143 (SIGTERM).
If no step completed, nothing is saved. A second signal aborts at once. (With torchrun every rank
receives the signal; only rank 0 writes.)

Failures: if a step fails before changing the weights (out of memory, a bug), the completed steps
are kept the same way (``--json`` gets a ``failed`` entry) before the error is reported.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

from harts.commands._inputs import (
    add_execution_arguments,
    add_model_arguments,
    add_output_arguments,
    add_workload_arguments,
    nonneg_float,
    positive_float,
    positive_int,
)

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "GRPO training on rollout trees (compact execution; --mode trajectory for the baseline)."

#: batches read by the checks before step 0 are kept for training up to this many tokens in all
#: (above it, preset steps are generated again when they run; a file is read once either way)
KEEP_TOKENS = 20_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, default="tiny")
    add_model_arguments(p)
    p.add_argument(
        "--mode",
        default="compact",
        choices=["compact", "trajectory"],
        help="compact (harts) or trajectory (the baseline, same plan)",
    )
    p.add_argument("--capacity", type=positive_int, default=65_536, help="microbatch capacity T (compact tokens)")
    p.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--kl-coef", type=nonneg_float, default=0.0, help="KL penalty coefficient (needs ref_logprobs)")
    add_execution_arguments(p)
    p.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="save the trained weights here (a transformers checkpoint when --model was one, "
        "else DIR/harts.pt); also on Ctrl-C / SIGTERM, after the last completed step",
    )
    add_output_arguments(p, what="the step logs")


class _Interrupted(BaseException):
    """Raised by the signal handler (a BaseException, so no ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """SIGINT/SIGTERM: raise ``_Interrupted`` inside a ``window()``, else remember for later.

    Outside the windows (progress-bar bookkeeping, printing, the optimizer update, saving) a
    signal is only recorded and acted on when the next window opens, so it never lands halfway
    through a tqdm call or a weight update. The windows cover the slow parts: reading and
    checking the steps, building the model, and computing each step's gradients.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.interruptible = False
        self._previous: dict[int, Any] = {}

    def handler(self, signum: int, frame: object) -> None:  # noqa: ARG002
        if self.signum is None:
            self.signum = signum
            if self.interruptible:
                raise _Interrupted(signum)

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self.handler)

    def restore(self) -> None:
        import signal

        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def check(self) -> None:
        """Become interruptible; a signal that arrived while we were not is acted on now."""
        self.interruptible = True
        if self.signum is not None:
            raise _Interrupted(self.signum)

    def defer(self) -> None:
        self.interruptible = False

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Interruptible inside the block (a signal recorded earlier is raised on entry)."""
        self.check()
        try:
            yield
        finally:
            self.interruptible = False


def run(args: argparse.Namespace) -> int:
    signals = _Signals()
    signals.install()
    try:
        return _run(args, signals)
    finally:
        signals.restore()


def _run(args: argparse.Namespace, signals: _Signals) -> int:
    import os
    import signal as signal_mod
    import sys

    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from harts.commands._inputs import (
        build_model,
        check_capacity,
        check_device,
        check_output_dir,
        check_output_file,
        check_plannable,
        needed_vocab,
        step_sources,
        summarize,
    )
    from harts.commands._progress import progress
    from harts.errors import UserError
    from harts.models.execution.config import ExecutionConfig
    from harts.rl.train import TrainConfig, train_step

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed and not dist.is_initialized():
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
        if args.device == "cuda":
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    logs: list = []
    model = None
    # True from the moment a step starts changing the weights until it has returned its log
    state = {"in_update": False}

    def on_update() -> None:
        signals.defer()
        state["in_update"] = True

    try:
        # ---------------------------------------------------------- checks before step 0
        with signals.window():
            if rank == 0:
                check_output_dir(args.save, "--save", args.overwrite)
                check_output_file(args.json_out, "--json", args.overwrite)
            check_device(args.device)
            sources = step_sources(args.workload, args.steps, args.seed)
        summaries, kept, kept_tokens = [], {}, 0
        with progress(
            len(sources), "checking inputs", "step", leave=False, disable=rank != 0 or len(sources) < 2
        ) as bar:
            for i, (label, make) in enumerate(sources):
                with signals.window():
                    batch = make()
                    st = summarize(i, label, batch)
                    summaries.append(st)
                    if world > 1 and st.longest_len <= args.capacity and st.trajectories >= world:
                        check_plannable(batch, st, args.capacity, world)
                    if kept_tokens + batch.num_tokens <= KEEP_TOKENS:
                        kept[i] = batch
                        kept_tokens += batch.num_tokens
                    del batch
                bar.update()
        with signals.window():
            check_capacity(summaries, args.capacity, world)
            vocab, where = needed_vocab(summaries)
            model = build_model(args, vocab, where=where)
            execution = ExecutionConfig(
                mode=args.mode,
                recompute=args.recompute,
                attention=args.attention,
                linear_attention_backend=args.la_backend,
            )
            cfg = TrainConfig(capacity=args.capacity, execution=execution, lr=args.lr, kl_coef=args.kl_coef)
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        if rank == 0:
            print(
                f"model {args.model}: {model.config.layer_pattern} x hidden {model.config.hidden_size}, "
                f"{model.num_parameters():,} parameters, {args.dtype} on {args.device}; mode {args.mode}",
                flush=True,
            )

        # ------------------------------------------------------------------ training
        steps_bar = progress(len(sources), "train", "step", disable=rank != 0)
        try:
            for i, (_, make) in enumerate(sources):
                mb_bar = progress(None, f"step {i}", "mb", leave=False, position=1, disable=rank != 0)

                def on_progress(done: int, total: int, bar=mb_bar) -> None:  # noqa: ANN001
                    signals.defer()  # not inside tqdm
                    bar.total = total
                    bar.update(done - bar.n)
                    signals.check()

                try:
                    with signals.window():
                        batch = kept.pop(i) if i in kept else make()
                        # on_update closes the window before the weights change
                        log = train_step(
                            model, optimizer, batch, cfg, step=i, progress=on_progress, on_update=on_update
                        )
                finally:
                    mb_bar.close()
                logs.append(log)
                state["in_update"] = False
                if rank == 0 and log.adv_nonzero == 0 and not state.get("warned_zero_adv"):
                    state["warned_zero_adv"] = True
                    tqdm.write(
                        f"harts: warning: step {i}: every advantage is zero, so the policy loss and its gradient "
                        "are zero and the weights only follow the MoE router losses (does the batch carry "
                        "advantages?); this warning is shown once",
                        file=sys.stderr,
                    )
                if rank == 0:
                    tqdm.write(
                        f"step {i}: loss {log.loss:+.5f}  grad-norm {log.grad_norm:.4f}  "
                        f"{log.microbatches} microbatches  {log.train_seconds:.2f} s  "
                        f"{log.tokens_per_second:,.0f} tok/s/rank",
                        file=sys.stdout,
                    )
                    sys.stdout.flush()
                steps_bar.update()
            with signals.window():
                pass  # a signal during the last step's update or bookkeeping
        finally:
            steps_bar.close()
    except (_Interrupted, Exception) as err:
        if isinstance(err, _Interrupted):
            signum = err.signum
        elif signals.signum is not None and not isinstance(err, UserError):
            signum = signals.signum  # the interrupt surfaced through torch as another exception
        else:
            if rank == 0 and logs and not state["in_update"]:
                _save_after_failure(args, model, logs, world, err)
            raise
        signals.restore()  # a second signal aborts at once
        name = signal_mod.Signals(signum).name
        if rank == 0:
            done = f"after step {len(logs) - 1}" if logs else "before the first step completed"
            print(f"harts: interrupted by {name} {done}", file=sys.stderr, flush=True)
            _finish(args, model if logs else None, logs, world, interrupted=name)
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
        return 128 + signum
    if rank == 0:
        _finish(args, model, logs, world, interrupted=None)
    if distributed:
        dist.destroy_process_group()
    return 0


def _save_after_failure(args: argparse.Namespace, model, logs: list, world: int, err: BaseException) -> None:  # noqa: ANN001
    """A step failed (out of memory, a bug, ...) before changing the weights: keep the completed
    steps -- table, ``--save``, ``--json`` with a ``failed`` entry -- then the error propagates."""
    import sys

    print(
        f"harts: step {len(logs)} failed ({type(err).__name__}); keeping the {len(logs)} completed step(s)",
        file=sys.stderr,
        flush=True,
    )
    try:
        _finish(
            args,
            model,
            logs,
            world,
            interrupted=None,
            failed={"step": len(logs), "error": f"{type(err).__name__}: {err}"},
        )
    except Exception as save_err:  # noqa: BLE001 - the original error is the one to report
        print(f"harts: could not keep them either: {save_err}", file=sys.stderr, flush=True)


def _finish(
    args: argparse.Namespace,
    model,
    logs: list,
    world: int,
    *,
    interrupted: str | None,  # noqa: ANN001
    failed: dict | None = None,
) -> None:
    """Table, then the checkpoint, then the JSON (a JSON failure cannot lose the checkpoint)."""
    import sys

    from harts.bench.table import format_table
    from harts.commands._inputs import write_json
    from harts.errors import OutputPathError

    if logs:
        rows = [
            [
                l.step,
                l.paths,
                l.raw_tokens,
                l.microbatches,
                l.rank_rows,
                l.rank_calls,
                l.rank_replay_rows,
                f"{l.loss:+.5f}",
                f"{l.grad_norm:.4f}",
                f"{l.adv_mean:+.3f}",
                f"{l.adv_std:.3f}",
                f"{l.adv_nonzero:.0%}",
                f"{l.clip_frac:.3f}",
                f"{l.plan_seconds:.3f}",
                f"{l.prepare_seconds:.3f}",
                f"{l.train_seconds:.3f}",
            ]
            for l in logs
        ]
        print(
            format_table(
                [
                    "step",
                    "paths",
                    "raw tok",
                    "mbs",
                    "rows",
                    "calls",
                    "replay",
                    "loss",
                    "|g|",
                    "adv mean",
                    "adv std",
                    "adv!=0",
                    "clip",
                    "plan s",
                    "prepare s",
                    "train s",
                ],
                rows,
            ),
            flush=True,
        )
    save_error = None
    if args.save:
        if model is None:
            print(f"nothing saved to {args.save}: no step completed", file=sys.stderr)
        else:
            try:
                save_model(model, args.model, args.save)
                partial = interrupted or failed
                print(f"saved to {args.save}" + (f" (weights after step {logs[-1].step})" if partial else ""))
            except OSError as err:
                save_error = OutputPathError(f"--save {args.save}: cannot write the weights ({err.strerror or err})")
    if args.json_out:
        record = {"mode": args.mode, "model": args.model, "world_size": world, "steps": [l.to_dict() for l in logs]}
        if interrupted:
            record["interrupted"] = {"signal": interrupted, "completed_steps": len(logs)}
        if failed:
            record["failed"] = {**failed, "completed_steps": len(logs)}
        write_json(args.json_out, record)
        print(f"wrote {args.json_out}")
    if save_error is not None:
        raise save_error


def save_model(model, spec: str, out: str) -> None:  # noqa: ANN001
    """What ``--save`` writes: a transformers checkpoint when ``spec`` was one, else ``out/harts.pt``
    (``{"config": ..., "state_dict": ...}``). Files appear atomically (written aside, then renamed)."""
    import os
    import shutil
    import tempfile

    import torch

    from harts.commands._inputs import write_atomic
    from harts.integrations.loading import is_checkpoint

    os.makedirs(out, exist_ok=True)
    if is_checkpoint(spec):
        from harts.integrations.hf import save_hf_checkpoint

        tmp = tempfile.mkdtemp(prefix=".harts-save-", dir=out)
        try:
            save_hf_checkpoint(model, tmp)
            for name in sorted(os.listdir(tmp)):
                os.replace(os.path.join(tmp, name), os.path.join(out, name))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        state = {"config": model.config.__dict__, "state_dict": model.state_dict()}
        write_atomic(os.path.join(out, "harts.pt"), lambda p: torch.save(state, p))
