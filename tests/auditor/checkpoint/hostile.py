"""Hostile checkpoints, built by hand: DCP metadata of DCP's own classes pickled with any field,
pickles written opcode by opcode, torch.save archives with another pickle inside, DCP
directories of thousands of one-row files."""

from __future__ import annotations

import io
import json
import pickle
import struct
import zipfile
from pathlib import Path

import torch

from tests.auditor.checkpoint.helpers import write_safetensors


def text(s: str) -> bytes:
    """BINUNICODE of `s` (which torch's weights_only unpickler also reads)."""
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def poison_path_class() -> bytes:
    """Opcodes that, run by a trusting unpickler, do ``setattr(pathlib.Path, "is_absolute",
    frozenset)`` (BUILD with slot state on the class) and leave the stack as it was."""
    return (text("pathlib") + text("Path") + b"\x93" + b"N" + b"}" + text("is_absolute")
            + text("builtins") + text("frozenset") + b"\x93" + b"s" + b"\x86" + b"b" + b"0")


def nested_lists(depth: int) -> bytes:
    """Opcodes pushing a list nested `depth` deep: [[[...]]]."""
    return b"]" * depth + b"a" * (depth - 1)


def nested_dicts(depth: int) -> bytes:
    """Opcodes pushing {"k": {"k": ... None}} nested `depth` deep."""
    return (b"}" + text("k")) * depth + b"N" + b"s" * depth


def deep_tuple_key(depth: int) -> bytes:
    """Opcodes pushing {((...(),)...): 1}: a key of `depth` nested tuples (1 byte a level)."""
    return b"}" + b")" + b"\x85" * depth + b"K\x01s"


def pickle_of(body: bytes) -> bytes:
    """A protocol-2 pickle of `body`'s opcodes (torch's weights_only unpickler reads those)."""
    return b"\x80\x02" + body + b"."


def torch_save_with(path: Path, data_pkl: bytes) -> Path:
    """A torch.save archive (as torch.save writes one) whose data.pkl is `data_pkl`."""
    buf = io.BytesIO()
    torch.save({"x": 0}, buf)
    genuine = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name in genuine.namelist():
            z.writestr(name, data_pkl if name.endswith("data.pkl") else genuine.read(name))
    return path


def write_metadata(directory: Path, entries: dict, storage: dict, prefix: bytes = b"") -> Path:
    """A ``.metadata`` of DCP's own classes: `entries` fqn -> TensorStorageMetadata or
    BytesStorageMetadata, `storage` (fqn, offsets or None) -> _StorageInfo; `prefix`: opcodes
    run before the Metadata object is built."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    md = Metadata(state_dict_metadata=entries,
                  storage_data={MetadataIndex(fqn, off): info
                                for (fqn, off), info in storage.items()})
    data = pickle.dumps(md, protocol=4)
    assert data[:2] == b"\x80\x04"
    (directory / ".metadata").write_bytes(data[:2] + prefix + data[2:])
    return directory / ".metadata"


def bytes_entries(relative_path: str, n: int) -> tuple[dict, dict]:
    """`n` one-byte values ``leak.k`` at bytes k of `relative_path` (compared as raw pickle bytes
    by a reader that follows the path)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    entries = {f"leak.{k}": BytesStorageMetadata() for k in range(n)}
    storage = {(f"leak.{k}", None): _StorageInfo(relative_path, k, 1) for k in range(n)}
    return entries, storage


def tensor_entry(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]],
                 dtype: torch.dtype = torch.float32):
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                                  for o, s in chunks])


def one_row_files_dcp(directory: Path, rows: int, width: int = 2) -> Path:
    """A DCP directory (safetensors serialization) of one tensor ``w`` of [rows, width] float32,
    each row saved as a chunk in a file of its own: `rows` files."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    directory.mkdir(parents=True, exist_ok=True)
    storage = {}
    for r in range(rows):
        name = f"__{r}_0.distcp"
        path = write_safetensors(
            directory / name, {"w": torch.full((1, width), float(r))},
            {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [r, 0]}})})
        storage[("w", (r, 0))] = _StorageInfo(name, 0, path.stat().st_size)
    write_metadata(directory, {"w": tensor_entry((rows, width), [((r, 0), (1, width))
                                                                  for r in range(rows)])},
                   storage)
    return directory
