"""Sampling options through the real tinker SDK against ``harts serve --model tiny --tokenizer DIR``
in float64: greedy, ``top_k``, string stop sequences, top-k prompt / sample log-probs, the
log-probs of named prompt targets and alternative prompt tokens, each
checked against its definition over the trainer's own forward (the log-prob of every vocabulary
token at a position, from ``TrainingClient.forward``); and the served tokenizer reaching the
SDK's ``get_tokenizer`` with the Hub offline.

Both sides compute in float64 and travel as float32, so two log-probs of one value differ by at
most the float32 rounding of each: ``RTOL`` is two float32 ulps."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tinker import types  # noqa: E402

from tests.serve._server import REPO, Server, service_client, serving  # noqa: E402

VOCAB = 64
RTOL = 2 * 2.0**-24
EOS = 0


def make_tokenizer(path: Path) -> Path:
    """A BPE tokenizer of the tiny preset's 64 ids (characters plus a few merges, so words span
    several tokens and a token several characters); EOS is id 0."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|eos|>": EOS}
    for c in "abcdefghijklmnopqrstuvwxyz .,!?\n":
        vocab[c] = len(vocab)
    merges = [("t", "h"), ("th", "e"), ("e", "n"), ("e", "r"), ("i", "n"), ("o", "n"), ("a", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    for c in "ABCDEFGHIJKLMNOPQRSTUVWX":  # every id of the model decodes to text
        vocab[c] = len(vocab)
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok dir") / "tok")


@pytest.fixture(scope="module")
def server(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # served under the tokenizer's path: SamplingClient.get_tokenizer loads its base model's name
    args = ("--tokenizer", str(tokenizer_dir), "--model-name", str(tokenizer_dir), "--dtype", "float64")
    args += ("--capacity", "256")
    with serving("tiny", tmp_path_factory.mktemp("serve options"), *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: Server) -> Iterator[tinker.ServiceClient]:
    with service_client(server) as sc:
        yield sc


@pytest.fixture(scope="module")
def trained(service: tinker.ServiceClient, tokenizer_dir: Path) -> tuple[tinker.TrainingClient, tinker.SamplingClient]:
    """A training client and a sampling client of its weights (the same tensors)."""
    tc = service.create_lora_training_client(base_model=str(tokenizer_dir), rank=4, seed=3).result()
    return tc, tc.save_weights_and_get_sampling_client().result()


def distributions(tc: tinker.TrainingClient, prefixes: list[list[int]]) -> np.ndarray:
    """[len(prefixes), VOCAB] log p(v | prefix) from the trainer's forward: one datum per
    (prefix, v) whose last target is v."""
    data = [
        types.Datum(model_input=types.ModelInput.from_ints(p), loss_fn_inputs={"target_tokens": p[1:] + [v]})
        for p in prefixes
        for v in range(VOCAB)
    ]
    out = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    return np.array([o["logprobs"].tolist()[-1] for o in out], dtype=np.float64).reshape(len(prefixes), VOCAB)


def assert_topk(got: list[tuple[int, float]], dist: np.ndarray, k: int) -> None:
    order = np.argsort(-dist, kind="stable")[:k]
    assert [t for t, _ in got] == order.tolist()
    np.testing.assert_allclose([lp for _, lp in got], dist[order], rtol=RTOL, atol=0)


PROMPT = [5, 9, 2, 33, 17, 4]


def test_greedy_is_the_argmax_and_topk_sample_logprobs_are_the_trainers(trained):
    tc, sampler = trained
    params = types.SamplingParams(temperature=0, max_tokens=5, stop=[])
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, params, topk_sample_logprobs=4).result()
    seqs = res.sequences
    assert all(s.tokens == seqs[0].tokens and s.stop_reason == "length" for s in seqs)
    tokens = seqs[0].tokens
    dist = distributions(tc, [PROMPT + tokens[:t] for t in range(len(tokens))])
    for t, tok in enumerate(tokens):
        assert tok == int(dist[t].argmax())
        np.testing.assert_allclose(seqs[0].logprobs[t], dist[t, tok], rtol=RTOL, atol=0)
        assert_topk(seqs[0].topk_logprobs[t], dist[t], 4)


def test_top_k_samples_only_the_k_largest_renormalized(trained):
    tc, sampler = trained
    k = 3
    params = types.SamplingParams(max_tokens=3, top_k=k, temperature=1.0, stop=[], seed=11)
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), 6, params).result()
    prefixes = sorted({tuple(PROMPT + s.tokens[:t]) for s in res.sequences for t in range(len(s.tokens))})
    dist = dict(zip(prefixes, distributions(tc, [list(p) for p in prefixes])))
    for s in res.sequences:
        for t, (tok, lp) in enumerate(zip(s.tokens, s.logprobs)):
            d = dist[tuple(PROMPT + s.tokens[:t])]
            top = np.argsort(-d)[:k]
            assert tok in top
            want = d[tok] - np.logaddexp.reduce(d[top])
            np.testing.assert_allclose(lp, want, rtol=RTOL, atol=4 * 2.0**-24)


