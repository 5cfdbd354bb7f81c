"""A DCP ``.metadata`` file read without trusting it: unpickled under an allow-list with
bounded memory (`agents.pickles`), then checked field by field into plain tuples.

DCP writes ``.metadata`` with `pickle.dump`. Reading it with `pickle.load` runs whatever it
names; the allow-list below names only what DCP metadata is made of (its dataclasses,
``torch.Size``, dtypes, paths), and `agents.pickles.BoundedUnpickler` adds what an allow-list
cannot: state is set (BUILD) only on instances of DCP's dataclasses, and only on their own
fields, never on a class (``setattr(pathlib.Path, "is_absolute", ...)`` made absolute paths look
relative); keys are hashed only when shallow; and the objects made are charged against a memory
budget proportional to the file's size (`agents.pickles.MEMORY_PER_BYTE`).

`check_metadata` then turns the objects into `DcpLayout` (strings, ints, tuples), so the reader
never touches an object the file made: every field the reader uses is checked for its type and
range, and a wrong one is one `CheckpointError` line naming the file, the entry and the field
(``offset: 'abc' is not a byte offset``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from numaudit.agents.pickles import BoundedUnpickler, UnsafePickle
from numaudit.auditor.checkpoint.sources import CheckpointError
from numaudit.wire import limits

MAX_METADATA_BYTES = 1 << 30
"""Largest ``.metadata`` read (a 100B-parameter model's is tens of MiB)."""
MAX_ELEMENTS = 1 << 62
"""Most elements (and bytes) a tensor of a checkpoint may claim."""

_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP, name) for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}


def _dataclasses() -> dict[type, frozenset[str]]:
    """DCP's dataclasses (the only types BUILD may give state) and their fields."""
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    classes = (m.Metadata, m.MetadataIndex, m.ChunkStorageMetadata, m.TensorStorageMetadata,
               m.BytesStorageMetadata, m.TensorProperties, m.StorageMeta, _StorageInfo)
    return {c: frozenset(f.name for f in dataclasses.fields(c)) for c in classes}


class _MetadataUnpickler(BoundedUnpickler):
    flat_keys = BoundedUnpickler.flat_keys | {torch.Size}  # sizes hold ints only
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(data, where)
        self.fields = _dataclasses()
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties

        self.index, self.properties = MetadataIndex, TensorProperties

    def find_class(self, module: str, name: str) -> Any:
        # exact names only: a dotted name would be followed through the module's own imports
        if "." not in name and (module, name) in _ALLOWED:
            return super(BoundedUnpickler, self).find_class(module, name)
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafePickle(f"{self.where}: the pickle refers to {module}.{name}, which DCP "
                           "metadata is not made of; not loaded (an untrusted file?)")

    def may_create(self, cls: Any) -> bool:
        return cls in self.fields

    def hashes_flat(self, value: Any) -> bool:
        # storage_data's keys: a MetadataIndex hashes its fqn and offset
        return (type(value) is self.index and type(vars(value).get("fqn")) is str
                and type(vars(value).get("offset")) in (type(None), torch.Size))

    def build(self, obj: Any, state: Any) -> None:
        fields = self.fields.get(type(obj))
        if fields is None:
            super().build(obj, state)
        assert fields is not None  # BoundedUnpickler.build raises for any other type
        if type(obj) is self.properties:
            if not isinstance(state, tuple) or len(state) != 5:
                raise UnsafePickle(f"{self.where}: TensorProperties state is not 5 values")
            try:
                obj.__setstate__(state)
            except RuntimeError as exc:  # an unknown memory format encoding
                raise UnsafePickle(f"{self.where}: TensorProperties: {exc}") from None
            return
        if type(state) is not dict or not fields.issuperset(state):
            raise UnsafePickle(f"{self.where}: state of a {type(obj).__name__} other than its "
                               f"fields ({', '.join(sorted(fields)) or 'none'})")
        obj.__dict__.update(state)


def read_metadata(data: bytes, where: Path) -> Any:
    """The `Metadata` object of `data` (a ``.metadata`` file's bytes); CheckpointError naming
    `where` when the pickle is refused or is not DCP metadata."""
    try:
        return _MetadataUnpickler(data, str(where)).load()
    except UnsafePickle as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # a malformed pickle, or a DCP constructor refusing its arguments
        msg = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise CheckpointError(f"{where}: not DCP metadata ({type(exc).__name__}: {msg})") \
            from None


@dataclass
class TensorLayout:
    """One tensor entry: dtype, logical size, and its chunks as (offsets, sizes)."""

    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]


