"""``harts serve``'s state directory survives a kill at any instant, and foreign or torn files in it.

The server may be SIGKILLed in the middle of any save: afterwards every checkpoint must be the
whole old one or the whole new one, never neither and never a mix, and start-up must clear what
the killed save left. ``test_sigkill_at_every_file_operation`` proves it the exhaustive way: a
forked child (it shares this process's imports, so it starts at once) runs a server's saves and a
deletion and kills itself at its n-th file operation, for every n until the saves finish; each
time a fresh ``CheckpointDir`` (what the service builds at start-up) opens the same state
directory, and the files are compared with both versions.

The listings must answer whatever lies in the state directory: a truncated or foreign JSON file,
a symlinked run folder or a stray file is skipped with a warning naming it, and the other runs are
listed. A JSON request body nested too deeply is a 400 like any other malformed body.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harts.serve.checkpoints import CheckpointDir, now
from harts.serve.wire import MAX_JSON_DEPTH, TinkerPath, WireError, json_body

RUN = "session:train:0"
A = TinkerPath(RUN, "weights", "a")  # overwritten (save_weights with overwrite=True)
S = TinkerPath(RUN, "sampler_weights", "s")  # overwritten (every save_weights_for_sampler of a name)
B = TinkerPath(RUN, "weights", "b")  # new
D = TinkerPath(RUN, "weights", "d")  # deleted
KEY = "tml-state-safety-0123456789abcdef"

#: the child's hook at each file operation (a no-op in this process)
_op: list[Callable[[], None]] = [lambda: None]


def _record(version: str) -> dict[str, Any]:
    return {
        "model_id": RUN,
        "base_model": "tiny",
        "lora": None,
        "created": now().isoformat(),
        "user_metadata": {"v": version},
    }


def _files(tag: str) -> dict[str, bytes]:
    """A checkpoint's files: several, one in a subfolder, each distinct per ``tag``."""
    return {
        "model.safetensors": f"{tag} weights ".encode() * 40,
        "state.json": json.dumps({"tag": tag}).encode(),
        "shards/part-1.bin": f"{tag} shard ".encode() * 20,
    }


