"""One validator for JSONL and Parquet batch files: same rules, same messages, naming file, record and field."""

from __future__ import annotations

import json
import re

import pytest

from harts import BatchValidationError, RolloutBatch, UserError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_jsonl(path, records, header=None):
    lines = ([json.dumps(header)] if header is not None else []) + [json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(path, records, schema=None, metadata=None):
    table = pa.Table.from_pylist(records, schema=schema)
    if metadata is not None:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, path)
    return path


def error_of(path) -> str:
    with pytest.raises(BatchValidationError) as info:
        RolloutBatch.load(path)
    return str(info.value)


def normalized(msg: str, path) -> str:
    """The message without the file name and with JSONL lines (1-based) as rows (0-based)."""
    msg = msg.replace(str(path), "FILE")
    return re.sub(r"\(line (\d+)\)", lambda m: f"(row {int(m.group(1)) - 1})", msg)


GOOD = {"tokens": [1, 2, 3], "advantages": 0.5}

# corruptions that both formats can express (a Parquet column has one type, so every record
# carries the same kind of value), with the message both must give
SAME = [
    (
        "float-token-ids",
        [{"tokens": [1.0, 2.0], "advantages": 1.0}] * 2,
        "FILE: trajectory 0 (row 0): tokens, position 0 is number 1.0 (must be an integer)",
    ),
    (
        "string-advantages",
        [{"tokens": [1, 2], "advantages": "high"}, {"tokens": [1], "advantages": "low"}],
        "FILE: trajectory 0 (row 0): advantages must be a number or a list of numbers (one per predicted token), got string 'high'",
    ),
    (
        "bool-advantages",
        [{"tokens": [1, 2], "advantages": True}],
        "FILE: trajectory 0 (row 0): advantages must be a number or a list of numbers (one per predicted token), got boolean true",
    ),
    (
        "no-advantages",
        [{"tokens": [1, 2]}, {"tokens": [3]}],
        "FILE: trajectory 0 (row 0): missing required field 'advantages'",
    ),
    (
        "negative-loss-weights",
        [dict(GOOD, loss_weights=[1.0, 0.5, -0.25])],
        "FILE: trajectory 0 (row 0): loss_weights, position 2 is -0.25 (weights must be >= 0)",
    ),
    (
        "positive-logprobs",
        [dict(GOOD, logprobs=[-1.0, 0.7])],
        "FILE: trajectory 0 (row 0): logprobs, position 1 is 0.7: a log-probability is <= 0",
    ),
    (
        "positive-old-logprobs-older-form",
        [dict(GOOD, old_logprobs=[0.0, -1.0, 0.7])],
        "FILE: trajectory 0 (row 0): old_logprobs, position 2 is 0.7: a log-probability is <= 0",
    ),
    (
        "negative-loss-weights-per-predicted-token",
        [dict(GOOD, loss_weights=[0.5, -0.25])],
        "FILE: trajectory 0 (row 0): loss_weights, position 1 is -0.25 (weights must be >= 0)",
    ),
    (
        "nan-advantage",
        [dict(GOOD, advantages=[0.0, float("nan"), 1.0])],
        "FILE: trajectory 0 (row 0): advantages, position 1 is nan (must be a finite number)",
    ),
    (
        "negative-token",
        [{"tokens": [4, -1], "advantages": 0.0}],
        "FILE: trajectory 0 (row 0): tokens, position 1 is a negative token id -1",
    ),
    (
        "short-mask",
        [dict(GOOD, action_mask=[True])],
        "FILE: trajectory 0 (row 0): action_mask has 1 values for 3 tokens (one per predicted token: "
        "len(tokens) - 1 = 2)",
    ),
    (
        "partial-group-id",
        [dict(GOOD, group_id=1), dict(GOOD, group_id=None)],
        "FILE: trajectory 1 (row 1): has no 'group_id' but trajectory 0 (row 0) does",
    ),
    (
        "string-group-id",
        [dict(GOOD, group_id="a")],
        "FILE: trajectory 0 (row 0): group_id must be an integer, got string 'a'",
    ),
]


@pytest.mark.parametrize("records, expected", [c[1:] for c in SAME], ids=[c[0] for c in SAME])
def test_jsonl_and_parquet_give_the_same_error(tmp_path, records, expected):
    jl = write_jsonl(tmp_path / "b.jsonl", records)
    pqf = write_parquet(tmp_path / "b.parquet", records)
    a, b = normalized(error_of(jl), jl), normalized(error_of(pqf), pqf)
    assert a == b
    assert a.startswith(expected), a


def test_scalar_and_per_token_advantages_mix_by_record(tmp_path):
    p = write_jsonl(
        tmp_path / "b.jsonl",
        [{"tokens": [1, 2], "advantages": 0.5}, {"tokens": [1, 3, 4], "advantages": [1.0, -1.0]}],
    )
    b = RolloutBatch.load(p)
    assert b.advantages.tolist() == [0.5, 0.5, 0.0, 1.0, -1.0]


def test_mixed_advantages_error_names_the_right_line(tmp_path):
    p = write_jsonl(
        tmp_path / "b.jsonl", [{"tokens": [1, 2], "advantages": 0.5}, {"tokens": [1, 3, 4], "advantages": [1.0]}]
    )
    assert error_of(p) == (
        f"{p}: trajectory 1 (line 2): advantages has 1 values for 3 tokens (one per predicted token: "
        "len(tokens) - 1 = 2)"
    )


