"""``harts serve --model tiny`` driven by the real tinker SDK: train, sample, save, resume, refuse.

One server for the module (a subprocess on a free port); every test makes its own training
client, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from tinker import types  # noqa: E402

from tests.serve._server import Server, service_client, serving  # noqa: E402

CAPACITY = 512
VOCAB = 64
RANK = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--capacity", str(CAPACITY), "--max-request-mb", "1", "--max-models", "32")
    with serving("tiny", tmp_path_factory.mktemp("serve tiny"), *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: Server) -> Iterator[tinker.ServiceClient]:
    with service_client(server) as sc:
        yield sc


def datum(tokens: list[int], n_prompt: int) -> types.Datum:
    """A Tinker datum of ``tokens`` with loss on the tokens after the first ``n_prompt``."""
    weights = [0.0] * (n_prompt - 1) + [1.0] * (len(tokens) - n_prompt)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def sft_batch(seed: int = 0) -> list[types.Datum]:
    """Four completions of one 6-token prompt (the prefix the engine computes once)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 6).tolist()
    return [datum(prompt + rng.integers(0, VOCAB, 5).tolist(), len(prompt)) for _ in range(4)]


def trajectories(data: list[types.Datum]) -> list[dict]:
    """The engine's trajectories of ``data`` (model_input plus the last target)."""
    out = []
    for d in data:
        tokens = d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"].tolist()[-1])]
        out.append({"tokens": tokens, "weights": np.asarray(d.loss_fn_inputs["weights"].tolist())})
    return out


def logprobs(result: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].tolist(), dtype=np.float64) for o in result.loss_fn_outputs]


def new_client(service: tinker.ServiceClient, seed: int = 7) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model="tiny", rank=RANK, seed=seed).result()


ADAM = types.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def test_sft_loss_falls_over_20_steps(service):
    tc = new_client(service)
    data = sft_batch()
    losses = []
    for _ in range(20):
        fwd = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(ADAM)
        losses.append(fwd.result().metrics["loss:sum"])
        assert opt.result().metrics["grad_norm"] > 0
    assert losses[-1] < 0.5 * losses[0], losses


def test_logprobs_equal_the_in_process_engine(service):
    from harts.trainer.engine import Engine
    from harts.trainer.lora import LoraConfig

    engine = Engine.from_spec("tiny", lora=LoraConfig(rank=RANK, seed=11), seed=0, capacity=CAPACITY)
    tc = new_client(service, seed=11)
    data = sft_batch(1)
    trajs = trajectories(data)
    served = logprobs(tc.forward(data, "cross_entropy").result())
    for s, e in zip(served, engine.forward(trajs)):
        np.testing.assert_allclose(s, e, rtol=0, atol=1e-5)
    # after one identical step on both sides the weights still agree
    out = tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    ref = engine.forward_backward(trajs, "cross_entropy")
    engine.optim_step(lr=ADAM.learning_rate, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, grad_clip=0.0)
    assert out.metrics["loss:sum"] == pytest.approx(ref.loss, rel=1e-5)
    served = logprobs(tc.forward(data, "cross_entropy").result())
    for s, e in zip(served, engine.forward(trajs)):
        np.testing.assert_allclose(s, e, rtol=0, atol=1e-5)


def test_sample_logprobs_are_the_forward_logprobs(service):
    tc = new_client(service)
    for _ in range(3):
        tc.forward_backward(sft_batch(), "cross_entropy")
        tc.optim_step(ADAM)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [3, 1, 4, 1, 5]
    params = types.SamplingParams(max_tokens=8, seed=123)
    res = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result()
    assert len(res.sequences) == 4 and len({s.sequence_id for s in res.sequences}) == 4
    data = []
    for seq in res.sequences:
        assert len(seq.tokens) == 8 and seq.stop_reason == "length"
        toks = prompt + seq.tokens
        data.append(datum(toks, len(prompt)))
    forward = logprobs(tc.forward(data, "cross_entropy").result())
    for seq, lp in zip(res.sequences, forward):
        np.testing.assert_allclose(np.asarray(seq.logprobs), lp[len(prompt) - 1 :], rtol=0, atol=1e-4)
    # a snapshot keeps its weights after the run trains on: the same seed samples the same tokens
    tc.forward_backward(sft_batch(), "cross_entropy")
    tc.optim_step(ADAM).result()
    again = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]
    np.testing.assert_allclose(
        [s.logprobs for s in again.sequences], [s.logprobs for s in res.sequences], rtol=0, atol=1e-6
    )
    # prompt log-probs (compute_logprobs) come from the same forward
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + res.sequences[0].tokens)).result()
    assert lps[0] is None
    np.testing.assert_allclose(lps[len(prompt) :], res.sequences[0].logprobs, rtol=0, atol=1e-4)


