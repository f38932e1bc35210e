"""The schema of a run's options: one name, one check and one default per option, and the one
place the run's configs are built from them.

A run is configured three ways that agree: command-line flags (``harts train --capacity 4096``),
a TOML file (``harts train --config run.toml``, a ``[step]`` table with ``capacity = 4096``)
and Python (``RunOptions.from_dict({"step": {"capacity": 4096}})``). Each option has a section
and a key (``OPTIONS``: model, lora, execution, step, parallel, optimizer, data, outputs); its
flag is its argparse destination spelled with dashes (``--la-backend``), LoRA's three excepted
(``lora.rank`` is ``--lora``). An option only one command has (``harts serve --port``) sits in
that command's own section (``[serve] port = 8000``), keyed by its flag's name. Precedence:
defaults < the file < flags.

Every value a file or a dict gives goes through the flag's own check (``convert``), so a bad
value is one ``UserError`` naming ``FILE: section.key``; an unknown section or key is one too.
The configs are then built here and nowhere else, from flags and file alike (``Values``):
``execution_config`` (``ExecutionConfig``), ``lora_config`` (``LoraConfig``), ``model_spec``
(``ModelSpec``) and ``train_config`` (``TrainConfig``).

Module level imports only the standard library and ``harts.ops.registry`` (which imports
nothing), so the command line's ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harts.errors import UserError
from harts.ops.registry import ATTENTION_IMPLS, linear_attn_choices

if TYPE_CHECKING:
    from harts.models.execution.config import ExecutionConfig
    from harts.parallel.mesh import ParallelConfig
    from harts.trainer.build import ModelSpec
    from harts.trainer.lora import LoraConfig
    from harts.trainer.step import TrainConfig

__all__ = [
    "LORA_TARGETS",
    "MODEL_PRESETS",
    "OPTIONS",
    "SECTIONS",
    "Option",
    "RunOptions",
    "Values",
    "convert",
    "execution_config",
    "learning_rate",
    "lora_config",
    "lora_targets",
    "model_spec",
    "names",
    "nonneg_float",
    "nonneg_int",
    "option_of",
    "planner_workers",
    "positive_float",
    "positive_int",
    "read_toml",
    "recompute_fields",
    "sections_of",
    "seed_int",
    "table_values",
    "train_config",
    "workers_int",
]


# ------------------------------------------------------------------ value checks
# argparse types (argparse names the flag in their error); a file's values go through the same ones
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {text!r}")
    return v


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer (>= 0), got {text!r}")
    return v


def workers_int(text: str) -> int | str:
    """``auto`` or an integer >= 0 (``--planner-workers``)."""
    if text.strip().lower() == "auto":
        return "auto"
    return nonneg_int(text)


def seed_int(text: str) -> int:
    """A seed, 0 <= seed < 2**32 (numpy's and torch's common range)."""
    v = nonneg_int(text)
    if v >= 2**32:
        raise argparse.ArgumentTypeError(f"must be below 2**32, got {text!r}")
    return v


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number > 0."""
    v = _float(text)
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    v = _float(text)
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def learning_rate(text: str) -> float:
    """A learning rate in (0, 1] (``harts.trainer.checks.check_lr``: AdamW moves every weight by
    about the learning rate per step, so a larger one diverges)."""
    from harts.trainer.checks import check_lr

    v = _float(text)
    try:
        return check_lr(v, "--lr", zero=False)
    except UserError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--lr: ")) from None


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names (checked where they are used)."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


#: ``LoraConfig``'s target flags by name (``harts.trainer.lora.LORA_TARGETS``: this module imports
#: no torch, so the names are spelled out here and a test keeps the two equal)
LORA_TARGETS = ("attn", "mlp", "unembed")


