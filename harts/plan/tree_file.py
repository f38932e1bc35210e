"""TREE.json segment files for ``harts calls``: parse and validate into a SegmentForest.

Format (segment order in the file is the fixed child order; several roots form a forest)::

    {"chunk_size": 64,                                   # optional
     "segments": [{"id": "R1", "tokens": 3, "parent": null},
                  {"id": "A1", "tokens": 2, "parent": "R1"}, ...]}

A bare list of segments is accepted too. Every error is a ``harts.TreeFileError`` naming the
offending segment (or the file, when it is not a readable JSON document).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from harts.errors import TreeFileError
from harts.tree.segments import SegmentForest

__all__ = ["parse_tree", "load_tree", "forest_to_tree"]


#: per-segment token counts above this (2**40) cannot be a real rollout and would overflow int64 sums
_MAX_TOKENS = 1 << 40


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_tree(data: Any) -> tuple[SegmentForest, int | None]:
    """Validate a decoded TREE.json document; returns (forest, chunk_size or None)."""
    chunk_size = None
    if isinstance(data, dict):
        if "segments" not in data:
            raise TreeFileError("tree file: missing the 'segments' list")
        chunk_size = data.get("chunk_size")
        if chunk_size is not None and (not _is_int(chunk_size) or not 1 <= chunk_size <= _MAX_TOKENS):
            raise TreeFileError(f"tree file: chunk_size must be a positive integer, got {chunk_size!r}")
        segs = data["segments"]
    else:
        segs = data
    if not isinstance(segs, list) or not segs:
        raise TreeFileError("tree file: 'segments' must be a non-empty list")

    index: dict[str, int] = {}
    ids: list[str] = []
    for i, s in enumerate(segs):
        if not isinstance(s, dict) or "id" not in s:
            raise TreeFileError(f"tree file: segment #{i} has no 'id'")
        sid = s["id"]
        if not isinstance(sid, (str, int)) or isinstance(sid, bool):
            raise TreeFileError(f"tree file: segment #{i}: id must be a string or integer, got {sid!r}")
        sid = str(sid)
        if sid in index:
            raise TreeFileError(f"tree file: duplicate segment id {sid!r} (segments #{index[sid]} and #{i})")
        index[sid] = i
        ids.append(sid)

    n = len(segs)
    lengths = np.zeros(n, dtype=np.int64)
    parents = np.full(n, -1, dtype=np.int64)
    for i, s in enumerate(segs):
        tok = s.get("tokens")
        if not _is_int(tok) or tok <= 0 or tok > _MAX_TOKENS:
            cap = f" (at most {_MAX_TOKENS:,})" if _is_int(tok) and tok > 0 else ""
            raise TreeFileError(f"tree file: segment {ids[i]!r}: tokens must be a positive integer, got {tok!r}{cap}")
        lengths[i] = tok
        p = s.get("parent")
        if p is not None:
            if not isinstance(p, (str, int)) or isinstance(p, bool):
                raise TreeFileError(
                    f"tree file: segment {ids[i]!r}: parent must be a segment id (string or integer) or null, got {p!r}"
                )
            if str(p) not in index:
                raise TreeFileError(f"tree file: segment {ids[i]!r}: unknown parent {p!r}")
            parents[i] = index[str(p)]
            if parents[i] == i:
                raise TreeFileError(f"tree file: segment {ids[i]!r} is its own parent")
    _check_acyclic(parents, ids)
    forest, _ = SegmentForest.from_parents(lengths, parents, ids)
    return forest, chunk_size


def _check_acyclic(parents: np.ndarray, ids: list[str]) -> None:
    """Every segment must reach a root; name one segment of the first cycle found."""
    n = parents.size
    state = np.zeros(n, dtype=np.int8)  # 0 unseen, 1 on the current walk, 2 reaches a root
    for i in range(n):
        path = []
        u = i
        while u >= 0 and state[u] == 0:
            state[u] = 1
            path.append(u)
            u = int(parents[u])
        if u >= 0 and state[u] == 1:
            cyc = [ids[u]]
            w = int(parents[u])
            while w != u:
                cyc.append(ids[w])
                w = int(parents[w])
            raise TreeFileError(f"tree file: parent links form a cycle: {' -> '.join(cyc + [ids[u]])}")
        state[path] = 2


def load_tree(path: str | Path) -> tuple[SegmentForest, int | None]:
    """Read and validate a TREE.json file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TreeFileError(f"{path}: no such tree file") from None
    except UnicodeDecodeError as err:
        raise TreeFileError(f"{path}: not a UTF-8 JSON text file (byte {err.start} is not UTF-8)") from None
    except OSError as err:
        raise TreeFileError(f"{path}: cannot read the tree file ({err.strerror or err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise TreeFileError(f"{path}: not valid JSON ({err})") from None
    except RecursionError:
        raise TreeFileError(f"{path}: JSON nested too deeply to be a tree file") from None
    try:
        return parse_tree(data)
    except TreeFileError as err:
        raise TreeFileError(f"{path}: {err}") from None


def forest_to_tree(forest: SegmentForest, chunk_size: int | None = None) -> dict[str, Any]:
    """The TREE.json document of a forest (preorder; names or ``s<id>``)."""
    segs = []
    for v in range(forest.num_segments):
        p = int(forest.parent[v])
        segs.append(
            {
                "id": forest.name(v),
                "tokens": int(forest.end[v] - forest.start[v]),
                "parent": forest.name(p) if p >= 0 else None,
            }
        )
    doc: dict[str, Any] = {"segments": segs}
    if chunk_size is not None:
        doc = {"chunk_size": int(chunk_size), **doc}
    return doc