def test_topk_prompt_logprobs_are_the_trainers(trained):
    tc, sampler = trained
    params = types.SamplingParams(max_tokens=1)
    prompt = types.ModelInput.from_ints(PROMPT)
    res = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=5).result()
    rows = res.topk_prompt_logprobs
    assert rows is not None and len(rows) == len(PROMPT) and rows[0] is None
    dist = distributions(tc, [PROMPT[:i] for i in range(1, len(PROMPT))])
    for i in range(1, len(PROMPT)):
        assert_topk(rows[i], dist[i - 1], 5)
        np.testing.assert_allclose(res.prompt_logprobs[i], dist[i - 1, PROMPT[i]], rtol=RTOL, atol=0)
    last = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=5, prompt_logprobs_last_n=2
    ).result()
    assert last.topk_prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert last.topk_prompt_logprobs[-2:] == rows[-2:]


def test_target_prompt_logprobs_are_the_trainers_dense_and_sparse(trained):
    tc, sampler = trained
    prompt, params = types.ModelInput.from_ints(PROMPT), types.SamplingParams(max_tokens=1)
    dist = distributions(tc, [PROMPT[:i] for i in range(1, len(PROMPT))])  # row i-1: position i
    ids = np.array([[PROMPT[i + 1], (7 * i) % VOCAB, -1] for i in range(len(PROMPT) - 1)], dtype=np.int64)
    ids[2] = [-1, -1, VOCAB - 1]
    want = np.where(ids >= 0, np.take_along_axis(dist, np.maximum(ids, 0), axis=1), 0.0)

    res = sampler.sample(prompt, 1, params, target_prompt_logprobs=types.TensorData.from_numpy(ids)).result()
    got = res.target_prompt_logprobs
    assert got is not None and got.sparse_crow_indices is None and got.shape == list(ids.shape)
    np.testing.assert_allclose(got.to_numpy(), want, rtol=RTOL, atol=0)

    import torch

    # sparse: only the listed cells ask (pad -1 leaves the -1 cells out); the answer keeps the layout
    sparse = types.TensorData.from_torch_sparse(torch.from_numpy(ids), pad_value=-1)
    res = sampler.sample(prompt, 1, params, target_prompt_logprobs=sparse).result()
    got = res.target_prompt_logprobs
    assert got.sparse_crow_indices == sparse.sparse_crow_indices
    assert got.sparse_col_indices == sparse.sparse_col_indices
    np.testing.assert_allclose(got.to_numpy(), want, rtol=RTOL, atol=0)


