"""Single-file ``torch.save`` checkpoints (``.pt``, ``.pth``, ``.bin``), read memory-mapped.

``torch.load(..., mmap=True, weights_only=True)`` maps the file's storages instead of reading
them and refuses any pickle that names other than tensors and plain containers: nothing of the
file is run. Its pickle is first run under `agents.pickles.check_pickle` (bounded memory, no key
nested deep enough to overflow the stack when torch's loader hashes it), and the state dict is
checked for nesting (`agents.capture.state.check_depth`) before it is flattened. The nested
state dict is flattened as DCP flattens it (agents/capture/state.py), so a ``torch.save`` of
``{"model": ..., "optim": ...}`` compares name for name with a DCP save of the same dict. A
tensor's boxes are sliced from the mapping (pages are read as they are copied into the reader's
buffer, and the kernel can drop them again); a non-contiguous saved view is made contiguous as a
whole.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from numaudit.agents.capture.state import TooDeep, check_depth, flatten
from numaudit.agents.pickles import UnsafePickle, check_pickle
from numaudit.auditor.checkpoint.files import open_regular
from numaudit.auditor.checkpoint.sources import CheckpointError, Chunk, Entry, Source, tensor_chunk

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
MAX_PICKLE_BYTES = 64 << 20
"""Largest pickle of a torch.save file read (its tensors' bytes are beside it, not in it)."""


def check_archive(path: Path) -> None:
    """CheckpointError naming `path` unless the pickles of the torch.save file keep the rules of
    `agents.pickles` (a zip archive's ``data.pkl``; a legacy file's first four pickles)."""
    try:
        try:
            zf = zipfile.ZipFile(path)
        except zipfile.BadZipFile:
            with io.BufferedReader(open_regular(path)) as f:
                for _ in range(4):  # magic, protocol, system info, the object
                    check_pickle(f, str(path))
            return
        with zf:
            name = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
            if name is None:
                raise CheckpointError(f"{path}: a zip archive without data.pkl, not a "
                                      "torch.save file")
            if zf.getinfo(name).file_size > MAX_PICKLE_BYTES:
                raise CheckpointError(f"{path}: its pickle is larger than {MAX_PICKLE_BYTES} "
                                      "bytes")
            check_pickle(zf.read(name), str(path))
    except UnsafePickle as exc:
        raise CheckpointError(str(exc)) from None
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
    except Exception:  # malformed: torch.load says how
        return


class TorchSaveSource(Source):
    """A ``torch.save`` file of a (nested) state dict."""

    format = "torch.save"

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        check_archive(path)
        try:
            self.obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{path}: not loadable as a torch.save state dict with "
                                  f"weights_only=True ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
        if not isinstance(self.obj, dict):
            raise CheckpointError(f"{path}: holds a {type(self.obj).__name__}, not a state dict")
        try:
            check_depth(self.obj)
        except TooDeep as exc:
            raise CheckpointError(f"{path}: {exc}") from None

    def entries(self) -> Iterator[Entry]:
        for name, value in flatten(self.obj):
            if isinstance(value, torch.Tensor):
                yield _tensor_entry(self, name, value)
            else:
                # the default binds this value; mypy cannot infer a lambda with defaults
                yield Entry(name, load_value=lambda v=value: (v, ""))  # type: ignore[misc]

    def close(self) -> None:
        self.obj = None
        super().close()


def _tensor_entry(src: TorchSaveSource, name: str, t: torch.Tensor) -> Entry:
    t = t.detach()
    shape = tuple(t.shape)
    if not t.is_contiguous():  # sliced from one contiguous copy, dropped after its last box
        return Entry(name, shape, t.dtype, [tensor_chunk(lambda: t, (0,) * len(shape), shape)],
                     note="saved as a non-contiguous view: made contiguous whole to be read")
    flat, itemsize = t.reshape(-1), t.element_size()

    def read(start: int, count: int, buffer: torch.Tensor | None) -> torch.Tensor:
        out = flat[start:start + count]
        if buffer is not None and count:  # the pages copied once, as a file read would
            dst = buffer[:count * itemsize].view(t.dtype)
            dst.copy_(out)
            out = dst
        src.files.bytes_read += count * itemsize
        return out

    return Entry(name, shape, t.dtype, [Chunk((0,) * len(shape), shape, read)])
