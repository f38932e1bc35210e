"""Shared command-line inputs and checks.

* the flags of the schema's options (``add_option``: each shared flag's spelling, check, default
  and help come from ``harts.trainer.options.OPTIONS``; a command states only what differs for
  it), and on/off switches with their ``--no-X`` (``Switch``);
* option types that name the option in their error (``positive_int``, ``nonneg_int``, ...) and the
  configs built from the parsed flags (``execution_config``, ``lora_config``, ``model_spec``): the
  schema's (``harts.trainer.options``), which a ``--config`` file's values go through too;
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
from harts.trainer.build import BuiltModel
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

# the schema (``harts.trainer.options``): a flag and a --config file's key share one check, and the
# configs are built there from flags and file alike
from harts.trainer.options import LORA_TARGETS as LORA_TARGETS
from harts.trainer.options import MODEL_PRESETS as MODEL_PRESETS
from harts.trainer.options import execution_config as execution_config
from harts.trainer.options import learning_rate as learning_rate
from harts.trainer.options import lora_config as lora_config
from harts.trainer.options import lora_targets as lora_targets
from harts.trainer.options import model_spec as model_spec
from harts.trainer.options import nonneg_float as nonneg_float
from harts.trainer.options import nonneg_int as nonneg_int
from harts.trainer.options import option_of
from harts.trainer.options import planner_workers as planner_workers
from harts.trainer.options import positive_float as positive_float
from harts.trainer.options import positive_int as positive_int
from harts.trainer.options import recompute_fields as recompute_fields
from harts.trainer.options import seed_int as seed_int
from harts.trainer.options import train_config as train_config
from harts.trainer.options import workers_int as workers_int
from harts.tree.dataset import Schedule

if TYPE_CHECKING:  # heavy imports stay after argument parsing
    from harts.models.execution.config import ExecutionConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.tree.batch import RolloutBatch


# ------------------------------------------------------------------- arguments
#: ``add_option``'s "not overridden"
_SCHEMA: Any = object()


class Switch(argparse.BooleanOptionalAction):
    """argparse's on/off pair (``--recompute`` / ``--no-recompute``), whose ``--no-X`` turns off a
    switch a ``--config`` file turned on; a switch spelled ``--no-X`` itself (``--no-prepare-ahead``)
    pairs with ``--X``, which sets it False."""

    def __init__(self, option_strings: list[str], dest: str, default: bool = False, help: str | None = None) -> None:
        (on,) = option_strings
        off = "--" + on.removeprefix("--no-") if on.startswith("--no-") else "--no-" + on.removeprefix("--")
        argparse.Action.__init__(self, [on, off], dest, nargs=0, default=default, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, option_string == self.option_strings[0])


def add_option(
    p: argparse.ArgumentParser,
    dest: str,
    *,
    default: Any = _SCHEMA,
    help: str | None = None,
    more: str = "",
    choices: tuple[str, ...] | None = None,
    type: Callable[[str], Any] | None = None,
    metavar: str | None = None,
) -> argparse.Action:
    """The schema's option ``dest`` (``harts.trainer.options.OPTIONS``) as a flag of ``p``: its
        spelling, check, choices, default, value name and help are the schema's, so they are written
        once; a command states only what differs for it (a ``default``, a ``help`` for what the option
        means to it, ``more`` text after the schema's help, its own ``choices``, a stricter ``type``, a
    ``metavar``).
        A switch gets its ``--no-X`` too (``Switch``)."""
    option = option_of(dest)
    if option is None:
        raise KeyError(f"{dest!r} is no option of harts.trainer.options.OPTIONS")
    text = (help if help is not None else option.help) + more
    value = option.default if default is _SCHEMA else default
    if option.switch:
        return p.add_argument(option.option, dest=dest, action=Switch, default=value, help=text)
    kwargs: dict[str, Any] = {"dest": dest, "default": value, "help": text}
    allowed = choices if choices is not None else option.allowed()
    if allowed is not None:
        kwargs["choices"] = list(allowed)
    if type is not None or option.type is not None:
        kwargs["type"] = type or option.type
    if (metavar or option.metavar) is not None:
        kwargs["metavar"] = metavar or option.metavar
    if option.many:
        kwargs["nargs"] = "+"
    return p.add_argument(option.option, **kwargs)


def add_options(p: argparse.ArgumentParser, *dests: str) -> None:
    """``add_option`` of each of ``dests``, as the schema has them."""
    for dest in dests:
        add_option(p, dest)


def add_planner_workers_argument(p: argparse.ArgumentParser) -> None:
    add_option(p, "planner_workers")


def add_workload_arguments(p: argparse.ArgumentParser, default: str = "tiny", *, data: bool = False) -> None:
    """``--workload``, ``--steps``, ``--seed``; ``data``: also ``--data PATH...`` and ``--epochs``
    (``workload_schedule``), and ``--workload`` then defaults to ``default`` only without ``--data``."""
    if data:
        add_option(p, "workload", default=None, more=f"; default {default} unless --data is given")
        add_options(p, "data", "epochs", "steps")
    else:
        add_option(p, "workload", default=default)
        add_option(p, "steps", help="steps to run (default: the preset's; 1 for a file, which repeats)")
    add_option(p, "seed")


def add_workload_preset_arguments(p: argparse.ArgumentParser) -> None:
    """``--workload NAME`` and ``--steps`` of the commands that plan a preset's steps beside batch
    files given as positional arguments (``harts plan``, ``harts stats``)."""
    add_option(p, "workload", help="built-in workload preset (tiny, small, medium, swe)", metavar="NAME")
    add_option(p, "steps", help="steps of the workload (default: all of the preset)")


def add_model_arguments(p: argparse.ArgumentParser, default_dtype: str = "float32") -> None:
    add_options(p, "model", "pattern", "layers")
    add_option(p, "dtype", default=default_dtype)
    add_options(p, "device", "la_backend", "threads")


def add_layers_argument(p: argparse.ArgumentParser) -> None:
    """``--layers N``: a preset's first N decoder layers (``check_model`` checks it against ``--model``)."""
    add_option(p, "layers")


