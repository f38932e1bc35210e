"""Concurrent sampling requests on the batched decoder (forced on the CPU, float64) decode in one
shared batch per weights source, through the real worker: each answers what it answers alone
(tokens, stop reasons exactly; log-probs to 1e-10: the same float64 terms, rows of a larger
batch), a short request is answered before a long one it shares the batch with, requests on
other weights never join it, and a cancelled request or a finished session's request leaves it;
through the server's endpoints, a sampling client's concurrent requests share the batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from google.protobuf.json_format import MessageToDict
from tinker.proto import tinker_public_pb2 as pb

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import harts.serve.sampling as sampling  # noqa: E402
from harts.rollout.fast import DecodeBatch  # noqa: E402
from harts.rollout.sampler import SamplingConfig  # noqa: E402
from harts.serve.app import build_app  # noqa: E402
from harts.serve.config import ServeConfig  # noqa: E402
from harts.serve.futures import Done, Failed, FutureStore, Outcome  # noqa: E402
from harts.serve.sampling import SampleBatches, SampleJob, SampleRun, take_snapshot  # noqa: E402
from harts.serve.server import make_service  # noqa: E402
from harts.serve.worker import Job, Worker  # noqa: E402
from harts.trainer.engine import Engine  # noqa: E402
from harts.trainer.lora import LoraConfig  # noqa: E402
from tests.serve.test_sampling_fast import _split  # noqa: E402
from tests.serve.test_sampling_slices import finish  # noqa: E402

TOL = 1e-10

JOBS = [
    SampleJob(
        prompt=list(range(1, 14)),
        num_samples=3,
        config=SamplingConfig(max_tokens=9, top_k=20, temperature=0.9, stop_tokens=(3,), topk_logprobs=2),
        seed=5,
        topk_prompt_logprobs=3,
    ),
    SampleJob(prompt=[7, 2, 9], num_samples=2, config=SamplingConfig(max_tokens=14), seed=6, prompt_logprobs=True),
    SampleJob(prompt=[4, 4, 8, 1, 5, 3, 30, 2], num_samples=1, config=SamplingConfig(max_tokens=5), seed=7),
    SampleJob(prompt=[11, 12], num_samples=4, config=SamplingConfig(max_tokens=11, temperature=0.0), seed=8),
]


class Recorder(FutureStore):
    """A future store that remembers the order requests were resolved in."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        self.order.append(request_id)
        super().resolve(request_id, outcome)


def outcome(futures: FutureStore, request_id: str) -> Done | Failed | None:
    return asyncio.run(futures.wait(request_id, timeout=120))


def response(out: Done | Failed | None) -> pb.SampleResponse:
    assert isinstance(out, Done), out
    msg = pb.SampleResponse()
    msg.ParseFromString(out.body)
    return msg


def assert_same(got: pb.SampleResponse, want: pb.SampleResponse) -> None:
    """The same answer: every non-float field equal, every float to ``TOL``."""
    (want_exact, want_floats), (got_exact, got_floats) = (_split(MessageToDict(r)) for r in (want, got))
    assert got_exact == want_exact and got_floats.keys() == want_floats.keys()
    keys = sorted(want_floats)
    np.testing.assert_allclose([got_floats[k] for k in keys], [want_floats[k] for k in keys], rtol=0, atol=TOL)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_spec("tiny", dtype="float64", seed=0, capacity=128)


def alone(job: SampleJob, weights: Callable[[], Any]) -> pb.SampleResponse:
    """``job`` decoded by itself on the batched decoder, in one slice."""
    return finish(SampleRun(job, weights, slice_seconds=1e9, fast=True))[0]


