"""RolloutBatch files: JSON Lines and Parquet, with one schema and one validator.

One record per trajectory, in batch order. A list beside ``tokens`` has one entry per predicted
token, ``len(tokens) - 1`` of them: entry t describes ``tokens[t + 1]``, predicted from
``tokens[:t + 1]`` (the first token is never predicted) -- the convention of ``harts.Engine``'s
trajectories and of Tinker's datums (``loss_fn_inputs``: ``advantages``, ``logprobs``):

=============  ==========================  ==========================================
field          type                        meaning
=============  ==========================  ==========================================
tokens         list[int]    (required)     token ids, non-empty, 0 <= id < vocab_size
advantages     float | list[float] (req.)  per trajectory or per predicted token
                                           (finite); write 0 for no learning signal
action_mask    list[bool]   (optional)     per predicted token; default: all
logprobs       list[float]  (optional)     the sampler's, per predicted token, <= 0
ref_logprobs   list[float]  (optional)     per predicted token, <= 0
loss_weights   list[float]  (optional)     per predicted token, >= 0
group_id       int          (optional)     e.g. the GRPO group / task
tree_id        int          (optional)     rollout tree the trajectory came from
reward         float        (optional)     the trajectory's scalar reward (finite); training
                                           reports its statistics, the loss uses advantages
=============  ==========================  ==========================================

The older form is still read, with one ``BatchFormatWarning`` (a ``FutureWarning``) per file:
lists of ``len(tokens)`` entries, one per token (entry 0, the first token's, unused), and
``old_logprobs`` for ``logprobs``. The length tells the two forms apart, record by record.

JSONL may start with a header line ``{"format": "harts.rollout_batch", "version": 1,
"vocab_size": V}`` (the first non-blank line only); Parquet keeps the same keys in the schema
metadata (where keys of other tools, e.g. pandas', are left alone). Only version 1 exists. Optional fields are all-or-nothing across trajectories (a file
where only some trajectories carry ``logprobs`` is rejected, naming the first one without);
``null`` (a Parquet null) means the field is absent. ``advantages`` may be a number in one record
and a list in another. ``save`` writes the predicted-token form (advantages as one number per
trajectory where each trajectory's are all equal), so ``load(save(b))`` reproduces every entry
of ``b`` that is read: a first token's entries are never read, and come back as 0 (False).

Both formats are read into the same Python records and checked by one validator
(``_check_record``), so a rule and its message are the same for both: every error is a
``harts.BatchValidationError`` naming the file, the trajectory with its JSONL line or Parquet
row, the field and the position, e.g. ``b.parquet: trajectory 3 (row 3): advantages must be a
number or a list of numbers, got string 'high'``. Token ids must be integers in both formats
(``1.0`` is rejected); log-probs above ``LOGPROB_TOLERANCE`` are rejected (a log-probability
is never positive; the tolerance absorbs rounding).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from harts.errors import BatchValidationError
from harts.tree.schema import PER_TOKEN_FIELDS

#: what ``load_batch`` returns: whatever its ``build`` (``RolloutBatch.from_trajectories``) makes
B = TypeVar("B")


class BatchArrays(Protocol):
    """What ``save_batch`` reads of a ``RolloutBatch`` (the batch builds on this module, so
    this module names the fields instead of importing the class)."""

    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def offsets(self) -> np.ndarray: ...

    @property
    def action_mask(self) -> np.ndarray: ...

    @property
    def advantages(self) -> np.ndarray: ...

    @property
    def old_logprobs(self) -> np.ndarray | None: ...

    @property
    def ref_logprobs(self) -> np.ndarray | None: ...

    @property
    def loss_weights(self) -> np.ndarray | None: ...

    @property
    def group_ids(self) -> np.ndarray | None: ...

    @property
    def tree_ids(self) -> np.ndarray | None: ...

    @property
    def rewards(self) -> np.ndarray | None: ...

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def num_trajectories(self) -> int: ...


__all__ = ["BatchFormatWarning", "load_batch", "save_batch", "FORMAT", "VERSION", "LOGPROB_TOLERANCE"]

FORMAT = "harts.rollout_batch"
VERSION = 1
#: largest log-prob accepted in a file (a log-probability is <= 0; this absorbs rounding)
LOGPROB_TOLERANCE = 1e-4
#: a batch's per-token field -> its name in files, where it differs (Tinker's datums and the
#: Engine call the sampler's log-probs ``logprobs``)
_FILE_NAMES = {"old_logprobs": "logprobs"}
#: the older file name of a field, still read (``BatchFormatWarning``)
_OLD_NAMES = {"old_logprobs": "logprobs"}
_OPTIONAL_LISTS = ("action_mask", *(_FILE_NAMES.get(f, f) for f in PER_TOKEN_FIELDS))
_OPTIONAL_IDS = ("group_id", "tree_id")
_OPTIONAL_SCALARS = ("reward",)
_KNOWN = ("tokens", "advantages", *_OPTIONAL_LISTS, *_OLD_NAMES, *_OPTIONAL_IDS, *_OPTIONAL_SCALARS)


class BatchFormatWarning(FutureWarning):
    """A batch file in the older form (module docstring): read as before, to be rewritten in
    the predicted-token form (``RolloutBatch.load(path).save(path)`` does it)."""


_HEADER_KEYS = ("format", "version", "vocab_size")
_INT64_MAX = (1 << 63) - 1


def _kind(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise BatchValidationError(f"{path}: unknown batch file type {suffix!r} (use .jsonl or .parquet)")


def load_batch(path: str | Path, *, build: Callable[..., B], vocab_size: int | None = None) -> B:
    """Read a batch file; ``vocab_size`` overrides the file's header when given. Use
    ``RolloutBatch.load``: it passes ``build=RolloutBatch.from_trajectories``, which is called
    with the checked records' fields (tokens, advantages, optional metadata, vocab_size).

    Raises ``BatchValidationError`` (naming file, trajectory with line or row, field and
    position) for anything but a valid file.
    """
    path = Path(path)
    kind = _kind(path)
    if not path.exists():
        raise BatchValidationError(f"{path}: no such batch file")
    if path.is_dir():
        raise BatchValidationError(f"{path}: is a directory, not a batch file")
    try:
        records, meta = _read_jsonl(path) if kind == "jsonl" else _read_parquet(path)
        unit = "line" if kind == "jsonl" else "row"
        if vocab_size is None:
            vocab_size = meta.get("vocab_size")
        old_forms: set[str] = set()
        batch = _from_records(records, vocab_size, unit, build, old_forms)
    except BatchValidationError as err:
        raise BatchValidationError(f"{path}: {err}") from None
    except OSError as err:
        raise BatchValidationError(f"{path}: cannot read the batch file ({err.strerror or err})") from None
    if old_forms:
        warnings.warn(_old_form_line(path, old_forms), BatchFormatWarning, stacklevel=3)
    return batch


def _old_form_line(path: Path, old_forms: set[str]) -> str:
    """The one line of ``BatchFormatWarning`` for ``path``: what it spells the older way
    (``old_forms``: ``name:OLD`` for a field's older name, else a field with a list per token)."""
    what = []
    renamed = sorted(f.removeprefix("name:") for f in old_forms if f.startswith("name:"))
    if renamed:
        what.append(", ".join(f"{old!r} for {_OLD_NAMES[old]!r}" for old in renamed))
    per_token = sorted(f for f in old_forms if not f.startswith("name:"))
    if per_token:
        what.append(f"one value per token in {', '.join(per_token)}")
    return (
        f"{path}: the older batch-file form ({'; '.join(what)}) is deprecated; write one value per predicted "
        "token (len(tokens) - 1) and 'logprobs', as harts.Engine and Tinker's datums take them "
        "(RolloutBatch.load(path).save(path) rewrites the file)"
    )


def save_batch(batch: BatchArrays, path: str | Path) -> None:
    """Write ``batch`` as JSONL or Parquet (by suffix)."""
    path = Path(path)
    if _kind(path) == "jsonl":
        with path.open("w") as fh:
            fh.write(json.dumps({"format": FORMAT, "version": VERSION, "vocab_size": batch.vocab_size}) + "\n")
            for rec in _to_records(batch):
                fh.write(json.dumps(rec) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        recs = _to_records(batch)
        cols = {k: [r[k] for r in recs] for k in recs[0]}
        meta = {"format": FORMAT, "version": str(VERSION), "vocab_size": json.dumps(batch.vocab_size)}
        table = pa.table(cols).replace_schema_metadata(meta)
        pq.write_table(table, path)


def _to_records(batch: BatchArrays) -> list[dict[str, Any]]:
    """One record per trajectory in the predicted-token form (module docstring); advantages as
    one number per trajectory when every trajectory's are all equal (a Parquet column holds
    one type)."""
    spans = [(int(batch.offsets[j]), int(batch.offsets[j + 1])) for j in range(batch.num_trajectories)]
    adv = batch.advantages
    scalar = all(np.all(adv[a + 1 : b] == adv[a]) for a, b in spans)
    out = []
    for j, (a, b) in enumerate(spans):
        pred = slice(a + 1, b)
        rec: dict[str, Any] = {
            "tokens": batch.tokens[a:b].tolist(),
            "action_mask": batch.action_mask[pred].tolist(),
            "advantages": float(adv[a]) if scalar else adv[pred].tolist(),
        }
        for name in PER_TOKEN_FIELDS:
            arr = getattr(batch, name)
            if arr is not None:
                rec[_FILE_NAMES.get(name, name)] = arr[pred].tolist()
        if batch.group_ids is not None:
            rec["group_id"] = int(batch.group_ids[j])
        if batch.tree_ids is not None:
            rec["tree_id"] = int(batch.tree_ids[j])
        if batch.rewards is not None:
            rec["reward"] = float(batch.rewards[j])
        out.append(rec)
    return out


# ---------------------------------------------------------------------- readers
# Each reader returns ``(records, meta)``: records are ``(location, dict)`` pairs of plain
# Python values (the location is the 1-based JSONL line or the 0-based Parquet row), meta is
# the checked header (``vocab_size`` only, for now).
def _read_jsonl(path: Path) -> tuple[list[tuple[int, Any]], dict[str, Any]]:
    records: list[tuple[int, Any]] = []
    meta: dict[str, Any] = {}
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise BatchValidationError(
                    f"line {lineno}: not UTF-8 text (byte {err.start + 1} of the line)"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise BatchValidationError(f"line {lineno}: not valid JSON ({err.msg})") from None
            except RecursionError:
                raise BatchValidationError(f"line {lineno}: JSON nested too deeply") from None
            if isinstance(obj, dict) and obj.get("format") == FORMAT:
                if records or meta:
                    raise BatchValidationError(
                        f"line {lineno}: a {FORMAT!r} header may only be the first line of the file"
                    )
                meta = _check_header(obj, f"line {lineno}: header")
                continue
            records.append((lineno, obj))
    return records, meta


def _read_parquet(path: Path) -> tuple[list[tuple[int, Any]], dict[str, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is an optional extra
        raise BatchValidationError("reading Parquet needs pyarrow: pip install 'harts[parquet]'") from None
    try:
        table = pq.read_table(path)
        cols = table.to_pydict()
    except (pa.ArrowException, ValueError, TypeError, IndexError, KeyError) as err:
        msg = " ".join(str(err).split())[:200]
        raise BatchValidationError(f"not a readable Parquet file ({type(err).__name__}: {msg})") from None
    raw = table.schema.metadata or {}
    header: dict[str, Any] = {}
    for key, value in raw.items():
        k = key.decode("utf-8", "replace")
        if k not in _HEADER_KEYS:
            continue  # pyarrow / pandas keep their own schema metadata
        text = value.decode("utf-8", "replace")
        if k == "format":
            header[k] = text
        else:
            try:
                header[k] = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                raise BatchValidationError(f"schema metadata: {k} is {text[:40]!r}, not a JSON value") from None
    meta = _check_header(header, "schema metadata") if header else {}
    names = list(cols)
    records = [(i, {k: cols[k][i] for k in names}) for i in range(table.num_rows)]
    return records, meta


def _check_header(obj: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(obj) - set(_HEADER_KEYS))
    if unknown:
        raise BatchValidationError(f"{where}: unknown field(s) {unknown}; a header holds {list(_HEADER_KEYS)}")
    fmt = obj.get("format", FORMAT)
    if fmt != FORMAT:
        raise BatchValidationError(f"{where}: format is {fmt!r}, expected {FORMAT!r}")
    version = obj.get("version", VERSION)
    if version != VERSION and str(version) != str(VERSION):
        raise BatchValidationError(
            f"{where}: version {version!r} is not supported; this harts reads version {VERSION} "
            "(write the file with a matching harts, or fix the header)"
        )
    vocab = obj.get("vocab_size")
    if vocab is not None and (not _is_int(vocab) or not 1 <= vocab <= _INT64_MAX):
        raise BatchValidationError(f"{where}: vocab_size must be a positive integer or null, got {_describe(vocab)}")
    return {"vocab_size": vocab}


# -------------------------------------------------------------------- validator
def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _describe(v: Any) -> str:
    """A value as the file spelled it: ``string 'high'``, ``boolean true``, ``null``, ``a list``."""
    if v is None:
        return "null"
    if isinstance(v, (bool, np.bool_)):
        return f"boolean {str(bool(v)).lower()}"
    if isinstance(v, str):
        return f"string {v[:40]!r}" + ("..." if len(v) > 40 else "")
    if isinstance(v, (list, tuple)):
        return f"a list of {len(v)}"
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, (int, np.integer)):
        text = str(int(v))
        return f"integer {text if len(text) <= 30 else text[:27] + '...'}"
    if isinstance(v, (float, np.floating)):
        return f"number {float(v)!r}"
    return type(v).__name__


_TYPES = {"int": (int,), "number": (int, float), "bool": (bool,)}
_WANT = {"int": "an integer", "number": "a finite number", "bool": "true or false"}


def _typed_list(value: Any, n: int | None, field: str, kind: str) -> np.ndarray:
    """``value`` as a checked 1-D array: a list of ``kind`` values (``n`` of them, if given)."""
    if not isinstance(value, list):
        what = {"int": "integers", "number": "numbers", "bool": "booleans"}[kind]
        per = " (one per token)" if n is not None else ""
        raise BatchValidationError(f"{field} must be a list of {what}{per}, got {_describe(value)}")
    if n is not None and len(value) != n:
        raise BatchValidationError(f"{field} has {len(value)} values for {n} tokens")
    allowed = _TYPES[kind]
    if not set(map(type, value)) <= set(allowed):
        t, v = next((t, v) for t, v in enumerate(value) if type(v) not in allowed)
        raise BatchValidationError(f"{field}, position {t} is {_describe(v)} (must be {_WANT[kind]})")
    if kind == "bool":
        return np.array(value, dtype=bool)
    if kind == "int":
        if value and (max(value) > _INT64_MAX or min(value) < -_INT64_MAX):
            t = next(t for t, v in enumerate(value) if not -_INT64_MAX <= v <= _INT64_MAX)
            raise BatchValidationError(f"{field}, position {t} is {_describe(value[t])} (does not fit int64)")
        return np.array(value, dtype=np.int64)
    try:
        arr = np.array(value, dtype=np.float64)
    except OverflowError:
        t = next(t for t, v in enumerate(value) if isinstance(v, int) and abs(v) > 1e308)
        raise BatchValidationError(f"{field}, position {t} is {_describe(value[t])} (too large for a float)") from None
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        t = int(bad[0])
        raise BatchValidationError(f"{field}, position {t} is {value[t]} (must be a finite number)")
    return arr


def _aligned(value: Any, n: int, field: str, kind: str) -> tuple[np.ndarray, int]:
    """A list of one value per predicted token (``n - 1``) as a per-token array [n] whose entry 0
    (the first token's) is 0 / False, or the older list of one per token [n] as it is; also the
    file position of entry 1: 1 for the older form, 0 for the predicted-token form."""
    if isinstance(value, list) and len(value) == n:
        return _typed_list(value, n, field, kind), 1
    if isinstance(value, list) and len(value) != n - 1:
        raise BatchValidationError(
            f"{field} has {len(value)} values for {n} tokens (one per predicted token: len(tokens) - 1 = {n - 1})"
        )
    arr = _typed_list(value, None, field, kind)
    return np.concatenate([np.zeros(1, dtype=arr.dtype), arr]), 0


def _check_record(rec: Any, old_forms: set[str]) -> dict[str, Any]:
    """One trajectory's record as per-token arrays; raises naming the field (the caller adds the
    location). The fields it spells the older way go into ``old_forms``."""
    if not isinstance(rec, dict):
        raise BatchValidationError(f"expected an object with 'tokens' and 'advantages', got {_describe(rec)}")
    unknown = sorted(k for k in rec if k not in _KNOWN)
    if unknown:
        raise BatchValidationError(f"unknown field(s) {unknown}; known: {list(_KNOWN)}")
    rec = {k: v for k, v in rec.items() if v is not None}  # null = absent (Parquet nulls)
    #: a field's name as this record spells it
    spelled: dict[str, str] = {}
    for old, name in _OLD_NAMES.items():
        if old in rec and name in rec:
            raise BatchValidationError(f"has both {name!r} and its older name {old!r}; keep {name!r}")
        if old in rec:
            old_forms.add(f"name:{old}")
            spelled[name] = old
            rec[name] = rec.pop(old)
    if "tokens" not in rec:
        raise BatchValidationError("missing required field 'tokens'")
    tokens = _typed_list(rec["tokens"], None, "tokens", "int")
    if tokens.size == 0:
        raise BatchValidationError("tokens is empty (a trajectory needs at least one token)")
    neg = np.flatnonzero(tokens < 0)
    if neg.size:
        raise BatchValidationError(f"tokens, position {int(neg[0])} is a negative token id {int(tokens[neg[0]])}")
    n = tokens.size
    out: dict[str, Any] = {"tokens": tokens}
    if "advantages" not in rec:
        raise BatchValidationError(
            "missing required field 'advantages' (a number, or one per predicted token; write 0 for no learning signal)"
        )
    adv = rec["advantages"]
    if isinstance(adv, list):
        out["advantages"], first = _aligned(adv, n, "advantages", "number")
        if first:
            old_forms.add("advantages")
    elif _is_number(adv):
        if isinstance(adv, int) and abs(adv) > 1e308 or not math.isfinite(float(adv)):
            raise BatchValidationError(f"advantages is {adv} (must be a finite number)")
        out["advantages"] = np.full(n, float(adv))
    else:
        raise BatchValidationError(
            f"advantages must be a number or a list of numbers (one per predicted token), got {_describe(adv)}"
        )
    if "action_mask" in rec:
        out["action_mask"], first = _aligned(rec["action_mask"], n, "action_mask", "bool")
        if first:
            old_forms.add("action_mask")
    for batch_name in PER_TOKEN_FIELDS:
        name = _FILE_NAMES.get(batch_name, batch_name)
        if name not in rec:
            continue
        shown = spelled.get(name, name)
        arr, first = _aligned(rec[name], n, shown, "number")
        if first:
            old_forms.add(name)
        if name == "loss_weights":
            bad = np.flatnonzero(arr < 0)
            if bad.size:
                t = int(bad[0])
                raise BatchValidationError(
                    f"loss_weights, position {t - 1 + first} is {float(arr[t])!r} (weights must be >= 0)"
                )
        else:
            bad = np.flatnonzero(arr[1:] > LOGPROB_TOLERANCE) + 1
            if bad.size:
                t = int(bad[0])
                raise BatchValidationError(
                    f"{shown}, position {t - 1 + first} is {float(arr[t])!r}: a log-probability is <= 0 (was a "
                    "probability or a negated log-prob written?)"
                )
        out[name] = arr
    for name in _OPTIONAL_IDS:
        if name in rec:
            v = rec[name]
            if not _is_int(v) or not -_INT64_MAX <= v <= _INT64_MAX:
                raise BatchValidationError(f"{name} must be an integer, got {_describe(v)}")
            out[name] = int(v)
    if "reward" in rec:
        v = rec["reward"]
        if not _is_number(v) or isinstance(v, int) and abs(v) > 1e308 or not math.isfinite(float(v)):
            raise BatchValidationError(f"reward must be a finite number, got {_describe(v)}")
        out["reward"] = float(v)
    return out


def _from_records(
    records: list[tuple[int, Any]], vocab_size: int | None, unit: str, build: Callable[..., B], old_forms: set[str]
) -> B:
    if not records:
        raise BatchValidationError("the file holds no trajectories")

    def where(j: int) -> str:
        return f"trajectory {j} ({unit} {records[j][0]})"

    checked = []
    for j, (_, rec) in enumerate(records):
        try:
            checked.append(_check_record(rec, old_forms))
        except BatchValidationError as err:
            raise BatchValidationError(f"{where(j)}: {err}") from None
    kwargs: dict[str, Any] = {}
    for name in (*_OPTIONAL_LISTS, *_OPTIONAL_IDS, *_OPTIONAL_SCALARS):
        present = [name in r for r in checked]
        if not any(present):
            continue
        if not all(present):
            j = present.index(False)
            k = present.index(True)
            raise BatchValidationError(
                f"{where(j)}: has no '{name}' but {where(k)} does (optional fields are all-or-nothing)"
            )
        key = {"group_id": "group_ids", "tree_id": "tree_ids", "reward": "rewards", "logprobs": "old_logprobs"}.get(
            name, name
        )
        kwargs[key] = [r[name] for r in checked]
    try:
        return build(
            [r["tokens"] for r in checked],
            advantages=[r["advantages"] for r in checked],
            vocab_size=vocab_size,
            **kwargs,
        )
    except BatchValidationError as err:
        # anchor "trajectory j" in the message to its file line / row
        msg = re.sub(r"trajectory (\d+)", lambda m: where(int(m.group(1))), str(err), count=1)
        raise BatchValidationError(msg) from None