def lora_targets(text: str) -> tuple[str, ...]:
    """A comma-separated list of ``LORA_TARGETS`` names, in their order."""
    given = names(text)
    unknown = [n for n in given if n not in LORA_TARGETS]
    if unknown or not given:
        what = f"unknown target {unknown[0]!r}" if unknown else "no target"
        raise argparse.ArgumentTypeError(f"{what} in {text!r}; the targets, comma-separated: {', '.join(LORA_TARGETS)}")
    return tuple(t for t in LORA_TARGETS if t in given)


#: the checks whose value is a list: a file gives it as a TOML array (or one comma-separated string)
_LIST_TYPES: tuple[Callable[[str], Any], ...] = (names, lora_targets)


# ------------------------------------------------------------------------ schema
@dataclass(frozen=True, slots=True)
class Option:
    """One option: where it sits in a file (``section.key``), its argparse destination (the flag
    is ``--`` + ``dest`` with dashes, unless ``flag`` says otherwise), its check, default and help
    (``harts.commands._inputs.add_option`` makes the flag of them)."""

    section: str
    key: str
    dest: str
    #: the flag's argparse type (a function of the flag's text); None: a string
    type: Callable[[str], Any] | None = None
    #: the allowed values (a callable: resolved when asked, as the registry's names)
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None
    #: an on/off switch: a file gives true or false; the command line ``--X`` and ``--no-X``
    #: (``--no-X`` turns off what a ``--config`` file turned on)
    switch: bool = False
    #: several values (``nargs="+"``): a file gives an array of strings
    many: bool = False
    default: Any = None
    flag: str = ""
    #: the flag's ``--help`` text, as ``harts train`` (the reference command) means it
    help: str = ""
    #: the value's name in ``--help`` (None: argparse's, the destination in capitals)
    metavar: str | None = None

    @property
    def option(self) -> str:
        """The command-line flag."""
        return self.flag or "--" + self.dest.replace("_", "-")

    def allowed(self) -> tuple[str, ...] | None:
        """The allowed values now (a callable ``choices`` is asked at each call), or None: any."""
        return self.choices() if callable(self.choices) else self.choices


def _la_choices() -> tuple[str, ...]:
    return tuple(linear_attn_choices())


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
    "nemotron_3_nano_30b_a3b",
    "granite_4_0_h_small",
)

_RECOMPUTE_SKIP_HELP = (
    "with --recompute: cores not rerun in the backward, their forward kept instead (comma-separated: attention, "
    "linear_attention, moe; more memory, less time)"
)
_MOE_KEEP_HELP = (
    "with --recompute-skip ...,moe: the first N MoE layers keep their routed experts' gate/up output for the "
    "backward instead of recomputing it (one grouped GEMM fewer per layer; rows x top-k x 2 x moe_intermediate "
    "half-precision entries more per layer: about 1.07 GB at 65,536 rows of ling3_tiny); default 0"
)
_LA_BACKEND_HELP = (
    "linear-attention core: torch reference, fla-core split path (CUDA), the one-pass tree kernel (CUDA; one call "
    "per round), or auto (on CUDA with fla-core: the tree kernel with a compact microbatch's rounds linked into one "
    "op per layer; reference elsewhere); tree_linked: tree with the rounds linked"
)
_PLANNER_WORKERS_HELP = (
    "processes that build the step planner's independent candidates in parallel (the same plan, sooner; steps of "
    "fewer than 1,000 trajectories are planned in this process anyway); 0 plans in this process; auto (default): "
    "4 where at least 6 cores are usable, else 0"
)

