"""What the checkpoint tests share: real saves (DCP, hand-written safetensors) and the CLI.

`cli` runs `auditor ...` in this process through the same click `main` that `python -m
numaudit.auditor` calls (exit code, stdout, stderr), since a subprocess spends ~3 s importing torch
and this folder has a time budget; `auditor` runs it as a subprocess, for the tests that need the
real process (one line on stderr, what a pickle may do to the process, peak RSS).
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]

# safetensors' dtype names (auditor/checkpoint/safetensors.py reads the same table)
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    exception: BaseException | None = None

    def report(self) -> dict:
        """The JSON report on stdout (the run must have been given --format json)."""
        assert self.code in (0, 1), f"exit {self.code}: {self.stderr[-3000:]} {self.exception!r}"
        return json.loads(self.stdout)


def cli(*args) -> Result:
    """`auditor ARGS...` in this process; arguments may be paths."""
    from click.testing import CliRunner

    from numaudit.auditor.cli import main

    res = CliRunner().invoke(main, [str(a) for a in args])
    exc = res.exception if not isinstance(res.exception, SystemExit) else None
    return Result(res.exit_code, res.stdout, res.stderr, exc)


def auditor(*args, timeout: float = 60) -> Result:
    """`python -m numaudit.auditor ARGS...` as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "numaudit.auditor", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    return Result(proc.returncode, proc.stdout, proc.stderr)


def input_error(res: Result, *names) -> str:
    """Assert exit 2 with exactly one ``auditor: error:`` line, the last on stderr (progress
    lines of a side read before the error may precede it), naming each of `names`; the line."""
    assert res.code == 2, (res.code, res.stderr[-3000:], res.exception)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("auditor: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], res.stderr
    for name in names:
        assert str(name) in errors[0], (name, errors[0])
    return errors[0]


def save_dcp(state_dict: dict, directory: Path) -> Path:
    """`torch.distributed.checkpoint.save` by one process, as a script without a process group
    saves."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed ... uninitialized": intended here
        dcp.save(state_dict, checkpoint_id=str(directory), no_dist=True)
    return directory


def tensor_bytes(t: torch.Tensor) -> bytes:
    """`t`'s elements row-major, little-endian (this machine's order)."""
    assert sys.byteorder == "little"
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> Path:
    """A safetensors file by the documented layout: u64 LE header length, JSON header (padded
    with spaces to 8 bytes, as the reference writer does), then each tensor's bytes."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    data, offset = [], 0
    for name, t in tensors.items():
        raw = tensor_bytes(t)
        assert len(raw) == math.prod(t.shape) * t.element_size()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    return write_raw_safetensors(path, json.dumps(header).encode(), b"".join(data))


def write_raw_safetensors(path: Path, header: bytes, data: bytes, *,
                          length: int | None = None) -> Path:
    """Header bytes and data as given; `length` overrides the header length field."""
    header = header + b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length)
                     + header + data)
    return path


def by_site(report: dict) -> dict[str, dict]:
    return {f["key"]["site"]: f for f in report["findings"]}


def all_identical(report: dict, sites: set[str]) -> None:
    """Every entry of `sites`, and nothing else, compared identical at phase state."""
    summary = report["summary"]
    assert (summary["exit_code"], summary["breaches"]) == (0, 0), summary
    assert summary["keys"] == summary["verdicts"]["identical"] == len(sites), summary
    assert {f["key"]["site"] for f in report["findings"]} == sites
    assert {f["key"]["phase"] for f in report["findings"]} == {"state"}
    assert report["first_divergence"] is None
