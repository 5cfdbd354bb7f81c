"""torch.distributed.checkpoint directories, read without trusting their pickles.

A DCP directory holds ``.metadata`` (a pickled `Metadata`: each flat name's logical size, dtype
and chunks, and where each chunk's bytes are) and ``*.distcp`` files holding, per chunk, a
``torch.save`` archive of the chunk tensor (an uncompressed zip: a small pickle naming a
storage, and the storage's raw bytes), and per non-tensor value its ``torch.save`` bytes.

Reading:
- ``.metadata`` is unpickled with an allow-list of the classes a DCP metadata file is made of
  (DCP's metadata dataclasses, ``torch.Size``, dtypes, paths): a pickle naming anything else
  is refused, never run.
- a chunk's archive is opened as a zip inside the ``.distcp`` file; its pickle is read with an
  unpickler that only records which storage the tensor views (offset, size, stride) and never
  loads it; a contiguous view is then read straight from the file in bounded boxes. A
  non-contiguous chunk (a transposed view saved as is) is loaded whole with
  ``torch.load(weights_only=True)``.
- a non-tensor value is loaded with ``torch.load(weights_only=True)``; one that needs other
  classes is compared as its raw bytes, and the entry says so.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from auditor.checkpoint.safetensors import read_header
from auditor.checkpoint.sources import (CheckpointError, Chunk, Entry, Source, file_chunk,
                                        tensor_chunk)

MAX_METADATA_BYTES = 1 << 30
"""Largest ``.metadata`` read (a 100B-parameter model's is tens of MiB)."""
MAX_VALUE_BYTES = 64 << 20
"""Largest non-tensor value unpickled; a larger one is compared as raw bytes."""

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
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


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        # exact names only: a dotted name would be followed through the module's own imports
        if "." not in name and (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise CheckpointError(f"{self.where}: the pickle refers to {module}.{name}, which DCP "
                              "metadata is not made of; not loaded (an untrusted file?)")


@dataclass
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass
class _TensorRef:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage, storage_offset, size, stride, *_rest) -> _TensorRef:
    return _TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, *_rest) -> Any:
    return data


