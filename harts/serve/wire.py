"""Tinker's wire formats in and out: request validation, datums -> trajectories, encoded results.

JSON requests are validated with the ``tinker`` package's own pydantic request types
(``validate_json``); ``forward_backward`` arrives as the SDK's protobuf
(``tinker.proto.tinker_public_pb2.ForwardBackwardRequest``, optionally zstd-compressed) and
is parsed with that message class. Responses the SDK reads as protobuf
(``ForwardBackwardOutput``, ``SampleResponse``) are built as those messages; the rest are the
SDK's pydantic response types dumped to JSON.

A datum maps to one harts trajectory. Tinker sends ``model_input`` = tokens[:-1] and
``loss_fn_inputs["target_tokens"]``: the token scored at each position, usually tokens[1:] but any
token of the vocabulary (tinker-cookbook pads prompt targets with 0); the returned log-prob of a
position is that of its target. ``target_tokens`` [T, K] scores K tokens per position (top-k
distillation), with ``weights`` (and any other per-position input) [T] or [T, K], dense or sparse
CSR (absent entries 0), and log-probs [T, K] back. The policy losses take an optional ``weights``
too, as a mask. The trajectory is ``model_input`` plus one more token (the last target), with
``targets`` where they are not the next input tokens, and ``weights`` / ``advantages`` /
``logprobs`` / ``sequence_ratio_mask`` of T entries (``harts.trainer.engine``).

Every refusal is a ``WireError`` (a ``UserError``) whose message starts with the field it is
about, e.g. ``forward_backward_input.data[3].loss_fn_inputs.target_tokens: ...``, and which
carries the HTTP status to answer with (400 unless said otherwise).

Shapes: T = len(model_input) = len(target_tokens) per datum (the trajectory has T + 1 tokens),
K top-k columns (at most ``MAX_TARGET_COLUMNS``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pydantic
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from harts.errors import UserError

__all__ = [
    "CHECKPOINT_KINDS",
    "LOSS_INPUTS",
    "MAX_TARGET_COLUMNS",
    "MAX_JSON_DEPTH",
    "PROTO_MEDIA_TYPE",
    "TinkerPath",
    "WireError",
    "batch_tokens",
    "check_loss_fn",
    "check_name",
    "decode_forward_backward",
    "describe_validation",
    "encode_forward_backward_output",
    "encode_sample_response",
    "json_body",
    "parse_datums",
    "parse_tinker_path",
    "split_forward_backward",
    "finite",
    "is_model_id",
    "loss_config",
    "prompt_target_ids",
    "prompt_tokens",
    "trajectories",
    "validate_json",
]

M = TypeVar("M", bound=pydantic.BaseModel)

#: the loss functions harts serves and the per-target inputs each accepts (required ones first)
LOSS_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (("target_tokens",), ("weights",)),
    "importance_sampling": (("target_tokens", "logprobs", "advantages"), ("weights",)),
    "ppo": (("target_tokens", "logprobs", "advantages"), ("weights",)),
    "cispo": (("target_tokens", "logprobs", "advantages"), ("weights",)),
    "dro": (("target_tokens", "logprobs", "advantages"), ("weights",)),
    "gspo": (("target_tokens", "logprobs", "advantages"), ("weights", "sequence_ratio_mask")),
}
#: Tinker's losses harts refuses, and why
UNSERVED_LOSSES = {
    "stable_reinforce": "Tinker documents its inputs (record_stability_info at sampling, sequence_ids in "
    "the datum's provenance, loss_fn_config kl_coeff) but not its objective or what the stability information "
    "is, so harts cannot compute it; importance_sampling, ppo, cispo, dro and gspo take the sampler's logprobs",
}
#: top-k columns per target position at most (tinker-cookbook distills K = 20)
MAX_TARGET_COLUMNS = 128

#: path segment of each checkpoint kind in a tinker path, and its Tinker checkpoint type
CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}")
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,199}")
#: the media type of the SDK's protobuf bodies
PROTO_MEDIA_TYPE = "application/x-protobuf"
#: how deeply a JSON request may nest: Tinker's requests nest a few levels, and the cap keeps what
#: later walks a body's values (validation, ``json.dumps`` of user metadata into ``run.json``, the
#: response echoing it) far from Python's recursion limit
MAX_JSON_DEPTH = 100


class WireError(UserError):
    """A request the server refuses; the message names the field, ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# ------------------------------------------------------------------ JSON requests
