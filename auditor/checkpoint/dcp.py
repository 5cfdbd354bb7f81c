"""torch.distributed.checkpoint directories, read without trusting their pickles.

A DCP directory holds ``.metadata`` (a pickled `Metadata`: each flat name's logical size, dtype
and chunks, and where each chunk's bytes are) and ``*.distcp`` files holding, per chunk, a
``torch.save`` archive of the chunk tensor (an uncompressed zip: a small pickle naming a
storage, and the storage's raw bytes), and per non-tensor value its ``torch.save`` bytes.

Reading:
- ``.metadata`` is unpickled with an allow-list of the classes a DCP metadata file is made of
  (DCP's metadata dataclasses, ``torch.Size``, dtypes, paths), in bounded memory, with state set
  only on DCP's own dataclasses, then checked field by field (`dcp_metadata`): a pickle naming
  anything else is refused, never run, and a wrong field is one line naming it.
- every file the metadata names must resolve inside the directory and be a regular file
  (`files.FileRanges`); at most `files.MAX_OPEN_FILES` are open at once.
- a chunk's archive is opened as a zip inside the ``.distcp`` file; its pickle is read with an
  unpickler that only records which storage the tensor views (offset, size, stride) and never
  loads it; a contiguous view is then read straight from the file in bounded boxes. A
  non-contiguous chunk (a transposed view saved as is) is loaded whole with
  ``torch.load(weights_only=True)``.
- a non-tensor value is loaded with ``torch.load(weights_only=True)``; one that needs other
  classes is compared as its raw bytes, and the entry says so. Every pickle handed to
  ``torch.load`` is first run under `agents.pickles.check_pickle` (bounded memory, no deep
  hashing: torch's loader hashes a key nested 200,000 tuples deep until the stack overflows).
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from numaudit.agents.pickles import BoundedUnpickler, UnsafePickle, check_pickle
from numaudit.auditor.checkpoint.dcp_metadata import (
    MAX_METADATA_BYTES,
    StorageRef,
    TensorLayout,
    check_metadata,
    read_metadata,
)
from numaudit.auditor.checkpoint.files import FileRanges, open_regular, read_bounded
from numaudit.auditor.checkpoint.safetensors import read_header
from numaudit.auditor.checkpoint.sources import (
    CheckpointError,
    Chunk,
    Entry,
    Source,
    file_chunk,
    tensor_chunk,
)

MAX_VALUE_BYTES = 64 << 20
"""Largest non-tensor value unpickled; a larger one is compared as raw bytes."""
MAX_CHUNK_PICKLE_BYTES = 1 << 20
"""Largest ``data.pkl`` of a chunk's archive read for where its storage is (a tensor's is a few
hundred bytes); a larger one is loaded whole like a non-contiguous chunk."""


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
    if (not isinstance(storage, _StorageRef) or type(storage_offset) is not int
            or not all(type(v) is int for v in (*size, *stride))):
        raise pickle.UnpicklingError("tensor rebuild arguments")
    return _TensorRef(storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_parameter(data, *_rest) -> Any:
    return data


class _ChunkUnpickler(BoundedUnpickler):
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
                or not isinstance(pid[1], tuple) or len(pid[1]) != 2 or pid[1][0] != "dtype"
                or type(pid[2]) is not str or type(pid[4]) is not int):
            raise pickle.UnpicklingError("storage reference")
        return _StorageRef(pid[2], pid[1][1], pid[4])


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
        super().__init__(root=path)
        self.path = path
        meta = path / ".metadata"
        with open_regular(meta) as f:
            data = read_bounded(f, MAX_METADATA_BYTES, meta)
        self.layout = check_metadata(read_metadata(data, meta), meta)
        del data
        self._blobs: dict[tuple[Path, int], dict[str, tuple]] = {}
        """(file, byte offset) -> the tensors of the safetensors data there, by name."""
        self._entries: list[Entry] | None = None

    def entries(self) -> Iterator[Entry]:
        """The entries, made once (each chunk's file checked and its header read then) and
        kept: the optimizer's names and the digest both walk them."""
        if self._entries is None:
            self._entries = [self._tensor_entry(fqn, t) if t is not None
                             else self._value_entry(fqn)
                             for fqn, t in self.layout.entries.items()]
        return iter(self._entries)

    def _info(self, fqn: str, offsets: tuple[int, ...] | None) -> StorageRef:
        info = self.layout.storage.get((fqn, offsets))
        if info is None:
            raise CheckpointError(f"{self.path}/.metadata: {fqn}: no storage for the "
                                  + ("value" if offsets is None else f"chunk at {offsets}"))
        if info.transforms:
            raise CheckpointError(f"{self.path}: {fqn}: saved with transforms "
                                  f"{list(info.transforms)[:8]}, which this reader does not "
                                  "apply")
        return info

    def _file(self, info: StorageRef) -> Path:
        """The file `info` names, checked before anything opens it: inside the directory
        (resolved: symlinks and ``..`` followed) and a regular file."""
        path = self.path / info.relative_path
        self.files.check(path)
        return path

    def _tensor_entry(self, fqn: str, md: TensorLayout) -> Entry:
        entry = Entry(fqn, md.size, md.dtype)
        for offsets, shape in md.chunks:
            info = self._info(fqn, offsets)
            entry.chunks.append(self._chunk(fqn, info, md.dtype, offsets, shape))
        return entry

    def _chunk(self, fqn: str, info: StorageRef, dtype: torch.dtype, offsets: tuple[int, ...],
               shape: tuple[int, ...]) -> Chunk:
        path, start, length = self._file(info), info.offset, info.length
        if start + length > self.files.size(path):
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
            base, ref = _locate_storage(self.files, path, start, length)
        except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, ValueError,
                struct.error, EOFError, OverflowError) as exc:
            raise CheckpointError(f"{where}: not a torch.save archive "
                                  f"({str(exc).splitlines()[0][:200] if str(exc) else exc!r})"
                                  ) from None
        if ref is not None and (ref.storage.dtype != dtype or ref.size != shape):
            raise CheckpointError(f"{where}: holds {ref.storage.dtype} {list(ref.size)[:8]}, "
                                  f"the metadata says {dtype} {list(shape)}")
        if ref is not None and _contiguous(ref.size, ref.stride) \
                and ref.offset + _numel(shape) <= ref.storage.numel:
            itemsize = torch.empty((), dtype=dtype).element_size()
            return file_chunk(self.files, path, base + ref.offset * itemsize, dtype, offsets,
                              shape)

        def load() -> torch.Tensor:
            raw = self.files.read_bytes(path, start, length)
            try:
                t = load_checked(raw, where)
            except CheckpointError:
                raise
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
            head = self.files.read_bytes(path, start, 9)
            if head[8:9] != b"{":  # a torch.save zip starts with PK
                return None
            self._blobs[key] = {name: (dtype, shape, at, saved) for name, dtype, shape, at, saved
                                in read_header(self.files, path, start)}
        return self._blobs[key]

    def _value_entry(self, fqn: str) -> Entry:
        info = self._info(fqn, None)
        path, start, length = self._file(info), info.offset, info.length
        if start + length > self.files.size(path):
            raise CheckpointError(f"{path}: {fqn}: the value lies past the end of the file")
        if length > MAX_VALUE_BYTES:  # streamed as bytes, never unpickled
            return Entry(fqn, (length,), torch.uint8,
                         [file_chunk(self.files, path, start, torch.uint8, (0,), (length,))],
                         note=f"larger than {MAX_VALUE_BYTES} bytes: compared as its raw bytes")
        where = f"{path}: {fqn}"

        def load() -> tuple[Any, str]:
            raw = self.files.read_bytes(path, start, length)
            try:
                return load_checked(raw, where), ""
            except CheckpointError:
                raise
            except Exception as exc:
                return (torch.frombuffer(bytearray(raw), dtype=torch.uint8),
                        f"not loadable with weights_only ({type(exc).__name__}): compared as "
                        "its raw pickle bytes")

        return Entry(fqn, load_value=load)


