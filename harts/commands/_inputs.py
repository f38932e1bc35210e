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
  written atomically (``write_json``, ``save_figure``): ``harts.outputs``.

Everything here raises ``harts.errors.UserError`` for bad input (the CLI prints one line and
exits 2). Module level imports only the standard library, so building the parser stays instant.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from harts.errors import UserError

# output paths: checked before any work, written atomically, devices and FIFOs written in place
from harts.outputs import PLOT_FORMATS as PLOT_FORMATS
from harts.outputs import check_output_dir as check_output_dir
from harts.outputs import check_output_file as check_output_file
from harts.outputs import save_figure as save_figure
from harts.outputs import write_atomic as write_atomic
from harts.outputs import write_json as write_json

# the model's and the batches' checks live on the trainer floor; commands import them from here too
from harts.trainer import build
from harts.trainer.build import BuiltModel, ModelSpec
from harts.trainer.build import check_device as check_device
from harts.trainer.build import check_la_backend as check_la_backend
from harts.trainer.build import checkpoint_errors as checkpoint_errors
from harts.trainer.build import flex_backends as flex_backends
from harts.trainer.checks import StepSummary as StepSummary
from harts.trainer.checks import batch_vocab as batch_vocab
from harts.trainer.checks import check_capacity as check_capacity
from harts.trainer.checks import check_plannable as check_plannable
from harts.trainer.checks import check_recompute_layers as check_recompute_layers
from harts.trainer.checks import max_compression as max_compression
from harts.trainer.checks import needed_vocab as needed_vocab
from harts.trainer.checks import summarize as summarize
from harts.tree.dataset import Schedule

if TYPE_CHECKING:  # heavy imports stay after argument parsing
    from harts.models.execution.config import ExecutionConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.trainer.lora import LoraConfig
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


def learning_rate(text: str) -> float:
    """argparse type: a learning rate in (0, 1] (``harts.trainer.checks.check_lr``: AdamW moves
    every weight by about the learning rate per step, so a larger one diverges)."""
    from harts.trainer.checks import check_lr

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    try:
        return check_lr(v, "--lr", zero=False)
    except UserError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--lr: ")) from None


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


def add_logprobs_argument(p: argparse.ArgumentParser, *, default: str, why: str) -> None:
    """``--logprobs {actions,all}`` (``ExecutionConfig.logprob_positions``), ``default`` with ``why``."""
    p.add_argument(
        "--logprobs",
        default=default,
        choices=["actions", "all"] if default == "actions" else ["all", "actions"],
        help="where the LM head runs: only at positions whose target is an action token (actions; "
        f"the other log-probs are not computed) or at every position (all). Default {default}: {why}",
    )


#: ``LoraConfig``'s target flags by name (``harts.trainer.lora.LORA_TARGETS``: this module imports
#: no torch, so the names are spelled out here and a test keeps the two equal)
LORA_TARGETS = ("attn", "mlp", "unembed")


def lora_targets(text: str) -> tuple[str, ...]:
    """argparse type: a comma-separated list of ``LORA_TARGETS`` names, in their order."""
    names = _names(text)
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown or not names:
        what = f"unknown target {unknown[0]!r}" if unknown else "no target"
        raise argparse.ArgumentTypeError(f"{what} in {text!r}; the targets, comma-separated: {', '.join(LORA_TARGETS)}")
    return tuple(t for t in LORA_TARGETS if t in names)


