"""Every public call of the installed tinker SDK answers against ``harts serve``: it returns or
raises, none hangs.

The methods are listed from the SDK itself (``inspect``), sync and async variants alike, so a call
a new SDK adds is tried too (and one whose required arguments this file cannot make fails the
test, naming the argument). Each runs in its own thread under a deadline; a call the server does
not serve must fail cleanly *and* give back the sequence number the SDK used for it, which the
last test checks: the training client that made every call still trains.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from tinker import types  # noqa: E402
from tinker.lib.api_future_impl import QueueState  # noqa: E402

from tests.serve._server import Server, serving  # noqa: E402

#: seconds one call may take; the tiny model answers any of them in a few
DEADLINE = 90.0
CLASSES = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient)
VOCAB = 64


def public_methods(cls: type) -> list[str]:
    """The public callables of ``cls`` (methods, static and class methods; not properties)."""
    return sorted(
        name
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and callable(member) and not isinstance(inspect.getattr_static(cls, name), property)
    )


def datums() -> list[types.Datum]:
    tokens = [3, 9, 4, 1, 7, 2, 8]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]},
        )
    ]


def custom_loss(data: list[types.Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
    """A loss for ``forward_backward_custom``: the weighted negative log-likelihood."""
    loss = -sum((lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True))
    return loss, {"custom:sum": float(loss)}


def per_datum_loss(logprobs: Any, weights: Any) -> tuple[Any, dict[str, Any]]:  # noqa: ANN401
    """The same per datum, as ``create_custom_loss`` takes it."""
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss}


@dataclass
class World:
    """The clients and checkpoints the calls act on."""

    server: Server
    service: Any
    training: Any
    sampling: Any
    rest: Any
    state: str
    sampler: str
    external: str
    made: list[str] = field(default_factory=list)

    def fresh_state(self) -> str:
        """A training checkpoint of its own (for a call that deletes it)."""
        return self.training.save_state(f"gone-{uuid.uuid4().hex[:8]}").result().path


def _arguments(world: World) -> dict[str, Callable[[], Any]]:
    """Plausible values by parameter name, or ``<method>.<parameter>`` where one name means
    different things."""
    parsed = lambda path: types.ParsedCheckpointTinkerPath.from_tinker_path(path)  # noqa: E731
    return {
        "base_model": lambda: "tiny",
        "path": lambda: world.state,
        "model_path": lambda: world.sampler,
        "name": lambda: f"n-{uuid.uuid4().hex[:8]}",
        "data": datums,
        "loss_fn": lambda: "cross_entropy",
        "forward_backward_custom.loss_fn": lambda: custom_loss,
        "forward_backward_custom_async.loss_fn": lambda: custom_loss,
        "optim_params": lambda: types.AdamParams(learning_rate=1e-3),
        "prompt": lambda: types.ModelInput.from_ints([3, 9, 4]),
        "num_samples": lambda: 2,
        "sampling_params": lambda: types.SamplingParams(max_tokens=3),
        "tinker_path": lambda: world.state,
        "get_external_weights_urls.tinker_path": lambda: world.external,
        "get_external_weights_urls_async.tinker_path": lambda: world.external,
        "delete_checkpoint_from_tinker_path.tinker_path": world.fresh_state,
        "delete_checkpoint_from_tinker_path_async.tinker_path": world.fresh_state,
        "training_run_id": lambda: world.training.model_id,
        "checkpoint_id": lambda: parsed(world.fresh_state()).checkpoint_id,
        "ttl_seconds": lambda: 7200,
        "session_id": lambda: world.service.holder._session_id,
        "project_id": lambda: "project",
        "sampler_id": lambda: world.sampling._sampling_session_id,
        "request": lambda: types.SessionSearchRequest(),
        "starting_on": lambda: "2026-01-01T00:00:00Z",
        "ending_before": lambda: "2026-01-02T00:00:00Z",
        "fn": lambda: per_datum_loss,
        "input_ranks": lambda: {"logprobs": 1, "weights": 1},
        "holder": lambda: world.service.holder,
        "handle": lambda: world.sampling.get_sampler_handle(),
        "queue_state": lambda: QueueState.ACTIVE,
        "queue_state_reason": lambda: None,
        "status": lambda: "success",
    }


def _call(world: World, cls: type, name: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The bound callable of ``cls.name`` in ``world`` and its keyword arguments."""
    owner = {
        tinker.ServiceClient: world.service,
        tinker.TrainingClient: world.training,
        tinker.SamplingClient: world.sampling,
        tinker.RestClient: world.rest,
    }[cls]
    fn = getattr(owner, name)
    values = _arguments(world)
    kwargs = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        make = values.get(f"{name}.{p.name}", values.get(p.name))
        # an optional argument is passed too when there is a value for it (optim_step takes
        # optim_params or adam_params, both optional; create_sampling_client a path or a model)
        assert make is not None or p.default is not p.empty, (
            f"{cls.__name__}.{name}: no plausible value for its argument {p.name!r}"
        )
        if make is not None:
            kwargs[p.name] = make()
    return fn, kwargs


