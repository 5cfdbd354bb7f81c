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

A header is JSON from elsewhere: it is parsed only when what parsing it would make, estimated
from its count of braces, brackets, colons and commas, stays within `JSON_MEMORY_PER_BYTE`
bytes per byte (a real header: 8-18), which bounds the memory ``json.loads`` takes
(docs/security.md); nesting past Python's recursion limit is one line,
as is every field the reader uses (dtype, shape, offsets) when it is not what the format says.
Shards of a directory must be regular files (a symlink to one is followed: Hugging Face's cache
links a snapshot's files to its blobs).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from numaudit.auditor.checkpoint.dcp_metadata import MAX_ELEMENTS, describe
from numaudit.auditor.checkpoint.files import FileRanges, regular
from numaudit.auditor.checkpoint.sources import (
    CheckpointError,
    Entry,
    Source,
    file_chunk,
    read_text,
    tiles,
)
from numaudit.wire import limits

MAX_HEADER_BYTES = 100 << 20
"""Largest JSON header read (the format's own limit is 100 MB)."""
JSON_MEMORY_PER_BYTE = 24
"""A JSON text whose objects, arrays, keys and items would take more than this many bytes per
byte to parse (`_JSON_COST`) is refused unparsed (21 MB of ``{}`` items took 818 MB)."""
_JSON_COST = ((b"{", 72), (b"[", 64), (b":", 160), (b",", 16))
"""What ``json.loads`` makes per character: an object, a list, a key (with its memo entry and
the object's slot), an item's slot. Counted in C, inside strings too: stricter, never looser."""

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
        for p in paths:
            regular(p)
        self.paths = paths
        self.path = path or paths[0]
        """What the user named: the file, or the directory of the files."""
        self._tensors: dict[str, list[tuple[Path, torch.dtype, tuple[int, ...], int,
                                            tuple[int, ...] | None]]] = {}
        for path in paths:
            for name, dtype, shape, start, offsets in read_header(self.files, path):
                chunks = self._tensors.setdefault(name, [])
                if chunks and (offsets is None or chunks[0][4] is None):
                    raise CheckpointError(f"{path}: tensor {name[:200]!r} is also in "
                                          f"{chunks[0][0]}")
                if chunks and (dtype, len(shape)) != (chunks[0][1], len(chunks[0][2])):
                    raise CheckpointError(f"{path}: tensor {name[:200]!r} is {dtype} of "
                                          f"{len(shape)} dims, its chunk in {chunks[0][0]} "
                                          f"{chunks[0][1]} of {len(chunks[0][2])}")
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
        doc = parse_json(read_text(index, MAX_INDEX_BYTES).encode(), str(index))
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


def parse_json(data: bytes, where: str) -> Any:
    """`data` parsed as JSON, refused unparsed when parsing it would take more than
    `JSON_MEMORY_PER_BYTE` bytes per byte; CheckpointError naming `where` for that, for nesting
    too deep, or for bad JSON. Messages quote no bytes of the file."""
    cost = sum(data.count(char) * nbytes for char, nbytes in _JSON_COST)
    if cost > JSON_MEMORY_PER_BYTE * len(data) + (1 << 20):
        raise CheckpointError(f"{where}: its objects, arrays and keys would take {cost} bytes "
                              f"to parse, more than {JSON_MEMORY_PER_BYTE} per byte of its "
                              f"{len(data)} (no real header takes that many); not parsed")
    try:
        return json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deep") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where}: not UTF-8 JSON (at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{where}: not JSON ({exc.msg} at character {exc.pos})") from None


def _sizes(value: Any, where: str, what: str) -> tuple[int, ...]:
    """A list of sizes (ints in [0, MAX_ELEMENTS], at most MAX_TENSOR_DIMS of them)."""
    if (not isinstance(value, list) or len(value) > limits.MAX_TENSOR_DIMS
            or not all(type(s) is int and 0 <= s <= MAX_ELEMENTS for s in value)):
        shown = (describe(value) if not isinstance(value, list)
                 else "of " + str(len(value)) + " items")
        raise CheckpointError(f"{where}: {what} {shown} is not a list of at most "
                              f"{limits.MAX_TENSOR_DIMS} sizes in [0, 2**62]")
    return tuple(value)