def test_base_model_sampling_and_stop_tokens(service):
    sampler = service.create_sampling_client(base_model="tiny").result()
    res = sampler.sample(
        types.ModelInput.from_ints([1, 2, 3]), 8, types.SamplingParams(max_tokens=30, seed=0, stop=[5, 9])
    ).result()
    for seq in res.sequences:
        stopped = seq.tokens[-1] in (5, 9)
        assert seq.stop_reason == ("stop" if stopped else "length")
        assert all(t not in (5, 9) for t in seq.tokens[:-1])
        assert stopped or len(seq.tokens) == 30


def test_importance_sampling_step_with_advantages(service):
    tc = new_client(service)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [7, 8, 9, 10]
    res = sampler.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=6, seed=5)).result()
    rewards = [float(seq.tokens.count(3) + (seq.tokens[0] % 2)) for seq in res.sequences]
    mean = sum(rewards) / len(rewards)
    data = []
    for seq, r in zip(res.sequences, rewards):
        ob = len(prompt) - 1
        tokens = prompt + seq.tokens
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                # as tinker-cookbook builds them: prompt targets padded with 0, loss only on the samples
                loss_fn_inputs={
                    "target_tokens": [0] * ob + seq.tokens,
                    "logprobs": [0.0] * ob + list(seq.logprobs),
                    "advantages": [0.0] * ob + [r - mean + 0.5] * len(seq.tokens),
                },
            )
        )
    out = tc.forward_backward(data, "importance_sampling").result()
    assert math.isfinite(out.metrics["loss:sum"])
    for seq, lp in zip(res.sequences, logprobs(out)):
        np.testing.assert_allclose(lp[len(prompt) - 1 :], seq.logprobs, rtol=0, atol=1e-4)
    assert tc.optim_step(ADAM).result().metrics["grad_norm"] > 0
    ppo = tc.forward_backward(data, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result()
    assert math.isfinite(ppo.metrics["loss:sum"]) and "clip_fraction:mean" in ppo.metrics


def test_custom_loss_matches_cross_entropy(service):
    data = sft_batch(2)
    ce, custom = new_client(service, seed=3), new_client(service, seed=3)

    def neg_ll(batch: list[types.Datum], lps: list) -> tuple:
        import torch

        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum() for d, lp in zip(batch, lps))
        return loss, {"custom/neg_ll:sum": float(loss.detach())}

    a = ce.forward_backward(data, "cross_entropy").result()
    b = custom.forward_backward_custom(data, neg_ll).result()
    assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-5)
    ce.optim_step(ADAM).result()
    custom.optim_step(ADAM).result()
    for x, y in zip(
        logprobs(ce.forward(data, "cross_entropy").result()), logprobs(custom.forward(data, "cross_entropy").result())
    ):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)


def test_save_state_then_resume_gives_the_same_next_losses(service, server):
    tc = new_client(service)
    data = sft_batch(3)
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(ADAM)
    saved = tc.save_state("resume-me").result()
    assert saved.path == f"tinker://{tc.model_id}/weights/resume-me"
    after = []
    for _ in range(2):
        after.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(ADAM).result()
    resumed = service.create_training_client_from_state_with_optimizer(saved.path).result()
    assert resumed.model_id != tc.model_id and resumed.get_info().lora_rank == RANK
    again = []
    for _ in range(2):
        again.append(resumed.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        resumed.optim_step(ADAM).result()
    assert again == after
    # without the optimizer the first loss is the same, the second (after a fresh Adam step) differs
    fresh = service.create_training_client_from_state(saved.path).result()
    first = fresh.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    fresh.optim_step(ADAM).result()
    second = fresh.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    assert first == after[0] and second != after[1]
    # the RestClient lists the checkpoint
    rest = tinker.RestClient(base_url=server.url, api_key=server.api_key)
    names = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert "weights/resume-me" in names
    run = rest.get_training_run(tc.model_id).result()
    assert run.base_model == "tiny" and run.lora_rank == RANK and run.last_checkpoint is not None
    assert tc.model_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]
    assert saved.path in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    info = rest.get_weights_info_by_tinker_path(saved.path).result()
    assert info.base_model == "tiny" and info.is_lora and info.lora_rank == RANK
    rest.delete_checkpoint_from_tinker_path(saved.path).result()
    assert "weights/resume-me" not in [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]


