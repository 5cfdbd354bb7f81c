"""Pipelining: captures keyed by the schedule's microbatches, shape inference not captured."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

_JOB = textwrap.dedent('''
    import collections, json, os, socket, sys
    import torch, torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      NUMAUDIT_SPOOL_MODE="off")
    dist.init_process_group("gloo")
    import numaudit
    from numaudit.agents.pipeline import agent_loss, watch_stages
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    agent = numaudit.attach(run="pp")
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))  # no shapes: inferred on step 0
    seen = collections.Counter()
    from numaudit.wire.vocabulary import PHASE_IDS
    phases = {v: k for k, v in PHASE_IDS.items()}
    sink = agent.capturer._batches._sink  # every capture, hooks' and agent.capture's
    def spy(batch):
        for c in batch.captures:
            seen[f"{c.step}|{phases[c.phase]}|{c.site}|{c.microbatch}|{c.call}"] += 1
        return sink(batch)
    agent.capturer._batches._sink = spy
    schedule = ScheduleGPipe(stage, n_microbatches=2,
                             loss_fn=agent_loss(agent, lambda y, t: ((y - t) ** 2).mean()))
    watch_stages(agent, [stage])
    for step in range(2):
        with agent.step(step):
            schedule.step(torch.randn(4, 8), target=torch.randn(4, 4))
    agent.close()
    dist.destroy_process_group()
    print(json.dumps(seen))
''')


def test_schedule_shape_inference_is_not_captured_and_keys_follow_the_schedule():
    out = subprocess.run([sys.executable, "-c", _JOB], cwd=ROOT, capture_output=True, text=True,
                         timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(n == 1 for n in seen.values()), {k: n for k, n in seen.items() if n != 1}
    for step in (0, 1):  # step 0 is the one where the schedule infers shapes
        fwd = sorted(k for k in seen if k.startswith(f"{step}|fwd|"))
        assert fwd == [f"{step}|fwd|{site}|{mb}|0" for site in "012" for mb in (0, 1)]
        losses = sorted(k for k in seen if k.startswith(f"{step}|loss|"))
        assert losses == [f"{step}|loss|loss|0|0", f"{step}|loss|loss|1|0"]
        assert sum(k.startswith(f"{step}|grad|") for k in seen) == 4
