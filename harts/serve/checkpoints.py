"""Where a training run's files live under ``--state-dir``, and their listing.

Layout (``<model_id>`` is Tinker's ``<session_id>:train:<n>``)::

    <state_dir>/runs/<model_id>/run.json                   base model, LoRA config, metadata
    <state_dir>/runs/<model_id>/weights/<name>/            Engine.save_state (weights, optimizer, RNG)
    <state_dir>/runs/<model_id>/sampler_weights/<name>/    Engine.save_weights_for_sampler (HF, LoRA merged)
    <state_dir>/runs/<model_id>/external_weights/<name>/   the same, saved for download (``save_weights_external``)
    <state_dir>/runs/<model_id>/meta/<kind>/<name>.json    when it was saved, its size, user metadata,
                                                           published or not, when it expires

``tinker://<model_id>/weights/<name>``, ``tinker://<model_id>/sampler_weights/<name>`` and
``tinker://<model_id>/external_weights/<name>`` name the three kinds of checkpoint. A client's path becomes a directory only through
``CheckpointDir.path``, which resolves it and refuses anything outside ``runs/``.

The server may be killed at any instant and must find every checkpoint whole afterwards. A
checkpoint is written into a hidden ``.<name>.tmp-<hex>`` beside its name and renamed into place
by ``harts.outputs.replace_dir``: one already there is first renamed to ``.<name>.old`` and
removed once the new one is in place. So at every instant the name holds the whole old or the
whole new checkpoint, except between those two renames, when ``.<name>.old`` holds the old one:
``exists`` and the listing count it under its name then, and start-up (``CheckpointDir()``) puts
it back. A deletion renames the checkpoint to a temporary name before removing it. ``run.json``
and the metadata files are written aside and renamed too. Start-up removes what killed saves
left (temporaries, stale ``.old`` copies), logging each.

Listings never fail on what they find on disk: a truncated or foreign JSON file, a run folder
that is a symlink, a stray file or folder under ``runs/`` is skipped with one warning naming it,
and the rest is listed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from harts.outputs import moved_aside, remove_path, replace_dir, restore_dir
from harts.serve.wire import CHECKPOINT_KINDS, TinkerPath, WireError, check_name, is_model_id

__all__ = ["CheckpointDir", "now"]

log = logging.getLogger("harts.serve")

#: what an unfinished write leaves: a checkpoint's ``.<name>.tmp-<hex>`` (and what
#: ``write_state`` makes beside it, ``..<name>.tmp-<hex>.<suffix>``), a JSON file's
#: ``.<file>.tmp-<hex>``, and the ``.run.json.<hex>`` of servers before these names
_TEMP = re.compile(r"\..*\.tmp-[0-9a-f]{32}(\..*)?|\.run\.json\.[0-9a-f]{32}")
#: where ``replace_dir`` moves the checkpoint it replaces: ``.<name>.old``
_ASIDE = re.compile(r"\.(.+)\.old")
#: what ``_read_json`` returns for a file it could not read or parse
_UNREADABLE = object()


def now() -> datetime:
    """The current time, timezone-aware (what Tinker's datetime fields carry)."""
    return datetime.now(timezone.utc)


def _temp_beside(path: Path) -> Path:
    """A fresh hidden name beside ``path`` that start-up removes if it is left behind."""
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")


def _write_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON in ``path``, written aside and renamed into place (never half a file)."""
    tmp = _temp_beside(path)
    try:
        tmp.write_text(json.dumps(obj, indent=1, default=str))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _is_name(name: str) -> bool:
    try:
        check_name(name, "name")
    except WireError:
        return False
    return True


def _valid_time(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def _run_problem(record: Any) -> str | None:
    """What makes ``record`` no ``run.json`` of this server's (None: it is one)."""
    if not isinstance(record, dict):
        return f"holds a JSON {type(record).__name__}, not an object"
    if not isinstance(record.get("base_model"), str):
        return "has no base_model string"
    if not _valid_time(record.get("created")):
        return "has no ISO 'created' time"
    if not isinstance(record.get("user_metadata"), dict | None):
        return "has a user_metadata that is not an object"
    lora = record.get("lora")
    if lora is None:
        return None
    if not isinstance(lora, dict):
        return "has a lora that is not an object"
    if not all(type(lora.get(k)) is int for k in ("rank", "seed")):
        return "has a lora without integer rank and seed"
    if not all(type(lora.get(k)) is bool for k in ("train_attn", "train_mlp", "train_unembed")):
        return "has a lora without boolean train_attn, train_mlp and train_unembed"
    return None


def _meta_problem(meta: Any) -> str | None:
    """What makes ``meta`` no checkpoint metadata of this server's (None: it is some)."""
    if not isinstance(meta, dict):
        return f"holds a JSON {type(meta).__name__}, not an object"
    if not _valid_time(meta.get("time")):
        return "has no ISO 'time'"
    size = meta.get("size_bytes")
    if size is not None and (type(size) is not int or size < 0):
        return "has a size_bytes that is not a count"
    user = meta.get("user_metadata")
    if user is not None and not (isinstance(user, dict) and all(isinstance(v, str) for v in user.values())):
        return "has a user_metadata that is not an object of strings"
    if meta.get("expires_at") is not None and not _valid_time(meta["expires_at"]):
        return "has an expires_at that is not an ISO time"
    if not isinstance(meta.get("public", False), bool):
        return "has a public that is not true or false"
    return None


class CheckpointDir:
    """The ``runs/`` tree of one state directory (module docstring). Constructing one repairs
    what a server killed mid-save left in it."""

    def __init__(self, state_dir: Path) -> None:
        self.root = (Path(state_dir) / "runs").resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        #: the (path, problem) pairs warned about already: a listing repeats every time
        self._warned: set[tuple[str, str]] = set()
        self.repair()

    def _warn(self, path: Path, problem: str) -> None:
        if (str(path), problem) not in self._warned:
            self._warned.add((str(path), problem))
            log.warning("%s: %s; skipped", path, problem)

    # ------------------------------------------------------------------ start-up
    def repair(self) -> None:
        """Put back every checkpoint a killed replacement left moved aside, and remove the
        temporaries and stale copies killed saves and deletions left (each one logged).
        Symlinks are never followed: what they point to is not the server's."""
        for run in self._entries(self.root):
            if run.is_symlink() or not run.is_dir():
                continue
            self._remove_temps(run)
            meta = run / "meta"
            for kind in CHECKPOINT_KINDS:
                kdir, mdir = run / kind, meta / kind
                if kdir.is_symlink():
                    continue
                if kdir.is_dir():
                    self._repair_kind(kdir)
                if not meta.is_symlink() and not mdir.is_symlink() and mdir.is_dir():
                    self._remove_temps(mdir)
                    self._remove_orphans(mdir, kdir)

    def _repair_kind(self, kdir: Path) -> None:
        """Put back a checkpoint of ``kdir`` left aside, remove stale copies and temporaries."""
        for p in self._entries(kdir):
            aside = _ASIDE.fullmatch(p.name)
            if aside is None or not _is_name(aside[1]):
                continue
            final = kdir / aside[1]
            try:
                done = restore_dir(final)
            except OSError as err:
                log.warning("%s: could not be put back as %s (%s)", p, final, err)
                continue
            if done == "restored":
                log.warning("%s: a save killed mid-replacement left it aside; put back", final)
            elif done == "removed":
                log.info("%s: removed (a stale copy of %s)", p, final.name)
        self._remove_temps(kdir)

    def _entries(self, directory: Path) -> list[Path]:
        """The entries of ``directory``, sorted by name; none when it cannot be read."""
        try:
            return sorted(directory.iterdir())
        except OSError as err:
            self._warn(directory, f"cannot be read ({err.strerror or err})")
            return []

    def _remove_orphans(self, mdir: Path, kdir: Path) -> None:
        """Remove the metadata of checkpoints a deletion killed halfway removed already."""
        for f in self._entries(mdir):
            name = f.name.removesuffix(".json")
            if f.name.endswith(".json") and _is_name(name) and f.is_file() and not os.path.lexists(kdir / name):
                f.unlink(missing_ok=True)
                log.info("%s: removed (the metadata of a deleted checkpoint)", f)

    def _remove_temps(self, directory: Path) -> None:
        for p in self._entries(directory):
            if _TEMP.fullmatch(p.name):
                remove_path(p)
                log.info("%s: removed (left by a save or deletion that did not finish)", p)

    # ------------------------------------------------------------------ paths
    def run_dir(self, model_id: str) -> Path:
        """``runs/<model_id>``, checked to stay under ``runs/``."""
        p = (self.root / model_id).resolve()
        if p.parent != self.root:
            raise WireError(f"model_id: {model_id!r} does not name a training run of this server")
        return p

    def path(self, tp: TinkerPath) -> Path:
        """The directory of checkpoint ``tp``, checked to stay under its run's directory."""
        run = self.run_dir(tp.model_id)
        p = (run / tp.kind / tp.name).resolve()
        if not p.is_relative_to(run / tp.kind):
            raise WireError(f"path: {tp} leaves the server's state directory")
        return p

    def exists(self, tp: TinkerPath) -> bool:
        """True when checkpoint ``tp`` is on disk (also in the instant a replacement has it aside)."""
        p = self.path(tp)
        return p.is_dir() or moved_aside(p).is_dir()

    # ------------------------------------------------------------------ runs
    def write_run(self, model_id: str, record: dict[str, Any]) -> None:
        """Write ``run.json`` of a run (created on its first save or at creation)."""
        d = self.run_dir(model_id)
        d.mkdir(parents=True, exist_ok=True)
        _write_json(d / "run.json", record)

    def read_run(self, model_id: str) -> dict[str, Any] | None:
        """``run.json`` of a run, or None when the run left nothing on disk or a file that is no
        ``run.json`` of this server's (warned about once)."""
        f = self.run_dir(model_id) / "run.json"
        if not f.is_file():
            return None
        record = self._read_json(f)
        if record is _UNREADABLE:
            return None
        problem = _run_problem(record)
        if problem is not None:
            self._warn(f, problem)
            return None
        return record

    def _read_json(self, f: Path) -> Any:  # noqa: ANN401
        """The JSON in file ``f``; ``_UNREADABLE`` (warned about) when it cannot be read or parsed."""
        try:
            return json.loads(f.read_bytes())
        except OSError as err:
            self._warn(f, f"cannot be read ({err.strerror or err})")
        except RecursionError:
            self._warn(f, "is not JSON (nested too deeply)")
        except ValueError as err:
            self._warn(f, f"is not JSON ({err})")
        return _UNREADABLE

    def run_ids(self) -> list[str]:
        """Every run with a ``run.json``, oldest first; anything else under ``runs/`` is skipped
        (a foreign or symlinked one with a warning)."""
        found: list[tuple[float, str]] = []
        for p in self._entries(self.root):
            if p.is_symlink():
                self._warn(p, "is a symlink, not a training run's folder")
            elif not p.is_dir():
                self._warn(p, "is not a training run's folder")
            elif not is_model_id(p.name):
                self._warn(p, "is not named as a training run")
            elif not (p / "run.json").is_file():
                self._warn(p, "has no run.json")
            elif self.read_run(p.name) is not None:
                try:
                    found.append(((p / "run.json").stat().st_mtime, p.name))
                except OSError:
                    continue  # deleted meanwhile
        return [name for _, name in sorted(found)]

    # ------------------------------------------------------------------ checkpoints
    def save(
        self,
        tp: TinkerPath,
        write: Callable[[Path], Any],
        *,
        overwrite: bool,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> None:
        """Run ``write(tmp_dir)`` and put the result in place of ``tp``'s directory (module
        docstring), then write its metadata."""
        final = self.path(tp)
        if self.exists(tp) and not overwrite:
            raise WireError(f"path: checkpoint {tp} exists; pass overwrite=True to replace it")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_beside(final)
        try:
            write(tmp)
            size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            replace_dir(tmp, final)
        finally:
            remove_path(tmp)
        saved = now()
        meta = {
            "time": saved.isoformat(),
            "size_bytes": size,
            "user_metadata": user_metadata,
            "expires_at": (saved + timedelta(seconds=ttl_seconds)).isoformat() if ttl_seconds else None,
        }
        self._meta_file(tp).parent.mkdir(parents=True, exist_ok=True)
        _write_json(self._meta_file(tp), meta)

    def delete(self, tp: TinkerPath) -> None:
        """Remove checkpoint ``tp`` and its metadata (a missing one is a 404). The checkpoint
        leaves its name in one rename, so a kill never leaves part of it there."""
        p = self.path(tp)
        restore_dir(p)
        if not p.is_dir():
            raise WireError(f"checkpoint {tp} does not exist", 404)
        trash = _temp_beside(p)
        os.replace(p, trash)
        self._meta_file(tp).unlink(missing_ok=True)
        remove_path(trash)

    def _meta_file(self, tp: TinkerPath) -> Path:
        return self.run_dir(tp.model_id) / "meta" / tp.kind / f"{tp.name}.json"

    def metadata(self, tp: TinkerPath) -> dict[str, Any]:
        """Checkpoint ``tp``'s metadata (empty when it has none or it is unreadable)."""
        return self._meta(self._meta_file(tp))

    def update(self, tp: TinkerPath, **changes: Any) -> None:  # noqa: ANN401
        """Set fields of checkpoint ``tp``'s metadata (``public``, ``expires_at``), written aside and
        renamed into place; a checkpoint without metadata gets it, timed by its folder. The caller
        holds the lock that orders updates and deletions of checkpoints."""
        p = self.path(tp)
        if not self.exists(tp):
            raise WireError(f"checkpoint {tp} does not exist", 404)
        meta = self.metadata(tp)
        if "time" not in meta:
            meta["time"] = datetime.fromtimestamp(p.stat().st_mtime, timezone.utc).isoformat()
        meta.update(changes)
        f = self._meta_file(tp)
        f.parent.mkdir(parents=True, exist_ok=True)
        _write_json(f, meta)

    def expired(self, at: datetime) -> list[TinkerPath]:
        """Every checkpoint whose ``expires_at`` is ``at`` or earlier."""
        out = []
        for model_id in self.run_ids():
            for c in self.listing(model_id):
                if c["expires_at"] is not None and datetime.fromisoformat(c["expires_at"]) <= at:
                    kind, name = c["checkpoint_id"].split("/")
                    out.append(TinkerPath(model_id, kind, name))
        return out

    def files(self, tp: TinkerPath) -> dict[str, Path]:
        """The regular files of checkpoint ``tp`` by their path under its folder (``/``-separated),
        sorted; symlinks are skipped (what they point to is not the server's)."""
        root = self.path(tp)
        if not root.is_dir():  # in the instant a replacement has it aside, the old one is read
            root = moved_aside(root)
        if not root.is_dir():
            raise WireError(f"checkpoint {tp} does not exist", 404)
        found = {}
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
            for f in filenames:
                full = Path(dirpath) / f
                if not full.is_symlink() and full.is_file():
                    found[full.relative_to(root).as_posix()] = full
        return dict(sorted(found.items()))

    def listing(self, model_id: str) -> list[dict[str, Any]]:
        """Tinker ``Checkpoint`` records of a run, oldest first. A checkpoint whose metadata is
        unreadable is listed without it; entries that are no checkpoint are skipped."""
        out = []
        run = self.run_dir(model_id)
        for kind, ctype in CHECKPOINT_KINDS.items():
            kdir = run / kind
            if kdir.is_symlink() or not kdir.is_dir():
                continue
            for d in self._entries(kdir):
                name = d.name
                aside = _ASIDE.fullmatch(name)
                if aside is not None and _is_name(aside[1]) and not os.path.lexists(kdir / aside[1]):
                    name = aside[1]  # in the instant a replacement has it aside
                elif name.startswith("."):
                    continue
                elif d.is_symlink() or not d.is_dir() or not _is_name(name):
                    self._warn(d, "is not a checkpoint's folder")
                    continue
                meta = self._meta(run / "meta" / kind / f"{name}.json")
                try:
                    stamp = meta.get("time") or datetime.fromtimestamp(d.stat().st_mtime, timezone.utc).isoformat()
                except OSError:
                    continue  # deleted meanwhile
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{name}",
                        "checkpoint_type": ctype,
                        "time": stamp,
                        "tinker_path": str(TinkerPath(model_id, kind, name)),
                        "size_bytes": meta.get("size_bytes"),
                        "user_metadata": meta.get("user_metadata"),
                        "expires_at": meta.get("expires_at"),
                        "public": meta.get("public", False),
                    }
                )
        return sorted(out, key=lambda c: c["time"])

    def _meta(self, f: Path) -> dict[str, Any]:
        """A checkpoint's metadata; empty when it has none or it is unreadable (warned about)."""
        if not f.is_file():
            return {}
        meta = self._read_json(f)
        if meta is _UNREADABLE:
            return {}
        problem = _meta_problem(meta)
        if problem is not None:
            self._warn(f, problem)
            return {}
        return meta
