"""A tinker-cookbook-style SFT loop, then an RL loop, against ``harts serve``, with the real tinker SDK.

    export KEY=tml-$(python -c 'import secrets; print(secrets.token_hex(16))')
    harts serve --model tiny --api-key "$KEY" &                     # one terminal
    python examples/tinker_loop.py --base-url http://127.0.0.1:8000 --api-key "$KEY"

    python examples/tinker_loop.py                                  # or: it starts its own server

The task is tiny on purpose, so it runs on a laptop CPU in a minute or two with the ``tiny``
preset (vocabulary 64, no tokenizer): after a prompt token ``x`` the model should continue
``x+1, x+2, ...`` (mod 64).

* SFT, as tinker-cookbook's ``sl_loop``: datums with loss on the completion only,
  ``forward_backward(batch, "cross_entropy")`` and ``optim_step`` submitted together, the mean
  NLL from the returned log-probs.
* RL, as tinker-cookbook's ``rl_loop``: each step saves the weights for a sampling client,
  samples a group per prompt, scores each sample (the fraction of its tokens that are their
  predecessor + 1), centres the rewards within the group, and trains with ``importance_sampling`` on
  datums built the cookbook's way (prompt targets padded with 0, the sampler's log-probs and the
  advantages on the sampled tokens).
* Finally ``save_state`` (resumable with ``create_training_client_from_state_with_optimizer``)
  and ``save_weights_for_sampler`` (the export an inference engine loads).

Needs ``pip install 'harts[serve]'`` (the tinker SDK, FastAPI, uvicorn).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import tinker
from tinker import types

VOCAB = 64
COMPLETION = 8


def successor_tokens(x: int, n: int = COMPLETION) -> list[int]:
    return [(x + i) % VOCAB for i in range(1, n + 1)]


def sft_datum(x: int) -> types.Datum:
    """Prompt [x], completion x+1..x+8; loss on the completion (cookbook's conversation_to_datum shape)."""
    tokens = [x, *successor_tokens(x)]
    weights = [1.0] * (len(tokens) - 1)  # every target here is a completion token
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def mean_nll(result: types.ForwardBackwardOutput, batch: list[types.Datum]) -> float:
    """tinker-cookbook's compute_mean_nll: -sum(logprobs * weights) / sum(weights)."""
    num = den = 0.0
    for out, d in zip(result.loss_fn_outputs, batch):
        lp = np.asarray(out["logprobs"].tolist())
        w = np.asarray(d.loss_fn_inputs["weights"].tolist())
        num += float(-(lp * w).sum())
        den += float(w.sum())
    return num / den


def reward(prompt: int, sampled: list[int]) -> float:
    """The fraction of sampled tokens that are their predecessor + 1 (the prompt first)."""
    previous = [prompt, *sampled[:-1]]
    return sum(t == (p + 1) % VOCAB for p, t in zip(previous, sampled)) / len(sampled)


def sft(
    training_client: tinker.TrainingClient, steps: int, batch_size: int, lr: float, rng: np.random.Generator
) -> None:
    adam = types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8)
    for step in range(steps):
        batch = [sft_datum(int(x)) for x in rng.integers(0, VOCAB, batch_size)]
        fwd_bwd_future = training_client.forward_backward(batch, loss_fn="cross_entropy")
        optim_future = training_client.optim_step(adam)
        fwd_bwd_result = fwd_bwd_future.result()
        optim_result = optim_future.result()
        print(
            f"sft step {step:3d}  mean nll {mean_nll(fwd_bwd_result, batch):.3f}  "
            f"grad norm {optim_result.metrics['grad_norm']:.2f}"
        )


