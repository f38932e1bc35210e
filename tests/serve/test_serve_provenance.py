"""A datum's provenance through the real tinker SDK against ``harts serve``: the ``sequence_id``
a sampling client returns names the sampled tokens in a training request of the same session
(``Datum.with_provenance``); an unknown sequence, one sampled in another session, and runs that
do not stay inside the sequence get a one-line 400 naming the datum and the field, and the client
carries on. ``stable_reinforce`` and ``record_stability_info`` are refused the same way (Tinker
documents their inputs but not the objective; ``harts.serve.provenance``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
pytest.importorskip("torch")

from tinker import types  # noqa: E402

from tests.serve._server import Server, service_client, serving  # noqa: E402

PROMPT = [5, 9, 2, 33, 17, 4]
PARAMS = types.SamplingParams(max_tokens=4, stop=[], seed=7)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving("tiny", tmp_path_factory.mktemp("serve provenance"), "--capacity", "256") as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: Server) -> Iterator[Any]:
    with service_client(server) as sc:
        yield sc


def rl_datum(seq: Any, *, sequence_id: str | None = None, prompt_offset: int = 0) -> types.Datum:
    """The cookbook's RL datum of one sampled sequence (prompt + its tokens, advantage 1 on the
    sampled ones) with its provenance: the prompt's runs and the sampled runs of ``seq``."""
    sid, n, p = sequence_id or seq.sequence_id, len(seq.tokens), len(PROMPT)
    tokens = PROMPT + seq.tokens
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * (p - 1) + list(seq.logprobs),
            "advantages": [0.0] * (p - 1) + [1.0] * n,
        },
    )
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=prompt_offset, length=p),
            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=p - 1),
            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n),
        ],
    )


def refused(call: Any, *needles: str) -> None:
    with pytest.raises(tinker.APIStatusError) as excinfo:
        call().result()
    err = excinfo.value
    assert err.status_code == 400, err
    for needle in needles:
        assert needle in str(err), str(err)
    assert str(err).count("\n") <= 1, str(err)


def test_sampled_sequences_name_their_tokens_in_a_training_request_of_their_session(
    server: Server, service: Any
) -> None:
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result().sequences
    assert len({s.sequence_id for s in seqs}) == 2 and all(len(s.tokens) == 4 for s in seqs)
    data = [rl_datum(s) for s in seqs]
    before = tc.forward_backward(data, "importance_sampling").result().metrics["loss:sum"]

    fb = tc.forward_backward
    field = "forward_backward_input.data[1].model_input_spans[1].sampled_tokens.sequence_id"
    refused(lambda: fb([data[0], rl_datum(seqs[1], sequence_id="nope")], "importance_sampling"), field, "unknown")
    refused(lambda: fb([rl_datum(seqs[0], prompt_offset=1)], "importance_sampling"), "data[0].model_input_spans[0]")
    with service_client(server) as other:
        theirs = (
            other.create_sampling_client(base_model="tiny")
            .result()
            .sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS)
        )
        foreign = rl_datum(theirs.result().sequences[0])
    refused(lambda: fb([foreign], "importance_sampling"), "data[0].model_input_spans[0]", "another session")
    refused(lambda: fb(data, "stable_reinforce"), "forward_backward_input.loss_fn", "objective")
    stable = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    refused(lambda: stable.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS), "record_stability_info")
    # every refusal used its sequence number: the same request runs again, to the same loss
    assert tc.forward_backward(data, "importance_sampling").result().metrics["loss:sum"] == pytest.approx(
        before, rel=1e-6
    )
