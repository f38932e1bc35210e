"""One configuration surface: a ``--config`` TOML file, the flags and ``RunOptions`` in Python build
the same configs through the schema (``harts.trainer.options``); a bad or unknown entry of a file
is one error naming ``FILE: section.key``; flags override the file."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from harts.cli import build_parser, main
from harts.commands import train
from harts.commands._config import apply_config, command_options
from harts.errors import UserError
from harts.trainer.options import OPTIONS, RunOptions, execution_config, lora_config, model_spec, read_toml

#: one file that sets an option of every shared section harts train has
RUN_TOML = """
[model]
model = "tiny"
pattern = "KM"
dtype = "float64"
seed = 7

[lora]
rank = 4
alpha = 8.0
targets = ["mlp", "attn"]

[execution]
attention = "gather"
la_backend = "reference"
recompute = true
recompute_skip = ["moe"]
moe_keep_gate_up = 1
logprobs = "all"

[step]
capacity = 4096
moe_stats = "step"
planner_workers = 0

[optimizer]
lr = 3e-4
kl_coef = 0.01

[data]
workload = "tiny"
steps = 2
"""

#: the same run as flags
RUN_FLAGS = [
    "--model", "tiny", "--pattern", "KM", "--dtype", "float64", "--seed", "7",
    "--lora", "4", "--lora-alpha", "8", "--lora-targets", "mlp,attn",
    "--attention", "gather", "--la-backend", "reference", "--recompute", "--recompute-skip", "moe",
    "--moe-keep-gate-up", "1", "--logprobs", "all",
    "--capacity", "4096", "--moe-stats", "step", "--planner-workers", "0",
    "--lr", "3e-4", "--kl-coef", "0.01",
    "--workload", "tiny", "--steps", "2",
]  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    """The command line as ``harts.cli.main`` sees it, ``--config`` applied."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    return apply_config(parser, args, list(argv)) if args.config else args


def write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _run_fields(cfg: object) -> dict[str, object]:
    """A ``RunConfig``'s fields but the lazy schedule and the raw settings (which name --config)."""
    fields = dataclasses.asdict(cfg)  # type: ignore[call-overload]
    fields.pop("schedule"), fields.pop("settings")
    return fields


def test_a_file_and_the_same_flags_build_equal_train_configs(tmp_path: Path) -> None:
    from_file = train.config(parse("train", "--config", write(tmp_path, RUN_TOML)))
    from_flags = train.config(parse("train", *RUN_FLAGS))
    assert _run_fields(from_file) == _run_fields(from_flags)
    # the file's values arrived (not the defaults)
    assert from_file.train.capacity == 4096 and from_file.train.lr == pytest.approx(3e-4)
    assert from_file.train.execution.recompute_skip == ("moe",)
    assert from_file.lora is not None and from_file.lora.rank == 4 and not from_file.lora.train_unembed
    assert from_file.model.dtype == "float64" and from_file.model.seed == 7


def test_python_names_build_the_same_configs(tmp_path: Path) -> None:
    path = write(tmp_path, RUN_TOML)
    opts = RunOptions.from_toml(path)
    cli = train.config(parse("train", *RUN_FLAGS))
    assert opts.train_config() == cli.train
    assert opts.model_spec() == cli.model
    assert opts.lora_config() == cli.lora
    assert RunOptions.from_dict(read_toml(path)).train_config() == cli.train
    from harts.parallel.mesh import ParallelConfig

    parallel = RunOptions.from_dict({"parallel": {"ep": 2, "cpu_offload": True}}).parallel_config()
    assert parallel == ParallelConfig(dp=1, ep=2, cpu_offload=True)


def test_flags_override_the_file_and_the_file_the_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "[step]\ncapacity = 4096\n[optimizer]\nlr = 0.001\n")
    args = parse("train", "--config", path, "--capacity", "2048")
    assert args.capacity == 2048 and args.lr == pytest.approx(1e-3)
    assert args.kl_coef == 0.0  # neither: the default
    assert args._config_sources == {"lr": f"{path}: optimizer.lr"}


@pytest.mark.parametrize(
    "text, match",
    [
        ("[step]\ncapacity = 0\n", "step.capacity: must be a positive integer (>= 1), got '0'"),
        ("[step]\ncapacity = 1.5\n", "step.capacity: expected an integer, got '1.5'"),
        ('[step]\ncapacity = "x"\n', "step.capacity: expected an integer, got 'x'"),
        ("[step]\ncapacity = true\n", "step.capacity: expected an integer, got True"),
        ("[step]\ncapacty = 1\n", "step.capacty: harts train has no such option; [step] takes capacity"),
        ("[stepz]\ncapacity = 1\n", "[stepz]: harts train has no such section; its sections: model, lora"),
        ("capacity = 1\n", "capacity: options sit in tables"),
        ('[execution]\nrecompute = "yes"\n', "execution.recompute: expected true or false, got 'yes'"),
        ('[execution]\nattention = "dense"\n', "execution.attention: 'dense' is not one of"),
        ('[lora]\ntargets = ["mlp", "convs"]\n', "lora.targets: unknown target 'convs'"),
        ("[optimizer]\nlr = 2.0\n", "optimizer.lr: 2.0 is outside (0, 1]"),
        ("[serve]\nport = 80\n", "[serve]: harts train has no such section"),
        ("[data]\ndata = [1, 2]\n", "data.data: expected a non-empty array of strings"),
        ("[execution]\nrecompute_layers = 2\n", "execution.recompute_layers = 2 needs --recompute"),
        ("[lora]\nalpha = 4.0\n", "lora.alpha sets up LoRA adapters"),
        ("[step\n", "not valid TOML"),
    ],
)
def test_a_bad_entry_is_one_error_naming_file_and_key(tmp_path: Path, capsys, text: str, match: str) -> None:
    path = write(tmp_path, text)
    code = main(["train", "--config", path])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("harts: error: "), err
    assert match in err, err
    assert str(path) in err, err


