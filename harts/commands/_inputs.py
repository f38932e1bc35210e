"""Shared command-line inputs and checks.

* option types that name the option in their error (``positive_int``, ``nonneg_int``, ...);
* a workload preset or batch files as lazy per-step sources; commands read every step once
  before any work starts (``summarize``: trajectory lengths, token ids) and check them
  (``check_capacity``, ``needed_vocab``), so that a problem in step k is reported in seconds,
  not after k steps;
* a model preset or checkpoint (``build_model``) with its device and vocabulary checked first,
  a preset optionally cut to its first ``--layers N`` decoder layers (``check_model``);
  ``build_model_and_attention`` also chooses the FlexAttention backend while the model is made;
* output paths checked before any work (``check_output_file`` / ``check_output_dir``) and
  written atomically (``write_json``).

Everything here raises ``harts.errors.UserError`` for bad input (the CLI prints one line and
exits 2). Module level imports only the standard library, so building the parser stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harts.errors import CapacityError, OutputPathError, UserError

if TYPE_CHECKING:  # heavy imports stay after argument parsing
    import torch

    from harts.models.config import HybridConfig
    from harts.models.execution.config import ExecutionConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.tree.batch import RolloutBatch


# ------------------------------------------------------------------ option types
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the option in the error)."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {text!r}")
    return v


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer (>= 0), got {text!r}")
    return v


def workers_int(text: str) -> int | str:
    """argparse type: ``auto`` or an integer >= 0 (``--planner-workers``)."""
    if text.strip().lower() == "auto":
        return "auto"
    return nonneg_int(text)


def add_planner_workers_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--planner-workers",
        type=workers_int,
        default="auto",
        metavar="N|auto",
        help="processes that build the step planner's independent candidates in parallel (the same plan, "
        "sooner; steps of fewer than 1,000 trajectories are planned in this process anyway); 0 plans in this "
        "process; auto (default): 4 where at least 6 cores are usable, else 0",
    )


def planner_workers(value: int | str) -> int:
    """``--planner-workers``' process count (``auto`` resolved for this machine)."""
    from harts.plan.step.workers import auto_workers

    return auto_workers() if value == "auto" else int(value)


def seed_int(text: str) -> int:
    """argparse type: a seed, 0 <= seed < 2**32 (numpy's and torch's common range)."""
    v = nonneg_int(text)
    if v >= 2**32:
        raise argparse.ArgumentTypeError(f"must be below 2**32, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


# ------------------------------------------------------------------- arguments
def add_workload_arguments(p: argparse.ArgumentParser, default: str = "tiny", *, data: bool = False) -> None:
    """``--workload``, ``--steps``, ``--seed``; ``data``: also ``--data PATH...`` and ``--epochs``
    (``workload_schedule``), and ``--workload`` then defaults to ``default`` only without ``--data``."""
    p.add_argument(
        "--workload",
        default=None if data else default,
        metavar="NAME|FILE",
        help="built-in workload preset (tiny, small, medium, swe) or a batch file (.jsonl/.parquet)"
        + (f"; default {default} unless --data is given" if data else ""),
    )
    if data:
        p.add_argument(
            "--data",
            nargs="+",
            default=None,
            metavar="PATH",
            help="batch files to train on, one step each, in the order given: files, directories (their "
            ".jsonl/.parquet files below, sorted by path) and glob patterns (quoted; sorted matches)",
        )
        p.add_argument(
            "--epochs", type=positive_int, default=1, help="passes over the steps (--data's files or the workload's)"
        )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="steps to run (default: the preset's; 1 for a file, which repeats"
        + ("; with --data: the first N of the files x epochs)" if data else ")"),
    )
    p.add_argument("--seed", type=seed_int, default=0, help="workload and model-init seed")


#: the names ``--model`` takes for a preset (``harts.models.config.PRESET_NAMES``; this module
#: imports no torch, so the names are spelled out here and a test keeps the two lists equal)
MODEL_PRESETS = (
    "tiny",
    "ling3_tiny",
    "qwen3_5_9b",
    "qwen3_5_27b",
    "qwen3_5_35b_a3b",
    "qwen3_next_80b_a3b",
    "kimi_linear_48b_a3b",
)