#: every option more than one command shares, by section; defaults and help are ``harts train``'s
#: (a command states only what differs for it: ``add_option``'s overrides; a test holds each
#: command's flags to these names and checks)
OPTIONS: tuple[Option, ...] = (
    # the model: which weights, in what dtype, where
    Option(
        "model",
        "model",
        "model",
        default="tiny",
        metavar="PRESET|PATH",
        help=f"model preset ({', '.join(MODEL_PRESETS)}: the real models' shapes, random init) or a transformers "
        "checkpoint directory (BailingHybrid / Qwen3-Next / Qwen3.5 / Kimi Linear / Nemotron-H / Granite 4.0-H)",
    ),
    Option("model", "pattern", "pattern", help="override a preset's layer pattern, e.g. KKKM"),
    Option(
        "model",
        "layers",
        "layers",
        positive_int,
        metavar="N",
        help="keep the first N decoder layers of the preset's layer pattern (after --pattern), at its real widths, "
        "heads and experts, e.g. --model qwen3_next_80b_a3b --layers 4; presets only (default: all layers)",
    ),
    Option(
        "model", "dtype", "dtype", choices=("float32", "float64", "bfloat16"), default="float32", help="parameter dtype"
    ),
    Option("model", "device", "device", default="cpu", help="cpu, cuda, cuda:1, ... (checked before any work)"),
    Option(
        "model", "threads", "threads", nonneg_int, default=1, help="torch intra-op threads on CPU; 0 lets torch choose"
    ),
    Option("model", "seed", "seed", seed_int, default=0, help="workload and model-init seed"),
    # LoRA adapters over the frozen base (``harts.trainer.lora.LoraConfig``)
    Option(
        "lora",
        "rank",
        "lora",
        positive_int,
        flag="--lora",
        metavar="RANK",
        help="train rank-RANK LoRA adapters (float32) on every projection of --lora-targets, each routed expert its "
        "own, with the base weights frozen in --dtype: only the adapters get gradients and AdamW state; default: "
        "train every weight",
    ),
    Option(
        "lora",
        "alpha",
        "lora_alpha",
        positive_float,
        metavar="ALPHA",
        help="with --lora: the adapters' scale is ALPHA / RANK (default 32 at every rank, as Tinker's LoRA)",
    ),
    Option(
        "lora",
        "targets",
        "lora_targets",
        lora_targets,
        metavar="NAMES",
        help="with --lora: the projections that get adapters, comma-separated: attn (attention and linear "
        "attention), mlp (dense MLP, shared and routed experts; not the router), unembed (the LM head); default all "
        "three",
    ),
    # how each forward runs (``harts.models.execution.config.ExecutionConfig``)
    Option(
        "execution",
        "mode",
        "mode",
        choices=("compact", "trajectory"),
        default="compact",
        help="compact (harts) or trajectory (the baseline: raw-token microbatches)",
    ),
    Option(
        "execution",
        "attention",
        "attention",
        choices=ATTENTION_IMPLS,
        default="auto",
        help="full attention: one call per branch (gather), one FlexAttention call over the tree mask (mask), or "
        "mask on CUDA / gather on CPU (auto, default)",
    ),
    Option("execution", "la_backend", "la_backend", choices=_la_choices, default="auto", help=_LA_BACKEND_HELP),
    Option(
        "execution", "recompute", "recompute", switch=True, default=False, help="full-layer activation recomputation"
    ),
    Option(
        "execution",
        "recompute_skip",
        "recompute_skip",
        names,
        default=(),
        metavar="CORES",
        help=_RECOMPUTE_SKIP_HELP,
    ),
    Option(
        "execution",
        "recompute_layers",
        "recompute_layers",
        nonneg_int,
        metavar="N",
        help="with --recompute: checkpoint only the first N decoder layers, the others keep their activations "
        "(default: all layers; more memory, less time)",
    ),
    Option(
        "execution", "moe_keep_gate_up", "moe_keep_gate_up", nonneg_int, default=0, metavar="N", help=_MOE_KEEP_HELP
    ),
    Option(
        "execution",
        "logprobs",
        "logprobs",
        choices=("actions", "all"),
        default="actions",
        help="where the LM head runs: only at positions whose target is an action token (actions; the other "
        "log-probs are not computed) or at every position (all). Default actions: the GRPO loss and the step logs "
        "read no other log-prob",
    ),
    # the step: capacity and planning (``harts.trainer.step.TrainConfig``)
    Option(
        "step",
        "capacity",
        "capacity",
        positive_int,
        default=65_536,
        help="microbatch capacity T (compact tokens; raw tokens with --mode trajectory)",
    ),
    Option(
        "step",
        "replicas",
        "replicas",
        positive_int,
        help="replicas of the step plan, a multiple of ranks / (--cp x --tp) (default: that); the same value keeps "
        "the plan, and so the step's MoE objective, when a run resumes on another number of ranks",
    ),
    Option(
        "step",
        "moe_stats",
        "moe_stats",
        choices=("microbatch", "step"),
        default="microbatch",
        help="MoE z/aux-loss statistics: per microbatch (the paper's) or over the whole step (independent of "
        "microbatching and ranks; one extra no-grad forward per microbatch)",
    ),
    Option(
        "step",
        "reduce_every_microbatch",
        "reduce_every_microbatch",
        switch=True,
        default=False,
        help="reduce-scatter FSDP gradients after each microbatch (less memory, more communication) instead of "
        "once per step",
    ),
    Option(
        "step",
        "no_prepare_ahead",
        "no_prepare_ahead",
        switch=True,
        default=False,
        help="prepare each microbatch's host inputs in the training thread right before it runs, not on a "
        "background thread while the one before it is launched (the same inputs; for debugging)",
    ),
    Option(
        "step",
        "planner_workers",
        "planner_workers",
        workers_int,
        default="auto",
        metavar="N|auto",
        help=_PLANNER_WORKERS_HELP,
    ),
    # the mesh (``harts.parallel.mesh.ParallelConfig``)
    Option("parallel", "dp", "dp", positive_int, help="ranks that hold the same experts (default: ranks / --ep)"),
    Option(
        "parallel",
        "ep",
        "ep",
        positive_int,
        default=1,
        help="expert-parallel degree: ranks each MoE layer is split over",
    ),
    Option(
        "parallel",
        "cp",
        "cp",
        positive_int,
        default=1,
        help="Ulysses context-parallel degree: ranks that split each microbatch's compact rows (all-to-all around "
        "every token mixer); it divides --capacity and the model's heads",
    ),
    Option(
        "parallel",
        "tp",
        "tp",
        positive_int,
        default=1,
        help="tensor-parallel degree with sequence parallelism: ranks that split the attention, linear-attention "
        "and MLP projections by heads / columns, and each microbatch's rows between them",
    ),
    Option(
        "parallel",
        "cpu_offload",
        "cpu_offload",
        switch=True,
        default=False,
        help="FSDP2 CPU offload of parameters, gradients, optimizer",
    ),
    Option(
        "parallel",
        "meta_init",
        "meta_init",
        switch=True,
        default=False,
        help="build the model on the meta device and initialise it after sharding, also on one process (always so "
        "on several ranks: no rank holds the whole model)",
    ),
    # the optimizer and the objective
    Option(
        "optimizer",
        "lr",
        "lr",
        learning_rate,
        default=1e-4,
        help="AdamW learning rate, in (0, 1]: AdamW moves every weight by about this much per step, so a larger one "
        "diverges",
    ),
    Option(
        "optimizer", "kl_coef", "kl_coef", nonneg_float, default=0.0, help="KL penalty coefficient (needs ref_logprobs)"
    ),
    # the steps' batches
    Option(
        "data",
        "workload",
        "workload",
        metavar="NAME|FILE",
        help="built-in workload preset (tiny, small, medium, swe) or a batch file (.jsonl/.parquet)",
    ),
    Option(
        "data",
        "data",
        "data",
        many=True,
        metavar="PATH",
        help="batch files to train on, one step each, in the order given: files, directories (their .jsonl/.parquet "
        "files below, sorted by path) and glob patterns (quoted; sorted matches)",
    ),
    Option(
        "data",
        "epochs",
        "epochs",
        positive_int,
        default=1,
        help="passes over the steps (--data's files or the workload's)",
    ),
    Option(
        "data",
        "steps",
        "steps",
        positive_int,
        help="steps to run (default: the preset's; 1 for a file, which repeats; with --data: the first N of the "
        "files x epochs)",
    ),
    # what the run writes
    Option(
        "outputs",
        "run_dir",
        "run_dir",
        metavar="DIR",
        help="the run's directory: DIR/metrics.jsonl gets every step's metrics (harts plot DIR draws them), "
        "DIR/checkpoints resumable checkpoints (at the end, on interrupt, and every --save-every steps)",
    ),
    Option("outputs", "save_every", "save_every", positive_int, metavar="N", help="checkpoint every N steps"),
    Option(
        "outputs",
        "resume",
        "resume",
        metavar="RUN_DIR|auto",
        help="continue the run in RUN_DIR from its latest checkpoint (and keep checkpointing there); auto: continue "
        "--run-dir from its newest checkpoint that loads, or start it there when it has none",
    ),
    Option(
        "outputs",
        "save",
        "save",
        metavar="DIR",
        help="save the trained weights here, in a directory --model DIR loads (a transformers checkpoint when "
        "--model was one, else harts' own: config.json + model.safetensors); with --lora the adapters alone "
        "(adapter_config.json + adapter_model.safetensors: PEFT's layout for a transformers --model, harts' own for "
        "a preset); also on Ctrl-C / SIGTERM, after the last completed step",
    ),
    Option(
        "outputs",
        "export_hf",
        "export_hf",
        metavar="DIR",
        help="also save the trained weights as a transformers checkpoint (config.json + safetensors) here, whenever "
        "--save would; for a --model that is a transformers checkpoint; with --lora the adapters merged into the "
        "weights (W + alpha / RANK * B A)",
    ),
    Option(
        "outputs",
        "json",
        "json_out",
        flag="--json",
        metavar="FILE",
        help="also write the step logs as JSON to FILE (checked before any work)",
    ),
    Option(
        "outputs",
        "overwrite",
        "overwrite",
        switch=True,
        default=False,
        help="replace existing output files (without it, an existing output is an error)",
    ),
    Option(
        "outputs",
        "tensorboard",
        "tensorboard",
        switch=True,
        default=False,
        help="also log the metrics to RUN_DIR/tensorboard (needs tensorboard)",
    ),
    Option(
        "outputs",
        "wandb",
        "wandb",
        metavar="PROJECT",
        help="also log the metrics to this Weights & Biases project (needs wandb and a run directory)",
    ),
)

