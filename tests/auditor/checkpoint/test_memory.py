"""`auditor checkpoint --max-memory` bounds what a read holds, measured on the process: the peak
RSS of `A A --max-memory 4MiB` over a save of one 48 MiB tensor stays well below the tensor
(under half of it) above the same command on a tiny save (the baseline: Python, torch, the
daemon, the store), while the pair holds 96 MiB of data.

The peak is the child's VmHWM (/proc/self/status), written by the child itself at exit. Not
ru_maxrss: Linux records the pre-exec memory of the forked (or vforked) child in it, that is this
test process's RSS, several hundred MiB, which hides the child's own.

Measured on 2 cores (baseline ~456 MiB): +9 MiB at 4 MiB; +19..21 MiB at 2 MiB, most of it not
data but the ~70 readers (one agent, channel and threads a piece of the most cut tensor,
digest.py), too near half the tensor to assert on a machine whose gRPC may start more threads;
+41 MiB at the default 256 MiB, where the tensor is read in one box: so the bound below does
tell bounded reading from reading whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.auditor.checkpoint.helpers import REPO, all_identical, save_dcp

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc")]

MiB = 1 << 20
TENSOR_BYTES = 3000 * 4000 * 4  # 48 MB: 12M float32

# `python -c PEAK OUT ARGS...` runs `python -m numaudit.auditor ARGS...` and writes its VmHWM (KiB)
# to OUT
PEAK = """
import atexit, runpy, sys
out, sys.argv = sys.argv[1], ["auditor", *sys.argv[2:]]

def peak():
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(out, "w") as f:
        f.write(kib)

atexit.register(peak)
runpy.run_module("auditor", run_name="__main__", alter_sys=True)
"""


def start(*args: str, out: Path):
    """Start `python -m numaudit.auditor ARGS...`; a function that waits for it and returns
    (exit code, peak RSS in bytes, stdout, stderr)."""
    stdout, stderr, peak = (out.with_suffix(s) for s in (".out", ".err", ".peak"))
    with open(stdout, "w") as o, open(stderr, "w") as e:
        proc = subprocess.Popen([sys.executable, "-c", PEAK, str(peak), *map(str, args)],
                                cwd=REPO, stdout=o, stderr=e,
                                env={**os.environ, "PYTHONPATH": str(REPO)})

    def wait() -> tuple[int, int, str, str]:
        code = proc.wait(timeout=100)
        err = stderr.read_text()
        assert peak.exists(), f"no peak written (exit {code}): {err[-3000:]}"
        return code, int(peak.read_text()) * 1024, stdout.read_text(), err

    return wait


def test_a_48_mib_tensor_is_read_in_bounded_memory(tmp_path):
    torch.manual_seed(0)
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    save_dcp({"model": {"w": torch.randn(3000, 4000)}}, big)
    save_dcp({"model": {"w": torch.randn(4, 4)}}, tiny)
    assert sum(p.stat().st_size for p in big.iterdir()) > TENSOR_BYTES
    # both at once (each is mostly torch's import); the peaks are each process's own
    waits = {name: start("checkpoint", path, path, "--max-memory", "4MiB", "--format", "json",
                         out=tmp_path / name)
             for name, path in (("tiny", tiny), ("big", big))}
    results = {name: wait() for name, wait in waits.items()}
    for name, (code, _, stdout, stderr) in results.items():
        assert code == 0, (name, stderr[-3000:])
        all_identical(json.loads(stdout), {"model.w"})
    stderr = results["big"][3]
    assert stderr.count("48.0 MB read") == 2, stderr  # both sides read every byte
    baseline, peak = results["tiny"][1], results["big"][1]
    grew = peak - baseline
    print(f"peak RSS: baseline {baseline / MiB:.1f} MiB, 48 MiB save {peak / MiB:.1f} MiB "
          f"(+{grew / MiB:.1f} MiB)")
    assert grew < TENSOR_BYTES // 2, (f"held {grew / MiB:.1f} MiB above the baseline "
                                      f"({baseline / MiB:.1f} MiB) reading 2 x 48 MiB")
