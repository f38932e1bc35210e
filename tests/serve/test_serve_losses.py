"""Every Tinker loss and datum form through the real tinker SDK against ``harts serve`` (float64):
dro, gspo (with and without ``sequence_ratio_mask``), arbitrary per-position targets and top-k
targets [T, K] with their weights, dense and sparse CSR. Each served result equals the in-process
engine's on the same trajectories (whose losses ``tests/rl/test_tinker_losses.py`` holds to
Tinker's definitions and whose targets ``tests/rl/test_tinker_targets.py`` holds to the
next-token reference); on-policy data reads ratio:mean 1; bad datums get a 400 naming the datum
and the field, and the client carries on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
torch = pytest.importorskip("torch")

from tinker import types  # noqa: E402

from tests.serve._server import Server, service_client, serving  # noqa: E402

CAPACITY = 512
VOCAB = 64
RANK = 4
K = 4
#: loss sums are float64 on both sides (metrics are doubles on the wire), the same operations
LOSS_TOL = 1e-10
#: log-probs come back as float32: one rounding of the float64 value
LP_RTOL = 2.0**-23


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--capacity", str(CAPACITY), "--dtype", "float64", "--max-models", "16")
    with serving("tiny", tmp_path_factory.mktemp("serve losses"), *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: Server) -> Iterator[Any]:
    with service_client(server) as sc:
        yield sc


def _client(service: Any, seed: int) -> Any:
    return service.create_lora_training_client(base_model="tiny", rank=RANK, seed=seed).result()


def _engine(seed: int) -> Any:
    from harts.trainer.engine import Engine
    from harts.trainer.lora import LoraConfig

    return Engine.from_spec("tiny", dtype="float64", lora=LoraConfig(rank=RANK, seed=seed), seed=0, capacity=CAPACITY)


def _rl_datums(rng: np.random.Generator, *, mask: bool = False) -> list[types.Datum]:
    """Cookbook-shaped RL datums over one prompt: targets padded with 0 on the prompt, sampler
    log-probs 0 there, advantages on the sampled tokens only."""
    prompt = rng.integers(0, VOCAB, 5).tolist()
    out = []
    for n in (4, 6, 3):
        sampled = rng.integers(0, VOCAB, n).tolist()
        ob = len(prompt) - 1
        inputs = {
            "target_tokens": [0] * ob + sampled,
            "logprobs": [0.0] * ob + rng.normal(-4.0, 0.3, n).tolist(),
            "advantages": [0.0] * ob + [float(rng.normal())] * n,
        }
        if mask:
            inputs["sequence_ratio_mask"] = [0.0] * ob + (rng.random(n) < 0.7).astype(float).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(prompt + sampled[:-1]), loss_fn_inputs=inputs))
    return out


def _top_k_datums(rng: np.random.Generator, *, sparse: bool) -> list[types.Datum]:
    """Top-k distillation datums as tinker-cookbook builds them: [T, K] targets and weights, zero
    rows on the prompt (sparse: the SDK's CSR of a torch tensor, which it sends where it is the
    smaller, so the prompt is long there)."""
    prompt = rng.integers(0, VOCAB, 24 if sparse else 6).tolist()
    out = []
    for n in (5, 7):
        tokens = prompt + rng.integers(0, VOCAB, n).tolist()
        t = len(tokens) - 1
        targets = torch.zeros(t, K, dtype=torch.long)
        weights = torch.zeros(t, K, dtype=torch.float32)
        for pos in range(len(prompt) - 1, t):
            targets[pos] = torch.as_tensor(rng.choice(VOCAB, K, replace=False))
            weights[pos] = torch.softmax(torch.as_tensor(rng.normal(size=K)), 0).float()
        wrap = types.TensorData.from_torch_sparse if sparse else types.TensorData.from_torch
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": wrap(targets), "weights": wrap(weights)},
            )
        )
    if sparse:
        assert out[0].loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    return out


def _arbitrary_target_datums(rng: np.random.Generator) -> list[types.Datum]:
    """1-D targets that are not the next input tokens, weighted everywhere."""
    out = []
    for n in (9, 12):
        inputs = rng.integers(0, VOCAB, n).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(inputs),
                loss_fn_inputs={"target_tokens": rng.integers(0, VOCAB, n).tolist(), "weights": rng.random(n).tolist()},
            )
        )
    return out


def _trajectories(data: list[types.Datum]) -> list[dict[str, Any]]:
    """The engine's trajectories of ``data``, built here from the datums' own arrays."""
    out = []
    for d in data:
        fields = {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}
        targets = fields.pop("target_tokens")
        tokens = d.model_input.to_ints() + [int(targets.reshape(len(targets), -1)[-1, 0])]
        out.append({"tokens": tokens, "targets": targets, **{k: v.astype(np.float64) for k, v in fields.items()}})
    return out


CASES = {
    "dro": lambda rng: (_rl_datums(rng), "dro", {"beta": 0.3}),
    "gspo": lambda rng: (_rl_datums(rng), "gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    "gspo-sequence_ratio_mask": lambda rng: (_rl_datums(rng, mask=True), "gspo", None),
    "top_k-dense": lambda rng: (_top_k_datums(rng, sparse=False), "cross_entropy", None),
    "top_k-sparse": lambda rng: (_top_k_datums(rng, sparse=True), "cross_entropy", None),
    "arbitrary_targets": lambda rng: (_arbitrary_target_datums(rng), "cross_entropy", None),
    "arbitrary_targets-ppo": lambda rng: (_rl_datums(rng), "ppo", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_served_loss_equals_the_in_process_engine(service: Any, case: str) -> None:
    seed = 20 + list(CASES).index(case)
    data, loss, cfg = CASES[case](np.random.default_rng(seed))
    tc, engine = _client(service, seed), _engine(seed)
    served = tc.forward_backward(data, loss, cfg).result()
    ref = engine.forward_backward(_trajectories(data), loss, cfg)
    assert served.metrics["loss:sum"] == pytest.approx(ref.loss, rel=LOSS_TOL)
    for out, lp, d in zip(served.loss_fn_outputs, ref.logprobs, data):
        got = out["logprobs"].to_numpy()
        assert got.shape == lp.shape == tuple(d.loss_fn_inputs["target_tokens"].shape or [len(lp)])
        np.testing.assert_allclose(got, lp, rtol=LP_RTOL, atol=0)
        if loss == "cross_entropy":
            w = d.loss_fn_inputs["weights"].to_numpy().astype(np.float64)
            np.testing.assert_allclose(out["elementwise_loss"].to_numpy(), -w * lp, rtol=LP_RTOL, atol=1e-30)
    for name in ("target_tokens:sum", "weight:sum"):
        assert served.metrics[name] == pytest.approx(ref.metrics[name], rel=LOSS_TOL), name
    # a forward's loss (no graph, from the returned log-probs) is the same number
    assert tc.forward(data, loss, cfg).result().metrics["loss:sum"] == pytest.approx(ref.loss, rel=LOSS_TOL)


def test_on_policy_ratio_mean_is_one(service: Any) -> None:
    """The served log-probs sent back as the sampler's on the sampled tokens, the prompt padded
    with 0: ratio:mean is 1 up to the float32 rounding of the log-probs on the wire."""
    tc = _client(service, 3)
    data = _rl_datums(np.random.default_rng(3))
    lps = [o["logprobs"].to_numpy() for o in tc.forward(data, "importance_sampling").result().loss_fn_outputs]
    on_policy = []
    for d, lp in zip(data, lps):
        adv = d.loss_fn_inputs["advantages"].to_numpy()
        inputs = {**d.loss_fn_inputs, "logprobs": np.where(adv != 0, lp, 0.0).astype(np.float32)}
        on_policy.append(types.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    tol = 2.0**-24 * float(np.abs(np.concatenate(lps)).max()) * 1.01
    sampled = sum(int((d.loss_fn_inputs["advantages"].to_numpy() != 0).sum()) for d in data)
    for loss in ("importance_sampling", "ppo", "gspo"):
        m = tc.forward_backward(on_policy, loss).result().metrics
        assert m["ratio:mean"] == pytest.approx(1.0, abs=tol), loss
        assert m["target_tokens:sum"] == sampled


def _refused(tc: Any, data: list[types.Datum], loss: str, *needles: str) -> None:
    with pytest.raises(tinker.APIStatusError) as excinfo:
        tc.forward_backward(data, loss).result()
    err = excinfo.value
    assert 400 <= err.status_code < 500, err
    for needle in needles:
        assert needle in str(err), str(err)
    assert str(err).count("\n") <= 1, str(err)


def test_bad_datums_get_a_400_naming_the_datum_and_field(service: Any) -> None:
    tc = _client(service, 4)
    good = _top_k_datums(np.random.default_rng(4), sparse=False)
    inputs = good[1].loss_fn_inputs
    targets = inputs["target_tokens"].to_numpy()
    t = len(targets)

    def bad(**fields: Any) -> list[types.Datum]:
        return [good[0], types.Datum(model_input=good[1].model_input, loss_fn_inputs={**inputs, **fields})]

    crow = list(range(0, t + 1))
    cases = [
        (bad(weights=np.ones((t, K + 1), np.float32)), "cross_entropy", "data[1].loss_fn_inputs.weights"),
        (bad(target_tokens=np.full((t, K), VOCAB)), "cross_entropy", "data[1].loss_fn_inputs.target_tokens"),
        (bad(target_tokens=np.zeros((t, 200), np.int64)), "cross_entropy", "data[1].loss_fn_inputs.target_tokens"),
        (
            bad(
                target_tokens=types.TensorData(
                    data=[1] * t, dtype="int64", shape=[t, K], sparse_crow_indices=crow, sparse_col_indices=[K] * t
                )
            ),
            "cross_entropy",
            "data[1].loss_fn_inputs.target_tokens.sparse_csr.col_indices",
        ),
        (
            bad(weights=np.ones((t, K), np.float32)[:, :1].ravel()[:-1]),
            "cross_entropy",
            "data[1].loss_fn_inputs.weights",
        ),
        (good, "stable_reinforce", "loss_fn", "stable_reinforce"),
    ]
    for data, loss, *needles in cases:
        _refused(tc, data, loss, *needles)
    # every refusal used its sequence number: the client's next request runs
    assert tc.forward_backward(good, "cross_entropy").result().metrics["loss:sum"] > 0