@dataclass
class StorageRef:
    """Where an entry's (or a chunk's) bytes are: a file of the directory, a byte range."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass
class DcpLayout:
    """What a checked ``.metadata`` says: entries in file order (a TensorLayout, or None for a
    value saved as bytes) and the storage of each (fqn, chunk offsets or None)."""

    entries: dict[str, TensorLayout | None] = field(default_factory=dict)
    storage: dict[tuple[str, tuple[int, ...] | None], StorageRef] = field(default_factory=dict)


def describe(value: Any, n: int = 40) -> str:
    """`value` for an error message: a short repr of a plain scalar, else its type's name
    (never a repr of a structure the file made, which could be nested without end)."""
    if value is None or type(value) in (bool, int, float):
        text = repr(value)
        return text if len(text) <= n else text[:n] + "..."
    if type(value) in (str, bytes):
        return repr(value[:n]) + ("..." if len(value) > n else "")
    return f"a {type(value).__name__}"


def _int(value: Any, where: str, what: str, top: int = MAX_ELEMENTS) -> int:
    if type(value) is not int or not 0 <= value <= top:
        raise CheckpointError(f"{where}: {what}: {describe(value)} is not an integer in "
                              f"[0, {top}]")
    return value


def _ints(value: Any, where: str, what: str, ndim: int | None = None) -> tuple[int, ...]:
    if type(value) not in (tuple, list, torch.Size):
        raise CheckpointError(f"{where}: {what}: {describe(value)} is not a list of sizes")
    if len(value) > limits.MAX_TENSOR_DIMS or (ndim is not None and len(value) != ndim):
        want = f"{ndim}" if ndim is not None else f"at most {limits.MAX_TENSOR_DIMS}"
        raise CheckpointError(f"{where}: {what}: {len(value)} dims, {want} expected")
    return tuple(_int(v, where, f"{what}[{i}]") for i, v in enumerate(value))


def check_metadata(md: Any, where: Path) -> DcpLayout:
    """`md` as a `DcpLayout`; CheckpointError naming `where`, the entry and the field for
    anything the reader could not use."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if type(md) is not Metadata:
        raise CheckpointError(f"{where}: not DCP metadata (holds {describe(md)})")
    out = DcpLayout()
    entries = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    for attr, value in (("state_dict_metadata", entries), ("storage_data", storage)):
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: not DCP metadata ({attr} is {describe(value)}; "
                                  "saved by a torch without it?)")
    assert isinstance(entries, dict) and isinstance(storage, dict)  # checked just above
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            raise CheckpointError(f"{where}: state_dict_metadata: a key is {describe(fqn)}, "
                                  "not a name")
        at = f"{where}: {fqn[:200]}"
        if type(entry) is BytesStorageMetadata:
            out.entries[fqn] = None
            continue
        if type(entry) is not TensorStorageMetadata:
            raise CheckpointError(f"{at}: {describe(entry)}, not tensor or bytes metadata")
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{at}: properties.dtype: {describe(dtype)} is not a dtype")
        size = _ints(getattr(entry, "size", None), at, "size")
        if math.prod(size) * torch.empty((), dtype=dtype).element_size() > MAX_ELEMENTS:
            raise CheckpointError(f"{at}: size {list(size)} holds more than {MAX_ELEMENTS} "
                                  "bytes")
        chunks = getattr(entry, "chunks", None)
        if type(chunks) is not list:
            raise CheckpointError(f"{at}: chunks: {describe(chunks)} is not a list of chunks")
        placed = []
        for i, chunk in enumerate(chunks):
            if type(chunk) is not ChunkStorageMetadata:
                raise CheckpointError(f"{at}: chunks[{i}]: {describe(chunk)} is not a chunk")
            offsets = _ints(getattr(chunk, "offsets", None), at, f"chunks[{i}].offsets",
                            len(size))
            sizes = _ints(getattr(chunk, "sizes", None), at, f"chunks[{i}].sizes", len(size))
            if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
                raise CheckpointError(f"{at}: chunks[{i}] at {list(offsets)} of {list(sizes)} "
                                      f"lies outside its size {list(size)}")
            placed.append((offsets, sizes))
        out.entries[fqn] = TensorLayout(dtype, size, placed)
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            raise CheckpointError(f"{where}: storage_data: a key is {describe(index)}, not a "
                                  "MetadataIndex")
        at = f"{where}: storage_data[{index.fqn[:200]}]"
        offset = None if index.offset is None else _ints(index.offset, at, "index offset")
        if type(info) is not _StorageInfo:
            raise CheckpointError(f"{at}: {describe(info)}, not a _StorageInfo")
        rel = getattr(info, "relative_path", None)
        if type(rel) is not str or not rel or "\x00" in rel:
            raise CheckpointError(f"{at}: relative_path: {describe(rel)} is not a file name")
        transforms = getattr(info, "transform_descriptors", None) or ()
        if not isinstance(transforms, (list, tuple)) or not all(type(t) is str
                                                                for t in transforms):
            raise CheckpointError(f"{at}: transform_descriptors: {describe(transforms)} is not "
                                  "a list of names")
        out.storage[(index.fqn, offset)] = StorageRef(
            rel, _int(getattr(info, "offset", None), at, "offset"),
            _int(getattr(info, "length", None), at, "length"), tuple(transforms))
    return out