class Serving:
    """A worker and the shared batches, as ``harts serve`` wires them, with what every slice
    saw: the batches' sizes as it started (``SampleBatches.sizes``)."""

    def __init__(self) -> None:
        self.futures = Recorder()
        self.worker = Worker(self.futures)
        self.batches = SampleBatches()
        self.seen: list[dict[Hashable, tuple[int, int]]] = []
        self.slices = 0

    def submit(
        self,
        job: SampleJob,
        weights: Callable[[], Any],
        key: Hashable,
        *,
        lane: str = "run",
        owner: str | None = None,
        before_slice: Callable[[int], None] | None = None,
    ) -> str:
        def watched() -> Any:
            self.slices += 1
            if before_slice is not None:
                before_slice(self.slices)
            self.seen.append(self.batches.sizes())
            return weights()

        run = SampleRun(job, watched, slice_seconds=0.0, batches=self.batches, weights_key=key, fast=True)
        request_id = self.futures.create("Sample")
        self.worker.submit(Job(request_id=request_id, kind="Sample", run=run.step, lane=lane, owner=owner))
        run.settle = lambda done: self.worker.settle(request_id, done)
        return request_id


def test_concurrent_requests_decode_together_and_answer_as_alone(engine: Engine) -> None:
    weights = lambda: (engine, None)  # noqa: E731
    want = [alone(job, weights) for job in JOBS]
    srv = Serving()
    ids = [srv.submit(job, weights, "base") for job in JOBS]  # one lane: the run's, as the server's
    got = [response(outcome(srv.futures, i)) for i in ids]
    srv.worker.stop()
    for g, w in zip(got, want):
        assert_same(g, w)
    # all four decoded at once, each sample a sequence of the one shared decoder
    assert max(s.get("base", (0, 0))[0] for s in srv.seen) == len(JOBS)
    assert max(s.get("base", (0, 0))[1] for s in srv.seen) == sum(j.num_samples for j in JOBS)
    assert srv.batches.sizes() == {}  # the last one out dropped the batch and its caches


def test_a_short_request_is_answered_before_the_long_one_it_decodes_with(engine: Engine) -> None:
    weights = lambda: (engine, None)  # noqa: E731
    long = SampleJob(prompt=[5, 6, 7], num_samples=2, config=SamplingConfig(max_tokens=40, stop_tokens=()), seed=1)
    short = SampleJob(prompt=[9, 8], num_samples=1, config=SamplingConfig(max_tokens=3, stop_tokens=()), seed=2)
    srv = Serving()
    long_id = srv.submit(long, weights, "base")
    short_id = srv.submit(short, weights, "base")  # queued behind the long one in the same lane
    assert_same(response(outcome(srv.futures, short_id)), alone(short, weights))
    assert_same(response(outcome(srv.futures, long_id)), alone(long, weights))
    srv.worker.stop()
    assert srv.futures.order == [short_id, long_id]


def test_requests_on_other_weights_decode_in_a_batch_of_their_own() -> None:
    lora = Engine.from_spec("tiny", dtype="float64", lora=LoraConfig(rank=2, seed=1), seed=0, capacity=128)
    with torch.no_grad():
        for p in lora.model.parameters():
            if p.requires_grad:
                p.add_(0.05)  # adapters that change the samples
    snap = take_snapshot("m", 0, lora.model)
    with torch.no_grad():
        for p in lora.model.parameters():
            if p.requires_grad:
                p.zero_()  # the run moved on: its live weights are no longer the snapshot's
    saved = lambda: (lora, snap.tensors)  # noqa: E731
    live = lambda: (lora, None)  # noqa: E731
    job = JOBS[1]
    want_saved, want_live = alone(job, saved), alone(job, live)
    assert want_saved.sequences[0].tokens != want_live.sequences[0].tokens
    srv = Serving()
    ids = [srv.submit(job, saved, "snapshot", lane="a"), srv.submit(job, live, "live", lane="b")]
    ids += [srv.submit(job, saved, "snapshot", lane="a"), srv.submit(job, live, "live", lane="b")]
    got = [response(outcome(srv.futures, i)) for i in ids]
    srv.worker.stop()
    for g, w in zip(got, [want_saved, want_live, want_saved, want_live]):
        assert_same(g, w)
    assert max(len(s) for s in srv.seen) == 2  # two batches at once, never one of both
    assert max(s.get("snapshot", (0, 0))[0] for s in srv.seen) == 2


