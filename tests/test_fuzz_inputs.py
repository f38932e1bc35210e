"""Fuzzing the input files: random corruptions of valid JSONL, Parquet and TREE.json files.

Every outcome must be a correct load or one of our errors (``harts.UserError``), both from the
loaders and from the CLI (exit 0, or exit 2 with ``harts: error:``) -- never another exception.
Corruptions: truncation, random bytes (replaced, inserted, flipped, or a whole random file),
type swaps of any field or element (numbers, NaN/inf, huge and negative ints, strings, bools,
nulls, lists, objects), out-of-range token ids, length changes, dropped and unknown fields, and
broken parent links in trees. The default budget is small; ``-m slow`` runs a larger one.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts import RolloutBatch, UserError
from harts.cli import main
from harts.plan.tree_file import load_tree

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FAST = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))

# ------------------------------------------------------------------ valid bases
VOCAB = 32


def base_records() -> list[dict]:
    batch = RolloutBatch.from_trajectories(
        [[1, 5, 9, 2], [1, 5, 9, 7, 7], [1, 4]],
        advantages=[0.7, -0.3, -0.4],
        old_logprobs=[[0.0, -1.0, -2.0, -0.5], [0.0, -0.1, -0.2, -0.3, -0.4], [0.0, -3.0]],
        ref_logprobs=[[0.0, -1.1, -2.1, -0.6], [0.0, -0.2, -0.2, -0.3, -0.5], [0.0, -2.5]],
        loss_weights=[[1.0] * 4, [0.5] * 5, [2.0] * 2],
        group_ids=[0, 0, 1],
        tree_ids=[0, 0, 1],
        vocab_size=VOCAB,
    )
    from harts.tree.io import _to_records

    return _to_records(batch)


HEADER = {"format": "harts.rollout_batch", "version": 1, "vocab_size": VOCAB}

BASE_TREE = {
    "chunk_size": 4,
    "segments": [
        {"id": "R", "tokens": 5, "parent": None},
        {"id": "A", "tokens": 3, "parent": "R"},
        {"id": "B", "tokens": 6, "parent": "R"},
        {"id": "C", "tokens": 1, "parent": "B"},
        {"id": "D", "tokens": 9, "parent": "B"},
        {"id": "S", "tokens": 2, "parent": None},
    ],
}

# -------------------------------------------------------------------- strategies
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, VOCAB - 1, VOCAB, 2**31, 2**63 - 1, 2**63, 2_000_000_000]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.5, -0.0, 1e308]),
    st.text(max_size=6),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def record_mutation(draw, records: list[dict]) -> list[dict]:
    """A few structural corruptions of the records (type swaps, range, length, fields)."""
    recs = copy.deepcopy(records)
    for _ in range(draw(st.integers(1, 3))):
        j = draw(st.integers(0, len(recs) - 1))
        rec = recs[j]
        if not isinstance(rec, dict):
            continue
        kind = draw(
            st.sampled_from(["swap-field", "swap-element", "drop", "unknown", "resize", "token-range", "whole-record"])
        )
        keys = sorted(rec)
        if kind == "swap-field" and keys:
            rec[draw(st.sampled_from(keys))] = draw(values)
        elif kind == "swap-element":
            lists = [k for k in keys if isinstance(rec[k], list) and rec[k]]
            if lists:
                k = draw(st.sampled_from(lists))
                rec[k][draw(st.integers(0, len(rec[k]) - 1))] = draw(scalars)
        elif kind == "drop" and keys:
            del rec[draw(st.sampled_from(keys))]
        elif kind == "unknown":
            rec[draw(st.text(min_size=1, max_size=5))] = draw(values)
        elif kind == "resize":
            lists = [k for k in keys if isinstance(rec[k], list)]
            if lists:
                k = draw(st.sampled_from(lists))
                n = draw(st.integers(0, 8))
                rec[k] = (rec[k] * 3)[:n]
        elif kind == "token-range" and isinstance(rec.get("tokens"), list) and rec["tokens"]:
            rec["tokens"][draw(st.integers(0, len(rec["tokens"]) - 1))] = draw(
                st.sampled_from([-1, VOCAB, 2**40, 2**63, -(2**63), 2_000_000_000])
            )
        elif kind == "whole-record":
            recs[j] = draw(values)
    return recs


@st.composite
def byte_mutation(draw, data: bytes) -> bytes:
    """Truncation, random bytes inserted / replaced / flipped, or an entirely random file."""
    kind = draw(st.sampled_from(["truncate", "insert", "replace", "flip", "random"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    i = draw(st.integers(0, max(len(data) - 1, 0)))
    if kind == "truncate":
        return data[:i]
    if kind == "insert":
        return data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
    if kind == "replace":
        chunk = draw(st.binary(min_size=1, max_size=8))
        return data[:i] + chunk + data[i + len(chunk) :]
    return data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1 :] if data else data


def jsonl_bytes(records: list, header: dict | None = HEADER) -> bytes:
    lines = ([json.dumps(header)] if header is not None else []) + [json.dumps(r) for r in records]
    return ("\n".join(lines) + "\n").encode()


def parquet_bytes(records: list) -> bytes | None:
    """Parquet of the records, or None when pyarrow cannot build a table from them."""
    try:
        table = pa.Table.from_pylist(records)
        table = table.replace_schema_metadata(
            {"format": "harts.rollout_batch", "version": "1", "vocab_size": str(VOCAB)}
        )
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
    except (pa.ArrowException, TypeError, ValueError, OverflowError, AttributeError):
        return None
    return sink.getvalue().to_pybytes()


# ------------------------------------------------------------------------ checks
def check_batch_file(path) -> None:
    """Loader: a valid batch (ours to validate) or a UserError; the CLI: exit 0 or 2."""
    try:
        batch = RolloutBatch.load(path)
    except UserError:
        loaded = False
    else:
        loaded = True
        assert batch.num_trajectories >= 1
        assert np.isfinite(batch.advantages).all()
        assert (batch.tokens >= 0).all() and (batch.vocab_size is None or (batch.tokens < batch.vocab_size).all())
        # a correct load is a batch harts itself writes and reads back unchanged
        again = path.with_name("again" + path.suffix)
        batch.save(again)
        back = RolloutBatch.load(again)
        # per-token fields hold one value per predicted token on disk: nothing predicts a
        # trajectory's first token, so its entries come back 0 (harts never reads them)
        read = np.ones(len(batch.tokens), dtype=bool)
        read[np.asarray(batch.offsets[:-1], dtype=np.int64)] = False
        for name in (
            "tokens",
            "offsets",
            "action_mask",
            "advantages",
            "old_logprobs",
            "ref_logprobs",
            "loss_weights",
            "group_ids",
            "tree_ids",
        ):
            a, b = getattr(batch, name), getattr(back, name)
            assert (a is None) == (b is None), name
            if a is not None:
                if name != "tokens" and np.shape(a) == read.shape:  # a per-token field
                    a, b = np.asarray(a)[read], np.asarray(b)[read]
                np.testing.assert_array_equal(a, b, err_msg=name)
    code = main(["stats", str(path), "--chunk-size", "4"])
    assert code == (0 if loaded else 2)


def check_tree_file(path) -> None:
    try:
        forest, chunk = load_tree(path)
    except UserError:
        loaded = False
    else:
        loaded = True
        assert forest.num_segments >= 1 and (chunk is None or chunk >= 1)
    code = main(["calls", str(path), "--json", "-"])
    assert code == (0 if loaded else 2)


def run_fuzz(tmp_path, capsys, example) -> None:  # noqa: ANN001
    name, data = example
    if data is None:  # pyarrow could not write these records at all
        return
    path = tmp_path / name
    path.write_bytes(data)
    if name.endswith(".json"):
        check_tree_file(path)
    else:
        check_batch_file(path)
    _, err = capsys.readouterr()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("harts")]
    # one line each: errors, and the deprecation line of a file in the older per-token form
    assert all(line.startswith(("harts: error: ", "harts: warning: ")) for line in lines), lines


# -------------------------------------------------------------------- examples
@st.composite
def jsonl_example(draw) -> tuple[str, bytes]:
    recs = base_records()
    if draw(st.booleans()):
        return "b.jsonl", jsonl_bytes(draw(record_mutation(recs)), HEADER if draw(st.booleans()) else None)
    if draw(st.booleans()):
        header = dict(HEADER)
        header[draw(st.sampled_from(["version", "vocab_size", "format"]))] = draw(values)
        return "b.jsonl", jsonl_bytes(recs, header)
    return "b.jsonl", draw(byte_mutation(jsonl_bytes(recs)))


@st.composite
def tree_example(draw) -> tuple[str, bytes]:
    doc = copy.deepcopy(BASE_TREE)
    segs = doc["segments"]
    kind = draw(st.sampled_from(["parent", "field", "drop", "cycle", "duplicate", "chunk", "bytes", "bare"]))
    i = draw(st.integers(0, len(segs) - 1))
    if kind == "parent":
        segs[i]["parent"] = draw(
            st.one_of(st.sampled_from(["R", "A", "B", "C", "D", "S", "nope", segs[i]["id"]]), values)
        )
    elif kind == "field":
        segs[i][draw(st.sampled_from(["id", "tokens", "parent"]))] = draw(values)
    elif kind == "drop":
        del segs[i][draw(st.sampled_from(["id", "tokens", "parent"]))]
    elif kind == "cycle":
        segs[0]["parent"] = segs[-2]["id"]  # R -> D -> B -> R
    elif kind == "duplicate":
        segs[i]["id"] = segs[(i + 1) % len(segs)]["id"]
    elif kind == "chunk":
        doc["chunk_size"] = draw(values)
    elif kind == "bare":
        doc = draw(st.one_of(values, st.just(segs)))
    data = json.dumps(doc).encode()
    if kind == "bytes":
        data = draw(byte_mutation(data))
    return "tree.json", data


@st.composite
def parquet_example(draw) -> tuple[str, bytes | None]:
    recs = base_records()
    if draw(st.booleans()):
        return "b.parquet", parquet_bytes(draw(record_mutation(recs)))
    return "b.parquet", draw(byte_mutation(parquet_bytes(recs)))


def test_bases_are_valid(tmp_path):
    (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(base_records()))
    assert RolloutBatch.load(tmp_path / "b.jsonl").num_trajectories == 3
    (tmp_path / "b.parquet").write_bytes(parquet_bytes(base_records()))
    assert RolloutBatch.load(tmp_path / "b.parquet").num_trajectories == 3
    (tmp_path / "tree.json").write_text(json.dumps(BASE_TREE))
    assert load_tree(tmp_path / "tree.json")[0].num_segments == 6


@FAST
@given(example=jsonl_example())
def test_fuzz_jsonl(tmp_path, capsys, example):
    run_fuzz(tmp_path, capsys, example)


@FAST
@given(example=parquet_example())
def test_fuzz_parquet(tmp_path, capsys, example):
    run_fuzz(tmp_path, capsys, example)


@FAST
@given(example=tree_example())
def test_fuzz_tree(tmp_path, capsys, example):
    run_fuzz(tmp_path, capsys, example)


@pytest.mark.slow
@SLOW
@given(example=st.one_of(jsonl_example(), parquet_example(), tree_example()))
def test_fuzz_all_inputs_large_budget(tmp_path, capsys, example):
    run_fuzz(tmp_path, capsys, example)