class _ChunkUnpickler(pickle.Unpickler):
    """Reads which storage a saved tensor views, loading nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return ("dtype", _storage_dtype(name))
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], tuple) or pid[1][0] != "dtype"):
            raise pickle.UnpicklingError("storage reference")
        return _StorageRef(str(pid[2]), pid[1][1], int(pid[4]))


def _storage_dtype(name: str) -> torch.dtype:
    from torch.storage import _get_dtype_from_pickle_storage_type

    try:
        return _get_dtype_from_pickle_storage_type(name)
    except KeyError:
        raise pickle.UnpicklingError(name) from None


class DcpSource(Source):
    """A torch.distributed.checkpoint directory."""

    format = "dcp"

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        meta = path / ".metadata"
        if self.files.size(meta) > MAX_METADATA_BYTES:
            raise CheckpointError(f"{meta}: larger than {MAX_METADATA_BYTES} bytes")
        try:
            data = meta.read_bytes()
            self.metadata = _MetadataUnpickler(data, meta).load()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{meta}: not DCP metadata ({type(exc).__name__}: {exc})") \
                from None
        for attr in ("state_dict_metadata", "storage_data"):
            if not isinstance(getattr(self.metadata, attr, None), dict):
                raise CheckpointError(f"{meta}: not DCP metadata (no {attr}; saved by a torch "
                                      "without it?)")
        self._blobs: dict[tuple[Path, int], dict[str, tuple]] = {}
        """(file, byte offset) -> the tensors of the safetensors data there, by name."""
        self._where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
        for index, info in self.metadata.storage_data.items():
            offset = None if index.offset is None else tuple(int(o) for o in index.offset)
            self._where[(index.fqn, offset)] = info

    def entries(self) -> Iterator[Entry]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        for fqn, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                yield self._tensor_entry(str(fqn), md)
            else:
                yield self._value_entry(str(fqn))

    def _info(self, fqn: str, offsets: tuple[int, ...] | None):
        info = self._where.get((fqn, offsets))
        if info is None:
            raise CheckpointError(f"{self.path}/.metadata: {fqn}: no storage for the chunk at "
                                  f"{offsets}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.path}: {fqn}: saved with transforms "
                                  f"{list(info.transform_descriptors)}, which this reader "
                                  "does not apply")
        return info

    def _file(self, info) -> Path:
        rel = Path(str(info.relative_path))
        if rel.is_absolute() or ".." in rel.parts:
            raise CheckpointError(f"{self.path}/.metadata: storage path {rel} leaves the "
                                  "checkpoint directory")
        return self.path / rel

    def _tensor_entry(self, fqn: str, md) -> Entry:
        dtype = md.properties.dtype
        entry = Entry(fqn, tuple(int(s) for s in md.size), dtype)
        for chunk in md.chunks:
            offsets = tuple(int(o) for o in chunk.offsets)
            shape = tuple(int(s) for s in chunk.sizes)
            info = self._info(fqn, offsets)
            entry.chunks.append(self._chunk(fqn, info, dtype, offsets, shape))
        return entry

    def _chunk(self, fqn: str, info, dtype: torch.dtype, offsets: tuple[int, ...],
               shape: tuple[int, ...]) -> Chunk:
        path, start, length = self._file(info), int(info.offset), int(info.length)
        if start < 0 or length < 0 or start + length > self.files.size(path):
            raise CheckpointError(f"{path}: {fqn}: the chunk at {offsets} lies past the end of "
                                  "the file")
        where = f"{path}: {fqn} (chunk at {offsets})"
        blob = self._safetensors_blob(path, start, length)
        if blob is not None:  # FileSystemWriter(serialization_format=SAFETENSORS)
            got = blob.get(fqn)
            if got is None or got[:2] != (dtype, shape) or (got[3] or offsets) != offsets:
                raise CheckpointError(f"{where}: the safetensors data at byte {start} holds "
                                      + ("no such tensor" if got is None else
                                         f"{got[0]} {list(got[1])} at {got[3]}"))
            return file_chunk(self.files, path, got[2], dtype, offsets, shape)
        try:
            base, ref = _locate_storage(path, start, length)
        except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, ValueError,
                struct.error, EOFError) as exc:
            raise CheckpointError(f"{where}: not a torch.save archive ({exc})") from None
        if ref is not None and (ref.storage.dtype != dtype or ref.size != shape):
            raise CheckpointError(f"{where}: holds {ref.storage.dtype} {list(ref.size)}, the "
                                  f"metadata says {dtype} {list(shape)}")
        if ref is not None and _contiguous(ref.size, ref.stride) \
                and ref.offset + _numel(shape) <= ref.storage.numel:
            itemsize = torch.empty((), dtype=dtype).element_size()
            return file_chunk(self.files, path, base + ref.offset * itemsize, dtype, offsets,
                              shape)

        def load() -> torch.Tensor:
            raw = self.files.read_into(path, start, length, None)
            try:
                t = torch.load(io.BytesIO(raw.numpy().tobytes()), map_location="cpu",
                               weights_only=True)
            except Exception as exc:  # weights_only refuses what it does not know: nothing ran
                msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise CheckpointError(f"{where}: not loadable with weights_only "
                                      f"({type(exc).__name__}: {msg[:200]})") from None
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                raise CheckpointError(f"{where}: does not hold a {dtype} tensor of {list(shape)}")
            return t

        return tensor_chunk(load, offsets, shape)

    def _safetensors_blob(self, path: Path, start: int,
                          length: int) -> dict[str, tuple] | None:
        """The tensors of safetensors data at byte `start` of `path` (name -> (dtype, shape,
        data offset, saved offsets)), or None where a torch.save record starts there. A save
        with DCP's safetensors serialization writes a rank's tensors as one safetensors blob
        after its other records and gives every tensor the blob's start as its offset."""
        key = (path, start)
        if key not in self._blobs:
            if length < 10:
                return None
            head = self.files.read_into(path, start, 9, None).numpy().tobytes()
            if head[8:9] != b"{":  # a torch.save zip starts with PK
                return None
            self._blobs[key] = {name: (dtype, shape, at, saved) for name, dtype, shape, at, saved
                                in read_header(path, self.files.size(path), start)}
        return self._blobs[key]

    def _value_entry(self, fqn: str) -> Entry:
        info = self._info(fqn, None)
        path, start, length = self._file(info), int(info.offset), int(info.length)
        if length > MAX_VALUE_BYTES:  # streamed as bytes, never unpickled
            return Entry(fqn, (length,), torch.uint8,
                         [file_chunk(self.files, path, start, torch.uint8, (0,), (length,))],
                         note=f"larger than {MAX_VALUE_BYTES} bytes: compared as its raw bytes")

        def load() -> tuple[Any, str]:
            raw = self.files.read_into(path, start, length, None).numpy().tobytes()
            try:
                return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True), ""
            except Exception as exc:
                return (torch.frombuffer(bytearray(raw), dtype=torch.uint8),
                        f"not loadable with weights_only ({type(exc).__name__}): compared as "
                        "its raw pickle bytes")

        return Entry(fqn, load_value=load)


def _locate_storage(path: Path, start: int, length: int) -> tuple[int, _TensorRef | None]:
    """(absolute byte offset of the storage's data, the tensor's view of it) of the torch.save
    archive at [start, start + length) of `path`; (0, None) when it is not a plain tensor of
    one little-endian storage (the caller then loads it whole)."""
    with open(path, "rb") as f:
        f.seek(start)
        blob = _Window(f, start, length)
        with zipfile.ZipFile(blob) as zf:
            names = zf.namelist()
            prefix = next((n[:-len("data.pkl")] for n in names if n.endswith("data.pkl")), None)
            if prefix is None:
                raise KeyError("data.pkl")
            if f"{prefix}byteorder" in names and zf.read(f"{prefix}byteorder") != b"little":
                return 0, None
            try:
                ref = _ChunkUnpickler(io.BytesIO(zf.read(f"{prefix}data.pkl"))).load()
            except pickle.UnpicklingError:
                return 0, None
            if not isinstance(ref, _TensorRef):
                return 0, None
            info = zf.getinfo(f"{prefix}data/{ref.storage.key}")
            itemsize = torch.empty((), dtype=ref.storage.dtype).element_size()
            if info.compress_type != zipfile.ZIP_STORED \
                    or info.file_size != ref.storage.numel * itemsize:
                return 0, None
            f.seek(start + info.header_offset)
            head = f.read(30)
            if head[:4] != b"PK\x03\x04":
                raise zipfile.BadZipFile("local header")
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            return start + info.header_offset + 30 + name_len + extra_len, ref


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable file of their own."""

    def __init__(self, f, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self.pos, self.length)[whence]
        self.pos = max(0, min(self.length, base + pos))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for s, st in zip(reversed(size), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return len(size) == len(stride)
