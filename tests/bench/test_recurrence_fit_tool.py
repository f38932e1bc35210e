"""``python -m benchmarks.step.recurrence_fit``: a bench result's chains counted again on the CPU equal
the ones the run recorded, the fit is the run's own, and a result from another workload or seed
is refused by name."""

from __future__ import annotations

import json

import pytest

from benchmarks.step.recurrence_fit import fit_result, main


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    from harts.cli import main as cli

    path = str(tmp_path_factory.mktemp("bench") / "b.json")
    cli(["bench", "--workload", "tiny", "--steps", "2", "--capacity", "300", "--no-warmup", "--json", path])
    with open(path) as f:
        return path, json.load(f)


def test_refit_counts_the_recorded_chains_and_gives_the_runs_fit(result: tuple[str, dict]) -> None:
    path, d = result
    fits = fit_result(d, "tiny")
    assert [f["step"] for f in fits] == [0, 1]
    for f, st in zip(fits, d["steps"]):
        assert st["recurrence_fit"] is not None
        assert f["fit"] == st["recurrence_fit"]


def test_refit_of_results_without_chains(result: tuple[str, dict]) -> None:
    # a result written before the chain was recorded: the chains come from the replanning
    _, d = result
    old = json.loads(json.dumps(d))
    for st in old["steps"]:
        for side in ("baseline", "harts"):
            del st[side]["microbatch_chain"]
    assert [f["fit"] for f in fit_result(old, "tiny")] == [st["recurrence_fit"] for st in d["steps"]]


def test_another_seed_is_refused_by_step_and_side(result: tuple[str, dict], capsys: pytest.CaptureFixture) -> None:
    path, d = result
    with pytest.raises(ValueError, match=r"step 0, baseline: replanned microbatch rows"):
        fit_result(d, "tiny", seed=5)
    with pytest.raises(SystemExit) as e:
        main([path, "--workload", "tiny", "--seed", "5"])
    assert e.value.code == 2 and "not this run's workload or seed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([path + ".missing", "--workload", "tiny"])
    assert "No such file" in capsys.readouterr().err


def test_cli_prints_each_step_and_writes_json(result: tuple[str, dict], tmp_path, capsys) -> None:
    path, d = result
    out = tmp_path / "fits.json"
    main([path, "--workload", "tiny", "--json", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1"]
    assert "sequential chunk steps per 1k rows" in lines[0]
    assert json.loads(out.read_text())[1]["fit"] == d["steps"][1]["recurrence_fit"]