#: the shared sections, in file order
SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(o.section for o in OPTIONS))
_BY_DEST = {o.dest: o for o in OPTIONS}


def option_of(dest: str) -> Option | None:
    """The shared option with argparse destination ``dest`` (None: a command's own option)."""
    return _BY_DEST.get(dest)


# ---------------------------------------------------------------------- values
def convert(value: Any, option: Option, where: str) -> Any:  # noqa: ANN401 - a TOML value
    """``value`` (from a file or a dict) checked as ``option``'s flag checks its text; one
    ``UserError`` naming ``where`` (``FILE: section.key``) otherwise."""
    if option.switch:
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false, got {value!r}")
        return value
    if option.many:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
            raise UserError(f"{where}: expected a non-empty array of strings, got {value!r}")
        return list(items)
    if isinstance(value, list) and option.type in _LIST_TYPES and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UserError(f"{where}: expected {_expected(option)}, got {value!r}")
    if option.type is None and not isinstance(value, str):
        raise UserError(f"{where}: expected a string, got {value!r}")
    text = value if isinstance(value, str) else repr(value)
    try:
        checked = text if option.type is None else option.type(text)
    except (argparse.ArgumentTypeError, ValueError) as err:
        raise UserError(f"{where}: {err}") from None
    allowed = option.allowed()
    if allowed is not None and checked not in allowed:
        raise UserError(f"{where}: {value!r} is not one of {', '.join(allowed)}")
    return checked