def add_model_arguments(p: argparse.ArgumentParser, default_dtype: str = "float32") -> None:
    p.add_argument(
        "--model",
        default="tiny",
        metavar="PRESET|PATH",
        help=f"model preset ({', '.join(MODEL_PRESETS)}: the real models' shapes, random init) or a "
        "transformers checkpoint directory (BailingHybrid / Qwen3-Next / Qwen3.5 / Kimi Linear)",
    )
    p.add_argument("--pattern", default=None, help="override a preset's layer pattern, e.g. KKKM")
    add_layers_argument(p)
    p.add_argument("--dtype", default=default_dtype, choices=["float32", "float64", "bfloat16"], help="parameter dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (checked before any work)")
    add_la_backend_argument(p, default="auto")
    p.add_argument("--threads", type=nonneg_int, default=1, help="torch intra-op threads on CPU; 0 lets torch choose")


def add_layers_argument(p: argparse.ArgumentParser) -> None:
    """``--layers N``: a preset's first N decoder layers (``check_model`` checks it against ``--model``)."""
    p.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        metavar="N",
        help="keep the first N decoder layers of the preset's layer pattern (after --pattern), at its "
        "real widths, heads and experts, e.g. --model qwen3_next_80b_a3b --layers 4; presets only "
        "(default: all layers)",
    )


def add_la_backend_argument(p: argparse.ArgumentParser, default: str) -> None:
    """``--la-backend``: ``ExecutionConfig.linear_attention_backend``, its choices from
    ``harts.ops.registry`` (the old name tree_linked among them)."""
    from harts.ops.registry import linear_attn_choices

    p.add_argument(
        "--la-backend",
        default=default,
        choices=linear_attn_choices(),
        help="linear-attention core: torch reference, fla-core split path (CUDA), the one-pass tree kernel (CUDA; "
        "one call per round), or auto (on CUDA with fla-core: the tree kernel with a compact microbatch's rounds "
        "linked into one op per layer; reference elsewhere); tree_linked: tree with the rounds linked",
    )


def add_execution_arguments(p: argparse.ArgumentParser) -> None:
    """``--recompute`` and ``--attention`` (fields of ``ExecutionConfig``) for model-running commands;
    the choices from ``harts.ops.registry``."""
    from harts.ops.registry import ATTENTION_IMPLS

    p.add_argument("--recompute", action="store_true", help="full-layer activation recomputation")
    p.add_argument(
        "--recompute-skip",
        type=_names,
        default=(),
        metavar="CORES",
        help="with --recompute: cores not rerun in the backward, their forward kept instead "
        "(comma-separated: attention, linear_attention, moe; more memory, less time)",
    )
    p.add_argument(
        "--recompute-layers",
        type=nonneg_int,
        default=None,
        metavar="N",
        help="with --recompute: checkpoint only the first N decoder layers, the others keep their "
        "activations (default: all layers; more memory, less time)",
    )
    p.add_argument(
        "--moe-keep-gate-up",
        type=nonneg_int,
        default=0,
        metavar="N",
        help="with --recompute-skip ...,moe: the first N MoE layers keep their routed experts' gate/up "
        "output for the backward instead of recomputing it (one grouped GEMM fewer per layer; rows x "
        "top-k x 2 x moe_intermediate half-precision entries more per layer: about 1.07 GB at 65,536 "
        "rows of ling3_tiny); default 0",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION_IMPLS,
        help="full attention: one call per branch (gather), one FlexAttention call over "
        "the tree mask (mask), or mask on CUDA / gather on CPU (auto, default)",
    )


def _names(text: str) -> tuple[str, ...]:
    """argparse type: a comma-separated list of names (checked where they are used)."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def recompute_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``recompute``, ``recompute_skip`` and ``recompute_layers`` of ``ExecutionConfig`` from
    ``--recompute``, ``--recompute-skip``, ``--recompute-layers`` and ``--moe-keep-gate-up``;
    UserError names a bad core, a skip or layer count without ``--recompute``, or kept gate/up
    outputs without a kept MoE block."""
    from harts.models.execution.config import check_recompute_skip

    skip = tuple(getattr(args, "recompute_skip", ()))
    try:
        check_recompute_skip(skip, args.recompute)
    except ValueError as err:
        raise UserError(f"--recompute-skip: {err}") from None
    layers = getattr(args, "recompute_layers", None)
    if layers is not None and not args.recompute:
        raise UserError(f"--recompute-layers {layers} needs --recompute (without it no layer is checkpointed)")
    keep = getattr(args, "moe_keep_gate_up", 0)
    if keep and "moe" not in skip:
        raise UserError(
            f"--moe-keep-gate-up {keep} needs --recompute --recompute-skip with moe in it (only a kept MoE "
            "block's lean routed experts recompute their gate/up output)"
        )
    return {"recompute": args.recompute, "recompute_skip": skip, "recompute_layers": layers, "moe_keep_gate_up": keep}


