"""Reading and writing transformers checkpoints (config.json + safetensors, sharded or not).

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` with its shards. Tensor names on disk may be the Hub
layout (per-expert weights, split q/k/v convs, architecture-specific renames; this is also
what transformers' ``save_pretrained`` writes) or transformers' module names. ``plan_sources``
turns the on-disk NAMES (and shapes) into canonical module tensors, each a ``Source``:

    single   one on-disk tensor
    cat0     q/k/v conv weights concatenated on dim 0 -> [3C, 1, w]
    gate_up  per-expert (gate, up) [I, D] pairs -> stacked [E, 2I, D] (gate rows first)
    down     per-expert down [D, I] -> stacked [E, D, I]
    stack    per-expert up [I, D] of ungated experts (Nemotron-H) -> stacked [E, I, D]

so a checkpoint can be checked (``harts convert``) without reading tensor data.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from harts.errors import UserError
from harts.integrations.hf.base import HFAdapter

__all__ = ["Source", "CheckpointFiles", "UnreadableFileError", "open_checkpoint", "plan_sources", "write_safetensors"]

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>[A-Za-z0-9_]+)\.weight$")
_CONV = re.compile(r"^(?P<prefix>.*)\.(?P<which>[qkv])_conv1d\.weight$")


@dataclass
class Source:
    """How one canonical tensor is assembled from on-disk tensors."""

    kind: str  # "single" | "cat0" | "gate_up" | "down" | "stack"
    names: list[str]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class CheckpointFiles:
    """A checkpoint directory: its config dict and where each on-disk tensor lives."""

    path: str
    config: dict[str, Any]
    #: on-disk tensor name -> safetensors file
    files: dict[str, str]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[str, list[str]] = defaultdict(list)
        for n in names:
            by_file[self.files[n]].append(n)
        out: dict[str, torch.Tensor] = {}
        for f, ns in by_file.items():
            with safe_open(f, framework="pt") as fh:
                for n in ns:
                    out[n] = fh.get_tensor(n)
        return out


class UnreadableFileError(UserError):
    """A checkpoint file that is not what its name says (garbled JSON, a damaged safetensors
    header); the message names the file. Commands add which option named the checkpoint."""


def _read_json(file: str) -> Any:
    """The JSON in ``file``; ``UserError`` naming it when it is not readable JSON."""
    try:
        with open(file, encoding="utf-8") as fh:
            return json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise UnreadableFileError(f"{file}: not JSON ({err})") from None
    except OSError as err:
        raise UnreadableFileError(f"{file}: not readable ({err.strerror or err})") from None


@contextlib.contextmanager
def _safe_open(file: str) -> Iterator[Any]:
    """``safetensors.safe_open(file)``; a damaged header is a ``UserError`` naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(file, framework="pt")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise UnreadableFileError(f"{file}: not a readable safetensors file ({err})") from None
    with handle as fh:
        yield fh


def open_checkpoint(path: str) -> CheckpointFiles:
    """Index a local checkpoint directory (no tensor data is read)."""
    if not os.path.isdir(path):
        raise UserError(f"checkpoint path {path!r} is not a directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise UserError(f"checkpoint {path!r} has no config.json")
    config = _read_json(cfg_path)
    if not isinstance(config, dict):
        raise UserError(f"{cfg_path}: not a JSON object")
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{index}: needs a 'weight_map' object of tensor name -> shard file")
        files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
        missing = sorted({f for f in files.values() if not os.path.isfile(f)})
        if missing:
            raise UserError(f"checkpoint {path!r}: index names missing shard file(s) {missing}")
    elif os.path.isfile(single):
        with _safe_open(single) as fh:
            files = {name: single for name in fh.keys()}
    else:
        raise UserError(f"checkpoint {path!r} has neither model.safetensors nor model.safetensors.index.json")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(set(files.values())):
        with _safe_open(f) as fh:
            for name in fh.keys():
                if name in files:
                    shapes[name] = tuple(fh.get_slice(name).get_shape())
    return CheckpointFiles(path=path, config=config, files=files, shapes=shapes)


def plan_sources(
    adapter: HFAdapter, names_shapes: dict[str, tuple[int, ...]], num_layers: int
) -> tuple[dict[str, Source], list[str], list[str]]:
    """(canonical name -> Source, ignored on-disk names, unrecognized on-disk names)."""
    sources: dict[str, Source] = {}
    ignored: list[str] = []
    problems: list[str] = []
    convs: dict[str, dict[str, str]] = defaultdict(dict)
    experts: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    leaf_role = {}
    for gate, up, down in adapter.expert_names:
        leaf_role.update({up: "up", down: "down"} | ({gate: "gate"} if gate else {}))
    for disk, shape in names_shapes.items():
        canon = adapter.canonical_name(disk)
        if adapter.is_extra_layer(canon, num_layers):
            ignored.append(disk)  # multi-token-prediction layers past the decoder
            continue
        m = _EXPERT.match(canon)
        if m and m.group("leaf") in leaf_role:
            experts[m.group("prefix")][int(m.group("e"))][leaf_role[m.group("leaf")]] = disk
            continue
        m = _CONV.match(canon)
        if m:
            convs[m.group("prefix")][m.group("which")] = disk
            continue
        sources[canon] = Source("single", [disk], tuple(shape))
    for prefix, parts in convs.items():
        if set(parts) != set("qkv"):
            problems.extend(parts.values())
            continue
        names = [parts[w] for w in "qkv"]
        shp = [names_shapes[n] for n in names]
        sources[f"{prefix}.conv1d.weight"] = Source("cat0", names, (sum(s[0] for s in shp), *shp[0][1:]))
    # gated experts (gate, up, down) unless the adapter names no gate leaf (Nemotron-H: up, down)
    roles = {"gate", "up", "down"} if any(g for g, _, _ in adapter.expert_names) else {"up", "down"}
    for prefix, per in experts.items():
        E = len(per)
        if sorted(per) != list(range(E)) or any(set(r) != roles for r in per.values()):
            problems.extend(n for r in per.values() for n in r.values())
            continue
        dn = [per[e]["down"] for e in range(E)]
        ds = names_shapes[dn[0]]
        sources[f"{prefix}.down_proj"] = Source("down", dn, (E, ds[0], ds[1]))
        if "gate" not in roles:
            ups = [per[e]["up"] for e in range(E)]
            us = names_shapes[ups[0]]
            sources[f"{prefix}.up_proj"] = Source("stack", ups, (E, us[0], us[1]))
            continue
        gu = [per[e][r] for e in range(E) for r in ("gate", "up")]
        gs = names_shapes[gu[0]]
        sources[f"{prefix}.gate_up_proj"] = Source("gate_up", gu, (E, 2 * gs[0], gs[1]))
    return sources, sorted(ignored), sorted(problems)


def materialize(src: Source, raw: dict[str, torch.Tensor]) -> torch.Tensor:
    ts = [raw[n] for n in src.names]
    if src.kind == "single":
        return ts[0]
    if src.kind == "cat0":
        return torch.cat(ts, dim=0)
    if src.kind == "gate_up":
        return torch.stack([torch.cat(ts[i : i + 2], dim=0) for i in range(0, len(ts), 2)])
    if src.kind in ("down", "stack"):
        return torch.stack(ts)
    raise ValueError(f"unknown source kind {src.kind!r}")


def write_safetensors(tensors: dict[str, torch.Tensor], path: str, *, max_shard_bytes: int | None = None) -> list[str]:
    """Write ``tensors`` as ``model.safetensors`` or, past ``max_shard_bytes``, as shards + index."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, os.path.join(path, fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2, sort_keys=True)
    return names