@pytest.mark.parametrize(
    "header, message",
    [
        ({"format": "harts.rollout_batch", "version": 7}, "version 7 is not supported; this harts reads version 1"),
        ({"format": "harts.rollout_batch", "version": 1, "vocab_size": "big"}, "vocab_size must be a positive integer"),
    ],
)
def test_bad_headers(tmp_path, header, message):
    p = write_jsonl(tmp_path / "b.jsonl", [GOOD], header=header)
    assert re.search(f"b.jsonl: line 1: header: {message}", error_of(p))
    meta = {k: json.dumps(v) if k != "format" else v for k, v in header.items()}
    q = write_parquet(tmp_path / "b.parquet", [GOOD], metadata=meta)
    assert re.search(f"b.parquet: schema metadata: {message}", error_of(q))


def test_jsonl_header_typo_is_rejected(tmp_path):
    # (Parquet schema metadata also carries other tools' keys, e.g. pandas', so only ours are read there)
    p = write_jsonl(tmp_path / "b.jsonl", [GOOD], header={"format": "harts.rollout_batch", "vocab": 3})
    assert "b.jsonl: line 1: header: unknown field(s) ['vocab']" in error_of(p)


def test_header_after_records_is_rejected(tmp_path):
    p = write_jsonl(tmp_path / "b.jsonl", [GOOD, {"format": "harts.rollout_batch", "version": 1}])
    assert "line 2: a 'harts.rollout_batch' header may only be the first line" in error_of(p)


def test_unreadable_files_are_batch_errors(tmp_path):
    (tmp_path / "bin.jsonl").write_bytes(b'{"tokens": [1], "advantages": 0}\n\xff\xfe\n')
    assert error_of(tmp_path / "bin.jsonl").endswith("bin.jsonl: line 2: not UTF-8 text (byte 1 of the line)")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    assert "junk.parquet: not a readable Parquet file" in error_of(tmp_path / "junk.parquet")
    (tmp_path / "dir.jsonl").mkdir()
    assert "is a directory" in error_of(tmp_path / "dir.jsonl")
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "deep.jsonl").write_text(deep + "\n")
    assert "deep.jsonl: line 1:" in error_of(tmp_path / "deep.jsonl")
    assert issubclass(BatchValidationError, UserError) and issubclass(BatchValidationError, ValueError)


def test_parquet_typed_columns_round_trip(tmp_path):
    """Integer columns of any width and float32 metadata load; nulls mean 'absent'."""
    schema = pa.schema(
        [("tokens", pa.list_(pa.int32())), ("advantages", pa.float32()), ("old_logprobs", pa.list_(pa.float32()))]
    )
    p = write_parquet(
        tmp_path / "b.parquet",
        [
            {"tokens": [1, 2], "advantages": 0.5, "old_logprobs": None},
            {"tokens": [3], "advantages": -1.0, "old_logprobs": None},
        ],
        schema,
    )
    b = RolloutBatch.load(p)
    assert b.tokens.tolist() == [1, 2, 3] and b.old_logprobs is None


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_rewards_round_trip_and_are_checked(tmp_path, suffix):
    b = RolloutBatch.from_trajectories([[1, 2, 3], [1, 4]], advantages=[0.5, -0.5], rewards=[1.0, 0.25])
    path = str(tmp_path / f"b{suffix}")
    b.save(path)
    back = RolloutBatch.load(path)
    assert back.rewards is not None and back.rewards.tolist() == [1.0, 0.25]
    assert back.select([1]).rewards.tolist() == [0.25]
    recs = [{"tokens": [1, 2], "advantages": 0.0, "reward": 1.0}, {"tokens": [1, 3], "advantages": 0.0}]
    write_jsonl(tmp_path / "some.jsonl", recs)
    assert "trajectory 1 (line 2): has no 'reward'" in error_of(tmp_path / "some.jsonl")
    write_jsonl(tmp_path / "str.jsonl", [{"tokens": [1, 2], "advantages": 0.0, "reward": "high"}])
    assert "trajectory 0 (line 1): reward must be a finite number, got string 'high'" in error_of(
        tmp_path / "str.jsonl"
    )


def test_tree_rewards_sit_on_every_leaf_or_none():
    nodes = [
        {"id": "t", "parent": None, "tokens": [1, 2]},
        {"id": "a", "parent": "t", "tokens": [3], "reward": 1.0},
        {"id": "b", "parent": "t", "tokens": [4, 5], "reward": 0.0},
    ]
    assert RolloutBatch.from_tree(nodes).rewards.tolist() == [1.0, 0.0]
    with pytest.raises(BatchValidationError, match="leaf 'b' has no 'reward'"):
        RolloutBatch.from_tree([*nodes[:2], {"id": "b", "parent": "t", "tokens": [4]}])
    with pytest.raises(BatchValidationError, match="node 't': 'reward' is per trajectory"):
        RolloutBatch.from_tree([{**nodes[0], "reward": 1.0}, *nodes[1:]])
    with pytest.raises(BatchValidationError, match="reward is nan"):
        RolloutBatch.from_tree([nodes[0], nodes[1], {**nodes[2], "reward": float("nan")}])
