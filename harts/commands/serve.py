"""``harts serve``: a Tinker-compatible training server for one model (``harts.serve``).

    harts serve --model tiny --port 8000 --api-key tml-local-0123456789abcdef
    # then:  tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-local-0123456789abcdef")

The real ``tinker`` SDK (0.38) trains through it: LoRA training clients (``forward``,
``forward_backward`` with cross_entropy / importance_sampling / ppo / cispo, custom losses,
``optim_step``), checkpoints (``save_state``, ``create_training_client_from_state[_with_optimizer]``,
``save_weights_for_sampler``), sampling clients (harts' sampler, with the prompt's state forked
per sample) and the RestClient's listings. Every request needs an API key: ``--api-key`` (or the
``HARTS_SERVE_API_KEY`` environment variable) for one tenant, ``--keys-file`` for several, each of
which sees only its own sessions, runs and checkpoints (``harts.serve.tenants``); checkpoints go
under ``--state-dir``. ``docs/SERVE.md`` is the user guide.

Ctrl-C / SIGTERM stop the server after the running request; results of finished requests that
were never fetched are lost with it, checkpoints on disk are not.
"""

from __future__ import annotations

import argparse

from harts.commands._config import add_config_argument
from harts.commands._inputs import (
    MODEL_PRESETS,
    add_execution_arguments,
    add_option,
    add_output_arguments,
    positive_float,
    positive_int,
)
from harts.commands._memory import add_force_argument

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "A Tinker-compatible training server: the tinker SDK trains, samples and saves a harts model."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_option(
        p,
        "model",
        metavar="PRESET_OR_DIR",
        help=f"a preset ({', '.join(MODEL_PRESETS)}: the real models' shapes, random init) or a "
        "transformers / harts checkpoint directory",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="the name clients pass as base_model (default: the preset name, or the directory's name)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a tokenizer directory (AutoTokenizer files) served with the model: clients' get_tokenizer loads it "
        "and string stop sequences decode with it (default: the checkpoint directory's own; a preset has none)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (any other than a loopback one is logged as a warning: keys travel over plain HTTP)",
    )
    p.add_argument("--port", type=positive_int, default=8000, help="TCP port")
    p.add_argument(
        "--api-key",
        default=None,
        help="the one tenant's key every request must carry (default: $HARTS_SERVE_API_KEY): 'tml-' and at least "
        "16 more printable characters",
    )
    p.add_argument(
        "--keys-file",
        default=None,
        metavar="PATH",
        help='several tenants, instead of --api-key: a TOML file of [tenants.NAME] tables with key = "tml-..." '
        "(distinct keys, each as --api-key takes it); a tenant sees, trains, samples and deletes only its own "
        "sessions, runs and checkpoints (docs/SERVE.md)",
    )
    p.add_argument(
        "--state-dir",
        default="harts-serve",
        metavar="DIR",
        help="where checkpoints go (runs/<model_id>/...); client paths never leave it",
    )
    add_option(p, "device", help="torch device of the engines")
    add_option(p, "dtype")
    add_option(
        p,
        "layers",
        help="keep the first N decoder layers of a preset's layer pattern, at its real widths, heads and experts; "
        "presets only (default: all layers)",
    )
    add_option(p, "la_backend")
    add_execution_arguments(p)
    add_option(p, "seed", help="model init (presets), default LoRA seed, sampling seeds")
    add_option(
        p,
        "capacity",
        help="engine microbatch capacity in tokens; also the longest datum and prompt + completion",
    )
    p.add_argument(
        "--max-models",
        type=positive_int,
        default=8,
        help="training runs held in memory at once (LoRA runs share the served weights; each adds its adapters)",
    )
    p.add_argument("--max-samples", type=positive_int, default=256, help="largest num_samples of one sample request")
    _add_limit_arguments(p)
    p.add_argument(
        "--max-snapshots",
        type=positive_int,
        default=32,
        help="in-memory adapter snapshots for sampling clients (the oldest are dropped)",
    )
    p.add_argument(
        "--max-request-mb", type=positive_float, default=256.0, help="largest request body, MiB (uncompressed)"
    )
    p.add_argument(
        "--poll-seconds", type=positive_float, default=30.0, help="how long one future poll waits before 'try again'"
    )
    add_option(p, "threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log")
    add_force_argument(p)
    add_output_arguments(p, what="the server's base URL, served model and state directory, once it listens,")
    add_config_argument(p)


