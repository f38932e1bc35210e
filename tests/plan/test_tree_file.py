"""TREE.json parsing and the ``harts calls`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

import harts
from harts.cli import main
from harts.plan.calls import plan_calls
from harts.plan.tree_file import forest_to_tree, load_tree, parse_tree
from harts.tree.compact import compact
from tests.plan.test_calls import FIGURE6


def doc(segs, chunk_size=None):
    d = {"segments": [{"id": i, "tokens": t, "parent": p} for i, t, p in segs]}
    if chunk_size is not None:
        d["chunk_size"] = chunk_size
    return d


def test_parse_keeps_file_child_order_and_names():
    forest, chunk = parse_tree(doc([("R", 3, None), ("b", 2, "R"), ("a", 5, "R"), ("c", 1, "b")], 16))
    assert chunk == 16
    assert forest.names == ["R", "b", "c", "a"]  # preorder, children in file order
    assert forest.start.tolist() == [0, 3, 5, 3]
    assert forest.end.tolist() == [3, 5, 6, 8]
    assert [forest.name(int(c)) for c in forest.children(0)] == ["b", "a"]


def test_several_roots_form_a_forest():
    forest, chunk = parse_tree(doc([("X", 3, None), ("Y", 4, None), ("x1", 1, "X"), ("y1", 2, "Y")]))
    assert chunk is None
    assert forest.num_trees == 2
    assert [forest.name(int(r)) for r in forest.roots] == ["X", "Y"]


def test_bare_list_and_integer_ids():
    forest, _ = parse_tree([{"id": 1, "tokens": 2, "parent": None}, {"id": 2, "tokens": 2, "parent": 1}])
    assert forest.names == ["1", "2"]


@pytest.mark.parametrize(
    "data, message",
    [
        (doc([("R", 3, None), ("a", 2, "Q")]), "segment 'a': unknown parent 'Q'"),
        (doc([("R", 3, None), ("a", 2, "b"), ("b", 2, "a")]), "cycle: a -> b -> a|cycle: b -> a -> b"),
        (doc([("R", 3, None), ("a", 2, "a")]), "'a' is its own parent"),
        (doc([("R", 0, None)]), "segment 'R': tokens must be a positive integer, got 0"),
        (doc([("R", -4, None)]), "positive integer, got -4"),
        (doc([("R", 2.5, None)]), "positive integer, got 2.5"),
        (doc([("R", True, None)]), "positive integer, got True"),
        (doc([("R", 3, None), ("R", 2, "R")]), "duplicate segment id 'R'"),
        ({"chunk_size": 64}, "missing the 'segments' list"),
        ({"segments": []}, "non-empty list"),
        (doc([("R", 3, None)], chunk_size=0), "chunk_size must be a positive integer"),
        ({"segments": [{"tokens": 3}]}, "segment #0 has no 'id'"),
    ],
    ids=[
        "unknown-parent",
        "cycle",
        "self-parent",
        "zero-tokens",
        "negative-tokens",
        "float-tokens",
        "bool-tokens",
        "duplicate-id",
        "no-segments",
        "empty",
        "bad-chunk",
        "no-id",
    ],  # fmt: skip
)
def test_bad_files(data, message):
    with pytest.raises(ValueError, match=message):
        parse_tree(data)


def test_roundtrip_through_file(tmp_path):
    path = tmp_path / "fig6.json"
    path.write_text(json.dumps(doc(FIGURE6, 64)))
    forest, chunk = load_tree(path)
    again, _ = parse_tree(forest_to_tree(forest, chunk))
    for k in ("start", "end", "parent", "row"):
        np.testing.assert_array_equal(getattr(forest, k), getattr(again, k))
    assert again.names == forest.names


# ------------------------------------------------------------------ CLI
def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["calls", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_schema(tmp_path, capsys):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(doc(FIGURE6, 64)))
    code, out, _ = run_cli(capsys, path, "--json")
    assert code == 0
    res = json.loads(out)
    assert set(res) == {"calls", "replay", "rounds"}
    assert res["calls"] == 3 and res["replay"] == 373
    for k, r in enumerate(res["rounds"], start=1):
        assert set(r) == {"round", "replay", "sequences"} and r["round"] == k
        for s in r["sequences"]:
            assert set(s) == {"segments", "replay"}
            assert all(isinstance(x, str) for x in s["segments"])
        assert r["replay"] == sum(s["replay"] for s in r["sequences"])
    assert res["rounds"][0]["sequences"][0] == {"segments": ["R1", "A1", "A2"], "replay": 0}


def test_cli_chunk_size_flag_overrides_file(tmp_path, capsys):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(doc([("v", 65, None), ("a", 3, "v"), ("b", 3, "v")], 64)))
    _, out, _ = run_cli(capsys, path, "--json")
    assert json.loads(out)["calls"] == 2
    _, out, _ = run_cli(capsys, path, "--json", "--chunk-size", "128")
    assert json.loads(out) == {
        "calls": 1,
        "replay": 65,
        "rounds": [
            {
                "round": 1,
                "replay": 65,
                "sequences": [{"segments": ["v", "a"], "replay": 0}, {"segments": ["b"], "replay": 65}],
            }
        ],
    }


def test_cli_text_and_plot(tmp_path, capsys):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(doc(FIGURE6, 64)))
    png = tmp_path / "plan.png"
    code, out, _ = run_cli(capsys, path, "--plot", png)
    assert code == 0
    assert "calls: 3" in out and "replay R: 373" in out
    assert "C13   (replay 7, from state" in out
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_file_is_one_line_error(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc([("R", 3, None), ("a", 2, "nope")])))
    code, _, err = run_cli(capsys, path)
    assert code == 2
    assert "unknown parent 'nope'" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, tmp_path / "missing.json")
    assert code == 2 and "no such file" in err
    (tmp_path / "junk.json").write_text("{not json")
    code, _, err = run_cli(capsys, tmp_path / "junk.json")
    assert code == 2 and "not valid JSON" in err


def test_cli_rollout_batch_file(tmp_path, capsys):
    trajs = [[7, 1, 2, 3, 4, 5], [7, 1, 2, 3, 9], [7, 1, 8], [6, 6, 6, 1]]
    batch = harts.RolloutBatch.from_trajectories(trajs)
    path = tmp_path / "batch.jsonl"
    batch.save(str(path))
    code, out, _ = run_cli(capsys, path, "--json", "--chunk-size", "2")
    assert code == 0
    expect = plan_calls(compact(batch).segment_trees, 2).summary()
    assert json.loads(out) == expect
    assert expect["calls"] >= 2