def _expected(option: Option) -> str:
    if option.type in _LIST_TYPES:
        return "an array of strings"
    if option.type is None:
        return "a string"
    return "a number" if option.type in (positive_float, nonneg_float, learning_rate) else "an integer"


def read_toml(path: str, source: str | None = None) -> dict[str, Any]:
    """The tables of TOML file ``path``; one ``UserError`` naming ``source`` (default ``--config
    PATH``) when it cannot be read or parsed. The standard library reads TOML from Python 3.11,
    tomli (where installed) before."""
    source = source or f"--config {path}"
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[import-not-found, no-redef]
        except ModuleNotFoundError:
            raise UserError(f"{source}: reading TOML needs Python 3.11+ or the tomli package") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise UserError(f"{source}: cannot read it ({err.strerror or err})") from None
    except ValueError as err:  # TOMLDecodeError, or bytes that are not UTF-8
        line = (str(err).strip().splitlines() or [""])[0]
        raise UserError(f"{source}: not valid TOML ({line})") from None
    return data


def sections_of(options: Iterable[tuple[str, str]]) -> list[str]:
    """The tables of ``options``' (section, key) pairs, in the schema's order (``SECTIONS``) and a
    command's own last: the order errors and ``--config``'s help list them in."""
    order = {s: i for i, s in enumerate(SECTIONS)}
    return sorted(dict.fromkeys(s for s, _ in options), key=lambda s: order.get(s, len(order)))