def test_prompt_alt_tokens_are_draws_with_the_trainers_logprobs(trained):
    tc, sampler = trained
    prompt, k = types.ModelInput.from_ints(PROMPT), 4
    dist = distributions(tc, [PROMPT[:i] for i in range(1, len(PROMPT))])

    greedy = types.SamplingParams(max_tokens=2, temperature=0, stop=[])
    alt = sampler.sample(prompt, 1, greedy, prompt_alt_tokens_k=k).result().prompt_alt_tokens
    assert alt is not None
    tokens, lps = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert tokens.shape == lps.shape == (len(PROMPT) - 1, k)
    assert (tokens == dist.argmax(axis=1)[:, None]).all()  # greedy: the argmax, k times
    np.testing.assert_allclose(lps, np.take_along_axis(dist, tokens, axis=1), rtol=RTOL, atol=0)

    params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[], seed=5)
    plain = sampler.sample(prompt, 2, params).result()
    with_alt = sampler.sample(prompt, 2, params, prompt_alt_tokens_k=k).result()
    again = sampler.sample(prompt, 2, params, prompt_alt_tokens_k=k).result()
    # the draws have their own generator: the samples are those of the request without them
    assert [s.tokens for s in with_alt.sequences] == [s.tokens for s in plain.sequences]
    tokens = with_alt.prompt_alt_tokens.tokens.to_numpy()
    assert (tokens == again.prompt_alt_tokens.tokens.to_numpy()).all()  # the seed fixes them
    assert ((tokens >= 0) & (tokens < VOCAB)).all() and len(np.unique(tokens)) > 1
    lps = with_alt.prompt_alt_tokens.logprobs.to_numpy()
    np.testing.assert_allclose(lps, np.take_along_axis(dist, tokens, axis=1), rtol=RTOL, atol=0)