def _writer(tag: str) -> Callable[[Path], None]:
    """What an engine's save does to its directory: files written piece by piece."""

    def write(directory: Path) -> None:
        for rel, data in _files(tag).items():
            f = directory / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            with open(f, "wb") as fh:
                fh.write(data[: len(data) // 2])
                fh.flush()
                _op[0]()  # killed here: a torn file in the temporary directory
                fh.write(data[len(data) // 2 :])

    return write


def _contents(directory: Path) -> dict[str, bytes] | None:
    if not directory.is_dir():
        return None
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def _die_at_operation(n: int) -> None:
    """Make this (child) process SIGKILL itself just before its ``n``-th file operation: a rename,
    removal or mkdir, half of a ``write_text``, half of a checkpoint file."""
    count = 0

    def op() -> None:
        nonlocal count
        count += 1
        if count == n:
            os.kill(os.getpid(), signal.SIGKILL)

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            op()
            return fn(*args, **kwargs)

        return call

    for name in ("replace", "rename", "unlink", "rmdir", "mkdir"):
        setattr(os, name, counted(getattr(os, name)))
    write_text = Path.write_text

    def torn_write_text(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        write_text(self, data[: len(data) // 2], *args, **kwargs)
        op()
        with open(self, "a") as fh:
            fh.write(data[len(data) // 2 :])
        return len(data)

    Path.write_text = torn_write_text  # type: ignore[method-assign]
    _op[0] = op


def _server_work(state: Path) -> None:
    """What the server's jobs do to the state directory after the setup: a run's record, two
    overwrites, a new checkpoint and a deletion, in this order."""
    ckpts = CheckpointDir(state)
    ckpts.write_run(RUN, _record("new"))
    ckpts.save(A, _writer("new-a"), overwrite=True, user_metadata={"v": "new"})
    ckpts.save(S, _writer("new-s"), overwrite=True, user_metadata={"v": "new"})
    ckpts.save(B, _writer("new-b"), overwrite=False, user_metadata={"v": "new"})
    ckpts.delete(D)


def _killed_at(state: Path, n: int, errors: Path) -> bool:
    """Run ``_server_work`` in a child killed at its ``n``-th file operation; False when it
    finished first (there are fewer operations)."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            _die_at_operation(n)
            _server_work(state)
        except BaseException:
            errors.write_text(traceback.format_exc())
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, errors.read_text() if errors.exists() else status
    return False


def _setup(state: Path) -> None:
    ckpts = CheckpointDir(state)
    ckpts.write_run(RUN, _record("old"))
    for tp in (A, S, D):
        ckpts.save(tp, _writer(f"old-{tp.name}"), overwrite=False, user_metadata={"v": "old"})


def _check_after_restart(state: Path) -> list[bool]:
    """Open ``state`` as a restarted server does and check every checkpoint is whole; which of the
    child's steps (new A, new S, B there, D gone) took effect."""
    ckpts = CheckpointDir(state)
    got = {tp: _contents(ckpts.path(tp)) for tp in (A, S, B, D)}
    assert got[A] in (_files("old-a"), _files("new-a")), "checkpoint a is neither the old one nor the new one"
    assert got[S] in (_files("old-s"), _files("new-s")), "checkpoint s is neither the old one nor the new one"
    assert got[B] in (None, _files("new-b")), "checkpoint b is half there"
    assert got[D] in (_files("old-d"), None), "checkpoint d is half deleted"
    left = [str(p) for p in (state / "runs").rglob(".*")]
    assert not left, f"start-up left temporaries: {left}"
    record = ckpts.read_run(RUN)
    assert record is not None and record["user_metadata"]["v"] in ("old", "new")
    for tp in (A, S, B, D):
        meta = state / "runs" / RUN / "meta" / tp.kind / f"{tp.name}.json"
        if got[tp] is None:
            assert not meta.exists()
        elif meta.exists():
            assert json.loads(meta.read_text())["user_metadata"]["v"] in ("old", "new")
    listed = {c["tinker_path"] for c in ckpts.listing(RUN)}
    assert listed == {str(tp) for tp in (A, S, B, D) if got[tp] is not None}
    steps = [got[A] == _files("new-a"), got[S] == _files("new-s"), got[B] is not None, got[D] is None]
    assert steps == sorted(steps, reverse=True), f"the steps took effect out of order: {steps}"
    return steps


def test_sigkill_at_every_file_operation(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Whichever file operation of a save (or deletion) the server dies at, every checkpoint is
    the whole old or the whole new one after a restart, and no temporary is left."""
    caplog.set_level(logging.INFO, logger="harts.serve")
    seen: set[tuple[bool, ...]] = set()
    n = 0
    while True:
        n += 1
        assert n < 1000, "the saves never finished"
        state = tmp_path / f"state dir {n}"
        _setup(state)
        killed = _killed_at(state, n, tmp_path / "child error.txt")
        seen.add(tuple(_check_after_restart(state)))
        if not killed:
            break
    # every step was caught both before and after it took effect
    assert seen == {tuple(i < k for i in range(4)) for k in range(5)}
    assert n > 30, f"only {n - 1} file operations were counted: the hooks did not catch the saves"
    # the kill between the two renames of a replacement happened, and start-up put the old one back
    assert "left it aside; put back" in caplog.text
    assert "removed (left by a save or deletion that did not finish)" in caplog.text


def test_start_up_repairs_what_killed_saves_left(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint left aside between the two renames is put back; temporaries, stale copies
    beside a whole checkpoint and the metadata of a half-deleted one are removed; each is logged."""
    caplog.set_level(logging.INFO, logger="harts.serve")
    ckpts = CheckpointDir(tmp_path)
    ckpts.write_run(RUN, _record("old"))
    ckpts.save(A, _writer("a"), overwrite=False)
    ckpts.save(B, _writer("b"), overwrite=False)
    weights = tmp_path / "runs" / RUN / "weights"
    os.replace(weights / "a", weights / ".a.old")  # killed between the renames
    (weights / ".b.old").mkdir()  # killed while removing the replaced copy
    (weights / ".b.old" / "x").write_text("old")
    (weights / f".c.tmp-{'0' * 32}").mkdir()  # killed while writing
    (weights / f".c.tmp-{'0' * 32}" / "model.safetensors").write_bytes(b"half")
    (tmp_path / "runs" / RUN / f".run.json.tmp-{'1' * 32}").write_text('{"base')
    orphan = tmp_path / "runs" / RUN / "meta" / "weights" / "gone.json"
    orphan.write_text("{}")
    ckpts = CheckpointDir(tmp_path)
    assert _contents(weights / "a") == _files("a") and _contents(weights / "b") == _files("b")
    assert sorted(p.name for p in weights.iterdir()) == ["a", "b"]
    assert not list((tmp_path / "runs").rglob(".*")) and not orphan.exists()
    assert "a save killed mid-replacement left it aside; put back" in caplog.text
    assert caplog.text.count("removed") == 4, caplog.text


def test_exists_and_listing_see_a_checkpoint_while_it_is_aside(tmp_path: Path) -> None:
    """Between a replacement's two renames the name still resolves to the old checkpoint."""
    ckpts = CheckpointDir(tmp_path)
    ckpts.write_run(RUN, _record("old"))
    ckpts.save(A, _writer("a"), overwrite=False)
    weights = tmp_path / "runs" / RUN / "weights"
    os.replace(weights / "a", weights / ".a.old")
    assert ckpts.exists(A)
    assert [c["tinker_path"] for c in ckpts.listing(RUN)] == [str(A)]
    with pytest.raises(WireError, match="exists"):
        ckpts.save(A, _writer("a2"), overwrite=False)
    ckpts.delete(A)
    assert not ckpts.exists(A) and not list(weights.iterdir())


# ------------------------------------------------------------------ torn and foreign state
def _torn_state(state: Path) -> Path:
    """A state directory with one good run ("good", checkpoint ``ok``) among foreign and torn
    files; returns the folder a symlinked run points to."""
    ckpts = CheckpointDir(state)
    good = TinkerPath("good", "weights", "ok")
    ckpts.write_run("good", _record("old"))
    ckpts.save(good, _writer("ok"), overwrite=False, user_metadata={"v": "old"})
    for name in ("torn", "plain", "null", "deep", "listed", "nobase"):
        ckpts.save(TinkerPath("good", "weights", name), _writer(name), overwrite=False)
    runs = state / "runs"
    meta = runs / "good" / "meta" / "weights"
    (meta / "torn.json").write_text('{"time": "2024-')
    (meta / "plain.json").write_text('"just a string"')
    (meta / "null.json").write_text("null")
    (meta / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (meta / "listed.json").write_text(json.dumps({"time": now().isoformat(), "size_bytes": "big"}))
    (meta / "nobase.json").write_text(json.dumps({"time": 5, "user_metadata": {"a": 1}}))
    (runs / "good" / "weights" / "stray.txt").write_text("not a checkpoint")
    (runs / "good" / "weights" / "bad name").mkdir()
    for name, text in [
        ("truncated", '{"base_model": "ti'),
        ("array", "[1, 2]"),
        ("deep", "[" * 100_000 + "]" * 100_000),
        ("nobase", json.dumps({"created": now().isoformat()})),
        ("badlora", json.dumps({**_record("x"), "lora": {"rank": "8"}})),
        ("badtime", json.dumps({**_record("x"), "created": "yesterday"})),
    ]:
        (runs / name).mkdir()
        (runs / name / "run.json").write_text(text)
    # a run of this server's whose metadata is no strings (create_model takes any JSON there)
    ckpts.write_run("numbers", {**_record("x"), "user_metadata": {"n": 1, "list": [1, "a"]}})
    (runs / "binary").mkdir()
    (runs / "binary" / "run.json").write_bytes(b"\xff\xfe\x00garbage")
    (runs / "empty").mkdir()
    (runs / "stray.txt").write_text("hello")
    (runs / "odd name").mkdir()
    (runs / "odd name" / "run.json").write_text(json.dumps(_record("x")))
    other = CheckpointDir(state.parent / f"{state.name} elsewhere")  # a whole run, outside runs/
    other.write_run("linked", _record("x"))
    (runs / "linked").symlink_to(other.root / "linked", target_is_directory=True)
    return other.root / "linked"


def test_listings_skip_torn_and_foreign_state_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state dir"
    elsewhere = _torn_state(state)
    caplog.set_level(logging.WARNING, logger="harts.serve")
    ckpts = CheckpointDir(state)
    assert ckpts.run_ids() == ["good", "numbers"]
    listed = {c["checkpoint_id"]: c for c in ckpts.listing("good")}
    assert sorted(listed) == [f"weights/{n}" for n in ("deep", "listed", "nobase", "null", "ok", "plain", "torn")]
    assert listed["weights/ok"]["user_metadata"] == {"v": "old"}
    assert all(c["user_metadata"] is None and c["size_bytes"] is None for k, c in listed.items() if k != "weights/ok")
    for name in ("truncated", "array", "deep", "nobase", "badlora", "badtime", "binary", "empty", "linked"):
        assert str(state / "runs" / name) in caplog.text, name
        if name != "linked":  # a client naming it gets the 400 of a path leaving runs/
            assert ckpts.read_run(name) is None
    for name in ("torn", "plain", "null", "deep", "listed", "nobase"):
        assert f"{name}.json" in caplog.text, name
    for name in ("stray.txt", "odd name", "weights/stray.txt", "weights/bad name"):
        assert name in caplog.text, name
    assert (elsewhere / "run.json").is_file()  # a symlinked run's target is never touched
    warnings = len(caplog.records)
    ckpts.run_ids()
    ckpts.listing("good")
    assert len(caplog.records) == warnings, "the same problem was warned about twice"


@pytest.fixture
def torn_client(tmp_path: Path) -> Iterator[Any]:
    """The HTTP app over a torn state directory."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from harts.serve.app import build_app
    from harts.serve.config import ServeConfig
    from harts.serve.server import make_service

    state = tmp_path / "state dir"
    _torn_state(state)
    config = ServeConfig(model="tiny", api_key=KEY, state_dir=state, poll_seconds=0.2, capacity=512)
    with TestClient(build_app(make_service(config)), raise_server_exceptions=False) as client:
        client.headers["X-API-Key"] = KEY
        yield client


def test_listing_endpoints_answer_over_torn_state(torn_client: Any) -> None:
    """Every listing endpoint and weights_info answers 200 with the good runs only."""
    runs = torn_client.get("/api/v1/training_runs")
    assert runs.status_code == 200, runs.text
    assert [r["training_run_id"] for r in runs.json()["training_runs"]] == ["good", "numbers"]
    assert runs.json()["training_runs"][1]["user_metadata"] == {"n": "1", "list": '[1, "a"]'}
    listed = torn_client.get("/api/v1/checkpoints")
    assert listed.status_code == 200, listed.text
    assert len(listed.json()["checkpoints"]) == 7
    assert torn_client.get("/api/v1/training_runs/good").status_code == 200
    assert torn_client.get("/api/v1/training_runs/good/checkpoints").status_code == 200
    info = torn_client.post("/api/v1/weights_info", json={"tinker_path": "tinker://good/weights/torn"})
    assert info.status_code == 200, info.text
    for run in ("truncated", "deep", "linked"):
        r = torn_client.get(f"/api/v1/training_runs/{run}")
        assert r.status_code in (400, 404), (run, r.status_code, r.text)
        r = torn_client.post("/api/v1/weights_info", json={"tinker_path": f"tinker://{run}/weights/x"})
        assert r.status_code in (400, 404), (run, r.status_code, r.text)


# ------------------------------------------------------------------ deep request bodies
def test_json_body_refuses_what_the_parser_cannot_take() -> None:
    with pytest.raises(WireError, match="nests deeper than"):
        json_body(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "create_session")
    with pytest.raises(WireError, match="nests deeper than"):
        json_body(json.dumps({"a": json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)}).encode(), "x")
    json_body(json.dumps({"a": json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))}).encode(), "x")
    with pytest.raises(WireError, match="not JSON"):
        json_body(b'{"a": ' + b"9" * 10_000 + b"}", "x")  # more digits than Python converts
    with pytest.raises(WireError, match="not JSON"):
        json_body(b"\xff\xfe{", "x")


def test_deep_request_bodies_get_a_400_and_the_server_carries_on(torn_client: Any) -> None:
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"user_metadata": {"a": ' + b"[" * 5_000 + b"]" * 5_000 + b"}}"):
        for route in ("create_session", "weights_info", "create_model", "save_weights"):
            r = torn_client.post(f"/api/v1/{route}", content=body)
            assert r.status_code == 400, (route, r.status_code, r.text[:300])
            assert "nests deeper than" in r.json()["detail"]
    assert torn_client.get("/api/v1/healthz").status_code == 200
