"""The overhead of ``harts serve`` over the engine it serves, for one ``forward_backward``.

    python -m benchmarks.step.serve_overhead --model ling3_tiny --device cuda --dtype bfloat16 --tokens 65536
    python -m benchmarks.step.serve_overhead --model tiny --tokens 4096            # CPU, a few minutes

Two measurements of the same call, a LoRA ``forward_backward`` (cross_entropy) of ``--datums``
datums of ``--tokens`` tokens in all, side by side in one run:

* in process: ``Engine.forward_backward`` on the trajectories, timed on the host (the device
  synchronized) -- the baseline;
* through the server: ``harts serve`` started as a subprocess on a free port, driven by the real
  tinker SDK on this process; each call is timed on the client from submission to the decoded
  result. The server reports its engine's own time for the call (``harts/engine_seconds:sum``),
  so ``overhead = client wall time - server engine time`` is exactly what the server adds:
  the request's protobuf encoding and transfer, validation and decoding into trajectories, the
  queue, the result's encoding, the poll that fetches it, and its decoding by the SDK.

``--sides server`` runs the server alone: the headline needs only its numbers, and a fresh GPU
machine then compiles the model once instead of twice. Progress lines go to stderr as the calls
finish; ``--server-log FILE`` keeps the server's own log.

The headline is ``overhead / engine time`` (median over ``--repeats`` calls, after
``--warmup``). The serialization steps are also timed alone on this process (``serialization``
in the JSON): SDK encode, server decode + validation, response encode, SDK decode. The in-process
engine is freed before the server starts, so the two never share the device.

Both sides run the same ``ExecutionConfig`` (``--la-backend``, ``--attention``, ``--recompute``
and its companions, as ``harts train`` and ``harts serve`` take them). ``--json FILE`` writes
every per-call time and the settings. Needs the ``serve`` extra.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._runner import (
    ROOT,
    add_device_argument,
    add_dtype_argument,
    add_json_argument,
    device_of,
    parse,
    parser,
    run,
    sync,
    write_json,
)
from harts.commands._inputs import (
    add_execution_arguments,
    add_la_backend_argument,
    check_output_file,
    recompute_fields,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, __file__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", help="preset or checkpoint directory (harts serve --model)")
    add_device_argument(p, "cpu")
    add_dtype_argument(p, ["float32", "float64", "bfloat16"], "float32")
    p.add_argument("--layers", type=int, default=None, help="a preset's first N layers (both sides)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the call, all datums together (T)")
    p.add_argument("--datums", type=int, default=1, help="datums the tokens are split into")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first, per side")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads, both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sides",
        choices=["both", "server"],
        default="both",
        help="both (default): the in-process engine and the server; server: the server alone (its own "
        "engine time is the overhead's reference, so the headline needs only this side; one cold "
        "compilation instead of two on a fresh GPU machine)",
    )
    p.add_argument("--server-log", type=Path, default=None, help="keep the server's log in FILE")
    add_la_backend_argument(p, default="auto")
    add_execution_arguments(p)
    add_json_argument(p)
    args = parse(p, argv)
    if args.tokens < 2 * args.datums:
        p.error("--tokens: need at least 2 tokens per datum")
    if args.server_log is not None:
        check_output_file(str(args.server_log), "--server-log", overwrite=True)
    return args


def progress(line: str) -> None:
    """One progress line on stderr, at once: a run cut off by a time limit still says how far it got."""
    print(line, file=sys.stderr, flush=True)


def trajectories(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    sizes = [args.tokens // args.datums + (i < args.tokens % args.datums) for i in range(args.datums)]
    return [rng.integers(0, vocab_size, n).tolist() for n in sizes]


def execution_options(args: argparse.Namespace) -> list[str]:
    """The execution options as ``harts serve`` takes them (the same as this script's)."""
    out = ["--la-backend", args.la_backend, "--attention", args.attention]
    if args.recompute:
        out.append("--recompute")
        if args.recompute_skip:
            out += ["--recompute-skip", ",".join(args.recompute_skip)]
        if args.recompute_layers is not None:
            out += ["--recompute-layers", str(args.recompute_layers)]
        if args.moe_keep_gate_up:
            out += ["--moe-keep-gate-up", str(args.moe_keep_gate_up)]
    return out


def in_process(args: argparse.Namespace, trajs: list[list[int]]) -> dict[str, Any]:
    """Engine.forward_backward timings of the call, then the engine is freed."""
    import torch

    from harts.models.execution.config import ExecutionConfig
    from harts.trainer.engine import Engine
    from harts.trainer.lora import LoraConfig

    execution = ExecutionConfig(
        **recompute_fields(args), attention=args.attention, linear_attention_backend=args.la_backend
    )

    engine = Engine.from_spec(
        args.model,
        layers=args.layers,
        dtype=args.dtype,
        device=args.device,
        lora=LoraConfig(rank=args.rank, seed=args.seed),
        seed=args.seed,
        capacity=args.tokens,
        execution=execution,
    )
    batch = [{"tokens": t, "weights": np.ones(len(t) - 1)} for t in trajs]
    device = device_of(args.device)
    times = []
    for i in range(args.warmup + args.repeats):
        sync(device)
        start = time.perf_counter()
        engine.forward_backward(batch, "cross_entropy")
        sync(device)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed)
        progress(f"in process: call {i + 1} of {args.warmup + args.repeats}: {elapsed:.3f} s")
        engine.optimizer.zero_grad(set_to_none=True)
    del engine
    # compiled graphs keep references to the weights they were traced with: drop them too, so
    # the server (another process, which checks the device's free memory) has the whole device
    torch._dynamo.reset()
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"seconds": times}