def check_recompute_layers(fields: dict[str, Any], model: Any) -> None:
    """UserError unless ``--recompute-layers`` (``fields`` from ``recompute_fields``) is at most
    ``model``'s number of decoder layers, and ``--moe-keep-gate-up`` at most its MoE layers,
    naming both."""
    layers, have = fields.get("recompute_layers"), model.config.num_hidden_layers
    if layers is not None and layers > have:
        raise UserError(f"--recompute-layers {layers}: the model has {have} decoder layers (use 0 .. {have})")
    keep = fields.get("moe_keep_gate_up", 0)
    moe_layers = sum(1 for layer in model.layers if layer.is_moe)
    if keep > moe_layers:
        noun = "MoE layer" if moe_layers == 1 else "MoE layers"
        raise UserError(f"--moe-keep-gate-up {keep}: the model has {moe_layers} {noun} (use 0 .. {moe_layers})")


def add_logprobs_argument(p: argparse.ArgumentParser, *, default: str, why: str) -> None:
    """``--logprobs {actions,all}`` (``ExecutionConfig.logprob_positions``), ``default`` with ``why``."""
    p.add_argument(
        "--logprobs",
        default=default,
        choices=["actions", "all"] if default == "actions" else ["all", "actions"],
        help="where the LM head runs: only at positions whose target is an action token (actions; "
        f"the other log-probs are not computed) or at every position (all). Default {default}: {why}",
    )


def add_output_arguments(p: argparse.ArgumentParser, *, what: str = "the figures") -> None:
    """``--json FILE`` and ``--overwrite`` (every command that writes files has both)."""
    p.add_argument(
        "--json",
        dest="json_out",
        default=None,
        metavar="FILE",
        help=f"also write {what} as JSON to FILE (checked before any work)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing output files (without it, an existing output is an error)",
    )


# ---------------------------------------------------------------------- sources
def batch_sources(
    files: list[str], workload: str | None, steps: int | None, seed: int, *, default: str = "small"
) -> list[tuple[str, Callable[[], RolloutBatch]]]:
    """``(label, make_batch)`` per step: each file is one step, or the preset's steps (lazy)."""
    from harts.tree.batch import RolloutBatch
    from harts.tree.workloads import PRESETS, workload_steps

    if files and workload:
        raise UserError("give FILEs or --workload, not both")
    if files:
        return [(f, partial(RolloutBatch.load, f)) for f in files]
    name = workload or default
    if name not in PRESETS:
        hint = " (a batch file is given as FILE, without --workload)" if os.path.exists(name) else ""
        raise UserError(f"--workload {name!r} is not a preset; presets: {', '.join(PRESETS)}{hint}")
    return workload_steps(name, steps, seed=seed)


def step_sources(workload: str, steps: int | None, seed: int) -> list[tuple[str, Callable[[], RolloutBatch]]]:
    """``(label, make_batch)`` per step of ``--workload NAME|FILE`` (``workload_steps``)."""
    from harts.tree.workloads import workload_steps

    return workload_steps(workload, steps, seed=seed)


@dataclass
class Schedule:
    """The steps of a training run: ``order[i]`` is the index into ``sources`` of step ``i``'s
    batch; each source is read (and checked) once, however often the epochs repeat it."""

    sources: list[tuple[str, Callable[[], RolloutBatch]]]
    order: list[int]
    #: what the steps are, for the run's first line (e.g. "3 batch files x 2 epochs = 6 steps")
    description: str
    #: the batch files of ``--data`` (None for a workload)
    files: list[str] | None = None

    def epoch(self, step: int) -> int:
        """The epoch (from 0) step ``step`` belongs to."""
        return step // len(self.sources)


