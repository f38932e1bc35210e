"""``harts serve`` over a tiny random transformers checkpoint (Qwen3-Next) the test writes, driven
by the real tinker SDK: training, the in-process engine's log-probs, sampling, and the
``save_weights_for_sampler`` export loaded back in transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tinker import types  # noqa: E402

from tests.integrations._hf import VOCAB, make_hf_model  # noqa: E402
from tests.serve._server import Server, service_client, serving  # noqa: E402

CAPACITY = 256
NAME = "test/qwen3-next-tiny"
ADAM = types.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3 next") / "harts"  # a folder named harts, a space above it
    make_hf_model("qwen3_next", seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--model-name", NAME, "--capacity", str(CAPACITY), "--max-models", "16")
    with serving(str(checkpoint), tmp_path_factory.mktemp("serve hf"), *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: Server) -> Iterator[tinker.ServiceClient]:
    with service_client(server) as sc:
        yield sc


def batch(seed: int) -> tuple[list[types.Datum], list[dict]]:
    """Three completions of a shared prompt, as Tinker datums and as engine trajectories."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 5).tolist()
    data, trajs = [], []
    for _ in range(3):
        tokens = prompt + rng.integers(0, VOCAB, 6).tolist()
        weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
        trajs.append({"tokens": tokens, "weights": np.asarray(weights)})
    return data, trajs


def logprobs(result: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].tolist(), dtype=np.float64) for o in result.loss_fn_outputs]


def test_capabilities_and_info_name_the_served_checkpoint(service, server, checkpoint):
    rest = tinker.RestClient(base_url=server.url, api_key=server.api_key)
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [NAME]
    tc = service.create_lora_training_client(base_model=NAME, rank=4, seed=1).result()
    info = tc.get_info()
    assert info.model_data.model_name == NAME and info.model_data.arch == "qwen3_next" and info.lora_rank == 4
    # the directory itself names the served model too
    assert service.create_lora_training_client(base_model=str(checkpoint), rank=4).result().model_id


def test_training_matches_the_in_process_engine(service, checkpoint):
    from harts.trainer.engine import Engine
    from harts.trainer.lora import LoraConfig

    engine = Engine.from_spec(str(checkpoint), lora=LoraConfig(rank=4, seed=5), dtype="float32", capacity=CAPACITY)
    tc = service.create_lora_training_client(base_model=NAME, rank=4, seed=5).result()
    data, trajs = batch(0)
    losses = []
    for _ in range(8):
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        ref = engine.forward_backward(trajs, "cross_entropy")
        engine.optim_step(lr=ADAM.learning_rate, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, grad_clip=0.0)
        assert out.metrics["loss:sum"] == pytest.approx(ref.loss, rel=1e-4)
        for s, e in zip(logprobs(out), ref.logprobs):
            np.testing.assert_allclose(s, e, rtol=0, atol=1e-5)
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.7 * losses[0], losses


def test_sampler_export_loads_in_transformers_with_the_same_logprobs(service, server):
    import torch
    from transformers import AutoModelForCausalLM

    tc = service.create_lora_training_client(base_model=NAME, rank=4, seed=2).result()
    data, trajs = batch(1)
    for _ in range(4):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(ADAM)
    path = tc.save_weights_for_sampler("export").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/export"
    served = logprobs(tc.forward(data, "cross_entropy").result())
    directory = server.state_dir / "runs" / tc.model_id / "sampler_weights" / "export"
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    for traj, lp in zip(trajs, served):
        with torch.no_grad():
            logits = hf(torch.tensor([traj["tokens"]])).logits[0].double()
        ref = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(traj["tokens"][1:])[:, None])[:, 0]
        np.testing.assert_allclose(lp, ref.numpy(), rtol=0, atol=1e-4)


def test_sample_logprobs_are_the_forward_logprobs(service):
    tc = service.create_lora_training_client(base_model=NAME, rank=4, seed=4).result()
    data, _ = batch(2)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(ADAM)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 6, 7, 8, 9, 10]
    res = sampler.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=7, seed=1)).result()
    check = [
        types.Datum(
            model_input=types.ModelInput.from_ints((prompt + s.tokens)[:-1]),
            loss_fn_inputs={"target_tokens": (prompt + s.tokens)[1:]},
        )
        for s in res.sequences
    ]
    for seq, lp in zip(res.sequences, logprobs(tc.forward(check, "cross_entropy").result())):
        np.testing.assert_allclose(np.asarray(seq.logprobs), lp[len(prompt) - 1 :], rtol=0, atol=1e-4)