def test_python_refuses_what_a_file_refuses() -> None:
    with pytest.raises(UserError, match=r"^options: step\.capacity: must be a positive integer"):
        RunOptions.from_dict({"step": {"capacity": -3}})
    with pytest.raises(UserError, match=r"^options: \[serve\]: RunOptions has no such section"):
        RunOptions.from_dict({"serve": {"port": 1}})
    with pytest.raises(UserError, match=r"needs --recompute"):
        RunOptions.from_dict({"execution": {"recompute_layers": 1}}).execution_config()


def test_a_missing_file_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["bench", "--config", str(tmp_path / "none.toml")]) == 2
    assert "--config" in capsys.readouterr().err


def test_bench_and_serve_take_the_same_sections(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[model]\nmodel = "tiny"\nlayers = 2\n[execution]\nrecompute = true\nrecompute_layers = 1\n'
        'attention = "gather"\n[step]\ncapacity = 1024\n',
    )
    flags = ["--model", "tiny", "--layers", "2", "--recompute", "--recompute-layers", "1", "--attention", "gather"]
    for command in ("bench", "serve"):
        from_file, from_flags = parse(command, "--config", path), parse(command, *flags, "--capacity", "1024")
        assert execution_config(from_file) == execution_config(from_flags), command
        assert model_spec(from_file) == model_spec(from_flags), command
        assert from_file.capacity == from_flags.capacity == 1024, command
    serve = parse("serve", "--config", write(tmp_path, "[serve]\nmax_models = 3\nport = 8123\n", "serve.toml"))
    assert (serve.max_models, serve.port) == (3, 8123)
    with pytest.raises(UserError, match=r"serve\.toml: \[parallel\]: harts serve has no such section"):
        parse("serve", "--config", write(tmp_path, "[parallel]\ntp = 2\n", "serve.toml"))
    bench = parse("bench", "--config", write(tmp_path, "[bench]\nrepeats = 3\n[parallel]\nep = 2\n", "b.toml"))
    assert (bench.repeats, bench.ep) == (3, 2)
    assert lora_config(bench) is None


def test_every_command_spells_a_shared_option_as_the_schema() -> None:
    """A shared option is the same flag with the same check in every command that has it, and
    harts train's defaults are the schema's (``RunOptions`` in Python starts from them)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    schema = {o.dest: o for o in OPTIONS}
    seen = set()
    # (harts fidelity takes no --config: its --recompute is a choice of sides, on / off / both)
    for command in ("train", "bench", "serve", "compare"):
        for option in command_options(sub.choices[command], command).values():
            shared = schema.get(option.dest)
            if shared is None:
                continue
            seen.add(option.dest)
            assert option.option == shared.option, (command, option.dest)
            if option.dest == "threads" and command == "serve":  # torch's own count unless given
                continue
            assert option.type is shared.type, (command, option.dest)
            assert option.switch == shared.switch and option.many == shared.many, (command, option.dest)
            if shared.choices is not None:
                # a command may take fewer (harts compare: float32 and float64 only)
                assert set(option.allowed() or ()) <= set(shared.allowed() or ()), (command, option.dest)
            if command == "train":
                assert option.default == shared.default, option.dest
    assert seen == set(schema)  # no schema entry is a flag no command has


def test_serve_flags_default_to_serve_config() -> None:
    """``harts serve``'s flags restate no default of ``ServeConfig`` differently."""
    from harts.serve.config import ServeConfig

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = {a.dest: a.default for a in sub._actions}
    compared = 0
    for f in dataclasses.fields(ServeConfig):
        # --api-key's None: the key comes from $HARTS_SERVE_API_KEY
        if f.name in flags and f.name != "api_key" and f.default is not dataclasses.MISSING:
            default = str(f.default) if isinstance(f.default, Path) else f.default
            assert flags[f.name] == default, f.name
            compared += 1
    assert compared >= 15
    assert flags["max_request_mb"] * (1 << 20) == ServeConfig.__dataclass_fields__["max_request_bytes"].default


def test_python_options_train_a_step() -> None:
    """``RunOptions`` in a user's script: build the model and train one step with its configs."""
    import harts
    from harts.trainer.build import build_model
    from harts.tree.workloads import generate

    opts = harts.RunOptions.from_dict(
        {"model": {"pattern": "KM", "seed": 1}, "step": {"capacity": 2048, "planner_workers": 0}}
    )
    batch = generate("tiny", step=0, seed=0)
    model = build_model(opts.model_spec(), vocab_size=batch.vocab_size or int(batch.tokens.max()) + 1)
    logs = harts.train(model, [batch], opts.train_config())
    assert len(logs) == 1 and logs[0].microbatches >= 1
