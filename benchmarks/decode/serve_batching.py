"""Concurrent sampling requests in ``harts serve``: decoded together in one shared batch against
one request at a time, on the same weights, through the server's own worker and sampling runs.

    python -m benchmarks.decode.serve_batching [--model tiny] [--requests 8] [--samples 4]
        [--prompt 32] [--new 64] [--repeats 3] [--device cpu] [--dtype float32] [--json FILE]

``--requests`` sampling requests (``--samples`` forks each, ``--prompt`` random prompt tokens,
``--new`` tokens per sample at temperature 1 with no stop token, so every sample decodes the full
length, a seed each) are submitted at once to a ``Worker``, in one lane, as ``harts serve``
queues a sampling client's requests; the clock runs from submission to the last answer. Rows:

    batched      the batched decoder, requests of the same weights in one ``DecodeBatch``
                 (``SampleBatches``): a request joins at the next step and leaves when done
    one by one   the batched decoder, each request decoding alone (its forks batched), one
                 request after another
    reference    the reference decoder (``harts.rollout.decode``), one request after another:
                 what ``harts serve`` runs on the CPU

tokens/s = requests x samples x new / seconds (median of ``--repeats`` rounds, after one warm-up;
the rows take turns within each round).
Both decoder rows sample the same tokens for the same seeds (``tests/serve/test_sampling_batched.py``
holds them equal in float64).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import torch

from benchmarks._runner import (
    add_device_argument,
    add_dtype_argument,
    add_json_argument,
    parse,
    parser,
    run,
    write_json,
)

MODES = ("batched", "one by one", "reference")


def one_round(engine: Any, jobs: list[Any], mode: str) -> float:
    """Seconds from submitting ``jobs`` to a fresh worker to the last answer, in ``mode``."""
    from harts.serve.futures import Done, FutureStore
    from harts.serve.sampling import SampleBatches, SampleRun
    from harts.serve.worker import Job, Worker

    futures = FutureStore()
    worker = Worker(futures)
    batches = SampleBatches() if mode == "batched" else None
    weights = lambda: (engine, None)  # noqa: E731
    ids = []
    started = time.perf_counter()
    for job in jobs:
        sample = SampleRun(job, weights, batches=batches, weights_key="base", fast=mode != "reference")
        request_id = futures.create("Sample")
        worker.submit(Job(request_id=request_id, kind="Sample", run=sample.step, lane="run"))
        sample.settle = lambda done, request_id=request_id: worker.settle(request_id, done)
        ids.append(request_id)

    async def wait_all() -> list[Any]:
        return [await futures.wait(i, timeout=3600) for i in ids]

    outcomes = asyncio.run(wait_all())
    seconds = time.perf_counter() - started
    worker.stop()
    bad = [o for o in outcomes if not isinstance(o, Done)]
    if bad:
        raise RuntimeError(f"{mode}: a request failed: {bad[0]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--model", default="tiny", help="preset (harts' presets; default tiny)")
    p.add_argument("--requests", type=int, default=8, help="concurrent sampling requests")
    p.add_argument("--samples", type=int, default=4, help="num_samples of each request")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens of each request")
    p.add_argument("--new", type=int, default=64, help="tokens sampled per sample")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per row (median)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_device_argument(p, "cpu")
    add_dtype_argument(p, ["float32", "float64", "bfloat16"], "float32")
    add_json_argument(p)
    args = parse(p, argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from harts.rollout.sampler import SamplingConfig
    from harts.serve.sampling import SampleJob
    from harts.trainer.engine import Engine

    engine = Engine.from_spec(
        args.model, dtype=args.dtype, device=args.device, seed=0, capacity=args.prompt + args.new + 8
    )
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    cfg = SamplingConfig(max_tokens=args.new, stop_tokens=())
    jobs = [
        SampleJob(
            prompt=torch.randint(0, vocab, (args.prompt,), generator=gen).tolist(),
            num_samples=args.samples,
            config=cfg,
            seed=i,
        )
        for i in range(args.requests)
    ]
    tokens = args.requests * args.samples * args.new
    rows: dict[str, dict[str, float]] = {}
    print(f"{args.requests} requests x {args.samples} samples x {args.new} tokens ({tokens} tokens), {args.model}")
    for mode in MODES:
        one_round(engine, jobs, mode)  # warm-up
    # the rows take turns, round after round, so a change in the machine's load reaches all of them
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            times[mode].append(one_round(engine, jobs, mode))
    for mode in MODES:
        seconds = statistics.median(times[mode])
        rows[mode] = {"seconds": seconds, "tokens_per_s": tokens / seconds, "all_seconds": times[mode]}
        print(f"{mode:>12}: {seconds:8.3f} s  {tokens / seconds:10.1f} tokens/s", flush=True)
    speedup = rows["one by one"]["seconds"] / rows["batched"]["seconds"]
    print(f"batched vs one by one: {speedup:.2f}x")
    write_json(args, {"settings": vars(args) | {"tokens": tokens}, "rows": rows, "batched_speedup": speedup})
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
