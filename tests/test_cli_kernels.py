"""The commands' kernel choices: every ``--la-backend`` and ``--attention`` takes the registry's
names (``harts.ops.registry``), and ``harts bench`` names the kernel record in its run header
and its JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from harts.cli import build_parser, main
from harts.ops.registry import ATTENTION_IMPLS, linear_attn_choices


def test_every_command_takes_the_registry_names() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    seen: dict[str, list[str]] = {"la_backend": [], "attention": []}
    for name, sub in commands.items():
        for action in sub._actions:
            if action.dest == "la_backend":
                assert tuple(action.choices) == linear_attn_choices(), name
                seen["la_backend"].append(name)
            elif action.dest == "attention" and action.choices is not None:
                assert tuple(action.choices) == ATTENTION_IMPLS, name
                seen["attention"].append(name)
    assert {"bench", "compare", "fidelity", "train"} <= set(seen["la_backend"])
    assert {"bench", "compare", "train"} <= set(seen["attention"])


def test_the_old_linear_attention_name_is_taken() -> None:
    args = build_parser().parse_args(["compare", "--la-backend", "tree_linked"])
    assert args.la_backend == "tree_linked"  # ExecutionConfig maps it: "tree" with link_rounds


def test_bench_names_the_kernel_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HARTS_KDA_SILU_IN_SPLIT", "HARTS_KDA_FLA_GATE"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "bench.json"
    argv = ["bench", "--workload", "tiny", "--steps", "1", "--capacity", "300", "--no-warmup", "--json", str(path)]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kernels (both sides): ")]
    assert lines == [
        "kernels (both sides): linear attention reference; conv reference; attention gather; "
        "fast paths: all but stacked_qkv, stacked_gates, fla_gate; torch.compile glue: off"
    ]
    kernels = json.loads(path.read_text())["kernels"]
    assert kernels["linear_attention"] == "reference" and kernels["attention"] == "gather"
    assert kernels["flex"] == {} and not kernels["link_rounds"]