def json_body(body: bytes, what: str) -> dict[str, Any]:
    """The JSON object in ``body``; ``what`` names the endpoint in the error. Whatever the parser
    refuses is a ``WireError``: bad syntax or encoding, an integer of more digits than Python
    converts, and nesting deeper than ``MAX_JSON_DEPTH`` (the parser itself stops at Python's
    recursion limit, with a ``RecursionError``, so a deep body never reaches the C stack's end)."""
    too_deep = f"{what}: the request body nests deeper than {MAX_JSON_DEPTH} levels"
    try:
        data = json.loads(body) if body else {}
    except RecursionError:
        raise WireError(too_deep) from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise WireError(f"{what}: the request body is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise WireError(f"{what}: the request body must be a JSON object, got {type(data).__name__}")
    if _nests_deeper(data, MAX_JSON_DEPTH):
        raise WireError(too_deep)
    return data


def _nests_deeper(data: dict[str, Any], limit: int) -> bool:
    """Whether JSON value ``data`` has containers nested more than ``limit`` deep (no recursion)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        items = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    return False


def validate_json(body: bytes, model: type[M], what: str) -> M:
    """``body`` validated as tinker's request type ``model``; the error names the first bad field."""
    data = json_body(body, what)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as err:
        raise WireError(f"{what}: {describe_validation(err)}") from None


def describe_validation(err: pydantic.ValidationError) -> str:
    """``field.path: message`` for the first error (and how many more there are)."""
    errors = err.errors()
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(body)"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{loc}: {first['msg']}{more}"


# ------------------------------------------------------------------ names and paths
def check_name(name: str, field: str) -> str:
    """A checkpoint name: letters, digits, ``_ . -``, no ``..``, at most 200 characters."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise WireError(
            f"{field}: {name!r} is not a checkpoint name (letters, digits, '_', '.', '-'; "
            "starting with a letter or digit; no '..' or '/')"
        )
    return name


def is_model_id(text: str) -> bool:
    """Whether ``text`` can be a training run's id (``<session>:train:<n>``, or any name of the
    same characters), as ``parse_tinker_path`` accepts it."""
    return bool(_MODEL_ID.fullmatch(text)) and ".." not in text


@dataclass(frozen=True, slots=True)
class TinkerPath:
    """``tinker://<model_id>/<kind>/<name>``; ``kind`` is ``weights`` or ``sampler_weights``."""

    model_id: str
    kind: str
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"


def parse_tinker_path(path: str, field: str, kinds: Sequence[str] = tuple(CHECKPOINT_KINDS)) -> TinkerPath:
    """Parse a client's tinker path; anything that could leave the state directory is refused."""
    if not path.startswith("tinker://"):
        raise WireError(f"{field}: {path!r} is not a tinker path (tinker://<model_id>/<kind>/<name>)")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3:
        raise WireError(f"{field}: {path!r} must have three parts, tinker://<model_id>/<kind>/<name>")
    model_id, kind, name = parts
    if not is_model_id(model_id):
        raise WireError(f"{field}: {path!r} does not name a training run of this server")
    if kind not in kinds:
        raise WireError(f"{field}: {path!r} has kind {kind!r}; expected {' or '.join(map(repr, kinds))}")
    check_name(name, field)
    return TinkerPath(model_id, kind, name)


# ------------------------------------------------------------------ forward_backward in
def decode_forward_backward(body: bytes, content_encoding: str | None, *, max_bytes: int) -> pb.ForwardBackwardRequest:
    """The protobuf ``ForwardBackwardRequest`` in ``body`` (zstd when ``content_encoding`` says so)."""
    body = _decompressed(body, content_encoding, max_bytes)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # google.protobuf.message.DecodeError
        raise WireError(f"forward_backward: the body is not a tinker ForwardBackwardRequest protobuf ({err})") from None
    return msg


#: the field number of ``ForwardBackwardRequest.data`` (the datums)
_DATA_FIELD = pb.ForwardBackwardRequest.DESCRIPTOR.fields_by_name["data"].number


