"""Where a training run's files live under ``--state-dir``, and their listing.

Layout (``<model_id>`` is Tinker's ``<session_id>:train:<n>``)::

    <state_dir>/runs/<model_id>/run.json                   base model, LoRA config, metadata
    <state_dir>/runs/<model_id>/weights/<name>/            Engine.save_state (weights, optimizer, RNG)
    <state_dir>/runs/<model_id>/sampler_weights/<name>/    Engine.save_weights_for_sampler (HF, LoRA merged)
    <state_dir>/runs/<model_id>/meta/<kind>/<name>.json    when it was saved, its size, user metadata

``tinker://<model_id>/weights/<name>`` and ``tinker://<model_id>/sampler_weights/<name>``
name the two kinds of checkpoint. A client's path becomes a directory only through
``CheckpointDir.path``, which resolves it and refuses anything outside ``runs/``. A checkpoint
is written into a hidden temporary directory and renamed into place, so a crash mid-save
never leaves a half-written checkpoint under its name.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from harts.serve.wire import CHECKPOINT_KINDS, TinkerPath, WireError

__all__ = ["CheckpointDir", "now"]


def now() -> datetime:
    """The current time, timezone-aware (what Tinker's datetime fields carry)."""
    return datetime.now(timezone.utc)


class CheckpointDir:
    """The ``runs/`` tree of one state directory (module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        self.root = (Path(state_dir) / "runs").resolve()
        self.root.mkdir(parents=True, exist_ok=True)

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
        """True when checkpoint ``tp`` is on disk."""
        return self.path(tp).is_dir()

    # ------------------------------------------------------------------ runs
    def write_run(self, model_id: str, record: dict[str, Any]) -> None:
        """Write ``run.json`` of a run (created on its first save or at creation)."""
        d = self.run_dir(model_id)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".run.json.{uuid.uuid4().hex}"
        tmp.write_text(json.dumps(record, indent=1, default=str))
        os.replace(tmp, d / "run.json")

    def read_run(self, model_id: str) -> dict[str, Any] | None:
        """``run.json`` of a run, or None when the run left nothing on disk."""
        f = self.run_dir(model_id) / "run.json"
        if not f.is_file():
            return None
        data = json.loads(f.read_text())
        return data if isinstance(data, dict) else None

    def run_ids(self) -> list[str]:
        """Every run with a ``run.json``, oldest first."""
        found = [p for p in self.root.iterdir() if (p / "run.json").is_file()]
        return [p.name for p in sorted(found, key=lambda p: (p / "run.json").stat().st_mtime)]

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
        """Run ``write(tmp_dir)`` and move the result to ``tp``'s directory, with its metadata."""
        final = self.path(tp)
        if final.exists() and not overwrite:
            raise WireError(f"path: checkpoint {tp} exists; pass overwrite=True to replace it")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{tp.name}.tmp-{uuid.uuid4().hex}"
        try:
            write(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        saved = now()
        meta = {
            "time": saved.isoformat(),
            "size_bytes": sum(f.stat().st_size for f in final.rglob("*") if f.is_file()),
            "user_metadata": user_metadata,
            "expires_at": (saved + timedelta(seconds=ttl_seconds)).isoformat() if ttl_seconds else None,
        }
        mdir = self.run_dir(tp.model_id) / "meta" / tp.kind
        mdir.mkdir(parents=True, exist_ok=True)
        (mdir / f"{tp.name}.json").write_text(json.dumps(meta))

    def delete(self, tp: TinkerPath) -> None:
        """Remove checkpoint ``tp`` and its metadata (a missing one is a 404)."""
        p = self.path(tp)
        if not p.is_dir():
            raise WireError(f"checkpoint {tp} does not exist", 404)
        shutil.rmtree(p)
        (self.run_dir(tp.model_id) / "meta" / tp.kind / f"{tp.name}.json").unlink(missing_ok=True)

    def listing(self, model_id: str) -> list[dict[str, Any]]:
        """Tinker ``Checkpoint`` records of a run, oldest first."""
        out = []
        run = self.run_dir(model_id)
        for kind, ctype in CHECKPOINT_KINDS.items():
            kdir = run / kind
            if not kdir.is_dir():
                continue
            for d in kdir.iterdir():
                if not d.is_dir() or d.name.startswith("."):
                    continue
                meta_file = run / "meta" / kind / f"{d.name}.json"
                meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
                stamp = meta.get("time") or datetime.fromtimestamp(d.stat().st_mtime, timezone.utc).isoformat()
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{d.name}",
                        "checkpoint_type": ctype,
                        "time": stamp,
                        "tinker_path": str(TinkerPath(model_id, kind, d.name)),
                        "size_bytes": meta.get("size_bytes"),
                        "user_metadata": meta.get("user_metadata"),
                        "expires_at": meta.get("expires_at"),
                    }
                )
        return sorted(out, key=lambda c: c["time"])
