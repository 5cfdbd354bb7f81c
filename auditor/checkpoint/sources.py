"""What a checkpoint holds, read lazily: entries, their chunks, and bounded reads of a chunk.

Every format comes down to the same model. An `Entry` is one flat state-dict name (DCP's
``optim.state.layers.0.wq.weight.exp_avg``, a safetensors tensor name) with its logical shape
and dtype; its `Chunk`s are boxes of it (a DCP save writes one per shard; a safetensors tensor
is one box) whose bytes are row-major and contiguous somewhere in a file. A chunk is read in
`boxes` of at most a given number of elements, each contiguous in the file, so a tensor of any
size is digested in bounded memory. Non-tensor values (a learning rate, a scheduler's
``last_epoch``) are `Entry.value` objects, made into tensors by `agents.state.leaf_tensor` as
the live capture does.
"""

from __future__ import annotations

import math
import mmap
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the file and what is wrong."""


def read_text(path: Path, limit: int) -> str:
    """A small text file beside a checkpoint (a name map, a safetensors index), UTF-8, of at
    most `limit` bytes; CheckpointError naming the file otherwise."""
    try:
        if path.stat().st_size > limit:
            raise CheckpointError(f"{path}: larger than {limit} bytes")
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc})") from None


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


def tiles(placed: list[tuple[tuple[int, ...], tuple[int, ...]]],
          shape: tuple[int, ...]) -> bool:
    """Whether the (offsets, shape) boxes cover an array of `shape`, each element once."""
    inside = all(len(o) == len(s) == len(shape) and all(0 <= a and a + n <= m for a, n, m
                                                        in zip(o, s, shape))
                 for o, s in placed)
    return (inside and sum(math.prod(s) for _, s in placed) == math.prod(shape)
            and not _overlap(placed))


def _overlap(placed: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two of the (offsets, shape) boxes share an element (swept along dim 0, so
    chunks split along it cost one comparison each)."""
    placed = sorted(b for b in placed if math.prod(b[1]))
    for i, (a, sa) in enumerate(placed):
        for b, sb in placed[i + 1:]:
            if sa and b[0] >= a[0] + sa[0]:
                break
            if all(x < y + t and y < x + s for x, s, y, t in zip(a, sa, b, sb)):
                return True
    return False


class FileRanges:
    """Open files of one checkpoint, read by (path, byte offset, length) into buffers."""

    def __init__(self) -> None:
        self._files: dict[Path, BinaryIO] = {}
        self.bytes_read = 0

    def read_into(self, path: Path, offset: int, nbytes: int,
                  buffer: torch.Tensor | None) -> torch.Tensor:
        """`nbytes` bytes of `path` from `offset` as a uint8 tensor (in `buffer` if given)."""
        f = self._files.get(path)
        if f is None:
            try:
                f = self._files[path] = open(path, "rb", buffering=0)
            except OSError as exc:
                raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
        out = torch.empty(nbytes, dtype=torch.uint8) if buffer is None else buffer[:nbytes]
        view = memoryview(out.numpy()).cast("B")
        f.seek(offset)
        got = 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{path}: ends at byte {offset + got}, {nbytes - got} bytes "
                                      f"short of the data its metadata places at {offset}")
            got += n
        self.bytes_read += nbytes
        return out

    def view(self, path: Path, offset: int, nbytes: int) -> torch.Tensor | None:
        """`nbytes` bytes of `path` from `offset` as a uint8 tensor over the file's mapped pages
        (read-only, faulted in at once: MAP_POPULATE); None where the range cannot be mapped (a
        file shorter than the range: `read_into` then names it). The mapping lives as long as
        the tensor; a file truncated while mapped ends the process (SIGBUS), as any mapped
        reader's would (docs/checkpoints.md)."""
        if nbytes <= 0 or not hasattr(mmap, "MAP_POPULATE"):
            return None
        f = self._files.get(path)
        if f is None:
            try:
                f = self._files[path] = open(path, "rb", buffering=0)
            except OSError:
                return None
        try:
            if os.fstat(f.fileno()).st_size < offset + nbytes:
                return None
            lead = offset % mmap.ALLOCATIONGRANULARITY
            m = mmap.mmap(f.fileno(), lead + nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                          prot=mmap.PROT_READ, offset=offset - lead)
        except (OSError, ValueError, OverflowError):
            return None
        with warnings.catch_warnings():
            # read-only pages: nothing here writes to a digested tensor
            warnings.simplefilter("ignore", UserWarning)
            out = torch.frombuffer(m, dtype=torch.uint8, offset=lead, count=nbytes)
        self.bytes_read += nbytes
        return out

    def size(self, path: Path) -> int:
        try:
            return os.stat(path).st_size
        except OSError as exc:
            raise CheckpointError(f"{path}: {exc.strerror or exc}") from None

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


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

    def __init__(self) -> None:
        self.files = FileRanges()

    def entries(self) -> Iterator[Entry]:  # pragma: no cover - each format has its own
        raise NotImplementedError

    def close(self) -> None:
        self.files.close()