def workload_schedule(args: argparse.Namespace) -> Schedule:
    """The steps of ``--data PATH... --epochs E`` or ``--workload`` (repeated ``--epochs`` times);
    ``--steps`` cuts the data's steps (and sets the workload's). UserError names a bad path, or
    ``--data`` together with ``--workload``."""
    from harts.tree.batch import RolloutBatch
    from harts.tree.dataset import batch_files, epoch_order

    epochs = getattr(args, "epochs", 1)
    if getattr(args, "data", None):
        if args.workload is not None:
            raise UserError("--data and --workload both name the training batches; give one")
        files = batch_files(args.data)
        order = epoch_order(len(files), epochs, args.steps)
        noun = "batch file" if len(files) == 1 else "batch files"
        per = f" x {epochs} epochs" if epochs > 1 else ""
        cut = f", the first {len(order)}" if len(order) < len(files) * epochs else ""
        description = f"{len(files)} {noun}{per} = {len(files) * epochs} steps{cut}"
        return Schedule([(f, partial(RolloutBatch.load, f)) for f in files], order, description, files)
    name = args.workload or "tiny"
    sources = step_sources(name, args.steps, args.seed)
    order = [i for _ in range(epochs) for i in range(len(sources))]
    per = f" x {epochs} epochs" if epochs > 1 else ""
    return Schedule(sources, order, f"workload {name}: {len(sources)} steps{per} = {len(order)} steps")


@dataclass
class StepSummary:
    """What the checks before the first step need to know about one step's batch."""

    step: int
    label: str
    trajectories: int
    tokens: int
    #: the longest trajectory: its index and length
    longest: int
    longest_len: int
    #: the largest token id: where it is (trajectory, position)
    max_token: int
    max_token_at: tuple[int, int]
    #: the batch's declared vocabulary (file header), if any
    vocab_size: int | None

    def where(self) -> str:
        return f"step {self.step} ({self.label})"


def summarize(step: int, label: str, batch: RolloutBatch) -> StepSummary:
    import numpy as np

    lengths = batch.lengths
    j = int(np.argmax(lengths))
    k = int(np.argmax(batch.tokens))
    jt = int(np.searchsorted(batch.offsets, k, side="right") - 1)
    return StepSummary(
        step=step,
        label=label,
        trajectories=batch.num_trajectories,
        tokens=batch.num_tokens,
        longest=j,
        longest_len=int(lengths[j]),
        max_token=int(batch.tokens[k]),
        max_token_at=(jt, int(k - batch.offsets[jt])),
        vocab_size=batch.vocab_size,
    )


def check_capacity(
    summaries: list[StepSummary], capacity: int, dp: int = 1, *, dp_name: str = "data-parallel ranks"
) -> None:
    """Every trajectory of every step fits ``--capacity`` and every step has >= ``dp`` trajectories."""
    fits = max(s.longest_len for s in summaries)
    for s in summaries:
        if s.longest_len > capacity:
            raise CapacityError(
                f"{s.where()}: trajectory {s.longest} has {s.longest_len:,} tokens, more than --capacity "
                f"{capacity:,} (a trajectory is never split across microbatches); the smallest capacity "
                f"that fits every step is --capacity {fits}"
            )
    for s in summaries:
        if s.trajectories < dp:
            raise UserError(
                f"{s.where()} has {s.trajectories} trajectories, fewer than the {dp} {dp_name} "
                f"(every replica needs a microbatch); use at most {s.trajectories}"
            )