def table_values(
    data: Mapping[str, Any], source: str, options: Mapping[tuple[str, str], Option], owner: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """``data``'s tables checked against ``options`` ((section, key) -> option, what ``owner``
    takes): argparse destination -> value, and destination -> ``source: section.key``. The first
    unknown section, unknown key or bad value is one ``UserError`` naming it."""
    sections = sections_of(options)
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise UserError(
                f"{source}: {section}: options sit in tables ([model], [execution], ...), not at the top level"
            )
        if section not in sections:
            raise UserError(f"{source}: [{section}]: {owner} has no such section; its sections: {', '.join(sections)}")
        for key, value in table.items():
            option = options.get((section, key))
            name = f"{source}: {section}.{key}"
            if option is None:
                known = [k for s, k in options if s == section]
                raise UserError(f"{name}: {owner} has no such option; [{section}] takes {', '.join(known)}")
            values[option.dest] = convert(value, option, name)
            where[option.dest] = name
    return values, where


# ------------------------------------------------------------------------ values
@dataclass
class Values:
    """A run's option values by argparse destination (a parsed command line, or a file's and a
    dict's values over the defaults), and where each came from, so that an error names the file
    and key a value came from, or else its flag."""

    values: Mapping[str, Any]
    #: destination -> ``FILE: section.key`` for the values a file gave
    sources: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, args: argparse.Namespace | Values) -> Values:
        """The values of parsed flags (``--config`` recorded the file's in ``_config_sources``)."""
        if isinstance(args, Values):
            return args
        return cls(vars(args), getattr(args, "_config_sources", {}))

    def get(self, dest: str, default: Any = None) -> Any:  # noqa: ANN401 - any option's value
        """The value of destination ``dest``, ``default`` where this command has no such option."""
        return self.values.get(dest, default)

    def has(self, dest: str) -> bool:
        """Whether this command has option ``dest`` (a config is built from the options it has)."""
        return dest in self.values

    def name(self, dest: str) -> str:
        """Where ``dest``'s value came from: ``FILE: section.key``, or its flag."""
        if dest in self.sources:
            return self.sources[dest]
        option = option_of(dest)
        return option.option if option is not None else "--" + dest.replace("_", "-")

    def said(self, dest: str) -> str:
        """``dest`` with its value, as a message names it: ``--recompute-layers 2``, or
        ``run.toml: execution.recompute_layers = 2``."""
        value = self.get(dest)
        return f"{self.name(dest)} = {value!r}" if dest in self.sources else f"{self.name(dest)} {value}"