def load_checked(raw: bytes, where: str) -> Any:
    """``torch.load(weights_only=True)`` of a torch.save archive's bytes, after its pickle
    passed `agents.pickles.check_pickle` (CheckpointError naming `where` otherwise)."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            name = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
            if name is not None:
                if zf.getinfo(name).file_size > MAX_VALUE_BYTES:
                    raise CheckpointError(f"{where}: a pickle of more than {MAX_VALUE_BYTES} "
                                          "bytes")
                check_pickle(zf.read(name), where)
            else:
                raise ValueError("no data.pkl in the archive")
    except UnsafePickle as exc:
        raise CheckpointError(str(exc)) from None
    except zipfile.BadZipFile:  # DCP writes zip archives; the legacy format is not unpickled
        raise ValueError("not a torch.save zip archive") from None
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


def _locate_storage(files: FileRanges, path: Path, start: int,
                    length: int) -> tuple[int, _TensorRef | None]:
    """(absolute byte offset of the storage's data, the tensor's view of it) of the torch.save
    archive at [start, start + length) of `path`; (0, None) when it is not a plain tensor of
    one little-endian storage (the caller then loads it whole)."""
    blob = _Window(files, path, start, length)
    with zipfile.ZipFile(blob) as zf:
        names = zf.namelist()
        prefix = next((n[:-len("data.pkl")] for n in names if n.endswith("data.pkl")), None)
        if prefix is None:
            raise KeyError("data.pkl")
        if f"{prefix}byteorder" in names and zf.read(f"{prefix}byteorder") != b"little":
            return 0, None
        if zf.getinfo(f"{prefix}data.pkl").file_size > MAX_CHUNK_PICKLE_BYTES:
            return 0, None
        try:
            ref = _ChunkUnpickler(zf.read(f"{prefix}data.pkl"), str(path)).load()
        except Exception:  # refused or malformed: loaded whole, by torch.load after a check
            return 0, None
        if not isinstance(ref, _TensorRef):
            return 0, None
        info = zf.getinfo(f"{prefix}data/{ref.storage.key}")
        itemsize = torch.empty((), dtype=ref.storage.dtype).element_size()
        if info.compress_type != zipfile.ZIP_STORED \
                or info.file_size != ref.storage.numel * itemsize:
            return 0, None
        head = files.read_bytes(path, start + info.header_offset, 30)
        if head[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile("local header")
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        return start + info.header_offset + 30 + name_len + extra_len, ref


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of a file of `files`, as a seekable file of their own."""

    def __init__(self, files: FileRanges, path: Path, start: int, length: int) -> None:
        self.files, self.path, self.start, self.length, self.pos = files, path, start, length, 0

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
        data = self.files.read_bytes(self.path, self.start + self.pos, n)
        memoryview(buf)[:len(data)] = data
        self.pos += len(data)
        return len(data)


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