def test_sampler_checkpoint_path_samples_its_weights(service):
    tc = new_client(service)
    tc.forward_backward(sft_batch(), "cross_entropy")
    tc.optim_step(ADAM).result()
    path = tc.save_weights_for_sampler("snap").result().path
    assert path.endswith("/sampler_weights/snap")
    a = tc.create_sampling_client(path).result()
    b = service.create_sampling_client(model_path=path).result()
    params = types.SamplingParams(max_tokens=5, seed=9)
    ra = a.sample(types.ModelInput.from_ints([1, 2]), 2, params).result()
    rb = b.sample(types.ModelInput.from_ints([1, 2]), 2, params).result()
    assert [s.tokens for s in ra.sequences] == [s.tokens for s in rb.sequences]


def test_wrong_or_missing_api_key_gets_401(server):
    assert server.get("healthz", key="").status_code == 401
    assert server.get("healthz", key="tml-wrong").status_code == 401
    r = server.post("create_session", json={}, headers={"X-API-Key": "tml-wrong"})
    assert r.status_code == 401 and "X-API-Key" in r.json()["detail"]
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong").create_lora_training_client(
            base_model="tiny", rank=RANK
        ).result()


def _bad_request(excinfo: pytest.ExceptionInfo, *needles: str) -> None:
    err = excinfo.value
    assert isinstance(err, tinker.APIStatusError) and 400 <= err.status_code < 500, err
    for needle in needles:
        assert needle in str(err), str(err)


def test_malformed_datums_get_4xx_naming_the_field_and_the_client_carries_on(service):
    tc = new_client(service)
    good = sft_batch()
    shifted = datum([1, 2, 3, 4, 5], 1)
    cases = [
        ([datum([1, 2, 3, 99], 1)], "cross_entropy", "data[0].loss_fn_inputs.target_tokens"),
        ([datum([1, 99, 3, 4], 1)], "cross_entropy", "data[0].model_input"),
        (
            [good[0], types.Datum(model_input=shifted.model_input, loss_fn_inputs={"target_tokens": [2, 3, 4]})],
            "cross_entropy",
            "data[1].loss_fn_inputs.target_tokens",
        ),
        (
            [
                types.Datum(
                    model_input=shifted.model_input, loss_fn_inputs={**shifted.loss_fn_inputs, "advantages": [0.0] * 4}
                )
            ],
            "cross_entropy",
            "data[0].loss_fn_inputs.advantages",
        ),
        ([shifted], "importance_sampling", "data[0].loss_fn_inputs.logprobs"),
        ([shifted], "stable_reinforce", "loss_fn"),
        ([datum(list(range(8)) * 80, 1)], "cross_entropy", "data[0].model_input"),
    ]
    for data, loss, field in cases:
        with pytest.raises(tinker.APIStatusError) as excinfo:
            tc.forward_backward(data, loss).result()
        _bad_request(excinfo, field)
    with pytest.raises(tinker.APIStatusError) as excinfo:
        tc.forward_backward(good, "ppo", {"clip_lo": 0.5}).result()
    _bad_request(excinfo, "loss_fn_config")
    with pytest.raises(tinker.APIStatusError) as excinfo:
        tc.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    _bad_request(excinfo, "optim_params.learning_rate")
    with pytest.raises(tinker.APIStatusError) as excinfo:
        tc.save_state("a..b").result()
    _bad_request(excinfo, "path")
    # every refused request used its sequence number: the client's next requests still run
    out = tc.forward_backward(good, "cross_entropy").result()
    assert tc.optim_step(ADAM).result().metrics["grad_norm"] > 0 and out.metrics["loss:sum"] > 0


