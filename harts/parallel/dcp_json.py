"""``torch.distributed.checkpoint`` (DCP) storage without pickle: the metadata in JSON, tensors only.

DCP's own ``FileSystemWriter`` / ``FileSystemReader`` keep a checkpoint's metadata (which tensor
chunk lies where) in a pickled ``.metadata`` file that ``read_metadata`` loads with
``pickle.load``, and its default load planner reads every non-tensor item with
``torch.load(weights_only=False)``: both run whatever code a planted file names. Here

* ``JsonWriter`` writes the metadata as ``metadata.json`` (plain data: shapes, dtypes, offsets);
* ``read_metadata`` parses it back into DCP's ``Metadata`` and checks that every tensor chunk it
  names lies inside its file, so a truncated ``.distcp`` file is named before anything is read;
* ``JsonReader`` reads tensors the way DCP does (``torch.load(weights_only=True)``, which admits
  tensors and plain containers only) and names the file whose bytes do not parse;
* ``TensorLoadPlanner`` refuses non-tensor (pickled) items instead of unpickling them.

A harts checkpoint therefore holds tensors only in DCP; everything else is JSON beside it
(``harts.parallel.checkpoint``). Every problem with the files is a ``DamagedCheckpoint`` naming
the file; resharding on load (N ranks saved, M load) works as with DCP's own reader.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from harts.errors import DamagedCheckpoint, UserError

__all__ = ["METADATA_FILE", "DamagedCheckpoint", "JsonReader", "JsonWriter", "TensorLoadPlanner", "read_metadata"]

METADATA_FILE = "metadata.json"
#: bumped whenever the JSON layout below changes
METADATA_FORMAT = "harts-dcp-metadata/1"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: object, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise DamagedCheckpoint(f"{where}: {name!r} is not a torch dtype")
    return dtype


def encode_metadata(metadata: Metadata) -> dict[str, Any]:
    """DCP's ``Metadata`` (tensor entries only) as plain JSON data."""
    tensors = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(f"{fqn}: only tensors go into a harts DCP checkpoint, not {type(md).__name__}")
        p = md.properties
        if p.layout != torch.strided or p.memory_format != torch.contiguous_format:
            raise TypeError(f"{fqn}: only strided, contiguous tensors are saved (got {p.layout}, {p.memory_format})")
        tensors[fqn] = {
            "dtype": _dtype_name(p.dtype),
            "requires_grad": bool(p.requires_grad),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    storage = [
        {
            "fqn": index.fqn,
            "offset": None if index.offset is None else list(index.offset),
            "index": index.index,
            "file": info.relative_path,
            "start": int(info.offset),
            "length": int(info.length),
            "transforms": list(info.transform_descriptors or ()),
        }
        for index, info in (metadata.storage_data or {}).items()
    ]
    mappings = metadata.planner_data or {}
    return {
        "format": METADATA_FORMAT,
        "version": metadata.version,
        "tensors": tensors,
        "storage": storage,
        "planner": {fqn: list(path) for fqn, path in mappings.items()},
    }


def _ints(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DamagedCheckpoint(f"{where}: expected a list of integers, got {value!r:.80}")
    return value


def decode_metadata(data: object, where: str) -> Metadata:
    """``encode_metadata``'s output back as DCP's ``Metadata``; ``DamagedCheckpoint`` naming
    ``where`` for anything else."""
    if not isinstance(data, dict) or data.get("format") != METADATA_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise DamagedCheckpoint(f"{where}: format {found!r}, expected {METADATA_FORMAT!r}")
    try:
        tensors = {}
        for fqn, t in data["tensors"].items():
            chunks = [
                ChunkStorageMetadata(
                    offsets=torch.Size(_ints(c["offsets"], where)), sizes=torch.Size(_ints(c["sizes"], where))
                )
                for c in t["chunks"]
            ]
            props = TensorProperties(dtype=_dtype(t["dtype"], where), requires_grad=bool(t["requires_grad"]))
            tensors[fqn] = TensorStorageMetadata(
                properties=props, size=torch.Size(_ints(t["size"], where)), chunks=chunks
            )
        storage = {}
        for s in data["storage"]:
            offset = None if s["offset"] is None else _ints(s["offset"], where)
            index = MetadataIndex(str(s["fqn"]), offset, s["index"])
            start, length = int(s["start"]), int(s["length"])
            file = str(s["file"])
            if Path(file).name != file or start < 0 or length < 0:
                raise DamagedCheckpoint(f"{where}: a chunk of {s['fqn']!r} lies outside the checkpoint ({file!r})")
            storage[index] = _StorageInfo(file, start, length, list(s["transforms"]) or None)
        planner = {str(fqn): tuple(path) for fqn, path in data["planner"].items()}
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        if isinstance(err, UserError):
            raise
        raise DamagedCheckpoint(f"{where}: not harts DCP metadata ({type(err).__name__}: {err})") from None
    return Metadata(
        state_dict_metadata=tensors,  # type: ignore[arg-type]
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=data.get("version"),
    )


def read_metadata(dcp_dir: str | Path) -> Metadata:
    """The metadata of the DCP checkpoint in ``dcp_dir``, after checking that every chunk it names
    lies inside an existing file (``DamagedCheckpoint`` naming the file otherwise)."""
    dcp_dir = Path(dcp_dir)
    file = dcp_dir / METADATA_FILE
    if not file.is_file():
        legacy = " (a .metadata pickle of DCP's own format: not loaded, since unpickling can run code)"
        raise DamagedCheckpoint(f"{file}: missing{legacy if (dcp_dir / '.metadata').exists() else ''}")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedCheckpoint(f"{file}: not readable JSON ({err})") from None
    metadata = decode_metadata(data, str(file))
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        part = dcp_dir / name
        try:
            size = part.stat().st_size
        except FileNotFoundError:
            raise DamagedCheckpoint(f"{part}: missing (named by {file.name})") from None
        if size < end:
            raise DamagedCheckpoint(f"{part}: truncated ({size:,} bytes, its chunks end at {end:,})")
    return metadata


class _NotedWrites(io.BufferedWriter):
    """A file whose failed writes are noted in ``errors`` before they propagate."""

    def __init__(self, raw: io.FileIO, errors: list[OSError]) -> None:
        super().__init__(raw)
        self._errors = errors

    def write(self, data: Any) -> int:  # noqa: ANN401 - any buffer
        try:
            return super().write(data)
        except OSError as err:
            self._errors.append(err)
            raise

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as err:
            self._errors.append(err)
            raise


class _NotingFileSystem(FileSystem):
    """DCP's local file system, its binary files noting their failed writes (``_NotedWrites``)."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _NotedWrites(io.FileIO(path, "wb"), self.errors) as stream:
            yield stream


class JsonWriter(FileSystemWriter):
    """DCP's file system writer with the metadata written as ``metadata.json`` instead of a pickle.

    A write that fails in the operating system (a full disk) is raised as its ``OSError``: torch's
    own serializer, which writes the tensors, reports it only as "unexpected pos" (a
    ``RuntimeError``), so the files note their failed writes and ``write_data`` raises the first."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:  # noqa: ANN401 - DCP's options
        super().__init__(path, **kwargs)
        self._noting = _NotingFileSystem()
        self.fs = self._noting

    def write_data(self, plan: Any, planner: Any) -> Any:  # noqa: ANN401 - DCP's signature
        try:
            return super().write_data(plan, planner)
        except Exception:
            errors = self._noting.errors
            if errors:
                raise errors[0] from None
            raise

    def finish(self, metadata: Metadata, results: list) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}
        path = Path(self.path)
        tmp = path / f".{METADATA_FILE}.tmp"
        with tmp.open("w") as fh:
            json.dump(encode_metadata(metadata), fh)
            fh.flush()
            if self.sync_files:
                os.fsync(fh.fileno())
        os.replace(tmp, path / METADATA_FILE)


class JsonReader(FileSystemReader):
    """DCP's file system reader over ``metadata.json`` (parsed and checked by ``read_metadata``
    before DCP starts: a failure inside DCP's metadata step would be logged with a traceback)."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._reading: _StorageInfo | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # noqa: ARG002 - DCP's signature
        self._metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self._metadata

    def _slice_file(self, file, sinfo: _StorageInfo):  # noqa: ANN001, ANN202 - DCP's private hook
        self._reading = sinfo
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):  # noqa: ANN001, ANN201 - DCP's signature
        try:
            with warnings.catch_warnings():
                # torch.load's note on a foreign pickle protocol: the refusal below says it all
                warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
                return super().read_data(plan, planner)
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - which bytes failed to parse is what the user needs
            info = self._reading
            where = (
                f"{Path(self.path) / info.relative_path}: garbled, the {info.length:,} bytes at {info.offset:,}"
                if info
                else f"{self.path}: garbled, a tensor"
            )
            raise DamagedCheckpoint(f"{where} are not a tensor ({type(err).__name__})") from None


class TensorLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing the non-tensor items DCP would unpickle."""

    def load_bytes(self, read_item, value) -> None:  # noqa: ANN001 - DCP's signature
        raise DamagedCheckpoint(
            f"{read_item.dest_index.fqn}: stored as a pickled object; a harts checkpoint holds tensors only "
            "(not loaded, since unpickling can run code)"
        )
