"""The GPU run's checks kept from earlier issues (bench/gpu.py item 7).

- :func:`ds3_overhead`: the DS3-style model's step overhead (bench/overhead.py's configuration,
  scale 8, fwd+grad and +bwd) on the GPU: wall time per step with a device synchronize at its
  end, agent off and on, interleaved; the ratio of medians.
- :func:`checkpoint_roundtrip`: a checkpoint of CUDA tensors (a model and its Adam state, plus
  a bfloat16 tensor) captured live by `Agent.capture_state_dict` (digested on the device)
  against its DCP save read back by `auditor checkpoint` (digested on the host): every entry
  identical, and a copy with one element one ulp up diverging there alone.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch


def ds3_overhead(repeats: int) -> None:
    """The DS3-style model of bench/overhead.py at scale 8 on the GPU, fwd+grad and +bwd, agent
    off and on interleaved (no auditor: records are built and dropped)."""
    from bench import overhead as O
    from examples.dsv3.data import batches
    from examples.dsv3.model import ModelArgs

    def step(model, ag, i, mbs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        O._step(model, ag, i, mbs)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    print("| scale | phases | off (ms) | on (ms) | on/off |\n|---:|---|---:|---:|---:|")
    for bwd in (False, True):
        off, on = O._model(8).cuda(), O._model(8).cuda()
        phases = ("fwd", "grad", "loss", "input") + (("bwd",) if bwd else ())
        agent = O._attach(on, phases)
        mbs = [(x.cuda(), y.cuda()) for x, y in next(batches(
            0, 0, O.MICROBATCHES, O.MICROBATCH_SIZE, O.SEQ_LEN, ModelArgs().vocab_size))]
        step(off, None, 0, mbs), step(on, agent, 0, mbs)
        t_off, t_on = [], []
        for i in range(repeats):
            t_off.append(step(off, None, i + 1, mbs))
            t_on.append(step(on, agent, i + 1, mbs))
        agent.close(timeout=5.0)
        a, b = statistics.median(t_off), statistics.median(t_on)
        print(f"| 8 | {','.join(phases)} | {1e3 * a:.1f} | {1e3 * b:.1f} | {b / a:.3f}x |",
              flush=True)


def checkpoint_roundtrip(device: str = "cuda") -> bool:
    """Check 6; True when it holds (each finding printed)."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import numaudit
    from numaudit.auditor.daemon.server import BackgroundServer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(64, 1024, device=device)).square().mean().backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    sd = {"model": msd, "optim": osd,
          "extra": {"bf16": torch.randn(4096, 1024, device=device).to(torch.bfloat16)}}
    with tempfile.TemporaryDirectory(prefix="numaudit-gpu-ckpt-") as tmp, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        db = Path(tmp) / "a.db"
        with BackgroundServer(f"unix:{tmp}/s.sock", db, grace=1.0) as server:
            agent = numaudit.attach(None, run="live", address=server.address, spool_mode="off")
            agent.capture_state_dict(sd, step=0)
            summary = agent.close(timeout=120)
        w = msd["0.weight"].detach().clone()
        w[5, 7] = torch.nextafter(w[5, 7], torch.tensor(float("inf"), device=device))
        dcp.save(sd, checkpoint_id=f"{tmp}/same", no_dist=True)
        dcp.save({**sd, "model": {**msd, "0.weight": w}}, checkpoint_id=f"{tmp}/ulp",
                 no_dist=True)
        reports = {}
        for name in ("same", "ulp"):
            out = Path(tmp) / f"{name}.json"
            code = subprocess.run([sys.executable, "-m", "numaudit.auditor", "checkpoint",
                                   "run:live", f"{tmp}/{name}", "--db", str(db), "--format",
                                   "json", "-o", str(out)],
                                  capture_output=True, timeout=300).returncode
            reports[name] = code, json.loads(out.read_text())
    (same_code, same), (ulp_code, ulp) = reports["same"], reports["ulp"]
    identical = same["summary"]["verdicts"].get("identical", 0)
    first = (ulp.get("first_divergence") or {}).get("key", {}).get("site")
    ok = (summary["dropped"] == 0 and same_code == 0 and identical == same["summary"]["keys"] > 0
          and ulp_code == 1 and ulp["summary"]["breaches"] == 1 and first == "model.0.weight")
    print(f"| checkpoint of {device} tensors | live vs files: {identical} of "
          f"{same['summary']['keys']} identical; one ulp: first divergence {first} | "
          f"{'holds' if ok else 'FAILS'} |", flush=True)
    return ok
