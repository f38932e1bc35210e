"""RolloutBatch files: JSON Lines and Parquet, with one schema.

One record per trajectory, in batch order:

=============  ==========================  ==========================================
field          type                        meaning
=============  ==========================  ==========================================
tokens         list[int]    (required)     token ids, non-empty
action_mask    list[bool]   (optional)     per token; default: all but the first
advantages     float | list[float] (opt.)  per trajectory or per token; default 0
old_logprobs   list[float]  (optional)     per token (entry 0 ignored)
ref_logprobs   list[float]  (optional)     per token (entry 0 ignored)
loss_weights   list[float]  (optional)     per token
group_id       int          (optional)     e.g. the GRPO group / task
tree_id        int          (optional)     rollout tree the trajectory came from
=============  ==========================  ==========================================

JSONL may start with a header line ``{"format": "harts.rollout_batch", "version": 1,
"vocab_size": V}``; Parquet keeps the same keys in the schema metadata. Optional fields
are all-or-nothing across trajectories (a file where only some trajectories carry
``old_logprobs`` is rejected, naming the first one without). ``save`` writes per-token
advantages, so ``load(save(b))`` reproduces ``b`` exactly.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from harts.tree.batch import PER_TOKEN_FIELDS, BatchValidationError, RolloutBatch

__all__ = ["load_batch", "save_batch", "FORMAT"]

FORMAT = "harts.rollout_batch"
_OPTIONAL_LISTS = ("action_mask", *PER_TOKEN_FIELDS)
_OPTIONAL_IDS = ("group_id", "tree_id")
_KNOWN = {"tokens", "advantages", *_OPTIONAL_LISTS, *_OPTIONAL_IDS}


def _kind(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"{path}: unknown batch file type {suffix!r} (use .jsonl or .parquet)")


def load_batch(path: str | Path, *, vocab_size: int | None = None) -> RolloutBatch:
    """Read a batch file; ``vocab_size`` overrides the file's header when given."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such batch file")
    if _kind(path) == "jsonl":
        records, meta = _read_jsonl(path)
    else:
        records, meta = _read_parquet(path)
    if vocab_size is None:
        vocab_size = meta.get("vocab_size")
    try:
        return _from_records(records, vocab_size)
    except BatchValidationError as err:
        raise BatchValidationError(f"{path}: {err}") from None


def save_batch(batch: RolloutBatch, path: str | Path) -> None:
    """Write ``batch`` as JSONL or Parquet (by suffix)."""
    path = Path(path)
    if _kind(path) == "jsonl":
        with path.open("w") as fh:
            fh.write(json.dumps({"format": FORMAT, "version": 1, "vocab_size": batch.vocab_size}) + "\n")
            for rec in _to_records(batch):
                fh.write(json.dumps(rec) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        recs = _to_records(batch)
        cols = {k: [r[k] for r in recs] for k in recs[0]}
        meta = {"format": FORMAT, "version": "1", "vocab_size": json.dumps(batch.vocab_size)}
        table = pa.table(cols).replace_schema_metadata(meta)
        pq.write_table(table, path)


def _to_records(batch: RolloutBatch) -> list[dict[str, Any]]:
    out = []
    for j in range(batch.num_trajectories):
        sl = slice(int(batch.offsets[j]), int(batch.offsets[j + 1]))
        rec: dict[str, Any] = {
            "tokens": batch.tokens[sl].tolist(),
            "action_mask": batch.action_mask[sl].tolist(),
            "advantages": batch.advantages[sl].tolist(),
        }
        for name in PER_TOKEN_FIELDS:
            arr = getattr(batch, name)
            if arr is not None:
                rec[name] = arr[sl].tolist()
        if batch.group_ids is not None:
            rec["group_id"] = int(batch.group_ids[j])
        if batch.tree_ids is not None:
            rec["tree_id"] = int(batch.tree_ids[j])
        out.append(rec)
    return out


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    records: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    with path.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise BatchValidationError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(obj, dict):
                raise BatchValidationError(f"{path}:{lineno}: expected a JSON object per line")
            if obj.get("format") == FORMAT:
                meta = obj
                continue
            obj["_line"] = lineno
            records.append(obj)
    return records, meta


def _read_parquet(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    raw = table.schema.metadata or {}
    meta: dict[str, Any] = {}
    if b"vocab_size" in raw:
        meta["vocab_size"] = json.loads(raw[b"vocab_size"])
    cols = table.to_pydict()
    n = table.num_rows
    records = [{k: cols[k][i] for k in cols if cols[k][i] is not None} for i in range(n)]
    return records, meta


def _from_records(records: list[dict[str, Any]], vocab_size: int | None) -> RolloutBatch:
    if not records:
        raise BatchValidationError("the file holds no trajectories")

    def where(j: int) -> str:
        line = records[j].get("_line")
        return f"trajectory {j}" + (f" (line {line})" if line is not None else "")

    for j, rec in enumerate(records):
        if "tokens" not in rec:
            raise BatchValidationError(f"{where(j)}: missing required field 'tokens'")
        unknown = set(rec) - _KNOWN - {"_line"}
        if unknown:
            raise BatchValidationError(f"{where(j)}: unknown field(s) {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for name in (*_OPTIONAL_LISTS, *_OPTIONAL_IDS, "advantages"):
        present = [name in r for r in records]
        if not any(present):
            continue
        if not all(present):
            j = present.index(False)
            raise BatchValidationError(f"{where(j)}: has no '{name}' but other trajectories do")
        values = [r[name] for r in records]
        if name in PER_TOKEN_FIELDS or name == "advantages":
            values = [_nan_checked(v, name, where(j)) for j, v in enumerate(values)]
        key = {"group_id": "group_ids", "tree_id": "tree_ids"}.get(name, name)
        kwargs[key] = values
    try:
        return RolloutBatch.from_trajectories([r["tokens"] for r in records], vocab_size=vocab_size, **kwargs)
    except BatchValidationError as err:
        # anchor "trajectory j" in the message to its file line
        msg = re.sub(r"trajectory (\d+)", lambda m: where(int(m.group(1))), str(err), count=1)
        raise BatchValidationError(msg) from None


def _nan_checked(value: Any, name: str, where: str) -> Any:
    """JSON has no NaN literal but Python's json reads ``NaN``; reject it with a location."""
    seq = value if isinstance(value, list) else [value]
    for t, v in enumerate(seq):
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            at = f", position {t}" if isinstance(value, list) else ""
            raise BatchValidationError(f"{where}: {name}{at} is {v} (must be a finite number)")
    return value if isinstance(value, list) else float(value)