def _settle(result: Any, deadline: float) -> Any:  # noqa: ANN401
    """What ``result`` stands for: a coroutine run, an SDK future's result, anything else as is."""
    if inspect.iscoroutine(result):
        result = asyncio.run(asyncio.wait_for(result, deadline))
    if hasattr(result, "result") and callable(result.result):
        result = result.result(timeout=deadline)
    if inspect.isawaitable(result):

        async def wait() -> Any:  # noqa: ANN401
            return await result

        result = asyncio.run(asyncio.wait_for(wait(), deadline))
    return result


def _outcome(fn: Callable[..., Any], kwargs: dict[str, Any]) -> str:
    """``ok`` or the exception a call ended with, within ``DEADLINE``; ``HUNG`` past it."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            job = pool.submit(lambda: _settle(fn(**kwargs), DEADLINE))
            job.result(timeout=DEADLINE + 10)
        return "ok"
    except concurrent.futures.TimeoutError:
        return "HUNG"
    except Exception as err:  # noqa: BLE001 -- any clean failure is an answer
        line = (str(err).strip().splitlines() or [""])[0][:160]
        return f"{type(err).__name__}: {line}"
    finally:
        pool.shutdown(wait=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--capacity", "256", "--max-models", "32")
    with serving("tiny", tmp_path_factory.mktemp("sdk surface"), *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def outcomes(server: Server, monkeypatch_module: pytest.MonkeyPatch) -> dict[str, str]:
    """Every public call's outcome, ``Class.method`` -> ``ok`` / the error / ``HUNG``."""
    monkeypatch_module.setenv("TINKER_BASE_URL", server.url)
    monkeypatch_module.setenv("TINKER_API_KEY", server.api_key)
    # the tiny preset has no tokenizer: get_tokenizer's fall-through to the Hub fails at once
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    # copy_weights posts only with a destination project (the server refuses it then)
    monkeypatch_module.setenv("TINKER_PROJECT_ID", "project")
    service = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    training = service.create_lora_training_client(base_model="tiny", rank=2).result()
    state = training.save_state("state").result().path
    sampler = training.save_weights_for_sampler("sampler").result().path
    external = training.save_weights_external("external").result().path
    world = World(
        server,
        service,
        training,
        service.create_sampling_client(base_model="tiny").result(),
        tinker.RestClient(base_url=server.url, api_key=server.api_key),
        state,
        sampler,
        external,
    )
    got = {}
    calls = [(cls, name) for cls in CLASSES for name in public_methods(cls)]
    # close() finishes the session every other call runs in: it goes last
    calls.sort(key=lambda c: c == (tinker.ServiceClient, "close"))
    for cls, name in calls:
        if (cls, name) == (tinker.ServiceClient, "close"):
            world.made.append(_outcome(training.forward, {"data": datums(), "loss_fn": "cross_entropy"}))
        fn, kwargs = _call(world, cls, name)
        got[f"{cls.__name__}.{name}"] = _outcome(fn, kwargs)
    got["after every call: TrainingClient.forward"] = world.made[0]
    return got


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_no_call_hangs(outcomes: dict[str, str]) -> None:
    hung = sorted(name for name, outcome in outcomes.items() if outcome == "HUNG")
    report = "\n".join(f"{k}: {v}" for k, v in sorted(outcomes.items()))
    assert not hung, f"these calls did not answer within {DEADLINE:g} s: {hung}\n{report}"


def test_the_training_client_goes_on_after_every_call(outcomes: dict[str, str]) -> None:
    """Each refused call gave its sequence number back: a forward after all of them runs."""
    assert outcomes["after every call: TrainingClient.forward"] == "ok", outcomes


def test_served_calls_succeed(outcomes: dict[str, str]) -> None:
    """The calls harts serve implements answer with a result, not an error."""
    served = [
        "TrainingClient.save_weights_external",
        "TrainingClient.forward_backward",
        "TrainingClient.forward_backward_custom",
        "TrainingClient.optim_step",
        "TrainingClient.save_state",
        "TrainingClient.save_weights_for_sampler",
        "SamplingClient.sample",
        "SamplingClient.compute_logprobs",
        "RestClient.get_external_weights_urls",
        "RestClient.publish_checkpoint_from_tinker_path",
        "RestClient.set_checkpoint_ttl_from_tinker_path",
        "RestClient.delete_checkpoint_from_tinker_path",
        "RestClient.list_user_checkpoints",
        "ServiceClient.create_training_client_from_state",
    ]
    failed = {name: outcomes[name] for name in served if outcomes[name] != "ok"}
    assert not failed, failed