def add_la_backend_argument(p: argparse.ArgumentParser, default: str) -> None:
    """``--la-backend``: ``ExecutionConfig.linear_attention_backend``, its choices from
    ``harts.ops.registry`` (the old name tree_linked among them)."""
    add_option(p, "la_backend", default=default)


def add_execution_arguments(p: argparse.ArgumentParser) -> None:
    """``--recompute`` (and what it keeps) and ``--attention`` (fields of ``ExecutionConfig``) for
    model-running commands; the choices from ``harts.ops.registry``."""
    add_options(p, "recompute", "recompute_skip", "recompute_layers", "moe_keep_gate_up", "attention")


def add_logprobs_argument(p: argparse.ArgumentParser, *, default: str, why: str) -> None:
    """``--logprobs {actions,all}`` (``ExecutionConfig.logprob_positions``), ``default`` with ``why``."""
    add_option(
        p,
        "logprobs",
        default=default,
        choices=("actions", "all") if default == "actions" else ("all", "actions"),
        help="where the LM head runs: only at positions whose target is an action token (actions; the other "
        f"log-probs are not computed) or at every position (all). Default {default}: {why}",
    )


def add_lora_arguments(p: argparse.ArgumentParser, *, rank_help: str = "") -> None:
    """``--lora RANK``, ``--lora-alpha`` and ``--lora-targets``: ``harts.trainer.lora.LoraConfig``'s
    rank, alpha and target flags, with its defaults; ``lora_config`` makes the config of them.
    ``rank_help``: what ``--lora`` means to this command, after what it always means."""
    add_option(p, "lora", more=f". {rank_help}" if rank_help else "")
    add_options(p, "lora_alpha", "lora_targets")


def add_output_arguments(p: argparse.ArgumentParser, *, what: str = "the figures") -> None:
    """``--json FILE`` and ``--overwrite`` (every command that writes files has both)."""
    add_option(p, "json_out", help=f"also write {what} as JSON to FILE (checked before any work)")
    add_option(p, "overwrite")


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
