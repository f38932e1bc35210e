"""``harts demo --config FILE``: the shared sections and ``[demo]`` set the demo's flags, each step's
``ExecutionConfig`` comes from the schema (``harts.trainer.options.execution_config``), and an
option the demo does not have is one error naming the file and key."""

from __future__ import annotations

import json
from pathlib import Path

from harts.cli import build_parser, main
from harts.commands import demo
from harts.commands._config import apply_config
from harts.trainer.options import execution_config

DEMO_TOML = """
[execution]
mode = "trajectory"

[optimizer]
lr = 0.01

[data]
steps = 1

[demo]
tasks = 2
group_size = 2
updates = 1
"""


def test_a_file_sets_the_demo_and_its_execution(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run dir"
    path = tmp_path / "demo.toml"
    path.write_text(
        DEMO_TOML + f'\n[outputs]\nrun_dir = "{run_dir.as_posix()}"\njson = "{(tmp_path / "s.json").as_posix()}"\n'
    )
    parser = build_parser()
    argv = ["demo", "--config", str(path), "--tasks", "3"]
    args = apply_config(parser, parser.parse_args(argv), argv)
    assert (args.mode, args.lr, args.steps, args.tasks, args.group_size) == ("trajectory", 0.01, 1, 3, 2)
    _, trainer = demo._trainer(args, "trajectory", vocab_size=64)
    assert trainer.cfg.train.execution == execution_config(args, mode="trajectory", attention="gather")
    assert trainer.cfg.train.lr == 0.01

    assert main(["demo", "--config", str(path)]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (run_dir / "metrics.jsonl").exists()
    assert "trajectory" in json.dumps(summary)


def test_an_option_the_demo_lacks_is_named(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[execution]\nattention = "mask"\n')
    assert main(["demo", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: execution.attention: harts demo has no such option" in err, err
