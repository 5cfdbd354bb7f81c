"""Real batches for fuzzing: what an actual agent sends, captured through its spool.

The agent (no auditor, spool_mode="always") captures a small zoo of tensors — float32 of several
shapes, bfloat16, NaN/Inf, zeros, an integer tensor, a None, and zstd payloads — and the spool
gives back its RegisterRequest and RecordBatches exactly as they would go on the wire.
"""

from __future__ import annotations

from pathlib import Path

import torch

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.spool import read_spool


def real_session(directory: Path) -> tuple[pb.RegisterRequest, list[pb.RecordBatch]]:
    import numaudit

    agent = numaudit.attach(None, run="fuzz", spool_dir=str(directory), spool_mode="always",
                          phases=("input", "fwd", "loss"), payload=("input:p*",), sketch_k=32,
                          batch_records=4)
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(4, 3, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "nan": torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0, -0.0]),
        "zeros": torch.zeros(2, 2),
        "ints": torch.arange(10),
        "p1": torch.randn(16, 4, generator=g),
        "p2": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
    }
    for step in range(2):
        with agent.step(step), agent.microbatch(0):
            for site, t in tensors.items():
                agent.capture(t + step if t.dtype.is_floating_point else t, site=site,
                              phase="input")
            agent.capture(None, site="none", phase="input")
            agent.capture(torch.tensor(0.25), site="loss", phase="loss")
    agent.close(timeout=1.0)
    (path,) = sorted(directory.glob("*.spool"))
    contents = read_spool(path)
    assert contents.register is not None and contents.batches
    return contents.register, contents.batches
