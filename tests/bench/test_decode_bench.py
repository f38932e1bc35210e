"""benchmarks.decode.throughput runs end to end on the CPU at a tiny Qwen3.5 shape: every row
has harts', the reference's and transformers' tokens/s, the bound and its fraction, and both
samplers' log-probs agree with the training forward (float32: to 1e-4, the tolerance of
tests/bench/test_hf_anchor.py's float32 comparison)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks.decode.throughput import main  # noqa: E402

TINY = {
    "hidden_size": 32,
    "vocab_size": 64,
    "intermediate_size": 48,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "chunk_size": 8,
}


def test_decode_bench_runs_on_cpu(tmp_path) -> None:
    out = tmp_path / "decode bench.json"
    argv = [
        "--preset",
        "qwen3_5_9b",
        "--layers",
        "4",
        "--prompt",
        "11",
        "--new",
        "3",
        "--batch",
        "1",
        "2",
        "--cuda-graphs",
    ]
    argv += ["--device", "cpu", "--dtype", "float32", "--json", str(out)]
    for field, value in TINY.items():
        argv += ["--override", f"{field}={value}"]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m benchmarks.decode.throughput") and record["layers"] == 4
    assert record["hf_not_run"] is None
    assert [r["batch"] for r in record["rows"]] == [1, 2]
    for row in record["rows"]:
        for key in ("harts_tok_s", "reference_tok_s", "hf_tok_s", "bound_tok_s"):
            assert row[key] > 0, key
        assert row["fraction_of_bound"] == pytest.approx(row["harts_tok_s"] / row["bound_tok_s"])
        assert row["harts_graphs_tok_s"] > 0  # --cuda-graphs: on the CPU the eager steps again
    for side in ("harts", "transformers"):
        gap = record["logprob_gap"][side]
        assert gap["tokens"] == 4 * 3 and 0 <= gap["mean_abs"] <= gap["max_abs"] < 1e-4  # float32