def _scaled(data: list[types.Datum], weight: float) -> list[types.Datum]:
    """``data`` with every loss weight set to ``weight``."""
    return [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": [weight] * len(d.loss_fn_inputs["weights"].tolist()),
            },
        )
        for d in data
    ]


def test_divergence_is_a_user_error_and_the_run_keeps_its_weights(service):
    """A forward_backward whose loss overflows, an optim_step whose gradient norm does: each
    fails with one line naming the step, the run keeps its weights (a save holds them, finite)
    and trains on; a learning rate outside [0, 1] is a 400 naming the field."""
    tc = new_client(service)
    good = sft_batch()
    tc.forward_backward(good, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    before = logprobs(tc.forward(good, "cross_entropy").result())
    with pytest.raises(tinker.RequestFailedError) as excinfo:
        tc.forward_backward(_scaled(good, 3e38), "cross_entropy").result()  # inf in the float32 loss sum
    assert excinfo.value.category == types.RequestErrorCategory.User
    assert "step 2: the loss is inf; the weights and the optimizer state are left as they were" in str(excinfo.value)
    assert math.isfinite(tc.forward_backward(_scaled(good, 1e30), "cross_entropy").result().metrics["loss:sum"])
    with pytest.raises(tinker.RequestFailedError, match=r"step 2: the gradient norm is (inf|nan)"):
        tc.optim_step(ADAM).result()
    with pytest.raises(tinker.APIStatusError) as excinfo:
        tc.optim_step(types.AdamParams(learning_rate=1e308)).result()
    _bad_request(excinfo, "optim_params.learning_rate: 1e+308 is outside [0, 1]")
    after = logprobs(tc.forward(good, "cross_entropy").result())
    assert all(np.array_equal(a, b) for a, b in zip(after, before))
    saved = tc.save_state("after-divergence").result()
    reloaded = service.create_training_client_from_state(saved.path).result()
    again = logprobs(reloaded.forward(good, "cross_entropy").result())
    assert all(np.isfinite(a).all() and np.array_equal(a, b) for a, b in zip(again, before))
    tc.forward_backward(good, "cross_entropy").result()
    assert tc.optim_step(ADAM).result().metrics["optimizer_step"] == 2.0


def test_malformed_requests_get_4xx_and_the_server_stays_up(service, server):
    with pytest.raises(tinker.APIStatusError) as excinfo:
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=RANK).result()
    _bad_request(excinfo, "base_model", "'Qwen/Qwen3-8B'", "'tiny'")
    sampler = service.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints([1, 2])
    for kwargs, field in (
        ({"num_samples": 0, "sampling_params": types.SamplingParams(max_tokens=2)}, "num_samples"),
        ({"num_samples": 1, "sampling_params": types.SamplingParams()}, "sampling_params.max_tokens"),
        ({"num_samples": 1, "sampling_params": types.SamplingParams(max_tokens=2, temperature=-1)}, "temperature"),
        ({"num_samples": 1, "sampling_params": types.SamplingParams(max_tokens=2, stop=["x"])}, "sampling_params.stop"),
        ({"num_samples": 1, "sampling_params": types.SamplingParams(max_tokens=CAPACITY)}, "max_tokens"),
        (
            {
                "num_samples": 1,
                "sampling_params": types.SamplingParams(max_tokens=2),
                "topk_sample_logprobs": VOCAB + 1,
            },
            "topk_sample_logprobs",
        ),
    ):
        with pytest.raises(tinker.APIStatusError) as excinfo:
            sampler.sample(prompt, **kwargs).result()
        _bad_request(excinfo, field)
    sid = server.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "test"}).json()
    load = {"optimizer": True, "session_id": sid["session_id"], "model_seq_id": 0}
    raw = [
        ("load_weights", {"json": {"path": "tinker://nobody/weights/x", **load}}, 404, "path"),
        ("create_model", {"content": b"{not json"}, 400, "not JSON"),
        ("create_model", {"json": {"session_id": "x", "model_seq_id": 0}}, 400, "base_model"),
        ("create_model", {"json": {"session_id": "nope", "model_seq_id": 0, "base_model": "tiny"}}, 404, "session_id"),
        (
            "forward_backward",
            {"content": b"\xff\x00garbage", "headers": {"Content-Type": "application/x-protobuf"}},
            400,
            "ForwardBackwardRequest",
        ),
        ("load_weights", {"json": {"path": "tinker://../weights/x", **load}}, 400, "path"),
        ("load_weights", {"json": {"path": "tinker://a/weights/..", **load}}, 400, "path"),
        ("load_weights", {"json": {"path": "/etc/passwd", **load}}, 400, "path"),
        ("retrieve_future", {"json": {"request_id": "unknown"}}, 404, "request_id"),
        ("optim_step", {"json": {"model_id": "none", "adam_params": {}}}, 404, "model_id"),
        ("asample", {"content": b"x" * (2 << 20)}, 413, "bytes"),
    ]
    for path, kwargs, status, needle in raw:
        r = server.post(path, **kwargs)
        assert r.status_code == status, (path, r.status_code, r.text)
        assert needle in r.json()["detail"], (path, r.text)
    assert server.get("healthz").json() == {"status": "ok"}