def split_forward_backward(
    body: bytes, content_encoding: str | None, *, max_bytes: int, max_datums: int
) -> tuple[pb.ForwardBackwardRequest, list[memoryview]]:
    """``decode_forward_backward`` in two parts: the request without its datums, and each datum's
    encoded bytes, for ``parse_datums``. One protobuf parse of a whole body of many small
    messages holds the interpreter for as long as it takes (seconds for a million datums); here
    each datum is its own short parse, and the reading stops after ``max_datums`` + 1 datums, so
    an oversized batch is refused (by ``parse_datums``, knowing its model_id and seq_id) without
    reading the rest."""
    body = _decompressed(body, content_encoding, max_bytes)
    view = memoryview(body)
    rest: list[memoryview] = []
    datums: list[memoryview] = []
    pos, end = 0, len(body)
    try:
        while pos < end and len(datums) <= max_datums:
            start = pos
            tag, pos = _varint(body, pos)
            wire_type = tag & 7
            if wire_type == 0:
                _, pos = _varint(body, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _varint(body, pos)
                pos += size
            else:
                raise ValueError(f"wire type {wire_type} of field {tag >> 3} is not one of a tinker request")
            if pos > end:
                raise ValueError(f"field {tag >> 3} runs past the end of the body")
            if wire_type == 2 and tag >> 3 == _DATA_FIELD:
                datums.append(view[pos - size : pos])
            else:
                rest.append(view[start:pos])
        msg = pb.ForwardBackwardRequest()
        msg.ParseFromString(b"".join(rest))
    except Exception as err:  # ValueError, google.protobuf.message.DecodeError
        raise WireError(f"forward_backward: the body is not a tinker ForwardBackwardRequest protobuf ({err})") from None
    return msg, datums


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The protobuf varint at ``buf[pos:]`` and the position after it."""
    value = shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("a varint is cut off or too long")


def parse_datums(
    msg: pb.ForwardBackwardRequest, datums: Sequence[memoryview], *, max_datums: int, max_tokens: int
) -> None:
    """Parse ``split_forward_backward``'s datums into ``msg.data``: at most ``max_datums`` of
    them (``--max-datums``), each no larger than one of ``max_tokens`` tokens can be (64 bytes a
    token is past any dense encoding of its input and loss inputs)."""
    if len(datums) > max_datums:
        raise WireError(
            f"forward_backward_input.data: more than {max_datums} datums; this server takes at most "
            f"{max_datums} per request (--max-datums): split the batch into several requests"
        )
    limit = 64 * max_tokens + (64 << 10)
    for i, raw in enumerate(datums):
        if len(raw) > limit:
            raise WireError(
                f"forward_backward_input.data[{i}]: {len(raw)} bytes; a datum of at most {max_tokens} tokens "
                f"(--capacity) takes at most {limit}"
            )
        try:
            msg.data.add().MergeFromString(raw)
        except Exception as err:  # google.protobuf.message.DecodeError
            raise WireError(f"forward_backward_input.data[{i}]: not a tinker Datum protobuf ({err})") from None


def batch_tokens(msg: pb.ForwardBackwardRequest) -> int:
    """The tokens of the trajectories a request's datums make (each datum's model_input + 1),
    counted from the encoded chunks' sizes, before any datum is checked."""
    return sum(1 + sum(len(c.encoded_text.tokens) // 4 for c in d.model_input) for d in msg.data)


def _decompressed(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """``body`` decompressed as ``content_encoding`` says (zstd or none), at most ``max_bytes``."""
    if content_encoding and content_encoding.strip().lower() == "zstd":
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=max_bytes)
        except zstandard.ZstdError as err:
            raise WireError(f"forward_backward: the zstd request body does not decompress ({err})") from None
        if len(body) > max_bytes:
            raise WireError(f"forward_backward: the request is over {max_bytes} bytes uncompressed", 413)
    elif content_encoding and content_encoding.strip().lower() not in ("identity", ""):
        raise WireError(f"forward_backward: Content-Encoding {content_encoding!r} is not supported (zstd is)", 415)
    return body


def loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    """``loss_fn_config``: the v2 map when set (numbers and strings), else the legacy float map."""
    if len(msg.loss_fn_config_v2):
        out: dict[str, float | str] = {}
        for k, v in msg.loss_fn_config_v2.items():
            arm = v.WhichOneof("value")
            if arm is None:
                raise WireError(f"forward_backward_input.loss_fn_config.{k}: no value")
            out[k] = v.number if arm == "number" else v.text
        return out
    return {k: float(v) for k, v in msg.loss_fn_config.items()}


def check_loss_fn(loss_fn: str) -> str:
    """``loss_fn`` if harts serves it."""
    if loss_fn in UNSERVED_LOSSES:
        raise WireError(
            f"forward_backward_input.loss_fn: {loss_fn!r} is not served by harts: {UNSERVED_LOSSES[loss_fn]}"
        )
    if loss_fn not in LOSS_INPUTS:
        raise WireError(
            f"forward_backward_input.loss_fn: {loss_fn!r} is not served by harts; "
            f"served: {', '.join(LOSS_INPUTS)} (forward_backward_custom runs any loss through cross_entropy)"
        )
    return loss_fn


def trajectories(msg: pb.ForwardBackwardRequest, *, vocab_size: int, max_tokens: int) -> list[dict[str, Any]]:
    """One trajectory per datum (module docstring), every field checked first."""
    loss_fn = check_loss_fn(msg.loss_fn)
    if not len(msg.data):
        raise WireError("forward_backward_input.data: no datums")
    return [
        _trajectory(d, f"forward_backward_input.data[{i}]", loss_fn, vocab_size, max_tokens)
        for i, d in enumerate(msg.data)
    ]


def _trajectory(d: pb.Datum, field: str, loss_fn: str, vocab_size: int, max_tokens: int) -> dict[str, Any]:
    inputs = _chunk_tokens(d.model_input, f"{field}.model_input", vocab_size)
    t = len(inputs)
    if t == 0:
        raise WireError(f"{field}.model_input: empty (a datum needs at least one input token)")
    if t + 1 > max_tokens:
        raise WireError(f"{field}.model_input: {t} tokens; this server fits at most {max_tokens - 1} per datum")
    required, optional = LOSS_INPUTS[loss_fn]
    unknown = sorted(set(d.loss_fn_inputs) - set(required) - set(optional))
    if unknown:
        raise WireError(
            f"{field}.loss_fn_inputs.{unknown[0]}: not an input of loss_fn {loss_fn!r} "
            f"(it takes {', '.join(required + optional)})"
        )
    arrays: dict[str, np.ndarray] = {}
    for name in required + optional:
        if name not in d.loss_fn_inputs:
            if name in required:
                raise WireError(f"{field}.loss_fn_inputs.{name}: missing (loss_fn {loss_fn!r} needs it)")
            continue
        arrays[name] = _tensor(
            d.loss_fn_inputs[name], f"{field}.loss_fn_inputs.{name}", t, integer=name == "target_tokens"
        )
    targets = arrays.pop("target_tokens").astype(np.int64)
    bad = np.argwhere((targets < 0) | (targets >= vocab_size))
    if bad.size:
        where = tuple(int(i) for i in bad[0])
        raise WireError(
            f"{field}.loss_fn_inputs.target_tokens: token {int(targets[where])} at position "
            f"{where[0] if len(where) == 1 else list(where)} is outside the vocabulary [0, {vocab_size})"
        )
    for name, arr in arrays.items():
        if arr.ndim == 2 and arr.shape != targets.shape:
            raise WireError(
                f"{field}.loss_fn_inputs.{name}: shape {list(arr.shape)}; a 2-D input takes target_tokens' shape "
                f"{list(targets.shape)}"
            )
    traj: dict[str, Any] = {"tokens": inputs.tolist() + [int(targets.reshape(t, -1)[-1, 0])]}
    if targets.ndim == 2 or np.any(targets[:-1] != inputs[1:]):
        traj["targets"] = targets
    traj.update(arrays)
    return traj


def _chunk_tokens(chunks: Sequence[pb.Chunk], field: str, vocab_size: int) -> np.ndarray:
    parts = []
    for c, chunk in enumerate(chunks):
        arm = chunk.WhichOneof("chunk")
        if arm != "encoded_text":
            raise WireError(f"{field}.chunks[{c}]: {arm or 'empty'} chunks are not supported (text tokens only)")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"{field}.chunks[{c}].tokens: {len(raw)} bytes is not a whole number of int32 tokens")
        parts.append(np.frombuffer(raw, dtype=np.int32))
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        raise WireError(
            f"{field}: token {int(tokens[bad[0]])} at position {int(bad[0])} is outside the vocabulary [0, {vocab_size})"
        )
    return tokens


_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def _tensor(msg: pb.Tensor, field: str, length: int, *, integer: bool) -> np.ndarray:
    """A per-position tensor [length] or [length, K] from its protobuf (dense, or sparse CSR with
    absent entries 0), K <= ``MAX_TARGET_COLUMNS``; integers for ``integer``, else finite floats."""
    np_dtype = _DTYPES.get(msg.dtype)
    if np_dtype is None:
        raise WireError(f"{field}: dtype {pb.DType.Name(msg.dtype)} is not supported (float32 or int64)")
    shape = list(msg.shape) or None
    if shape is not None and (len(shape) not in (1, 2) or shape[0] != length):
        raise WireError(f"{field}: shape {shape}; expected [{length}] or [{length}, K] (one row per target position)")
    if shape is not None and len(shape) == 2 and not 1 <= shape[1] <= MAX_TARGET_COLUMNS:
        raise WireError(f"{field}: shape {shape}; K must be in [1, {MAX_TARGET_COLUMNS}] columns")
    if msg.HasField("sparse_csr"):
        if shape is None or len(shape) != 2:
            raise WireError(f"{field}: a sparse tensor needs its 2-D shape [{length}, K]")
        arr = _csr(msg.sparse_csr, field, np_dtype, shape[0], shape[1])
    else:
        arr = _buffer(msg.dense, field, np_dtype)
        if arr.size != length * (shape[1] if shape is not None and len(shape) == 2 else 1):
            raise WireError(
                f"{field}: {arr.size} values; expected {length} per column, one per model_input token"
                + (f" (shape {shape})" if shape is not None else "")
            )
        if shape is not None and len(shape) == 2:
            arr = arr.reshape(shape)
    if integer:
        if arr.dtype.kind == "f" and (not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr))):
            raise WireError(f"{field}: token ids must be integers")
        return arr.astype(np.int64)
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float32)
    if not np.all(np.isfinite(arr)):
        j = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise WireError(f"{field}: value {float(arr[j])} at position {j[0] if len(j) == 1 else list(j)} is not finite")
    return arr.copy()


