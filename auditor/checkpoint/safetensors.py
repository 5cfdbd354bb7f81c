"""safetensors files, read by their documented layout (no dependency, nothing executed).

A file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``)
and the tensors' raw little-endian bytes, each row-major and contiguous at
``8 + N + begin``. A directory of files (``model-00001-of-00004.safetensors`` ...) is one
checkpoint. A tensor is one chunk covering its whole shape, except in the sharded files
torch.distributed.checkpoint's ``HuggingFaceStorageWriter`` writes without consolidating
(``shard-00001-model-00001-of-00001.safetensors``, one a rank): there each file's
``__metadata__["DCP_SHARDING_INFO"]`` (JSON ``{name: {"saved_offsets": [...]}}``) places its
tensor as a chunk of a logical tensor, whose shape is where the chunks end, and the chunks of a
name must cover it exactly once. Any other name found in two files is an error.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Iterator

import torch

from auditor.checkpoint.sources import (CheckpointError, Entry, Source, file_chunk, read_text,
                                       tiles)

MAX_HEADER_BYTES = 100 << 20
"""Largest JSON header read (the format's own limit is 100 MB)."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}


class SafetensorsSource(Source):
    """One or more .safetensors files, as one checkpoint."""

    format = "safetensors"

    def __init__(self, paths: list[Path], path: Path | None = None) -> None:
        super().__init__()
        self.paths = paths
        self.path = path or paths[0]
        """What the user named: the file, or the directory of the files."""
        self._tensors: dict[str, list[tuple[Path, torch.dtype, tuple[int, ...], int,
                                            tuple[int, ...] | None]]] = {}
        for path in paths:
            for name, dtype, shape, start, offsets in read_header(path,
                                                                  self.files.size(path)):
                chunks = self._tensors.setdefault(name, [])
                if chunks and (offsets is None or chunks[0][4] is None):
                    raise CheckpointError(f"{path}: tensor {name!r} is also in {chunks[0][0]}")
                if chunks and (dtype, len(shape)) != (chunks[0][1], len(chunks[0][2])):
                    raise CheckpointError(f"{path}: tensor {name!r} is {dtype} of {len(shape)} "
                                          f"dims, its chunk in {chunks[0][0]} {chunks[0][1]} of "
                                          f"{len(chunks[0][2])}")
                chunks.append((path, dtype, shape, start, offsets))
        self._logical = {name: _logical(name, chunks) for name, chunks in self._tensors.items()}

    def entries(self) -> Iterator[Entry]:
        for name, chunks in self._tensors.items():
            entry = Entry(name, self._logical[name], chunks[0][1])
            for path, dtype, shape, start, offsets in chunks:
                entry.chunks.append(file_chunk(self.files, path, start, dtype,
                                               offsets or (0,) * len(shape), shape))
            yield entry


MAX_INDEX_BYTES = 64 << 20
"""Largest ``*.safetensors.index.json`` read."""
_NUMBERED = re.compile(r"^(?P<stem>.+)-(?P<n>\d+)-of-(?P<total>\d+)\.safetensors$")


def check_complete(directory: Path, files: list[Path]) -> None:
    """CheckpointError naming a file the directory's own records say it should hold: one its
    ``*.safetensors.index.json`` maps a tensor to, or one of a numbered set
    (``model-00002-of-00004.safetensors``) whose other members are there. Without it, every
    tensor of a missing file would come out as its own ``missing_in_…`` finding and the file
    would go unnamed. (Files written one per rank without a count, as DCP's unconsolidated
    ``shard-0000r-…`` files are, cannot tell that a last rank's file is missing.)"""
    present = {f.name for f in files}
    for index in sorted(directory.glob("*.safetensors.index.json")):
        try:
            doc = json.loads(read_text(index, MAX_INDEX_BYTES))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{index}: not JSON ({exc})") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                       for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map: must map tensor names to file names")
        _missing(directory, sorted(set(weight_map.values()) - present), f"{index.name} maps "
                 "tensors to")
    sets: dict[tuple[str, str], set[int]] = {}
    for name in present:
        m = _NUMBERED.match(name)
        if m is not None:
            sets.setdefault((m["stem"], m["total"]), set()).add(int(m["n"]))
    for (stem, total), numbers in sorted(sets.items()):
        width = len(total)
        absent = [f"{stem}-{n:0{width}d}-of-{total}.safetensors"
                  for n in range(1, int(total) + 1) if n not in numbers]
        _missing(directory, absent, f"the numbered set {stem}-*-of-{total} holds")