# ----------------------------------------------------------------------- configs
def recompute_fields(values: argparse.Namespace | Values) -> dict[str, Any]:
    """``recompute``, ``recompute_skip``, ``recompute_layers`` and ``moe_keep_gate_up`` of
    ``ExecutionConfig``; a bad core, a skip or layer count without recomputation, or kept gate/up
    outputs without a kept MoE block is a ``UserError`` naming the option."""
    from harts.models.execution.config import check_recompute_skip

    v = Values.of(values)
    recompute = bool(v.get("recompute", False))
    skip = tuple(v.get("recompute_skip", ()) or ())
    try:
        check_recompute_skip(skip, recompute)
    except ValueError as err:
        raise UserError(f"{v.name('recompute_skip')}: {err}") from None
    layers = v.get("recompute_layers")
    if layers is not None and not recompute:
        raise UserError(
            f"{v.said('recompute_layers')} needs {v.name('recompute')} (without it no layer is checkpointed)"
        )
    keep = v.get("moe_keep_gate_up", 0) or 0
    if keep and "moe" not in skip:
        raise UserError(
            f"{v.said('moe_keep_gate_up')} needs {v.name('recompute')} {v.name('recompute_skip')} with moe in it "
            "(only a kept MoE block's lean routed experts recompute their gate/up output)"
        )
    return {"recompute": recompute, "recompute_skip": skip, "recompute_layers": layers, "moe_keep_gate_up": keep}


def execution_config(values: argparse.Namespace | Values, **fixed: Any) -> ExecutionConfig:
    """The ``ExecutionConfig`` of the options a command has (mode, attention, linear-attention
    backend, recomputation, log-prob positions), with ``fixed`` fields set by the command itself
    (``fused_logprobs=True``, a side's ``mode``)."""
    from harts.models.execution.config import ExecutionConfig

    v = Values.of(values)
    fields: dict[str, Any] = recompute_fields(v)
    for dest, name in (("mode", "mode"), ("attention", "attention"), ("la_backend", "linear_attention_backend")):
        if v.has(dest):
            fields[name] = v.get(dest)
    if v.has("logprobs"):
        fields["logprob_positions"] = v.get("logprobs")
    fields.update(fixed)
    return ExecutionConfig(**fields)


def lora_config(values: argparse.Namespace | Values) -> LoraConfig | None:
    """The ``LoraConfig`` of ``lora.rank``, ``lora.alpha`` and ``lora.targets`` (its adapters'
    seed is ``model.seed``), None without a rank. A ``UserError`` naming the option: an alpha or
    targets without a rank, or a value ``LoraConfig`` refuses."""
    from harts.trainer.lora import LoraConfig

    v = Values.of(values)
    rank = v.get("lora")
    alpha, targets = v.get("lora_alpha"), v.get("lora_targets")
    if rank is None:
        for dest, value in (("lora_alpha", alpha), ("lora_targets", targets)):
            if value is not None:
                raise UserError(
                    f"{v.name(dest)} sets up LoRA adapters, which --lora RANK turns on: give --lora RANK "
                    "(lora.rank in a file) too"
                )
        return None
    fields: dict[str, Any] = {} if alpha is None else {"alpha": alpha}
    if targets is not None:
        fields.update({f"train_{t}": t in targets for t in LORA_TARGETS})
    try:
        return LoraConfig(rank=rank, seed=v.get("seed", 0), **fields)
    except UserError as err:
        raise UserError(f"{v.said('lora')}: {err}") from None


def model_spec(values: argparse.Namespace | Values) -> ModelSpec:
    """The ``ModelSpec`` of the model's options and the execution's kernels (those a command has)."""
    from harts.trainer.build import ModelSpec

    v = Values.of(values)
    return ModelSpec(
        model=v.get("model", "tiny"),
        pattern=v.get("pattern"),
        layers=v.get("layers"),
        dtype=v.get("dtype"),
        device=v.get("device", "cpu"),
        la_backend=v.get("la_backend", "reference"),
        attention=v.get("attention", "auto"),
        threads=v.get("threads", 1),
        seed=v.get("seed", 0),
    )