def test_string_stops_end_at_the_completing_token_across_token_boundaries(trained, tokenizer_dir):
    from transformers import AutoTokenizer

    _, sampler = trained
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)

    def text(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    prompt = types.ModelInput.from_ints(PROMPT)
    free = sampler.sample(prompt, 1, types.SamplingParams(temperature=0, max_tokens=12, stop=[])).result()
    tokens = free.sequences[0].tokens
    # the first boundary before any EOS whose two characters around it (the last of one token,
    # the first of the next) are not in the text before: a stop string completed by token i
    i = next(
        i
        for i in range(1, len(tokens))
        if EOS not in tokens[: i + 1]
        and text(tokens[i - 1 : i])[-1] + text(tokens[i : i + 1])[0] not in text(tokens[:i])
    )
    stop, end = text(tokens[i - 1 : i])[-1] + text(tokens[i : i + 1])[0], i + 1
    for given in ([stop, "never!?"], stop):
        res = sampler.sample(prompt, 2, types.SamplingParams(temperature=0, max_tokens=12, stop=given)).result()
        for seq in res.sequences:
            assert seq.tokens == tokens[:end] and seq.stop_reason == "stop"
            assert seq.logprobs == free.sequences[0].logprobs[:end]
    res = sampler.sample(prompt, 1, types.SamplingParams(temperature=0, max_tokens=12, stop=["never!?"])).result()
    eos_at = tokens.index(EOS) + 1 if EOS in tokens else None
    assert res.sequences[0].tokens == tokens[:eos_at]
    assert res.sequences[0].stop_reason == ("stop" if eos_at else "length")


def test_refused_options_name_their_field(trained):
    _, sampler = trained
    prompt = types.ModelInput.from_ints([1, 2])
    for kwargs, field in (
        ({"sampling_params": types.SamplingParams(max_tokens=2, temperature=-1)}, "sampling_params.temperature"),
        ({"sampling_params": types.SamplingParams(max_tokens=2, top_k=-2)}, "sampling_params.top_k"),
        ({"sampling_params": types.SamplingParams(max_tokens=2, stop=[""])}, "sampling_params.stop"),
        ({"sampling_params": types.SamplingParams(max_tokens=2), "topk_sample_logprobs": VOCAB + 1}, "topk_sample"),
        ({"sampling_params": types.SamplingParams(max_tokens=2), "topk_prompt_logprobs": -1}, "topk_prompt"),
        ({"sampling_params": types.SamplingParams(max_tokens=2), "prompt_alt_tokens_k": VOCAB + 1}, "prompt_alt"),
    ):
        with pytest.raises(tinker.APIStatusError) as excinfo:
            sampler.sample(prompt, 1, **kwargs).result()
        assert excinfo.value.status_code == 400 and field in str(excinfo.value), (field, excinfo.value)


@pytest.mark.parametrize(
    ("target", "says"),
    [
        (types.TensorData(data=[1, 2, 3, 4, 5, 6], dtype="int64", shape=[3, 2]), "shape [3, 2]"),
        (types.TensorData(data=[1] * 129, dtype="int64", shape=[1, 129]), "1 <= K <= 128"),
        (types.TensorData(data=[1, VOCAB], dtype="int64", shape=[1, 2]), f"id {VOCAB} at [0, 1]"),
        (types.TensorData(data=[1, -2], dtype="int64", shape=[1, 2]), "id -2 at [0, 1]"),
        (
            types.TensorData(data=[1], dtype="int64", shape=[1, 2], sparse_crow_indices=[0, 2], sparse_col_indices=[0]),
            "sparse_crow_indices",
        ),
    ],
)
def test_a_bad_target_prompt_logprobs_names_the_field(trained, target, says):
    _, sampler = trained
    with pytest.raises(tinker.APIStatusError) as excinfo:
        sampler.sample(
            types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=target
        ).result()
    assert excinfo.value.status_code == 400
    assert "target_prompt_logprobs" in str(excinfo.value) and says in str(excinfo.value), excinfo.value


def test_get_tokenizer_loads_the_served_directory_offline(trained, tokenizer_dir, monkeypatch):
    """TrainingClient.get_tokenizer loads get_info's tokenizer_id (the --tokenizer directory);
    SamplingClient.get_tokenizer loads its base model's name, here that same directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tc, sampler = trained
    assert tc.get_info().model_data.tokenizer_id == str(tokenizer_dir.resolve())
    for tok in (tc.get_tokenizer(), sampler.get_tokenizer()):
        assert tok.encode("then the end", add_special_tokens=False) == [34, 14, 27, 34, 27, 35, 4]
        assert tok.eos_token_id == EOS and len(tok) == VOCAB


def _serve_error(tmp_path: Path, *args: str) -> str:
    """``harts serve`` with ``args``: it must exit 2 with one line on stderr, which is returned."""
    cmd = [sys.executable, "-m", "harts.cli", "serve", "--api-key", "tml-test-0123456789abcdef", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300, env=_env())
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_a_bad_tokenizer_directory_is_one_line_naming_it(tmp_path):
    from harts.errors import UserError
    from harts.serve.config import ServeConfig

    missing = tmp_path / "no such tok"
    assert str(missing) in _serve_error(tmp_path, "--model", "tiny", "--tokenizer", str(missing))
    empty = tmp_path / "empty dir"
    empty.mkdir()
    with pytest.raises(UserError, match=re.escape(f"--tokenizer {empty}: holds no tokenizer")):
        ServeConfig(model="tiny", api_key="tml-test-0123456789abcdef", tokenizer=str(empty))
    colon = make_tokenizer(tmp_path / "a:b")
    with pytest.raises(UserError, match=re.escape(f"--tokenizer {colon}: the tinker SDK cuts a tokenizer id at ':'")):
        ServeConfig(model="tiny", api_key="tml-test-0123456789abcdef", tokenizer=str(colon))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match=re.escape(f"--tokenizer {broken}: does not load")):
        ServeConfig(model="tiny", api_key="tml-test-0123456789abcdef", tokenizer=str(broken))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from harts.errors import UserError
    from harts.serve.config import ServeConfig
    from harts.serve.server import model_info

    big = tmp_path / "big"
    vocab = {f"w{i}": i for i in range(VOCAB + 1)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0"))).save_pretrained(big)
    config = ServeConfig(model="tiny", api_key="tml-test-0123456789abcdef", tokenizer=str(big))
    with pytest.raises(UserError, match=re.escape(f"--tokenizer {big}: its {VOCAB + 1} tokens do not fit")):
        model_info(config)
