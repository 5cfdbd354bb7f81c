"""The files of a checkpoint, opened with care.

A checkpoint is data from elsewhere, and its metadata names the files to read. So:
- a path the metadata names is resolved (symlinks followed, ``..`` folded) and must lie inside
  the checkpoint's directory (`FileRanges(root=...)`): a ``data.distcp`` symlinked to
  ``/proc/self/environ`` is refused, never read;
- only regular files are opened, checked by ``stat`` first and by ``fstat`` on the descriptor
  (opened non-blocking, so a FIFO swapped in between cannot block): a FIFO, a device, a
  directory where a file belongs is one line naming it;
- text (a name map, an index) is read by counting the bytes read, never by trusting
  ``st_size`` (``/dev/zero`` says 0 and never ends);
- at most `MAX_OPEN_FILES` files are open at once (least recently used closed first), so a
  checkpoint of 10,000 files reads under ``ulimit -n 1024``.
"""

from __future__ import annotations

import io
import mmap
import os
import stat
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO

import torch

from numaudit.auditor.checkpoint.errors import CheckpointError

MAX_OPEN_FILES = 64
"""Files of a checkpoint held open at once (each mapped slab holds one more while it lives)."""

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular(path: Path) -> os.stat_result:
    """``stat`` of `path` (symlinks followed); CheckpointError unless it is a regular file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: {_kind(st.st_mode)} where a file belongs; not read")
    return st


def open_regular(path: Path) -> io.FileIO:
    """`path` opened for reading, unbuffered; CheckpointError unless it is a regular file."""
    regular(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced after the stat
        os.close(fd)
        raise CheckpointError(f"{path}: {_kind(st.st_mode)} where a file belongs; not read")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0)


def read_bounded(f: BinaryIO, limit: int, path: Path) -> bytes:
    """What is left of `f`, at most `limit` bytes; CheckpointError naming `path` past it."""
    parts: list[bytes] = []
    got = 0
    while True:
        block = f.read(min(1 << 20, limit + 1 - got))
        if not block:
            return b"".join(parts)
        parts.append(block)
        got += len(block)
        if got > limit:
            raise CheckpointError(f"{path}: larger than {limit} bytes")


def read_text(path: Path, limit: int) -> str:
    """A small text file beside a checkpoint (a name map, a safetensors index), UTF-8, of at
    most `limit` bytes; CheckpointError naming the file otherwise."""
    with open_regular(path) as f:
        data = read_bounded(f, limit, path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text (at byte {exc.start})") from None


def inside(path: Path, root: str) -> Path:
    """`path` resolved; CheckpointError unless it lies inside the (resolved) directory `root`."""
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root or real == root:
        raise CheckpointError(f"{path}: resolves to {real}, outside the checkpoint directory "
                              f"{root}; not read")
    return Path(real)


class FileRanges:
    """Open files of one checkpoint, read by (path, byte offset, length) into buffers. With
    `root`, every path must resolve inside that directory (`inside`)."""

    def __init__(self, root: Path | None = None, max_open: int = MAX_OPEN_FILES) -> None:
        self.root = os.path.realpath(root) if root is not None else None
        self._given = Path(root) if root is not None else None
        self.max_open = max(1, max_open)
        self._files: OrderedDict[Path, io.FileIO] = OrderedDict()
        self._checked: dict[Path, Path] = {}
        self._lock = threading.RLock()
        self.bytes_read = 0
        self.opened = 0
        """Files opened so far (a file closed for room and read again counts twice)."""

    def check(self, path: Path) -> Path:
        """The path to open for `path`: itself, or (with a root) its resolved path, refused
        outside the root or when it is not a regular file."""
        got = self._checked.get(path)
        if got is None:
            if self.root is not None and path.parent == self._given and self._plain(path):
                got = path  # a regular file right in the directory, not a link: inside
            else:
                got = inside(path, self.root) if self.root is not None else path
                regular(got)
            self._checked[path] = got
        return got

    @staticmethod
    def _plain(path: Path) -> bool:
        try:
            return stat.S_ISREG(os.lstat(path).st_mode) and path.name not in ("", ".", "..")
        except OSError:
            return False

    def _open(self, path: Path) -> io.FileIO:
        f = self._files.get(path)
        if f is not None:
            self._files.move_to_end(path)
            return f
        f = open_regular(self.check(path))
        self.opened += 1
        self._files[path] = f
        while len(self._files) > self.max_open:
            self._files.popitem(last=False)[1].close()
        return f

    def read_into(self, path: Path, offset: int, nbytes: int,
                  buffer: torch.Tensor | None) -> torch.Tensor:
        """`nbytes` bytes of `path` from `offset` as a uint8 tensor (in `buffer` if given)."""
        out = torch.empty(nbytes, dtype=torch.uint8) if buffer is None else buffer[:nbytes]
        # numpy's stubs do not declare ndarray a Buffer, which it is
        view = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
        with self._lock:
            f = self._open(path)
            f.seek(offset)
            got = 0
            while got < nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"{path}: ends at byte {offset + got}, {nbytes - got} "
                                          f"bytes short of the data its metadata places at "
                                          f"{offset}")
                got += n
        self.bytes_read += nbytes
        return out

    def read_bytes(self, path: Path, offset: int, nbytes: int) -> bytes:
        """`nbytes` bytes of `path` from `offset` (fewer at the end of the file)."""
        with self._lock:
            f = self._open(path)
            f.seek(offset)
            parts, got = [], 0
            while got < nbytes:
                block = f.read(min(nbytes - got, 1 << 24))
                if not block:
                    break
                parts.append(block)
                got += len(block)
        self.bytes_read += got
        return b"".join(parts)

    def view(self, path: Path, offset: int, nbytes: int) -> torch.Tensor | None:
        """`nbytes` bytes of `path` from `offset` as a uint8 tensor over the file's mapped pages
        (read-only, faulted in at once: MAP_POPULATE); None where the range cannot be mapped (a
        file shorter than the range: `read_into` then names it). The mapping lives as long as
        the tensor; a file truncated while mapped ends the process (SIGBUS), as any mapped
        reader's would (docs/checkpoints.md)."""
        if nbytes <= 0 or not hasattr(mmap, "MAP_POPULATE"):
            return None
        try:
            with self._lock:
                f = self._open(path)
                if os.fstat(f.fileno()).st_size < offset + nbytes:
                    return None
                lead = offset % mmap.ALLOCATIONGRANULARITY
                m = mmap.mmap(f.fileno(), lead + nbytes,
                              flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ,
                              offset=offset - lead)
        except (CheckpointError, OSError, ValueError, OverflowError):
            return None
        with warnings.catch_warnings():
            # read-only pages: nothing here writes to a digested tensor
            warnings.simplefilter("ignore", UserWarning)
            out = torch.frombuffer(m, dtype=torch.uint8, offset=lead, count=nbytes)
        self.bytes_read += nbytes
        return out

    def size(self, path: Path) -> int:
        return regular(self.check(path)).st_size

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
