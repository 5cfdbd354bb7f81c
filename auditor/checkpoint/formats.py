"""Which reader a checkpoint path needs."""

from __future__ import annotations

from pathlib import Path

from numaudit.auditor.checkpoint.dcp import DcpSource
from numaudit.auditor.checkpoint.safetensors import SafetensorsSource, check_complete
from numaudit.auditor.checkpoint.sources import CheckpointError, Source
from numaudit.auditor.checkpoint.torch_save import SUFFIXES, TorchSaveSource


def open_source(spec: str) -> Source:
    """The checkpoint at `spec`: a DCP directory (it has ``.metadata``), a ``.safetensors``
    file or a directory of them, or a ``torch.save`` file (``.pt``, ``.pth``, ``.bin``,
    ``.ckpt``). CheckpointError when it is none of these."""
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"{spec}: no such file or directory")
    if path.is_dir() and (path / ".metadata").is_file():
        return DcpSource(path)
    if path.is_file() and path.suffix == ".safetensors":
        return SafetensorsSource([path])
    if path.is_file() and path.suffix in SUFFIXES:
        return TorchSaveSource(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if files:
            check_complete(path, files)
            return SafetensorsSource(files, path)
    raise CheckpointError(f"{spec}: not a checkpoint (a torch.distributed.checkpoint directory "
                          "with .metadata, a .safetensors file or a directory of them, or a "
                          "torch.save .pt/.pth/.bin/.ckpt file)")
