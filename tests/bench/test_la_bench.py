"""``benchmarks.ops.la`` plans real rounds and times every backend it is given (CPU smoke run, reference op)."""

from __future__ import annotations

import json

import numpy as np

from benchmarks.ops.la import main, round_shapes
from harts.tree.workloads import generate


def test_round_shapes_cover_every_round_of_the_plan():
    batch = generate("tiny", step=0)
    shapes = round_shapes(batch, capacity=100_000, chunk_size=8)
    assert shapes and all(s.cu_seqlens[0] == 0 and s.rows > 0 for s in shapes)
    assert [s.round for s in shapes] == list(range(len(shapes)))  # one microbatch at this capacity
    assert shapes[0].has_initial == [False] * (len(shapes[0].cu_seqlens) - 1)  # the first round starts from zeros
    assert any(any(s.has_initial) for s in shapes[1:])  # later rounds consume exported states
    assert sum(len(s.requests) for s in shapes) >= 1
    lengths = [np.diff(s.cu_seqlens) for s in shapes]
    assert all((a >= 0).all() for a in lengths)


def test_la_bench_cpu_smoke(tmp_path):
    out = tmp_path / "la.json"
    assert (
        main(
            [
                "--workload",
                "tiny",
                "--device",
                "cpu",
                "--backends",
                "reference",
                "--heads",
                "2",
                "--dim",
                "16",
                "--chunk-size",
                "8",
                "--dtype",
                "float32",
                "--repeat",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["rounds"]
    for r in data["rounds"]:
        assert r["forward_ms"]["reference"] > 0 and r["forward_backward_ms"]["reference"] > 0