def check_plannable(
    batch: RolloutBatch, summary: StepSummary, capacity: int, dp: int, modes: tuple[str, ...] = ("compact",)
) -> None:
    """Each of ``modes`` can plan ``batch`` for ``dp`` replicas: harts' step planner ("compact")
    splits it into a multiple of ``dp`` microbatches of ``capacity`` compact tokens (with D > 1
    a small capacity can need more microbatches than there are trajectories); the baseline's
    raw-token packing ("trajectory") gives every replica as many microbatches."""
    from harts.plan.baselines.trajectory_plan import plan_trajectory_step
    from harts.plan.step.step_plan import check_inputs
    from harts.tree.compact import prefix_index

    n = summary.trajectories
    if "trajectory" in modes:
        try:
            plan_trajectory_step(batch.lengths, dp=dp, capacity=capacity)
        except ValueError as err:  # its message says what to change
            raise CapacityError(f"{summary.where()}: trajectory-wise baseline: {err}") from None
    if "compact" in modes and dp * max(1, -(-summary.tokens // (capacity * dp))) > dp * (n // dp):
        # (when even the raw tokens, >= the compact work, fit, there is no need to compact)
        try:
            check_inputs(prefix_index(batch), dp, capacity)
        except ValueError as err:
            raise CapacityError(f"{summary.where()}: {err}; raise --capacity") from None


def needed_vocab(summaries: list[StepSummary]) -> tuple[int, str]:
    """The vocabulary every step fits, and where the largest token id sits."""
    top = max(summaries, key=lambda s: s.max_token)
    vocab = max(top.max_token + 1, *(s.vocab_size or 0 for s in summaries))
    j, t = top.max_token_at
    return vocab, f"token id {top.max_token:,} ({top.where()}, trajectory {j}, position {t})"


# ------------------------------------------------------------------------ model
def check_model(args: argparse.Namespace) -> None:
    """``--model`` names a preset or a checkpoint directory, and ``--layers`` (when given) fits it:
    1 .. the preset's depth (after ``--pattern``); a checkpoint keeps its layers."""
    from harts.integrations.loading import is_checkpoint

    layers = getattr(args, "layers", None)
    if is_checkpoint(args.model):
        if layers is not None:
            raise UserError(
                f"--layers {layers}: for model presets only; the checkpoint --model {args.model} keeps all its "
                "layers (drop --layers)"
            )
        return
    from harts.models.config import HybridConfig, preset_key

    pattern = getattr(args, "pattern", None)
    try:
        key = preset_key(args.model)
        config = HybridConfig.preset(key, **({"layer_pattern": pattern} if pattern else {}))
    except ValueError as err:
        raise UserError(f"--model {args.model!r}: {err} (or give a checkpoint directory)") from None
    if layers is not None:
        config.first_layers(layers, name=f"--model {key}", option="--layers")


def check_device(spec: str) -> None:
    """``--device`` names a device this torch build can use, or raise naming the fix."""
    import torch

    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {spec!r} is not a device name; use cpu, cuda, cuda:1, ...") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise UserError(
                f"--device {spec}: this torch build ({torch.__version__}) has no CUDA support; "
                "run on --device cpu or install a CUDA build of torch"
            )
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UserError(f"--device {spec}: no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)")
        if dev.index is not None and dev.index >= n:
            raise UserError(f"--device {spec}: only {n} CUDA device(s) visible (cuda:0..cuda:{n - 1})")
        return
    if dev.type == "mps" and torch.backends.mps.is_available():
        return
    raise UserError(f"--device {spec}: not available here; use cpu or cuda")


def check_la_backend(backend: str, device: str, chunk_size: int | None = None, model: str | None = None) -> None:
    """``--la-backend`` can run on ``--device`` (fla needs CUDA and fla-core) and, once the model
    is known (``chunk_size`` of ``--model``), at its linear-attention chunk size."""
    import torch

    from harts.ops.linear_attn.dispatch import linear_attn_op

    try:
        linear_attn_op(backend, torch.device(device), chunk_size)
    except ValueError as err:
        with_model = f" with --model {model}" if model else ""
        raise UserError(
            f"--la-backend {backend} on --device {device}{with_model}: {err}; use --la-backend auto "
            "(or reference, which runs on any device)"
        ) from None


_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


def _memory_bytes(device: str) -> int | None:
    """Total memory of ``device`` (RAM for cpu), or None when unknown."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev.index or 0).total_memory)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_vocab(args: argparse.Namespace, vocab_size: int, where: str | None = None, *, training: bool = True) -> None:
    """The vocabulary the batch needs fits the model named by ``--model``.

    A checkpoint must already cover it (read from its config.json, before loading). A preset's
    embedding and output layers are sized from it: refuse when they alone would not fit the
    device's memory (parameters + gradients, + two AdamW moments when ``training``).
    """
    from harts.integrations.loading import is_checkpoint

    origin = f" for {where}" if where else ""
    if is_checkpoint(args.model):
        cfg_path = Path(args.model) / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            return  # load_model reports an unreadable checkpoint
        if isinstance(cfg, dict) and isinstance(cfg.get("harts_config"), dict):
            cfg = cfg["harts_config"]  # harts' own weights directory (harts.integrations.native)
        have = cfg.get("vocab_size") if isinstance(cfg, dict) else None
        if isinstance(have, int) and vocab_size > have:
            raise UserError(
                f"the batch needs vocab_size >= {vocab_size:,}{origin}, but the checkpoint --model "
                f"{args.model} has a vocabulary of {have:,}: the batch was tokenized for another model"
            )
        return
    from harts.models.config import HybridConfig

    try:
        cfg = HybridConfig.preset(args.model)
    except ValueError as err:
        raise UserError(f"--model {args.model!r}: {err} (or give a checkpoint directory)") from None
    dtype = getattr(args, "dtype", None) or cfg.dtype
    copies = (1 if cfg.tie_word_embeddings else 2) * (4 if training else 2)
    need = vocab_size * cfg.hidden_size * _DTYPE_BYTES.get(dtype, 4) * copies
    have = _memory_bytes(args.device)
    if have is not None and need > have:
        raise UserError(
            f"the batch needs vocab_size >= {vocab_size:,}{origin}: the {args.model} preset's "
            f"embedding and output layers would then take {need / 2**30:,.1f} GiB "
            f"({'training' if training else 'forward + backward'}), more than the {have / 2**30:,.1f} GiB "
            f"of {args.device}. Token ids index the embedding table: remap them to a dense range "
            "0..V-1, or use a checkpoint (--model DIR) whose vocabulary covers them"
        )


def checkpoint_errors() -> tuple[type[BaseException], ...]:
    """What reading a malformed checkpoint raises: ValueError / OSError, and safetensors' own error."""
    errors: tuple[type[BaseException], ...] = (ValueError, OSError)
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is an optional extra
        return errors
    return (*errors, SafetensorError)


def build_model(
    args: argparse.Namespace, vocab_size: int, *, where: str | None = None, training: bool = True, meta: bool = False
) -> HybridLM:
    """The model named by ``--model`` on ``--device`` (device, vocabulary and threads checked first;
    ``where`` names the largest token id for the vocabulary error).

    ``meta``: its structure on the meta device only (several ranks, ``--meta-init``); the caller
    shards it and gives it values with ``harts.parallel.build.materialize``."""
    import torch

    from harts.models.execution.config import ExecutionConfig, attention_head_dim_range

    check_model(args)
    check_device(args.device)
    check_la_backend(getattr(args, "la_backend", "reference"), args.device)
    check_vocab(args, vocab_size, where, training=training)
    if args.threads < 0:
        raise UserError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = _load_model(args, vocab_size, "meta" if meta else args.device)
    # device and fla-core were checked before loading; now the model's chunk size too
    check_la_backend(getattr(args, "la_backend", "reference"), args.device, model.config.chunk_size, args.model)
    attention = getattr(args, "attention", "auto")
    try:  # the model's attention head dims against FlexAttention's
        ExecutionConfig(attention=attention).resolved_attention(
            torch.device(args.device).type, *attention_head_dim_range(model.config.attention_head_dims)
        )
    except ValueError as err:
        raise UserError(f"--attention {attention} with --model {args.model}: {err}") from None
    return model


def _load_model(args: argparse.Namespace, vocab_size: int, device: str) -> HybridLM:
    """``--model`` (a preset or a checkpoint) on ``device``, a bad checkpoint as a ``UserError``."""
    from harts.integrations.loading import load_model

    try:
        return load_model(
            args.model,
            vocab_size=vocab_size,
            dtype=args.dtype,
            layer_pattern=args.pattern,
            layers=getattr(args, "layers", None),
            seed=args.seed,
            device=device,
        )
    except checkpoint_errors() as err:
        if isinstance(err, UserError):
            raise
        raise UserError(f"--model {args.model}: {err}") from None


@dataclass
class BuiltModel:
    """``build_model_and_attention``'s result: the model, its FlexAttention backends, and how long
    each half took (they ran side by side, so the wall time is about the longer one)."""

    model: HybridLM
    #: FlexAttention backend per full-attention layer kind, e.g. {"M": "flash"} (``flex_backends``)
    flex: dict[str, str]
    #: seconds making the model's storage and values (on a helper thread)
    model_seconds: float
    #: seconds choosing the FlexAttention backend (on the calling thread, beside the model)
    attention_seconds: float


def build_model_and_attention(
    args: argparse.Namespace, vocab_size: int, execution: ExecutionConfig, *, where: str | None = None
) -> BuiltModel:
    """``build_model(args, vocab_size, where=where)``, and the FlexAttention backend that
    ``execution`` runs on ``--device``,
    chosen while the model's values are made.

    Both are cold-start costs. For the full ``ling3_tiny`` on an H200 (session 24) FLASH's probe,
    which compiles FA4's forward and backward (``flex_backends``), took 20.2 s, and drawing the
    model's 7.8 B initial values on the host's threads 6.2 s beside it (a checkpoint is read
    instead). Every check ``build_model`` makes runs
    first, on a structure-only (meta) model; then a helper thread makes the model while this
    thread probes (torch.compile stays on the calling thread; the draws release the GIL). An error
    on either side is raised here, after both have ended."""
    import threading
    import time

    import torch

    shell = build_model(args, vocab_size, where=where, meta=True)  # every check; no storage
    made: dict[str, Any] = {}

    def make() -> None:
        began = time.perf_counter()
        try:
            made["model"] = _load_model(args, vocab_size, args.device)
        except BaseException as err:  # noqa: BLE001 - raised on the calling thread below
            made["error"] = err
        made["seconds"] = time.perf_counter() - began

    helper = threading.Thread(target=make, name="harts-build-model", daemon=True)
    helper.start()
    began = time.perf_counter()
    try:
        flex = flex_backends(shell.config, execution, torch.device(args.device))
        attention_seconds = time.perf_counter() - began
    finally:
        helper.join()
    if "error" in made:
        raise made["error"]
    return BuiltModel(made["model"], flex, made["seconds"], attention_seconds)


def flex_backends(config: HybridConfig, execution: ExecutionConfig, device: torch.device) -> dict[str, str]:
    """Which FlexAttention backend ("flash" / "triton") each full-attention layer kind of a model
    with ``config`` runs under ``execution`` on ``device``: {"M": ..., "A": ...}; empty where the mask path does not run (the CPU,
    ``--attention gather``). The same choice both sides of a bench make; FLASH's probe runs here
    once per head shape, not inside the first step."""
    from harts.models.execution.config import attention_head_dim_range
    from harts.ops.attention.tree_mask import flex_backend

    dims = config.attention_head_dims
    if not dims or device.type != "cuda":
        return {}
    try:
        if execution.resolved_attention(device.type, *attention_head_dim_range(dims)) != "mask":
            return {}
        dtype = config.torch_dtype()
        return {k: flex_backend(device, dtype, qk, v, gqa=gqa) for k, (qk, v, gqa) in dims.items()}
    except (ValueError, RuntimeError) as exc:  # --attention mask below its head dim; FLASH asked for, unusable
        raise UserError(str(exc)) from exc


# ---------------------------------------------------------------------- outputs
def _nearest_existing(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_creatable(p: Path, option: str, *, is_dir: bool = False) -> None:
    anc = _nearest_existing(p if is_dir else p.parent)
    if not anc.is_dir():
        raise OutputPathError(f"{option} {p}: cannot be created, {anc} is a file, not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise OutputPathError(f"{option} {p}: cannot be created, {anc} is not writable")


def check_output_file(path: str | None, option: str, overwrite: bool) -> None:
    """``path`` can be written as a file (missing parent directories are created when writing)."""
    if not path or path == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"{option} {p}: is a directory; give a file name")
    if p.exists():
        if not overwrite:
            raise OutputPathError(f"{option} {p}: exists; pass --overwrite to replace it, or choose another name")
        if not os.access(p, os.W_OK):
            raise OutputPathError(f"{option} {p}: exists and is not writable")
        return
    _check_creatable(p, option)


def check_output_dir(path: str | None, option: str, overwrite: bool) -> None:
    """``path`` can be written as a directory: missing, or empty, or ``overwrite``."""
    if not path:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputPathError(f"{option} {p}: exists and is not a directory; give a directory name")
    if p.is_dir():
        if any(p.iterdir()) and not overwrite:
            raise OutputPathError(f"{option} {p}: exists and is not empty; pass --overwrite to write into it")
        if not os.access(p, os.W_OK | os.X_OK):
            raise OutputPathError(f"{option} {p}: is not writable")
        return
    _check_creatable(p, option, is_dir=True)


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` then rename onto ``path``: an interrupted write never leaves half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.parent / f".{p.name}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str, obj: Any, *, indent: int | None = 2, default: Callable[[Any], Any] | None = None) -> None:
    """Write ``obj`` as JSON to ``path`` (atomically; ``-`` = stdout)."""
    if path == "-":
        print(json.dumps(obj, indent=indent, default=default))
        return

    def write(tmp: Path) -> None:
        with tmp.open("w") as fh:
            json.dump(obj, fh, indent=indent, default=default)

    try:
        write_atomic(path, write)
    except OSError as err:
        raise OutputPathError(f"--json {path}: cannot write ({err.strerror or err})") from None