POSTS = [
    "create_session",
    "session_heartbeat",
    "create_model",
    "get_info",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "create_sampling_session",
    "asample",
    "retrieve_future",
    "weights_info",
]
BODIES = [
    b"",
    b"[]",
    b"null",
    b'{"x": 1}',
    b'{"model_id": 5, "seq_id": "a"}',
    b"\x00\xff garbage",
    b'{"session_id": []}',
]


def test_every_malformed_body_gets_a_4xx(server):
    for path in POSTS:
        for body in BODIES:
            r = server.post(path, content=body, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500 and r.json()["detail"], (path, body, r.status_code, r.text)
    for path in ("training_runs/..%2F..", "training_runs/nope/checkpoints", "samplers/nope", "sessions/nope"):
        r = server.get(path)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    assert server.get("training_runs?limit=x").status_code == 400
    assert server.get("healthz").status_code == 200


def test_resent_and_out_of_order_requests_apply_once_in_order(server):
    """Raw protocol: optim_step (seq 2) sent before forward_backward (seq 1) waits for it, and a
    resent request gets the first one's future instead of running again."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    sid = server.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "test"}).json()[
        "session_id"
    ]
    create = {"session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 2, "seed": 1}}
    fut = server.post("create_model", json=create).json()
    model_id = fut["model_id"]

    def result(request_id: str) -> object:
        while True:
            r = server.post("retrieve_future", json={"request_id": request_id})
            assert r.status_code == 200, r.text
            if r.headers["content-type"].startswith("application/json"):
                body = r.json()
                if body.get("type") == "try_again":
                    continue
                return body
            return r.content

    assert result(fut["request_id"]) == {"model_id": model_id, "type": "create_model"}
    optim = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}}
    first = server.post("optim_step", json=optim).json()["request_id"]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=sft_batch(), loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=1,
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    fb = server.post("forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"}).json()
    assert server.post("optim_step", json=optim).json()["request_id"] == first
    step = result(first)
    assert isinstance(step, dict) and step["metrics"]["optimizer_step"] == 1.0 and step["metrics"]["grad_norm"] > 0
    assert isinstance(result(fb["request_id"]), bytes)
    # the result stays retrievable: a client that lost the answer asks again and gets the same
    assert result(first) == step
    # requests refused for a bad field (3: a pydantic error, 4: a path) free their numbers for 5
    bad = server.post("optim_step", json={"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": "x"}})
    assert bad.status_code == 400 and "learning_rate" in bad.json()["detail"], bad.text
    load = {"model_id": model_id, "seq_id": 4, "path": "tinker://x/weights/..", "optimizer": False}
    assert server.post("load_weights", json=load).status_code == 400
    fifth = server.post("optim_step", json={**optim, "seq_id": 5}).json()["request_id"]
    assert result(fifth)["metrics"]["optimizer_step"] == 2.0  # type: ignore[index]


def test_heartbeat_and_finish(server):
    sid = server.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "test"}).json()[
        "session_id"
    ]
    assert server.post("session_heartbeat", json={"session_id": sid}).status_code == 200
    assert server.post(f"sessions/{sid}/finish", json={"reason": {"type": "success"}}).status_code == 200
    assert server.post("session_heartbeat", json={"session_id": sid}).status_code == 410