def _buffer(raw: bytes, field: str, np_dtype: Any) -> np.ndarray:
    """``raw`` bytes as a 1-D array of ``np_dtype``; ``WireError`` for a partial value."""
    itemsize = np.dtype(np_dtype).itemsize
    if len(raw) % itemsize:
        raise WireError(f"{field}: {len(raw)} bytes is not a whole number of {np.dtype(np_dtype).name} values")
    return np.frombuffer(raw, dtype=np_dtype)


def _csr(csr: pb.SparseCsr, field: str, np_dtype: Any, rows: int, cols: int) -> np.ndarray:
    """The dense [rows, cols] array of a sparse CSR tensor (absent entries 0), its indices checked."""
    values = _buffer(csr.values, f"{field}.sparse_csr.values", np_dtype)
    crow = _buffer(csr.crow_indices, f"{field}.sparse_csr.crow_indices", np.int64)
    col = _buffer(csr.col_indices, f"{field}.sparse_csr.col_indices", np.int64)
    if crow.size != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != values.size:
        raise WireError(
            f"{field}.sparse_csr.crow_indices: expected {rows + 1} non-decreasing row pointers from 0 to the "
            f"{values.size} values"
        )
    if col.size != values.size or np.any((col < 0) | (col >= cols)):
        raise WireError(f"{field}.sparse_csr.col_indices: expected {values.size} column indices in [0, {cols})")
    out = np.zeros((rows, cols), dtype=values.dtype)
    out[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return out


# ------------------------------------------------------------------ sampling in
def prompt_tokens(chunks: Sequence[Any], field: str, vocab_size: int) -> list[int]:
    """The token ids of a validated ``ModelInput``'s chunks (text chunks only)."""
    tokens: list[int] = []
    for c, chunk in enumerate(chunks):
        kind = getattr(chunk, "type", None)
        if kind != "encoded_text":
            raise WireError(f"{field}.chunks[{c}]: {kind} chunks are not supported (text tokens only)")
        for j, tok in enumerate(chunk.tokens):
            if not 0 <= int(tok) < vocab_size:
                raise WireError(f"{field}.chunks[{c}].tokens[{j}]: {tok} is outside the vocabulary [0, {vocab_size})")
            tokens.append(int(tok))
    return tokens


def prompt_target_ids(
    td: Any, rows: int, vocab_size: int, max_columns: int
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """The ``[rows, K]`` int64 token ids of a sample request's ``target_prompt_logprobs`` (SDK
    ``TensorData``, dense or sparse CSR), ``-1`` where a cell requests nothing (a ``-1`` cell, or a
    cell a sparse tensor leaves out), and the sparse tensor's (row pointers, column indices) to
    answer in the same layout (``None`` when dense); ``rows`` is ``len(prompt) - 1``. A
    ``WireError`` naming the field for a non-integer dtype, a shape other than ``[rows, K]`` with
    1 <= K <= ``max_columns``, or an id outside ``[-1, vocab_size)``."""
    field = "target_prompt_logprobs"
    if td.dtype != "int64":
        raise WireError(f"{field}: dtype {td.dtype}; token ids are int64")
    shape = list(td.shape or [])
    if len(shape) != 2 or shape[0] != rows or not 1 <= shape[1] <= max_columns:
        raise WireError(
            f"{field}: shape {shape}; expected [len(prompt) - 1, K] = [{rows}, K] with 1 <= K <= {max_columns}"
        )
    # ids outside [-1, vocab_size) are refused below; here a fraction, or an integer too large for
    # int64, before numpy would truncate or overflow it
    for j, x in enumerate(td.data):
        if not (isinstance(x, int) or (isinstance(x, float) and x.is_integer())) or abs(x) >= 2**62:
            raise WireError(
                f"{field}: value {x!r} at flat index {j} is not a token id (an integer in [-1, {vocab_size}))"
            )
    data = np.asarray(td.data, dtype=np.int64)
    layout: tuple[np.ndarray, np.ndarray] | None = None
    if td.sparse_crow_indices is not None or td.sparse_col_indices is not None:
        crow = np.asarray(td.sparse_crow_indices or [], dtype=np.int64)
        col = np.asarray(td.sparse_col_indices or [], dtype=np.int64)
        if crow.size != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != data.size:
            raise WireError(
                f"{field}.sparse_crow_indices: expected {rows + 1} non-decreasing row pointers from 0 to the "
                f"{data.size} values"
            )
        if col.size != data.size or np.any((col < 0) | (col >= shape[1])):
            raise WireError(f"{field}.sparse_col_indices: expected {data.size} column indices in [0, {shape[1]})")
        ids = np.full(shape, -1, dtype=np.int64)
        ids[np.repeat(np.arange(rows), np.diff(crow)), col] = data
        layout = (crow, col)
    elif data.size != rows * shape[1]:
        raise WireError(f"{field}: {data.size} values; shape {shape} holds {rows * shape[1]}")
    else:
        ids = data.reshape(shape)
    bad = np.argwhere((ids < -1) | (ids >= vocab_size))
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise WireError(f"{field}: id {int(ids[i, j])} at [{i}, {j}] is outside [-1, {vocab_size}) (-1: no request)")
    return ids, layout


# ------------------------------------------------------------------ results out
def _batched(arrays: Sequence[np.ndarray]) -> pb.BatchedTensor:
    """One field of datums whose arrays share their trailing shape (``[T_j]`` or ``[T_j, K]``)."""
    flat = [np.ascontiguousarray(a, dtype=np.float32).reshape(-1) for a in arrays]
    sizes = np.array([0] + [a.nbytes for a in flat], dtype=np.int64)
    data = b"".join(a.tobytes() for a in flat)
    trailing = list(np.shape(arrays[0])[1:]) if arrays else []
    return pb.BatchedTensor(
        data=data, offsets=np.cumsum(sizes).tobytes(), dtype=pb.DTYPE_FLOAT32, trailing_shape=trailing
    )


def encode_forward_backward_output(
    outputs: Mapping[str, Sequence[np.ndarray]], metrics: Mapping[str, float], num_datums: int
) -> bytes:
    """``ForwardBackwardOutput`` protobuf: one float32 array per datum and field, plus metrics.

    Metric names carry Tinker's reduction suffix (``loss:sum``): the SDK combines chunked
    requests by it. A record holds datums of one trailing shape per field (a BatchedTensor has
    one), so each run of consecutive datums with the same shapes (top-k datums of one K, or the
    1-D ones) is its own record, in order, as the SDK reads ragged outputs."""
    shapes = [tuple(np.shape(arrays[i])[1:] for arrays in outputs.values()) for i in range(num_datums)]
    records, start = [], 0
    for i in range(1, num_datums + 1):
        if i == num_datums or shapes[i] != shapes[start]:
            record = pb.ArrayRecord(num_datums=i - start)
            for name, arrays in outputs.items():
                record.fields[name].CopyFrom(_batched(arrays[start:i]))
            records.append(record)
            start = i
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=records)
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    return msg.SerializeToString()


def _topk(ids: np.ndarray, logprobs: np.ndarray) -> pb.TopkLogprobs:
    """The SDK's ``TopkLogprobs`` of ``[n, k]`` ids and log-probs; a row of ids -1 (no
    log-probs there) gets the SDK's sentinel (id 0, ``MASK_LOGPROB``)."""
    empty = ids < 0
    n, k = ids.shape if ids.ndim == 2 else (len(ids), 0)
    return pb.TopkLogprobs(
        token_ids=np.where(empty, 0, ids).astype(np.int32).tobytes(),
        logprobs=np.where(empty, MASK_LOGPROB, logprobs).astype(np.float32).tobytes(),
        k=k,
        length=n,
    )


def encode_sample_response(
    sequences: Sequence[tuple[Sequence[int], Sequence[float], bool]],
    prompt_logprobs: np.ndarray | None,
    *,
    sample_topk: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    prompt_topk: tuple[np.ndarray, np.ndarray] | None = None,
    prompt_targets: np.ndarray | None = None,
    prompt_targets_layout: tuple[np.ndarray, np.ndarray] | None = None,
    prompt_alt: tuple[np.ndarray, np.ndarray] | None = None,
) -> bytes:
    """``SampleResponse`` protobuf; each sequence is (tokens, logprobs, stopped at a stop token or
    string). ``sample_topk``: per sequence, its ``[n_tokens, k]`` top-k ids and log-probs;
    ``prompt_topk``: the prompt's ``[len(prompt), k]`` (ids -1 where there are none);
    ``prompt_targets``: the ``[len(prompt) - 1, K]`` log-probs of ``target_prompt_logprobs``' ids,
    sparse CSR with ``prompt_targets_layout``'s (row pointers, column indices) when the request was;
    ``prompt_alt``: the ``[len(prompt) - 1, k]`` ids and log-probs of ``prompt_alt_tokens_k``."""
    msg = pb.SampleResponse()
    for s, (tokens, logprobs, stopped) in enumerate(sequences):
        seq = msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
        )
        if sample_topk is not None:
            seq.topk_sampled_logprobs.CopyFrom(_topk(*sample_topk[s]))
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if prompt_topk is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(*prompt_topk))
    if prompt_targets is not None:
        msg.target_prompt_logprobs.CopyFrom(_dense_or_csr(prompt_targets, prompt_targets_layout))
    if prompt_alt is not None:
        msg.prompt_alt_tokens.tokens.CopyFrom(_dense_or_csr(prompt_alt[0].astype(np.int64), None))
        msg.prompt_alt_tokens.logprobs.CopyFrom(_dense_or_csr(prompt_alt[1], None))
    return msg.SerializeToString()


