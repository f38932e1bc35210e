"""``benchmarks/_runner.py`` and the layout it serves: every script runs as ``python -m
benchmarks.<group>.<name>`` with the runner's parser, its JSON records the command that made it,
a bad ``--json`` is refused before any work, and the package ships none of it."""

from __future__ import annotations

import importlib
import json
import pathlib
import shlex

import pytest

from benchmarks import _runner

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for group in ("ops", "modules", "step")
    for p in (ROOT / "benchmarks" / group).glob("*.py")
    if p.name != "__init__.py"
)


def test_every_group_has_scripts() -> None:
    assert {s.split(".")[1] for s in SCRIPTS} == {"ops", "modules", "step"}
    assert _runner.ROOT == ROOT and _runner.module_of(str(ROOT / "benchmarks/ops/la.py")) == "benchmarks.ops.la"


@pytest.mark.parametrize("module", SCRIPTS)
def test_script_help_names_its_module(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m {module} ")


def test_json_starts_with_the_command_line(tmp_path: pathlib.Path) -> None:
    from benchmarks.step.compaction import main

    out = tmp_path / "a dir" / "compaction.json"
    argv = ["--workload", "tiny", "--json", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert next(iter(record)) == "command"
    assert record["command"] == "python -m benchmarks.step.compaction " + shlex.join(argv)
    assert shlex.split(record["command"])[-1] == str(out) and record["identical"] is True


def test_bad_json_path_is_refused_before_any_work(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.step.compaction import main

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the --json check")

    import harts.tree.workloads

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harts.tree.workloads, "generate", never)
        assert _runner.run(lambda: main(["--workload", "tiny", "--json", str(tmp_path)])) == 2
    err = capsys.readouterr().err
    assert err.startswith("harts: error: --json ") and "is a directory" in err and "Traceback" not in err


def test_median_seconds_warms_up_once_then_times_each_repeat() -> None:
    calls = []
    seconds = _runner.median_seconds(lambda: calls.append(1), None, 3)
    assert len(calls) == 4 and seconds >= 0
    _runner.median_seconds(lambda: calls.append(1), None, 2, warmup=False)
    assert len(calls) == 6


def test_the_package_ships_no_benchmarks() -> None:
    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=find["include"])
    assert "harts" in packages and "harts.commands" in packages
    assert all(p == "harts" or p.startswith("harts.") for p in packages), packages