def rl(
    training_client: tinker.TrainingClient,
    steps: int,
    batch_size: int,
    group_size: int,
    lr: float,
    rng: np.random.Generator,
) -> None:
    adam = types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8)
    sampling_params = types.SamplingParams(max_tokens=COMPLETION, temperature=1.0)
    for step in range(steps):
        sampling_client = training_client.save_weights_and_get_sampling_client().result()
        prompts = [int(x) for x in rng.integers(0, VOCAB, batch_size)]
        futures = [
            sampling_client.sample(
                prompt=types.ModelInput.from_ints([x]), num_samples=group_size, sampling_params=sampling_params
            )
            for x in prompts
        ]
        datums: list[types.Datum] = []
        rewards_P = []
        for x, future in zip(prompts, futures):
            result = future.result()
            rewards_G = [reward(x, seq.tokens) for seq in result.sequences]
            mean = sum(rewards_G) / len(rewards_G)
            rewards_P.append(mean)
            if all(r == mean for r in rewards_G):
                continue  # no signal in this group
            prompt = types.ModelInput.from_ints([x])
            for seq, r in zip(result.sequences, rewards_G):
                ob_len = prompt.length - 1
                model_input = prompt.append(types.EncodedTextChunk(tokens=seq.tokens[:-1]))
                datums.append(
                    types.Datum(
                        model_input=model_input,
                        loss_fn_inputs={
                            "target_tokens": [0] * ob_len + seq.tokens,
                            "logprobs": [0.0] * ob_len + list(seq.logprobs),
                            "advantages": [0.0] * ob_len + [r - mean] * (model_input.length - ob_len),
                        },
                    )
                )
        if datums:
            fwd_bwd_future = training_client.forward_backward(datums, loss_fn="importance_sampling")
            optim_future = training_client.optim_step(adam)
            fwd_bwd_future.result()
            optim_future.result()
        print(f"rl step {step:3d}  mean reward {sum(rewards_P) / len(rewards_P):.3f}  datums {len(datums)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_server(model: str, api_key: str, state_dir: str | None) -> Iterator[str]:
    """``harts serve --model MODEL`` on a free port for the duration; its base URL."""
    import httpx

    with tempfile.TemporaryDirectory(prefix="harts-serve-") as tmp:
        port = _free_port()
        opts = {
            "--model": model,
            "--port": str(port),
            "--api-key": api_key,
            "--state-dir": state_dir or tmp,
            "--log-level": "warning",
        }
        proc = subprocess.Popen([sys.executable, "-m", "harts.cli", "serve", *[x for kv in opts.items() for x in kv]])
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"harts serve exited with status {proc.returncode}")
                try:
                    if httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": api_key}).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait()


@contextmanager
def running_at(url: str) -> Iterator[str]:
    yield url


def main() -> int:
    p = argparse.ArgumentParser(description="SFT then RL through harts serve with the tinker SDK")
    p.add_argument("--base-url", default=None, help="a running harts serve (default: start one with --model)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("TINKER_API_KEY") or f"tml-{secrets.token_hex(16)}",
        help="the server's key (default: $TINKER_API_KEY, else a fresh one for the server it starts)",
    )
    p.add_argument("--model", default="tiny", help="base_model (and harts serve --model when starting one)")
    p.add_argument("--state-dir", default=None, help="the started server's checkpoints (default: a temporary dir)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--sft-steps", type=int, default=40)
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--sft-lr", type=float, default=1e-2)
    p.add_argument("--rl-lr", type=float, default=3e-3)
    args = p.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    rng = np.random.default_rng(0)

    server = (
        local_server(args.model, args.api_key, args.state_dir) if args.base_url is None else running_at(args.base_url)
    )
    with server as url:
        service_client = tinker.ServiceClient(base_url=url, api_key=args.api_key)
        training_client = service_client.create_lora_training_client(base_model=args.model, rank=args.rank).result()
        print(f"training run {training_client.model_id}")
        sft(training_client, args.sft_steps, args.batch_size, args.sft_lr, rng)
        rl(training_client, args.rl_steps, args.batch_size, args.group_size, args.rl_lr, rng)
        state = training_client.save_state("final").result()
        sampler = training_client.save_weights_for_sampler("final").result()
        print(f"state   {state.path}\nsampler {sampler.path}")
        service_client.close("success").result()
    return 0


if __name__ == "__main__":
    sys.exit(main())
