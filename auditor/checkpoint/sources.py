"""What a checkpoint holds, read lazily: entries, their chunks, and bounded reads of a chunk.

Every format comes down to the same model. An `Entry` is one flat state-dict name (DCP's
``optim.state.layers.0.wq.weight.exp_avg``, a safetensors tensor name) with its logical shape
and dtype; its `Chunk`s are boxes of it (a DCP save writes one per shard; a safetensors tensor
is one box) whose bytes are row-major and contiguous somewhere in a file. A chunk is read in
`boxes` of at most a given number of elements, each contiguous in the file, so a tensor of any
size is digested in bounded memory. Non-tensor values (a learning rate, a scheduler's
``last_epoch``) are `Entry.value` objects, made into tensors by
`agents.capture.state.leaf_tensor` as the live capture does.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from numaudit.auditor.checkpoint.errors import CheckpointError
from numaudit.auditor.checkpoint.files import FileRanges, read_text

__all__ = ["CheckpointError", "Chunk", "Entry", "FileRanges", "Part", "Slab", "Source", "boxes",
           "file_chunk", "plan", "read_text", "tensor_chunk", "tiles"]


@dataclass
class Chunk:
    """One box of an entry: `offsets` and `shape` inside the logical tensor, its elements
    row-major from `read(start, count, buffer)`."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    read: Callable[[int, int, torch.Tensor | None], torch.Tensor]
    """(first element, element count, a uint8 buffer to read into or None) -> a 1-D tensor of
    the entry's dtype holding those elements (a view of the buffer when one was given)."""
    view: Callable[[int, int], torch.Tensor | None] | None = None
    """(first element, element count) -> the same elements as a read-only tensor over the file's
    pages (mapped, nothing copied), or None where they cannot be mapped (then `read`)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Entry:
    """One flat state-dict name: a tensor (`chunks`) or a plain value (`value`)."""

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    chunks: list[Chunk] = field(default_factory=list)
    load_value: Callable[[], tuple[Any, str]] | None = None
    """A plain value's loader: (the value, a note when it is compared other than as the
    checkpoint meant it, e.g. as raw pickle bytes). None for a tensor."""
    note: str = ""
    """Why this tensor is compared other than as the checkpoint meant it."""

    def plan(self, cap: int) -> list[Slab]:
        """The boxes the entry is digested in, of at most `cap` bytes each (`plan`; none for a
        value)."""
        if self.load_value is not None or self.dtype is None:
            return []
        return plan(self, cap // torch.empty((), dtype=self.dtype).element_size())


@dataclass
class Part:
    """Elements [start, start + count) of `chunk`, row-major, which fill the box `shape` at
    `offsets` inside their slab."""

    chunk: Chunk
    start: int
    count: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class Slab:
    """A box of the logical tensor (`offsets`, `shape`) digested as one piece, filled by its
    `parts` exactly once."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    parts: list[Part]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def plan(entry: Entry, cap: int) -> list[Slab]:
    """Slabs of at most `cap` elements that digest `entry`.

    Where the chunks tile the logical tensor (each element once) and a row (dim 0) fits the cap,
    the tensor is cut into slabs of whole rows, each filled from the rows of every chunk it
    crosses: a tensor saved by 1024 FSDP ranks is digested in as many pieces as its size needs,
    not one a rank (each piece needs a reader of its own: digest.py). Otherwise (a row above
    the cap, chunks that overlap or leave gaps) each chunk is cut on its own (`boxes`), and the
    auditor judges the pieces' coverage as it does a live run's."""
    shape = entry.shape
    inner = math.prod(shape[1:])
    chunks = [c for c in entry.chunks if c.numel]
    if not (len(shape) > 0 and 0 < inner <= max(1, cap) and math.prod(shape) > 0
            and tiles([(c.offsets, c.shape) for c in chunks], shape)):
        return [Slab(tuple(a + b for a, b in zip(c.offsets, off)), sub,
                     [Part(c, start, math.prod(sub), (0,) * len(sub), sub)])
                for c in entry.chunks for off, sub, start in boxes(c.shape, cap)]
    rows = max(1, cap // inner)
    slabs = [Slab((r, *(0,) * (len(shape) - 1)), (min(rows, shape[0] - r), *shape[1:]), [])
             for r in range(0, shape[0], rows)]
    for c in chunks:
        c_inner, first = math.prod(c.shape[1:]), c.offsets[0]
        for k in range(first // rows, (first + c.shape[0] - 1) // rows + 1):
            slab = slabs[k]
            a, b = max(first, slab.offsets[0]), min(first + c.shape[0],
                                                   slab.offsets[0] + slab.shape[0])
            slab.parts.append(Part(c, (a - first) * c_inner, (b - a) * c_inner,
                                   (a - slab.offsets[0], *c.offsets[1:]),
                                   (b - a, *c.shape[1:])))
    return slabs


MAX_CORNERS = 1 << 22
"""Most box corners `tiles` counts (boxes x 2**dims cut); past it, it answers False."""


def tiles(placed: list[tuple[tuple[int, ...], tuple[int, ...]]],
          shape: tuple[int, ...]) -> bool:
    """Whether the (offsets, shape) boxes cover an array of `shape`, each element once.

    Counted, not compared pairwise: the boxes tile the array exactly when the sum of their
    indicator functions is the array's, and a sum of boxes is zero exactly when, at every
    point, the signed count of box corners there is zero (a box contributes +1 at each corner
    with an even number of upper bounds, -1 at the others: its mixed finite difference). Only
    the dims some box does not span whole matter, so the cost is n * 2**k for n boxes cut in
    k dims (30,000 chunks along one dim: 60,000 corners), whatever the layout; past
    `MAX_CORNERS` the answer is False (the boxes are then read one by one)."""
    nd = len(shape)
    boxes_ = []
    for o, s in placed:
        if len(o) != nd or len(s) != nd or not all(a >= 0 and n >= 0 and a + n <= m
                                                    for a, n, m in zip(o, s, shape)):
            return False
        if math.prod(s):
            boxes_.append((o, s))
    total = math.prod(shape)
    if sum(math.prod(s) for _, s in boxes_) != total:
        return False
    cut = [d for d in range(nd) if any(o[d] or s[d] != shape[d] for o, s in boxes_)]
    k = len(cut)
    if not boxes_ or (len(boxes_) + 1) << k > MAX_CORNERS:
        return total == 0 and not boxes_
    count: defaultdict[tuple[int, ...], int] = defaultdict(int)
    signs = [(-1) ** bin(mask).count("1") for mask in range(1 << k)]
    for o, s, sign in [(o, s, 1) for o, s in boxes_] + [((0,) * nd, shape, -1)]:
        lo = [o[d] for d in cut]
        hi = [o[d] + s[d] for d in cut]
        for mask in range(1 << k):
            corner = tuple(hi[i] if mask >> i & 1 else lo[i] for i in range(k))
            count[corner] += sign * signs[mask]
    return not any(count.values())


def file_chunk(files: FileRanges, path: Path, base: int, dtype: torch.dtype,
               offsets: tuple[int, ...], shape: tuple[int, ...]) -> Chunk:
    """A chunk whose elements lie row-major and contiguous in `path` from byte `base`."""
    itemsize = torch.empty((), dtype=dtype).element_size()

    def read(start: int, count: int, buffer: torch.Tensor | None) -> torch.Tensor:
        raw = files.read_into(path, base + start * itemsize, count * itemsize, buffer)
        return raw.view(dtype) if count else torch.empty(0, dtype=dtype)

    def view(start: int, count: int) -> torch.Tensor | None:
        at = base + start * itemsize
        if at % itemsize:  # an element split across its natural alignment: read a copy
            return None
        raw = files.view(path, at, count * itemsize)
        return None if raw is None else raw.view(dtype)

    return Chunk(offsets, shape, read, view)


def tensor_chunk(load: Callable[[], torch.Tensor], offsets: tuple[int, ...],
                 shape: tuple[int, ...]) -> Chunk:
    """A chunk read whole by `load` (a layout the streaming reader does not take), then sliced;
    the tensor is kept only while its boxes are read."""
    held: dict[str, torch.Tensor] = {}

    def read(start: int, count: int, buffer: torch.Tensor | None) -> torch.Tensor:
        t = held.get("t")
        if t is None:
            t = held["t"] = load().contiguous().reshape(-1)
        out = t[start:start + count]
        if start + count >= t.numel():
            held.clear()
        return out

    return Chunk(offsets, shape, read)


def boxes(shape: tuple[int, ...], cap: int) -> Iterator[tuple[tuple[int, ...],
                                                             tuple[int, ...], int]]:
    """(offsets, shape, first element) of boxes that tile a row-major array of `shape`, each
    contiguous in memory and of at most `cap` elements (at least one row of one element)."""
    cap = max(1, cap)
    n = math.prod(shape)
    if not shape or n <= cap:
        yield (0,) * len(shape), tuple(shape), 0
        return
    inner = math.prod(shape[1:])
    if inner <= cap:
        rows = max(1, cap // max(inner, 1))
        for r in range(0, shape[0], rows):
            k = min(rows, shape[0] - r)
            yield (r, *(0,) * (len(shape) - 1)), (k, *shape[1:]), r * inner
        return
    for r in range(shape[0]):
        for off, sub, start in boxes(shape[1:], cap):
            yield (r, *off), (1, *sub), r * inner + start


class Source:
    """A checkpoint's entries (`entries()`), its format's name, the path the user named
    (`path`) and the bytes read so far."""

    format = ""
    path: Path

    def __init__(self, root: Path | None = None) -> None:
        self.files = FileRanges(root)
        """The source's open files (with `root`: only files inside that directory)."""

    def entries(self) -> Iterator[Entry]:  # pragma: no cover - each format has its own
        raise NotImplementedError

    def close(self) -> None:
        self.files.close()