def _dense_or_csr(arr: np.ndarray, layout: tuple[np.ndarray, np.ndarray] | None) -> pb.Tensor:
    """A 2-D int64 or float32 array as the SDK's ``Tensor``: dense, or sparse CSR holding only the
    cells of ``layout`` (row pointers, column indices)."""
    integer = arr.dtype.kind in "iu"
    arr = arr.astype(np.int64 if integer else np.float32)
    dtype = pb.DTYPE_INT64 if integer else pb.DTYPE_FLOAT32
    if layout is None:
        return pb.Tensor(dense=np.ascontiguousarray(arr).tobytes(), dtype=dtype, shape=list(arr.shape))
    crow, col = layout
    rows = np.repeat(np.arange(arr.shape[0]), np.diff(crow))
    csr = pb.SparseCsr(
        values=np.ascontiguousarray(arr[rows, col]).tobytes(),
        crow_indices=crow.astype(np.int64).tobytes(),
        col_indices=col.astype(np.int64).tobytes(),
    )
    return pb.Tensor(sparse_csr=csr, dtype=dtype, shape=list(arr.shape))


def finite(x: float, field: str) -> float:
    """``x`` if finite, else a ``WireError`` naming ``field``."""
    if not math.isfinite(x):
        raise WireError(f"{field}: {x} is not finite")
    return x