def datums(trajs: list[list[int]]) -> list[Any]:
    from tinker import types

    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(t[1:], dtype=np.int64),
                "weights": np.ones(len(t) - 1, np.float32),
            },
        )
        for t in trajs
    ]


def serialization(data: list[Any], vocab_size: int, tokens: int, repeats: int) -> dict[str, float]:
    """Median seconds of each serialization step of the call, alone on this process."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    from harts.serve import wire

    def timed(fn: Any) -> tuple[float, Any]:
        out, times = None, []
        for _ in range(repeats):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times), out

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model_id="m", seq_id=1
    )
    encode, body = timed(lambda: forward_backward_request_to_proto(request).SerializeToString())

    def decode() -> list[dict[str, Any]]:
        msg = wire.decode_forward_backward(body, None, max_bytes=1 << 40)
        return wire.trajectories(msg, vocab_size=vocab_size, max_tokens=tokens + 1)

    dec, trajs = timed(decode)
    lps = [np.zeros(len(t["tokens"]) - 1) for t in trajs]
    outputs = {"logprobs": lps, "elementwise_loss": lps}
    resp, payload = timed(lambda: wire.encode_forward_backward_output(outputs, {"loss:sum": 0.0}, len(lps)))
    sdk, _ = timed(lambda: deserialize_forward_backward_output(payload))
    return {
        "sdk_encode": encode,
        "server_decode": dec,
        "server_encode": resp,
        "sdk_decode": sdk,
        "request_bytes": float(len(body)),
        "response_bytes": float(len(payload)),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def through_server(args: argparse.Namespace, data: list[Any], workdir: Path) -> dict[str, Any]:
    """Client wall time and server engine time of each call through ``harts serve``."""
    import httpx
    import tinker
    from tinker import types

    port, key = _free_port(), f"tml-bench-{uuid.uuid4().hex[:16]}"
    cmd = [sys.executable, "-m", "harts.cli", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--api-key", key, "--state-dir", str(workdir / "state"), "--device", args.device, "--dtype", args.dtype]
    # one training run is all this script creates: the memory check counts one engine (and the
    # sampling engines), not the default --max-models
    cmd += ["--capacity", str(args.tokens), "--seed", str(args.seed), "--max-models", "1"]
    cmd += ["--log-level", "info" if args.server_log is not None else "warning"]
    cmd += execution_options(args)
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log = open(workdir / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        deadline = started + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"harts serve exited:\n{(workdir / 'server.log').read_text()}")
            try:
                if httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": key}, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("harts serve did not come up in 600 s")
            time.sleep(0.5)
        progress(f"server: up after {time.monotonic() - started:.1f} s")
        service = tinker.ServiceClient(base_url=url, api_key=key)
        tc = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=args.seed).result()
        wall, engine = [], []
        for i in range(args.warmup + args.repeats):
            start = time.perf_counter()
            out = tc.forward_backward(data, "cross_entropy").result()
            elapsed = time.perf_counter() - start
            seconds = out.metrics["harts/engine_seconds:sum"]
            if i >= args.warmup:
                wall.append(elapsed)
                engine.append(seconds)
            progress(
                f"server: call {i + 1} of {args.warmup + args.repeats}: client {elapsed:.3f} s, engine {seconds:.3f} s"
            )
            tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # clears the gradients, changes nothing
        service.close("success").result()
        return {"wall_seconds": wall, "engine_seconds": engine}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
        if args.server_log is not None:
            args.server_log.parent.mkdir(parents=True, exist_ok=True)
            args.server_log.write_bytes((workdir / "server.log").read_bytes())


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from harts.integrations.loading import load_model

    vocab = load_model(args.model, device="meta").config.vocab_size
    trajs = trajectories(args, vocab)
    local = in_process(args, trajs) if args.sides == "both" else None
    data = datums(trajs)
    ser = serialization(data, vocab, args.tokens, max(args.repeats, 3))
    with tempfile.TemporaryDirectory(prefix="serve-overhead ") as tmp:
        served = through_server(args, data, Path(tmp))
    overhead = [w - e for w, e in zip(served["wall_seconds"], served["engine_seconds"])]
    med = {
        "server_engine_s": statistics.median(served["engine_seconds"]),
        "client_wall_s": statistics.median(served["wall_seconds"]),
        "overhead_s": statistics.median(overhead),
    }
    med["overhead_fraction"] = med["overhead_s"] / med["server_engine_s"]
    print(
        f"forward_backward of {args.model} ({args.dtype}, {args.device}), T = {args.tokens} in {args.datums} datum(s)"
    )
    if local is not None:
        med["in_process_engine_s"] = statistics.median(local["seconds"])
        med["overhead_vs_in_process"] = (med["client_wall_s"] - med["in_process_engine_s"]) / med["in_process_engine_s"]
        print(f"  in-process engine     {med['in_process_engine_s'] * 1e3:10.1f} ms")
    print(f"  server engine         {med['server_engine_s'] * 1e3:10.1f} ms")
    print(f"  client wall (SDK)     {med['client_wall_s'] * 1e3:10.1f} ms")
    print(
        f"  overhead              {med['overhead_s'] * 1e3:10.1f} ms = {100 * med['overhead_fraction']:.2f} % of the engine"
    )
    if local is not None:
        print(f"  wall vs in-process    {100 * med['overhead_vs_in_process']:+.2f} %")
    print(
        "  serialization (ms):   " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in ser.items() if not k.endswith("bytes"))
    )
    print(f"  request {ser['request_bytes'] / 1e6:.2f} MB, response {ser['response_bytes'] / 1e6:.2f} MB")
    result = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "command_line"},
        "median": med,
        "serialization_s": ser,
        "in_process_s": None if local is None else local["seconds"],
        "server": served,
        "torch": torch.__version__,
    }
    write_json(args, result, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