def _add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """What one request or connection may take, so that one client cannot stall the others:
    each request past a limit is refused with a 400 naming the field and the flag, before any
    of its work is queued (the worker also takes runs in turns, and samples in slices)."""
    p.add_argument(
        "--max-datums",
        type=positive_int,
        default=16_384,
        help="most datums in one forward / forward_backward request",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=1 << 21,
        help="most tokens in one forward / forward_backward request, each datum's model_input + 1",
    )
    p.add_argument(
        "--max-sample-tokens",
        type=positive_int,
        default=1 << 20,
        help="most tokens one sample request costs: its prompt + num_samples x max_tokens",
    )
    p.add_argument(
        "--header-timeout",
        type=positive_float,
        default=10.0,
        help="seconds a connection has to send a request's line and headers; slower ones are closed",
    )
    p.add_argument(
        "--body-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a request body may stall before the answer is 408 and the connection closes",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=positive_int,
        default=5,
        help="seconds an idle keep-alive connection stays open",
    )
    p.add_argument(
        "--session-timeout",
        type=positive_float,
        default=120.0,
        help="seconds a session may go without a request or heartbeat (the tinker SDK sends one every 10 s while "
        "its client lives) before it is finished: its runs released, its queued work dropped (at least 30)",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=512,
        help="connections and requests in progress at once; past it requests are answered 503",
    )


def run(args: argparse.Namespace) -> int:
    import os
    from dataclasses import replace
    from pathlib import Path

    from harts.commands._inputs import execution_config
    from harts.commands._memory import check_memory, run_memory_check
    from harts.serve.config import API_KEY_ENV, ServeConfig
    from harts.serve.sampling import SAMPLER_ENGINES
    from harts.serve.server import serve
    from harts.serve.tenants import DEFAULT_TENANT, check_keys, load_keys_file
    from harts.trainer.build import ModelSpec

    # the keys first: a bad keys file is one line before anything is loaded
    tenants = None if args.keys_file is None else load_keys_file(args.keys_file)
    api_key = args.api_key or ("" if tenants is not None else os.environ.get(API_KEY_ENV, ""))
    if tenants is None and api_key:  # a key without a secret part is one line before any estimate
        check_keys({DEFAULT_TENANT: api_key}, source="--api-key")
    execution = execution_config(args)
    # what the server holds at once: the served weights once (every LoRA run trains its adapters
    # over them, harts.trainer.lora.adapted_view), the sampling engines beside them (the base
    # model, exported weights read from disk), and one microbatch at --capacity (the worker runs
    # one request at a time); a run without LoRA is checked when it is asked for
    spec = ModelSpec(model=args.model, layers=args.layers, dtype=args.dtype, device=args.device)
    # the engines' own execution (recomputation sizes the activations), with their fused LM head
    engine_execution = replace(execution, fused_logprobs=True)
    check_memory(
        spec,
        None,
        capacity=args.capacity,
        execution=engine_execution,
        optimizer=False,
        frozen_base=True,
        force=args.force,
        models_beside=SAMPLER_ENGINES,
    )

    config = ServeConfig(
        model=args.model,
        model_name=args.model_name,
        tokenizer=args.tokenizer,
        api_key=api_key,
        tenants=tenants,
        host=args.host,
        port=args.port,
        state_dir=Path(args.state_dir),
        device=args.device,
        dtype=args.dtype,
        layers=args.layers,
        execution=execution,
        seed=args.seed,
        capacity=args.capacity,
        max_models=args.max_models,
        max_request_bytes=int(args.max_request_mb * (1 << 20)),
        max_samples=args.max_samples,
        max_datums=args.max_datums,
        max_batch_tokens=args.max_batch_tokens,
        max_sample_tokens=args.max_sample_tokens,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections,
        session_timeout=args.session_timeout,
        max_snapshots=args.max_snapshots,
        poll_seconds=args.poll_seconds,
        threads=args.threads,
    )

    # each new run against what the device has free then: its adapters, their gradients and
    # AdamW state (or, without LoRA, a whole model with them) beside one microbatch
    check_run_memory = run_memory_check(spec, capacity=args.capacity, execution=engine_execution, force=args.force)
    serve(config, log_level=args.log_level, json_out=args.json_out, check_run_memory=check_run_memory)
    return 0