def read_header(files: FileRanges, path: Path, base: int = 0
                ) -> Iterator[tuple[str, torch.dtype, tuple[int, ...], int,
                                    tuple[int, ...] | None]]:
    """(name, dtype, shape, absolute byte offset of its data, DCP saved offsets or None) of
    every tensor of the safetensors data that starts at byte `base` of `path` (DCP's
    safetensors serialization puts it after a rank's other records)."""
    size = files.size(path)
    head = files.read_bytes(path, base, 8)
    if len(head) < 8:
        raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or base + 8 + n > size:
        raise CheckpointError(f"{path}: not a safetensors file (its header length does not fit "
                              f"the file's {size} bytes, nor {MAX_HEADER_BYTES})")
    header = parse_json(files.read_bytes(path, base + 8, n), f"{path}: header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start, data_len = base + 8 + n, size - base - 8 - n
    sharding = _sharding_info(path, header.get("__metadata__"))
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name[:200]!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: entry is not an object")
        dtype_name = info.get("dtype")
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise CheckpointError(f"{where}: dtype {describe(info.get('dtype'))} is not one of "
                                  f"{', '.join(DTYPES)}")
        shape, span = _sizes(info.get("shape"), where, "shape"), info.get("data_offsets")
        if (not isinstance(span, list) or len(span) != 2
                or not all(type(o) is int for o in span)
                or not 0 <= span[0] <= span[1] <= data_len):
            raise CheckpointError(f"{where}: data_offsets "
                                  f"{describe(span) if not isinstance(span, list) else span[:2]} "
                                  f"do not lie in the file's {data_len} data bytes")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if span[1] - span[0] != math.prod(shape) * itemsize:
            raise CheckpointError(f"{where}: data_offsets span {span[1] - span[0]} bytes, "
                                  f"shape {list(shape)} of {info['dtype']} needs "
                                  f"{math.prod(shape) * itemsize}")
        offsets = None
        if sharding is not None:
            placed = sharding.get(name)
            got = placed.get("saved_offsets") if isinstance(placed, dict) else None
            offsets = _sizes(got, where, "DCP_SHARDING_INFO saved_offsets")
            if len(offsets) != len(shape):
                raise CheckpointError(f"{where}: DCP_SHARDING_INFO gives it saved_offsets "
                                      f"of {len(offsets)} dims, not {len(shape)}")
        yield name, dtype, shape, data_start + span[0], offsets


def _logical(name: str, chunks: list) -> tuple[int, ...]:
    """The shape of the tensor the chunks of `name` make up: where they end; CheckpointError
    unless they cover it, each element once."""
    ndim = len(chunks[0][2])
    placed = [(offsets or (0,) * ndim, shape) for _, _, shape, _, offsets in chunks]
    logical = tuple(max(o[d] + s[d] for o, s in placed) for d in range(ndim))
    if not tiles(placed, logical):
        held = sum(math.prod(s) for _, s in placed)
        raise CheckpointError(f"tensor {name[:200]!r}: its {len(chunks)} chunks hold {held} "
                              f"elements of its {list(logical)}, not each once (in "
                              f"{', '.join(sorted({str(c[0].name) for c in chunks}))})")
    return logical


def _sharding_info(path: Path, metadata) -> dict | None:
    """A DCP sharded file's placement of its tensors (``DCP_SHARDING_INFO``), or None."""
    if not isinstance(metadata, dict) or "DCP_SHARDING_INFO" not in metadata:
        return None
    text = metadata["DCP_SHARDING_INFO"]
    if not isinstance(text, str):
        raise CheckpointError(f"{path}: __metadata__ DCP_SHARDING_INFO is not a string")
    info = parse_json(text.encode(), f"{path}: __metadata__ DCP_SHARDING_INFO")
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
