"""The Mamba-2 rows of ``benchmarks.step.gpu_runs``: ``mamba2_la`` times the SSD's tree kernel
against plain fla at Nemotron 3 Nano's shapes on `medium` step 3, and ``nemotron_L8`` benches the
preset's first 8 layers like the Qwen L8 rows, on any card: its memory estimate (counted on the
CPU, the CUDA terms) fits an H100 and is the figure its purpose states."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from benchmarks.step.gpu_runs import BY_NAME, commands, main
from harts.cli import build_parser

#: an H100's memory as torch reports it (80 GB, 79.2 GiB), less a little for the CUDA context
H100_BYTES = int(79.1 * 2**30)
#: `medium` step 3's compression (gpu_runs' STEP3): sizes gathered attention views, if any
STEP3_COMPRESSION = 5.55


def test_nemotron_l8_is_the_qwen_l8_row_on_the_nemotron_preset() -> None:
    nemo = build_parser().parse_args(commands(BY_NAME["nemotron_L8"], "o")[0][-1][1:])
    q35 = build_parser().parse_args(commands(BY_NAME["q35_L8"], "o")[0][-1][1:])
    assert (nemo.model, nemo.layers) == ("nemotron_3_nano_30b_a3b", 8)
    same = ("device", "dtype", "recompute", "capacity", "attention", "la_backend", "workload", "first_step", "steps")
    assert {k: getattr(nemo, k) for k in same} == {k: getattr(q35, k) for k in same}
    assert nemo.json_out == "o/nemotron_L8.json" and not nemo.force


def test_nemotron_l8_fits_an_h100_by_its_estimate() -> None:
    from harts.commands._inputs import execution_config
    from harts.models.config import HybridConfig
    from harts.models.memory import estimate_memory, gathered_view_rows

    run = BY_NAME["nemotron_L8"]
    args = build_parser().parse_args(commands(run, "o")[0][-1][1:])
    config = HybridConfig.preset(args.model, layers=args.layers)
    assert config.layer_pattern == "S-S-SA-S" and config.ffn_pattern == "-E-E--E-"
    est = estimate_memory(
        config,
        replace(execution_config(args), fused_logprobs=True),  # as harts bench counts it
        capacity=args.capacity,
        device_type="cuda",
        dtype=args.dtype,
        optimizer=args.optimizer,
        device_total_bytes=H100_BYTES,
        view_rows=gathered_view_rows(args.capacity, STEP3_COMPRESSION),
    )
    assert est.total < H100_BYTES and run.card is None
    stated = float(re.search(r"estimated ([0-9.]+) GiB", run.purpose).group(1))  # type: ignore[union-attr]
    assert stated == pytest.approx(est.total / 2**30, abs=0.05)


def test_mamba2_la_times_the_ssd_at_nemotrons_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.ops import la

    argv = commands(BY_NAME["mamba2_la"], "o")[0][-1]
    assert argv[0] == "benchmarks.ops.la"
    seen = {}

    def parse_only(p, args):  # noqa: ANN001, ANN202
        seen["args"] = p.parse_args(args)
        raise SystemExit(0)

    monkeypatch.setattr(la, "parse", parse_only)
    with pytest.raises(SystemExit):
        la.main(argv[1:])
    args = seen["args"]
    assert (args.rule, args.model, args.backends, args.device) == (
        "plain",
        "nemotron_3_nano_30b_a3b",
        "tree,plain",
        "cuda",
    )
    assert (args.workload, args.step, args.capacity, args.chunk_size, args.dtype) == (
        "medium",
        3,
        65536,
        64,
        "bfloat16",
    )
    assert args.json_out == "o/mamba2_la.json"


def test_the_mamba2_rows_dry_run(capsys: pytest.CaptureFixture) -> None:
    assert main(["mamba2_la", "nemotron_L8", "--dry-run", "--out", "o"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["mamba2_la", "nemotron_L8"]
    assert "python3 -m benchmarks.ops.la --device cuda --rule plain --model nemotron_3_nano_30b_a3b" in lines[0]
    assert "harts.cli bench" in lines[1] and "--model nemotron_3_nano_30b_a3b --layers 8" in lines[1]
    assert "needs an" not in "".join(lines)