def _missing(directory: Path, names: list[str], what: str) -> None:
    if names:
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        raise CheckpointError(f"{directory}: {what} {names[0]}{more}, which is not there "
                              "(an incomplete copy?)")


def read_header(path: Path, size: int, base: int = 0
                ) -> Iterator[tuple[str, torch.dtype, tuple[int, ...], int,
                                    tuple[int, ...] | None]]:
    """(name, dtype, shape, absolute byte offset of its data, DCP saved offsets or None) of
    every tensor of the safetensors data that starts at byte `base` of `path` (a file of
    `size` bytes; DCP's safetensors serialization puts it after a rank's other records)."""
    with open(path, "rb") as f:
        f.seek(base)
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or base + 8 + n > size:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n} does "
                                  f"not fit the file's {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start, data_len = base + 8 + n, size - base - 8 - n
    sharding = _sharding_info(path, header.get("__metadata__"))
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: entry is not an object")
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{where}: dtype {info.get('dtype')!r} is not one of "
                                  f"{', '.join(DTYPES)}")
        shape, span = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0
                                                    for s in shape)):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of sizes")
        if (not isinstance(span, list) or len(span) != 2
                or not all(isinstance(o, int) for o in span)
                or not 0 <= span[0] <= span[1] <= data_len):
            raise CheckpointError(f"{where}: data_offsets {span!r} do not lie in the file's "
                                  f"{data_len} data bytes")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if span[1] - span[0] != math.prod(shape) * itemsize:
            raise CheckpointError(f"{where}: data_offsets span {span[1] - span[0]} bytes, "
                                  f"shape {shape} of {info['dtype']} needs "
                                  f"{math.prod(shape) * itemsize}")
        offsets = None
        if sharding is not None:
            placed = sharding.get(name)
            offsets = placed.get("saved_offsets") if isinstance(placed, dict) else None
            if (not isinstance(offsets, list) or len(offsets) != len(shape)
                    or not all(isinstance(o, int) and o >= 0 for o in offsets)):
                raise CheckpointError(f"{where}: DCP_SHARDING_INFO gives it saved_offsets "
                                      f"{offsets!r}, not {len(shape)} offsets")
            offsets = tuple(offsets)
        yield name, dtype, tuple(shape), data_start + span[0], offsets


def _logical(name: str, chunks: list) -> tuple[int, ...]:
    """The shape of the tensor the chunks of `name` make up: where they end; CheckpointError
    unless they cover it, each element once."""
    ndim = len(chunks[0][2])
    placed = [(offsets or (0,) * ndim, shape) for _, _, shape, _, offsets in chunks]
    logical = tuple(max(o[d] + s[d] for o, s in placed) for d in range(ndim))
    if not tiles(placed, logical):
        held = sum(math.prod(s) for _, s in placed)
        raise CheckpointError(f"tensor {name!r}: its {len(chunks)} chunks hold {held} elements "
                              f"of its {list(logical)}, not each once (in "
                              f"{', '.join(sorted({str(c[0].name) for c in chunks}))})")
    return logical


def _sharding_info(path: Path, metadata) -> dict | None:
    """A DCP sharded file's placement of its tensors (``DCP_SHARDING_INFO``), or None."""
    if not isinstance(metadata, dict) or "DCP_SHARDING_INFO" not in metadata:
        return None
    try:
        info = json.loads(metadata["DCP_SHARDING_INFO"])
    except (TypeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: __metadata__ DCP_SHARDING_INFO is not JSON "
                              f"({exc})") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: __metadata__ DCP_SHARDING_INFO is not a JSON object")
    return info


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> Path:
    """`tensors` as a safetensors file at `path` (the layout above; the header padded with
    spaces to 8 bytes, so every tensor starts aligned to its element size as the reference
    writer's do). The benchmark's and the acceptance job's files; little-endian machines."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return path
