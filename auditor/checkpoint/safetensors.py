"""safetensors files, read by their documented layout (no dependency, nothing executed).

A file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``)
and the tensors' raw little-endian bytes, each row-major and contiguous at
``8 + N + begin``. Every tensor is one chunk covering its whole shape; a directory of shards
(``model-00001-of-00004.safetensors`` ...) is read file by file, and a name found in two files
is an error.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterator

import torch

from auditor.checkpoint.sources import CheckpointError, Entry, Source, file_chunk

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

    def __init__(self, paths: list[Path]) -> None:
        super().__init__()
        self.paths = paths
        self._tensors: list[tuple[Path, str, torch.dtype, tuple[int, ...], int]] = []
        seen: dict[str, Path] = {}
        for path in paths:
            for name, dtype, shape, start in self._header(path):
                if name in seen:
                    raise CheckpointError(f"{path}: tensor {name!r} is also in {seen[name]}")
                seen[name] = path
                self._tensors.append((path, name, dtype, shape, start))

    def _header(self, path: Path) -> Iterator[tuple[str, torch.dtype, tuple[int, ...], int]]:
        size = self.files.size(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} does "
                                      f"not fit the file's {size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{path}: header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: header is not a JSON object")
        data_start, data_len = 8 + n, size - 8 - n
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
            yield name, dtype, tuple(shape), data_start + span[0]

    def entries(self) -> Iterator[Entry]:
        for path, name, dtype, shape, start in self._tensors:
            entry = Entry(name, shape, dtype)
            entry.chunks.append(file_chunk(self.files, path, start, dtype, (0,) * len(shape),
                                           shape))
            yield entry


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