def planner_workers(value: int | str) -> int:
    """``step.planner_workers``' process count (``auto`` resolved for this machine)."""
    from harts.plan.step.workers import auto_workers

    return auto_workers() if value == "auto" else int(value)


def train_config(values: argparse.Namespace | Values, **fixed: Any) -> TrainConfig:
    """The ``TrainConfig`` of the step's, the optimizer's and the execution's options. Both modes
    compute log-probs chunked: the baseline's plain log_softmax would hold [positions, V] logits
    (tens of GiB per microbatch at a 157 k vocabulary)."""
    from harts.trainer.step import TrainConfig

    v = Values.of(values)
    mode = v.get("mode", "compact")
    return TrainConfig(
        capacity=v.get("capacity", 65_536),
        execution=execution_config(v, fused_logprobs=True),
        lr=v.get("lr", 1e-4),
        kl_coef=v.get("kl_coef", 0.0),
        replicas=v.get("replicas"),
        moe_statistics=v.get("moe_stats", "microbatch"),
        reduce_every_microbatch=bool(v.get("reduce_every_microbatch", False)),
        planner_workers=planner_workers(v.get("planner_workers", "auto")) if mode == "compact" else 0,
        prepare_ahead=not v.get("no_prepare_ahead", False),
        **fixed,
    )


# ----------------------------------------------------------------------- Python
@dataclass
class RunOptions:
    """A run's options in Python, by the names a file uses: ``RunOptions.from_toml("run.toml")``
    or ``RunOptions.from_dict({"model": {"model": "tiny"}, "step": {"capacity": 4096}})`` check
    every value as its flag does, and build the same configs ``harts train`` builds from them.

    Example::

        opts = RunOptions.from_dict({"execution": {"recompute": True}, "optimizer": {"lr": 3e-4}})
        model = harts.trainer.build.build_model(opts.model_spec(), vocab_size=1024)
        logs = harts.train(model, batches, opts.train_config())
    """

    #: every shared option's value by argparse destination (defaults where not given)
    values: dict[str, Any]
    #: destination -> ``SOURCE: section.key`` for the values given
    sources: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "options") -> RunOptions:
        """Options from ``{section: {key: value}}`` (``OPTIONS``); a ``UserError`` naming
        ``source: section.key`` for an unknown section or key or a bad value."""
        given, sources = table_values(data, source, {(o.section, o.key): o for o in OPTIONS}, "RunOptions")
        return cls({**{o.dest: o.default for o in OPTIONS}, **given}, sources)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> RunOptions:
        """Options from the TOML file ``path`` (the shared sections; a command's own ``[train]``,
        ``[serve]``... tables are the command line's)."""
        return cls.from_dict(read_toml(os.fspath(path)), source=os.fspath(path))

    @property
    def _values(self) -> Values:
        return Values(self.values, self.sources)

    def execution_config(self, **fixed: Any) -> ExecutionConfig:
        """``[execution]``'s ``ExecutionConfig`` (``execution_config``), ``fixed`` fields set as given."""
        return execution_config(self._values, **fixed)

    def lora_config(self) -> LoraConfig | None:
        """``[lora]``'s ``LoraConfig``, None without a rank (``lora_config``)."""
        return lora_config(self._values)

    def model_spec(self) -> ModelSpec:
        """``[model]``'s ``ModelSpec``, with the execution's kernels (``model_spec``)."""
        return model_spec(self._values)

    def train_config(self, **fixed: Any) -> TrainConfig:
        """The ``TrainConfig`` of ``[step]``, ``[optimizer]`` and ``[execution]`` (``train_config``)."""
        return train_config(self._values, **fixed)

    def parallel_config(self) -> ParallelConfig:
        """The mesh of ``[parallel]`` (``dp`` unset: 1, one process's replica)."""
        from harts.parallel.mesh import ParallelConfig

        v = self.values
        return ParallelConfig(dp=v["dp"] or 1, ep=v["ep"], cp=v["cp"], tp=v["tp"], cpu_offload=v["cpu_offload"])