def add_lora_arguments(p: argparse.ArgumentParser, *, rank_help: str = "") -> None:
    """``--lora RANK``, ``--lora-alpha`` and ``--lora-targets``: ``harts.trainer.lora.LoraConfig``'s
    rank, alpha and target flags, with its defaults; ``lora_config`` makes the config of them.
    ``rank_help``: what ``--lora`` means to this command, after what it always means."""
    p.add_argument(
        "--lora",
        type=positive_int,
        default=None,
        metavar="RANK",
        help="train rank-RANK LoRA adapters (float32) on every projection of --lora-targets, each routed expert "
        "its own, with the base weights frozen in --dtype: only the adapters get gradients and AdamW state; "
        "default: train every weight" + (f". {rank_help}" if rank_help else ""),
    )
    p.add_argument(
        "--lora-alpha",
        type=positive_float,
        default=None,
        metavar="ALPHA",
        help="with --lora: the adapters' scale is ALPHA / RANK (default 32 at every rank, as Tinker's LoRA)",
    )
    p.add_argument(
        "--lora-targets",
        type=lora_targets,
        default=None,
        metavar="NAMES",
        help="with --lora: the projections that get adapters, comma-separated: attn (attention and linear "
        "attention), mlp (dense MLP, shared and routed experts; not the router), unembed (the LM head); default "
        "all three",
    )


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    """The ``LoraConfig`` of ``--lora``, ``--lora-alpha`` and ``--lora-targets`` (its adapters'
    seed is ``--seed``), None without ``--lora``. UserError naming the flag: ``--lora-alpha`` or
    ``--lora-targets`` without ``--lora``, or a value ``LoraConfig`` refuses."""
    from harts.trainer.lora import LoraConfig

    rank = getattr(args, "lora", None)
    alpha, targets = getattr(args, "lora_alpha", None), getattr(args, "lora_targets", None)
    if rank is None:
        for flag, value in (("--lora-alpha", alpha), ("--lora-targets", targets)):
            if value is not None:
                raise UserError(f"{flag} sets up LoRA adapters, which --lora RANK turns on: give --lora RANK too")
        return None
    fields: dict[str, Any] = {} if alpha is None else {"alpha": alpha}
    if targets is not None:
        fields.update({f"train_{t}": t in targets for t in LORA_TARGETS})
    try:
        return LoraConfig(rank=rank, seed=getattr(args, "seed", 0), **fields)
    except UserError as err:
        raise UserError(f"--lora {rank}: {err}") from None


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
    noun = "step" if len(sources) == 1 else "steps"
    total = f" x {epochs} epochs = {len(order)} steps" if epochs > 1 else ""
    return Schedule(sources, order, f"workload {name}: {len(sources)} {noun}{total}")


# ------------------------------------------------------------------------ model
def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The ``ModelSpec`` of ``--model``, ``--pattern``, ``--layers``, ``--dtype``, ``--device``,
    ``--la-backend``, ``--attention``, ``--threads`` and ``--seed`` (those a command has)."""
    return ModelSpec(
        model=args.model,
        pattern=getattr(args, "pattern", None),
        layers=getattr(args, "layers", None),
        dtype=getattr(args, "dtype", None),
        device=getattr(args, "device", "cpu"),
        la_backend=getattr(args, "la_backend", "reference"),
        attention=getattr(args, "attention", "auto"),
        threads=getattr(args, "threads", 1),
        seed=getattr(args, "seed", 0),
    )


def check_model(args: argparse.Namespace) -> None:
    """``harts.trainer.build.check_model`` of the command's ``model_spec``."""
    build.check_model(model_spec(args))


def check_vocab(args: argparse.Namespace, vocab_size: int, where: str | None = None, *, training: bool = True) -> None:
    """``harts.trainer.build.check_vocab`` of the command's ``model_spec``."""
    build.check_vocab(model_spec(args), vocab_size, where, training=training)


def build_model(
    args: argparse.Namespace, vocab_size: int, *, where: str | None = None, training: bool = True, meta: bool = False
) -> HybridLM:
    """``harts.trainer.build.build_model`` of the command's ``model_spec``."""
    return build.build_model(model_spec(args), vocab_size, where=where, training=training, meta=meta)


def build_model_and_attention(
    args: argparse.Namespace, vocab_size: int, execution: ExecutionConfig, *, where: str | None = None
) -> BuiltModel:
    """``harts.trainer.build.build_model_and_attention`` of the command's ``model_spec``."""
    return build.build_model_and_attention(model_spec(args), vocab_size, execution, where=where)