@pytest.mark.parametrize("how", ["cancel", "session"])
def test_a_dropped_request_leaves_the_batch_with_its_sequences(engine: Engine, how: str) -> None:
    weights = lambda: (engine, None)  # noqa: E731
    keep = SampleJob(prompt=[1, 2, 3], num_samples=2, config=SamplingConfig(max_tokens=30, stop_tokens=()), seed=3)
    drop = SampleJob(prompt=[4, 5], num_samples=3, config=SamplingConfig(max_tokens=30, stop_tokens=()), seed=4)
    srv = Serving()
    dropped: list[str] = []

    def drop_at(slice_number: int) -> None:  # on the kept request's 5th slice: both have joined
        if slice_number == 5:
            if how == "cancel":
                assert srv.worker.cancel(dropped[0], "cancelled by the client")
            else:
                assert srv.worker.drop_owner("s2", "session s2 expired") == 1

    keep_id = srv.submit(keep, weights, "base", owner="s1", before_slice=drop_at)
    dropped.append(srv.submit(drop, weights, "base", owner="s2"))
    assert_same(response(outcome(srv.futures, keep_id)), alone(keep, weights))
    lost = outcome(srv.futures, dropped[0])
    srv.worker.stop()
    assert isinstance(lost, Failed) and ("cancelled" in lost.message or "expired" in lost.message)
    sizes = [s["base"] for s in srv.seen if "base" in s]
    assert sizes[3] == (2, 5)  # both requests decoding: 2 + 3 sequences
    assert sizes[-1] == (1, 2)  # after the drop: only the kept request's sequences are open
    assert srv.batches.sizes() == {}


def test_the_server_batches_a_sampling_client_s_concurrent_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``harts serve``'s endpoints (in process, the batched decoder forced): requests sent
    at once decode in one batch and answer as the same requests sent one after another."""
    key = "tml-batched-0123456789abcdef"
    config = ServeConfig(model="tiny", dtype="float64", api_key=key, state_dir=tmp_path, poll_seconds=0.2)
    monkeypatch.setattr(sampling, "fast_decoding_applies", lambda model: True)
    widest: list[int] = []
    step = DecodeBatch.step

    def watched(self: DecodeBatch) -> list[Any]:
        widest.append(len(self.jobs))
        return step(self)

    monkeypatch.setattr(DecodeBatch, "step", watched)
    with TestClient(build_app(make_service(config)), raise_server_exceptions=False) as c:
        c.headers["X-API-Key"] = key
        r = c.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"})
        create = {"session_id": r.json()["session_id"], "sampling_session_seq_id": 0, "base_model": "tiny"}
        sampler = c.post("/api/v1/create_sampling_session", json=create).json()["sampling_session_id"]

        def send(seed: int) -> str:
            req = {
                "sampling_session_id": sampler,
                "num_samples": 2,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1 + seed, 2, 3, 4, 5]}]},
                "sampling_params": {"max_tokens": 40, "seed": seed, "stop": []},
            }
            r = c.post("/api/v1/asample", json=req)
            assert r.status_code == 200, r.text
            return str(r.json()["request_id"])

        def answer(request_id: str) -> pb.SampleResponse:
            while True:
                r = c.post("/api/v1/retrieve_future", json={"request_id": request_id})
                if r.headers["content-type"].startswith("application/json"):
                    assert r.json().get("type") == "try_again", r.text
                    continue
                msg = pb.SampleResponse()
                msg.ParseFromString(r.content)
                return msg

        seeds = range(4)
        one_by_one = [answer(send(seed)) for seed in seeds]
        assert max(widest) == 1
        widest.clear()
        together = [answer(i) for i in [send(seed) for seed in seeds]]
    assert max(widest) >= 2  # a request joined while another was decoding
    for got, want in zip(together, one_by_one):
        assert_same(got, want)
