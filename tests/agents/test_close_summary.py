"""What a rank says at close (issue 41): one summary line that shows on stderr in a script that
never configured logging; a job whose run name is taken spools its records instead of dropping
them, and its line gives the `auditor ingest ... --run NEW` that stores them under a new name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.daemon.server import BackgroundServer

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import torch, agents
for job in ("first", "second"):   # two jobs under one run name: the second is refused
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    agent = agents.attach(model, run="taken", job_id=job)
    with agent.step(0):
        with agent.microbatch(0):
            model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).sum().backward()
    agent.close()
"""


def test_the_close_summary_shows_and_a_taken_name_spools_for_ingest(tmp_path):
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL",
                          grace=0.5) as server:
        env = dict(os.environ, PYTHONPATH=str(ROOT), NUMAUDIT_ADDR=server.address,
                   NUMAUDIT_SPOOL=str(tmp_path / "spool"), OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if "numaudit run=taken" in ln]
        assert len(lines) == 2, proc.stderr
        first, second = lines
        # logging was never configured: the INFO line shows anyway, once per close
        assert first.startswith(
            "INFO numaudit.agents.summary: rank 0: numaudit run=taken: captured ")
        assert re.search(r"acked by the auditor (\d+), spooled 0, dropped 0", first)
        n = int(re.search(r"captured (\d+)", first).group(1))
        assert second.startswith("WARNING numaudit.agents.summary: rank 0:")
        assert f"acked by the auditor 0, spooled {n} in " in second
        command = re.search(r"`(auditor ingest (\S+) --run NEW_NAME --address (\S+))` stores "
                            r"them under a new name$", second)
        assert command and command.group(3) == server.address, second
        assert "records are spooled" in proc.stderr  # the refusal says where they went
        spool = command.group(2)
        ingest = subprocess.run([sys.executable, "-m", "numaudit.auditor", "ingest", spool, "--run",
                                 "kept", "--address", server.address], cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                capture_output=True, text=True, timeout=60)
        assert ingest.returncode == 0, ingest.stderr
        assert f"run kept rank 0: 1 batches, {n} records: {n} stored" in ingest.stdout
    report = compare_runs(tmp_path / "audit.db", "taken", "kept")
    assert report.exit_code == 0 and report.counts["identical"] == n


def test_a_model_holding_dtensors_without_a_mesh_says_so(fake_rank):
    """attach(mesh=None) on a model whose parameters are DTensors: the job has a mesh the agent
    was not given, and the run's labels say so (the auditor then advises passing it); a plain
    model gets no such label."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from numaudit import agents
    from numaudit.wire.labels import UNPASSED_MESH_LABEL

    fake_rank(0)
    mesh = init_device_mesh("cpu", (4,))
    plain = nn.Linear(4, 4)
    sharded = nn.Linear(4, 4)
    sharded.weight = nn.Parameter(distribute_tensor(sharded.weight.detach(), mesh, [Shard(0)]))
    for model, labelled in ((plain, False), (sharded, True)):
        agent = agents.attach(model, run="mesh", enabled=True)
        assert (UNPASSED_MESH_LABEL in agent.ident.labels) is labelled
        agent.close(timeout=0.1)
    given = agents.attach(sharded, run="mesh", mesh=mesh)
    assert UNPASSED_MESH_LABEL not in given.ident.labels  # given: its dims name the collectives
    given.close(timeout=0.1)
